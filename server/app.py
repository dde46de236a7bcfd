"""`build_app(settings, engine)`: the FastAPI application, its lifespan and its routers.

Nothing heavy happens at import or in `build_app`: the lifespan opens the job store, reconciles it
with reality (nothing can be running before the worker starts) and starts the engine, whose worker
thread loads the models while `/healthz` already answers and `/readyz` says 503.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import shutil
from pathlib import Path

from fastapi import Depends, FastAPI

from megaslide import __version__

from .client import EngineClient
from .deps import require_api_key
from .errors import install_error_handlers
from .routers import files, fine_tuning, health, models, videos
from .settings import Settings
from .store import JobStore
from .worker import LocalEngine, video_paths

log = logging.getLogger("megaslide.server")


@contextlib.contextmanager
def data_dir_lock(data_dir: Path):
    """Hold an exclusive lock on the data directory: two servers on one store would run jobs twice.

    The kernel drops the lock when the process dies, kill -9 included, so a restart never finds a
    stale one.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "server.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another megaslide server is using the data directory {data_dir}"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def housekeeping(store: JobStore, data_dir: Path) -> None:
    """Start-up cleaning, while no worker runs: expired videos' files, and what a killed process left
    half-written (temporary MP4/PNG files, uploads that never got a row)."""
    for video_id in store.expired_videos():
        for path in video_paths(data_dir, video_id):
            path.unlink(missing_ok=True)
    videos, files = data_dir / "videos", data_dir / "files"
    if videos.is_dir():
        for tmp in [*videos.glob(".*.part"), *videos.glob(".*.tmp")]:
            tmp.unlink(missing_ok=True)
    if files.is_dir():
        known = store.file_ids()
        for folder in files.iterdir():
            if folder.name not in known:
                shutil.rmtree(folder, ignore_errors=True)


def build_app(settings: Settings, engine: EngineClient | None = None) -> FastAPI:
    """The API for `settings`, served by `engine` (default: a LocalEngine on the torch backend)."""
    engine = engine if engine is not None else LocalEngine(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        data_dir = Path(settings.data_dir)
        with data_dir_lock(data_dir):
            store = JobStore(settings.db_path)
            try:
                counts = store.reconcile()
                if any(counts.values()):
                    log.warning("reconciled after an unclean stop: %s", counts)
                housekeeping(store, data_dir)
                app.state.store = store
                await engine.start(store)
                try:
                    yield
                finally:
                    await engine.shutdown()
            finally:
                store.close()

    app = FastAPI(
        title="MegaSlide",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible video generation and fine-tuning",
    )
    app.state.settings = settings
    app.state.engine = engine
    install_error_handlers(app)
    app.include_router(health.router)
    for router in (videos.router, files.router, fine_tuning.router, models.router):
        app.include_router(router, dependencies=[Depends(require_api_key)])
    return app
