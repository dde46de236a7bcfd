"""What every part of one worker shares: who it is, the store and the backend it works with, its
counters, its stop and wake signals, and the rules for a failing store or a lost device."""

from __future__ import annotations

import logging
import threading
import time

from ..backend import Backend
from ..datadir import DataDir
from ..metrics import PUBLISH_INTERVAL_S, Registry
from ..settings import Settings
from ..store import UNAVAILABLE, JobStore, new_token

log = logging.getLogger("megaslide.server")

STORE_RETRY_S = (0.2, 5.0)  # back-off while the job store fails: first wait, longest wait


class DeviceLost(Exception):
    """An error inside a job left the device unusable (`Backend.is_fatal`): the worker stops."""


class WorkerContext:
    """One worker's identity, resources and life state, as its parts (models, videos,
    fine-tunes, heartbeat) see it. `Worker` is one; each part is handed it."""

    def __init__(self, settings: Settings, backend: Backend, store: JobStore, name: str):
        self.settings, self.backend, self.store, self.name = settings, backend, store, name
        self.data = DataDir(settings.storage_dir)
        self.token = new_token()
        self.metrics = Registry()
        self._published_at = 0.0
        self.ready = False
        self.dead: str | None = None
        self.trouble: str | None = None  # why the job store fails, while it does
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.progress_at = time.monotonic()  # when the main loop last began a tick

    def retrying(self, call, *args, **kwargs):
        """`call(*args, **kwargs)`, retried with back-off while the store fails; None if the
        worker stops first (the job's lease then runs out and it runs again elsewhere)."""
        for wait_s in backoff():
            try:
                return call(*args, **kwargs)
            except UNAVAILABLE as exc:
                log.warning("job store write failed, retrying in %.1f s: %s", wait_s, exc)
                if self.stop.wait(wait_s):
                    return None
        return None

    def count_finished(self, kind: str, status: str) -> None:
        self.metrics.jobs_finished.labels(kind=kind, status=status).inc()
        self.publish_metrics(force=True)

    def publish_metrics(self, force: bool = False) -> None:
        """Show the API hosts this worker's counters now rather than at the next heartbeat, at
        most every `PUBLISH_INTERVAL_S` unless `force`d (a job ended)."""
        now = time.monotonic()
        if not force and now - self._published_at < PUBLISH_INTERVAL_S:
            return
        self._published_at = now
        try:
            self.store.workers.publish_metrics(self.name, self.token, self.metrics.snapshot())
        except Exception:  # noqa: BLE001 - the next heartbeat publishes them again
            log.debug("publishing metrics failed", exc_info=True)

    def check_device(self, exc: BaseException) -> None:
        """Raise `DeviceLost` when the job's failure `exc` took the device with it."""
        if self.backend.is_fatal(exc):
            raise DeviceLost(f"the device is unusable after {message(exc)}") from exc


def backoff():
    """Waits in seconds: doubling from STORE_RETRY_S[0] up to STORE_RETRY_S[1], for ever."""
    wait_s, longest = STORE_RETRY_S
    while True:
        yield wait_s
        wait_s = min(2 * wait_s, longest)


def message(exc: BaseException) -> str:
    """An exception as a job's error message: its type, then its text."""
    text = str(exc).strip() or "no message"
    return f"{type(exc).__name__}: {text}"
