"""A worker as the whole life of a process: `serve_jobs`, what `megaslide worker` runs (one per
device, on any host that reaches the store), and `WorkerProcess`, which runs it in a child of the
API's process (`megaslide serve --worker-process`) and starts it again when it dies."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection

from ..settings import Settings
from ..store import JobStore, WorkerNameInUse
from .heartbeat import default_name
from .loop import Worker

log = logging.getLogger("megaslide.server")

REFUSED_EXIT = 2  # a worker that refused to start (a name another worker holds): not restarted


def serve_jobs(settings: Settings, log_level: str) -> int:
    """A worker's life: load the models, register, run jobs until SIGTERM or SIGINT, leave.
    Returns the exit status (1: the worker died); raises `WorkerNameInUse` when a live worker
    holds its name."""
    # Imported here: the engine (and torch) load only in a process that runs jobs.
    from ..torch_backend import TorchBackend

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    backend = TorchBackend(settings)
    store = JobStore(settings.database_url, crash_limit=settings.crash_limit)
    worker = Worker(
        settings, backend, store, settings.worker_name or default_name(backend.device_name)
    )
    try:
        worker.register()
    except WorkerNameInUse:
        store.close()
        raise

    def stop(signum, _frame):
        # At the next step boundary: running videos go back to the queue, a fine-tune
        # checkpoints first, and the worker leaves the registry.
        worker.stop.set()
        worker.wake.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    names = ", ".join(worker.cards)
    print(
        f"megaslide worker {worker.name}: {names} on {backend.device_name} "
        f"(store {settings.database_url_shown}, storage {settings.storage_dir})",
        file=sys.stderr,
    )
    try:
        worker.run()
    finally:
        worker.close()
        store.close()
    if worker.dead:
        print(f"megaslide worker: stopped: {worker.dead}", file=sys.stderr)
        return 1
    return 0


def serve_jobs_in_child(settings: Settings, log_level: str) -> None:
    """`serve --worker-process`'s child (a `WorkerProcess` main): `serve_jobs`, which also stops
    when its parent dies; a refused name exits with `REFUSED_EXIT`."""
    threading.Thread(target=_stop_with_parent, daemon=True).start()
    try:
        code = serve_jobs(settings, log_level)
    except WorkerNameInUse as e:
        print(f"megaslide worker: error: {e}", file=sys.stderr)
        code = REFUSED_EXIT
    sys.exit(code)


def _stop_with_parent() -> None:
    # A server killed with SIGKILL cannot stop its child: the child sees its parent's sentinel
    # close and stops itself the way SIGTERM stops a worker, at a step boundary.
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os.kill(os.getpid(), signal.SIGTERM)


class WorkerProcess:
    """`main` (say `serve_jobs_in_child`) in a spawned child process, started with the API and
    stopped at its shutdown.

    The child has its own interpreter, so the engine's Python and the API's event loop never wait
    on one lock (benchmarks/api_load.py measures the engine's pace under 20 clients polling back
    to back either way: docs/benchmarks.md, "The API under load"). A child that dies is started
    again, under the same worker name, so it takes back the jobs the dead one held: after
    `RESTART_DELAY_S`, doubled for each death in a row that came within `STEADY_S` of its start
    (a crash loop, say a model that fails to load) up to `MAX_RESTART_DELAY_S`. One that exits
    with a code in `keep_down` (stopped, or refused to start) is not started again.
    """

    RESTART_DELAY_S = 2.0
    MAX_RESTART_DELAY_S = 60.0
    STEADY_S = 60.0  # a child that lived this long died of something other than its start
    STOP_TIMEOUT_S = 120.0  # SIGTERM: videos requeue at a step boundary, a fine-tune checkpoints

    def __init__(self, main: Callable[[], None], keep_down: Collection[int] = (0,)):
        self._main = main  # pickled into the child: a module-level function or a partial of one
        self._keep_down = set(keep_down)
        self._spawn = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.process: multiprocessing.process.BaseProcess | None = None
        self.watcher = threading.Thread(target=self._watch, name="worker-process", daemon=True)

    def start(self, store: JobStore) -> None:
        """Start the child (it opens the store itself) and the thread that restarts it."""
        self.watcher.start()

    def stop(self) -> None:
        """SIGTERM the child and wait for it (killed after `STOP_TIMEOUT_S`); no restart."""
        with self._lock:
            self._stopping.set()
            process = self.process
        if process is not None and process.is_alive():
            process.terminate()
            process.join(self.STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        if self.watcher.is_alive():
            self.watcher.join()

    def _watch(self) -> None:
        delay = self.RESTART_DELAY_S
        while True:
            with self._lock:
                if self._stopping.is_set():
                    return
                self.process = self._spawn.Process(target=self._main, name="megaslide-worker")
                self.process.start()
                started = time.monotonic()
            self.process.join()
            code = self.process.exitcode
            if self._stopping.is_set() or code in self._keep_down:
                return
            if time.monotonic() - started >= self.STEADY_S:
                delay = self.RESTART_DELAY_S
            log.warning("the worker process exited with %s; restarting it in %g s", code, delay)
            self._stopping.wait(delay)
            delay = min(2 * delay, self.MAX_RESTART_DELAY_S)
