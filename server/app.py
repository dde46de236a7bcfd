"""`build_app(settings, workers)`: the FastAPI application, its lifespan and its routers.

Nothing heavy happens at import or in `build_app`: the lifespan opens the job store, reconciles it
with reality (nothing can be running before the worker starts) and starts the workers, whose
thread loads the models while `/healthz` already answers and `/readyz` says 503.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import shutil

from fastapi import Depends, FastAPI

from megaslide.engine import __version__

from .body_limit import BodyLimit, Upload
from .datadir import DataDir
from .deps import require_api_key
from .errors import UnexpectedErrors, install_error_handlers
from .protocol import WorkerClient
from .routers import files, fine_tuning, health, models, videos, web
from .schemas import error_responses
from .settings import Settings
from .store import AsyncStore, JobStore

log = logging.getLogger("megaslide.server")


@contextlib.contextmanager
def data_dir_lock(data: DataDir):
    """Hold an exclusive lock on the data directory: two servers on one store would run jobs twice.

    The kernel drops the lock when the process dies, kill -9 included, so a restart never finds a
    stale one.
    """
    data.root.mkdir(parents=True, exist_ok=True)
    with open(data.lock, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another megaslide server is using the data directory {data.root}"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def housekeeping(store: JobStore, data: DataDir) -> None:
    """Start-up cleaning, while no worker runs: expired videos' files, and what a killed process left
    half-written (temporary MP4/PNG files, uploads that never got a row)."""
    for video_id in store.expired_videos():
        for path in data.video_files(video_id):
            path.unlink(missing_ok=True)
    data.remove_stale()
    known = store.file_ids()
    for folder in data.files.iterdir():
        if folder.name not in known:
            shutil.rmtree(folder, ignore_errors=True)


def build_app(settings: Settings, workers: WorkerClient) -> FastAPI:
    """The API for `settings`, its jobs run by `workers` (`EmbeddedWorker` on a `TorchBackend`
    for `megaslide serve`)."""
    data = DataDir(settings.data_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        with data_dir_lock(data):
            store = JobStore(data.db)
            try:
                counts = store.reconcile()
                if any(counts.values()):
                    log.warning("reconciled after an unclean stop: %s", counts)
                housekeeping(store, data)
                app.state.store = AsyncStore(store)
                await workers.start(store)
                try:
                    yield
                finally:
                    await workers.shutdown()
            finally:
                store.close()

    app = FastAPI(
        title="MegaSlide",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible video generation and fine-tuning",
    )
    app.state.settings = settings
    app.state.workers = workers
    app.state.data = data
    install_error_handlers(app)
    uploads = [
        Upload("POST", "/v1/files", settings.max_upload_bytes, "file"),
        Upload("POST", "/v1/videos", settings.max_image_bytes, "input_reference"),
    ]
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes, uploads=uploads)
    app.add_middleware(UnexpectedErrors)  # added last, so outermost: it sees every failure
    app.include_router(health.router)
    app.include_router(web.router)
    app.mount("/assets", web.assets(), name="assets")
    for router in (videos.router, files.router, fine_tuning.router, models.router):
        app.include_router(
            router,
            dependencies=[Depends(require_api_key)],
            responses=error_responses(401, 413, 500),
        )
    return app
