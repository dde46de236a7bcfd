"""`build_app(settings, workers)`: the FastAPI application, its lifespan and its routers.

Nothing heavy happens at import or in `build_app`: the lifespan opens the job store (migrating
its schema when an older server made it) and starts the workers, whose thread loads the models
while `/healthz` already answers and `/readyz` says 503. Jobs a killed process left running come
back when its worker restarts under the same name, or when their leases expire (store/).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time

from fastapi import Depends, FastAPI

from megaslide.engine import __version__

from .auth import Keyring
from .body_limit import BodyLimit, Upload
from .datadir import DataDir
from .deps import require_api_key, require_key_or_link
from .errors import UnexpectedErrors, install_error_handlers
from .feed import EventFeed
from .links import LinkSigner
from .plain_text import RefuseNul
from .protocol import WorkerClient
from .routers import adapters, files, fine_tuning, health, models, videos, web, webhooks
from .schemas import FILE_FIELDS, FILE_LIST_FIELDS, error_responses
from .settings import Settings
from .store import AsyncStore, JobStore
from .uploads import Validator
from .webhooks import Sender

log = logging.getLogger("megaslide.server")


STALE_AFTER_S = 3600.0  # a temporary file untouched this long was left by a killed process


def housekeeping(store: JobStore, data: DataDir) -> None:
    """Start-up cleaning: expired videos' files, and what a killed process left half-written
    (temporary MP4/PNG files, uploads that never got a row). Other hosts may be writing at this
    moment: a temporary file goes once no live writer holds it, the rest once left alone for
    `STALE_AFTER_S`."""
    for video_id in store.videos.expired():
        for path in data.video_files(video_id):
            path.unlink(missing_ok=True)
    data.remove_stale(min_age_s=STALE_AFTER_S)
    known = store.files.ids()
    cutoff = time.time() - STALE_AFTER_S
    for folder in data.files.iterdir():
        if folder.name not in known and folder.stat().st_mtime < cutoff:
            shutil.rmtree(folder, ignore_errors=True)


def build_app(settings: Settings, workers: WorkerClient) -> FastAPI:
    """The API for `settings`, its jobs run by `workers`: `Fleet.embedded` on a `TorchBackend`
    for `megaslide serve`, a `Fleet` of workers elsewhere for `megaslide serve --no-worker`."""
    data = DataDir(settings.storage_dir)
    app = FastAPI(
        title="MegaSlide",
        version=__version__,
        lifespan=_lifespan(settings, workers, data),
        description="OpenAI-compatible video generation and fine-tuning",
    )
    app.state.settings = settings
    app.state.keyring = Keyring(settings.api_keys, settings.api_keys_file)
    app.state.workers = workers
    app.state.data = data
    app.state.links = LinkSigner(data.root)
    install_error_handlers(app)
    _add_middleware(app, settings)
    _include_routers(app)
    return app


def _lifespan(settings: Settings, workers: WorkerClient, data: DataDir):
    """The app's lifespan: the job store opened and tidied, the event feed, the dataset
    validator and the webhook sender started, the workers started; all stopped in reverse at
    shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        store = JobStore(settings.database_url, crash_limit=settings.crash_limit)
        try:
            housekeeping(store, data)
            app.state.store = AsyncStore(store)
            app.state.feed = EventFeed(
                app.state.store,
                settings.sse_interval_s,
                settings.max_streams_per_key,
                settings.max_streams,
            )
            app.state.validator = Validator(settings, store, data, workers.check_dataset)
            validating = asyncio.create_task(app.state.validator.run())
            app.state.sender = Sender(settings, app.state.store)
            sending = asyncio.create_task(app.state.sender.run())
            await workers.start(store)
            try:
                yield
            finally:
                validating.cancel()
                sending.cancel()
                await workers.shutdown()
                for task in (validating, sending):
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        finally:
            store.close()

    return lifespan


def _video_files_bytes(settings: Settings) -> int:
    """The most a `POST /v1/videos` body's files may take: each field of `FILE_FIELDS` and
    `FILE_LIST_FIELDS` (schemas.py) at its kind's limit."""
    limit = {"an image": settings.max_image_bytes, "a video": settings.max_video_bytes}
    limit["images"] = settings.max_image_bytes
    one = sum(limit[kind] for kind in FILE_FIELDS.values())
    return one + sum(limit[kind] * most for kind, most in FILE_LIST_FIELDS.values())


def _add_middleware(app: FastAPI, settings: Settings) -> None:
    uploads = [
        Upload("POST", "/v1/files", settings.max_upload_bytes, "file"),
        Upload("POST", "/v1/adapters", settings.max_upload_bytes, "file"),
        # Every file field the API takes at its own limit (no model takes them all, so this
        # bounds the body loosely); each file's limit is checked as it is stored.
        Upload(
            "POST",
            "/v1/videos",
            _video_files_bytes(settings),
            ", ".join([*FILE_FIELDS, *FILE_LIST_FIELDS]),
        ),
    ]
    app.add_middleware(
        BodyLimit,
        max_body_bytes=settings.max_body_bytes,
        uploads=uploads,
        body_timeout_s=settings.body_timeout_s,
        min_body_rate=settings.min_body_rate,
    )
    app.add_middleware(RefuseNul)
    app.add_middleware(UnexpectedErrors)  # added last, so outermost: it sees every failure


def _include_routers(app: FastAPI) -> None:
    app.include_router(health.router)
    app.include_router(web.router)
    app.mount("/assets", web.assets(), name="assets")
    for router in (
        videos.router,
        files.router,
        fine_tuning.router,
        models.router,
        adapters.router,
        webhooks.router,
    ):
        app.include_router(
            router,
            dependencies=[Depends(require_api_key)],
            # Any route may meet a store that is briefly unavailable, or a full disk, and a NUL
            # in any request's path or query is refused 400 (RefuseNul).
            responses=error_responses(400, 401, 413, 500, 503, 507),
        )
    app.include_router(
        videos.content_router,
        dependencies=[Depends(require_key_or_link)],
        responses=error_responses(400, 401, 413, 500, 503, 507),
    )
