"""`AsyncStore`: the job store for async code, each call it lists run in a worker thread, so a
slow disk or a busy lock never stalls the event loop."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import anyio

from ..records import VideoRecord
from .files import FileStore
from .fine_tunes import FineTuneStore
from .job_store import JobStore
from .jobs import Jobs
from .keys import IdempotencyKeys
from .videos import VideoStore
from .webhooks import WebhookStore

P = ParamSpec("P")
R = TypeVar("R")


class _InThread(Generic[P, R]):
    """`<async repository>.<name>`: `await`s the sync repository's `<name>` run in a worker
    thread, with the sync method's signature (the ParamSpec carries it to type checkers)."""

    def __init__(self, method: Callable[Concatenate[Any, P], R]):
        self.name = method.__name__

    def __get__(self, repository: _Async, owner: type) -> Callable[P, Awaitable[R]]:
        # Looked up on the instance at each call, so a method patched on it (a test's) is used.
        method = getattr(repository.sync, self.name)

        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return await anyio.to_thread.run_sync(functools.partial(method, *args, **kwargs))

        return call


class _Async:
    """A repository's async calls, over the sync repository `sync`."""

    def __init__(self, sync: Any):
        self.sync = sync


class AsyncVideoStore(_Async):
    """`VideoStore` for async code; a video's status read on SQLite runs on the event loop itself.

    That is the one read clients repeat back to back. A WAL-mode reader never waits for the
    writer, and the read takes about 30 us where handing it to a thread and back costs 150-300 us
    of the loop's time (benchmarks/api_load.py: status polls while a video generates)."""

    def __init__(self, sync: VideoStore, *, inline_reads: bool):
        super().__init__(sync)
        self._inline_reads = inline_reads

    async def get(self, video_id: str) -> VideoRecord | None:
        """The video, or None."""
        if self._inline_reads:
            return self.sync.get(video_id)
        return await anyio.to_thread.run_sync(self.sync.get, video_id)

    insert = _InThread(VideoStore.insert)
    repeated = _InThread(VideoStore.repeated)
    insert_repeat = _InThread(VideoStore.insert_repeat)
    repeats = _InThread(VideoStore.repeats)
    page = _InThread(VideoStore.page)
    cancel = _InThread(VideoStore.cancel)
    delete = _InThread(VideoStore.delete)
    queue_position = _InThread(VideoStore.queue_position)
    queue_positions = _InThread(VideoStore.queue_positions)
    naming_adapter = _InThread(VideoStore.naming_adapter)
    events_after = _InThread(VideoStore.events_after)
    last_event_seq = _InThread(VideoStore.last_event_seq)
    events_since = _InThread(VideoStore.events_since)


class AsyncFineTuneStore(_Async):
    """`FineTuneStore` for async code."""

    insert = _InThread(FineTuneStore.insert)
    get = _InThread(FineTuneStore.get)
    page = _InThread(FineTuneStore.page)
    cancel = _InThread(FineTuneStore.cancel)
    events = _InThread(FineTuneStore.events)
    checkpoints = _InThread(FineTuneStore.checkpoints)
    checkpoint = _InThread(FineTuneStore.checkpoint)


class AsyncFileStore(_Async):
    """`FileStore` for async code."""

    insert = _InThread(FileStore.insert)
    get = _InThread(FileStore.get)
    page = _InThread(FileStore.page)
    delete = _InThread(FileStore.delete)


class AsyncJobs(_Async):
    """`Jobs` for async code."""

    queue_depth = _InThread(Jobs.queue_depth)
    queue_depth_by_model = _InThread(Jobs.queue_depth_by_model)
    counts_by_state = _InThread(Jobs.counts_by_state)


class AsyncKeys(_Async):
    """`IdempotencyKeys` for async code."""

    reserve = _InThread(IdempotencyKeys.reserve)
    release = _InThread(IdempotencyKeys.release)
    record_response = _InThread(IdempotencyKeys.record_response)


class AsyncWebhookStore(_Async):
    """`WebhookStore` for async code."""

    create_endpoint = _InThread(WebhookStore.create_endpoint)
    get_endpoint = _InThread(WebhookStore.get_endpoint)
    page_endpoints = _InThread(WebhookStore.page_endpoints)
    delete_endpoint = _InThread(WebhookStore.delete_endpoint)
    enable = _InThread(WebhookStore.enable)
    prune = _InThread(WebhookStore.prune)
    deliveries = _InThread(WebhookStore.deliveries)
    claim = _InThread(WebhookStore.claim)
    record_attempt = _InThread(WebhookStore.record_attempt)


class AsyncStore:
    """The job store for async code: `await store.files.get(id)` runs `JobStore.files.get` in a
    worker thread, so the event loop goes on serving other requests meanwhile. The calls async
    code makes are listed here, each once; `sync` is the `JobStore` they run on."""

    def __init__(self, store: JobStore):
        self.sync = store
        self.videos = AsyncVideoStore(store.videos, inline_reads=store.db.dialect == "sqlite")
        self.fine_tunes = AsyncFineTuneStore(store.fine_tunes)
        self.files = AsyncFileStore(store.files)
        self.jobs = AsyncJobs(store.jobs)
        self.keys = AsyncKeys(store.keys)
        self.webhooks = AsyncWebhookStore(store.webhooks)
