"""A worker's place in the store's registry: its name, held by one live worker at a time, and the
heartbeat thread that proves it alive, publishes its metrics and extends the leases of the jobs
it holds, unless its main loop has stalled (a watchdog).

When a write comes back refused (the lease went to another worker while this one was silent),
the job is dropped without a trace: its outcome belongs to the new holder.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from ..store import WorkerNameInUse
from .context import WorkerContext

log = logging.getLogger("megaslide.server")

# (database, name) of the workers running in this process: a second one of a name on one store is
# refused here, whatever the registry's heartbeat says.
_RUNNING_HERE: set[tuple[str, str]] = set()
_RUNNING_LOCK = threading.Lock()


def default_name(device: str) -> str:
    """One worker per device slot of a host: a restart under the same name takes its jobs back."""
    return f"{socket.gethostname()}/{device}"


class Heartbeat:
    """Registers one worker, then beats for it every `heartbeat_s` on a thread of its own until
    the worker stops; `leases` says which claims to extend."""

    def __init__(self, ctx: WorkerContext, leases: Callable[[], list[str]]):
        self.ctx, self._leases = ctx, leases
        self._thread: threading.Thread | None = None

    def register(self, cards: list[dict]) -> None:
        """Enter the registry with the published `cards`, and start beating; jobs a previous
        incarnation of this name held come back now.

        A live worker of the same name is refused (`WorkerNameInUse`): one on another host that
        was heard from within the lease, or a process of this host that still runs.
        """
        ctx = self.ctx
        known = ctx.store.workers.get(ctx.name)
        if known is not None and known.age_s < ctx.settings.lease_s:
            if known.host != socket.gethostname() or (
                known.pid != os.getpid() and _alive(known.pid)
            ):
                raise WorkerNameInUse(
                    f"a worker named {ctx.name!r} is already running (pid {known.pid} on "
                    f"{known.host}); give this one another name"
                )
        with _RUNNING_LOCK:
            if (ctx.store.url, ctx.name) in _RUNNING_HERE:
                raise WorkerNameInUse(f"a worker named {ctx.name!r} already runs in this process")
            _RUNNING_HERE.add((ctx.store.url, ctx.name))
        requeued = ctx.store.workers.register(
            ctx.name,
            ctx.token,
            host=socket.gethostname(),
            pid=os.getpid(),
            device=ctx.backend.device_name,
            capacity=ctx.settings.max_batch,
            cards=cards,
        )
        if any(requeued.values()):
            log.warning("worker %s took back what its last run held: %s", ctx.name, requeued)
        self._thread = threading.Thread(target=self._beat, name="megaslide-heartbeat", daemon=True)
        self._thread.start()

    def deregister(self) -> None:
        """Leave the registry, once the worker's `stop` is set."""
        ctx = self.ctx
        if self._thread is not None:
            self._thread.join()
        ctx.store.workers.deregister(ctx.name, ctx.token)
        with _RUNNING_LOCK:
            _RUNNING_HERE.discard((ctx.store.url, ctx.name))

    def send(self) -> None:
        """One heartbeat now; a worker registered again elsewhere under this name stops."""
        ctx = self.ctx
        alive = ctx.store.workers.heartbeat(
            ctx.name,
            ctx.token,
            leases=self._leases(),
            lease_s=ctx.settings.lease_s,
            ready=ctx.ready,
            dead=ctx.dead,
            metrics=ctx.metrics.snapshot(),
        )
        if not alive:
            log.error("worker %s was registered again elsewhere; stopping", ctx.name)
            ctx.stop.set()
            ctx.wake.set()

    def _beat(self) -> None:
        ctx = self.ctx
        withheld = False
        while not ctx.stop.wait(ctx.settings.heartbeat_s):
            # A watchdog: a main loop stuck in one step for `stall_s` (a hung kernel, a deadlock)
            # must not keep its jobs' leases alive from this thread. Without a beat the leases
            # expire and the jobs run elsewhere; should the loop come back, its writes are
            # refused (each claim's token) and it drops them.
            stalled_s = time.monotonic() - ctx.progress_at
            if ctx.ready and stalled_s > ctx.settings.stall_s:
                if not withheld:
                    log.error(
                        "worker %s: its loop made no progress for %.0f s; withholding the "
                        "heartbeat so that its jobs' leases expire",
                        ctx.name,
                        stalled_s,
                    )
                withheld = True
                continue
            if withheld:
                log.warning("worker %s: its loop moves again; heartbeat resumed", ctx.name)
                withheld = False
            try:
                self.send()
            except Exception:  # noqa: BLE001 - the store may be back at the next beat
                log.exception("heartbeat failed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True
