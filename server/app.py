"""`build_app(settings, workers)`: the FastAPI application, its lifespan and its routers.

Nothing heavy happens at import or in `build_app`: the lifespan opens the job store (migrating
its schema when an older server made it) and starts the workers, whose thread loads the models
while `/healthz` already answers and `/readyz` says 503. Jobs a killed process left running come
back when its worker restarts under the same name, or when their leases expire (store.py).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time

from fastapi import Depends, FastAPI

from megaslide.engine import __version__

from .datadir import DataDir
from .deps import require_api_key
from .errors import install_error_handlers
from .protocol import WorkerClient
from .routers import files, fine_tuning, health, models, videos, web
from .settings import Settings
from .store import AsyncStore, JobStore

log = logging.getLogger("megaslide.server")


STALE_AFTER_S = 3600.0  # a temporary file untouched this long was left by a killed process


def housekeeping(store: JobStore, data: DataDir) -> None:
    """Start-up cleaning: expired videos' files, and what a killed process left half-written
    (temporary MP4/PNG files, uploads that never got a row). Other hosts may be writing at this
    moment, so only what has been left alone for `STALE_AFTER_S` goes."""
    for video_id in store.expired_videos():
        for path in data.video_files(video_id):
            path.unlink(missing_ok=True)
    data.remove_stale(min_age_s=STALE_AFTER_S)
    known = store.file_ids()
    cutoff = time.time() - STALE_AFTER_S
    for folder in data.files.iterdir():
        if folder.name not in known and folder.stat().st_mtime < cutoff:
            shutil.rmtree(folder, ignore_errors=True)


def build_app(settings: Settings, workers: WorkerClient) -> FastAPI:
    """The API for `settings`, its jobs run by `workers`: `EmbeddedWorker` on a `TorchBackend`
    for `megaslide serve`, a `Fleet` of workers elsewhere for `megaslide serve --no-worker`."""
    data = DataDir(settings.storage_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        store = JobStore(settings.database_url)
        try:
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
    app.include_router(health.router)
    app.include_router(web.router)
    app.mount("/assets", web.assets(), name="assets")
    for router in (videos.router, files.router, fine_tuning.router, models.router):
        app.include_router(router, dependencies=[Depends(require_api_key)])
    return app
