"""What video and fine-tuning jobs share: ids, admission to the queue, event numbers, and waiting
for a worker to act on a job."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable

from ..auth import Principal
from ..errors import Forbidden, InvalidRequest, QueueFull, WorkerDead
from ..protocol import WorkerClient
from ..settings import Settings
from ..store import AsyncStore

EVENT_SEQ_LIMIT = 2**63  # event numbers are stored as signed 64-bit integers


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def event_seq(text: str, param: str) -> int:
    """An event number a client sends back (SSE's `Last-Event-ID`, a page cursor): plain decimal
    digits below 2**63, else a 400 naming `param`."""
    # isdigit() alone would take other scripts' digits ("٣", "²"); 19 digits hold any valid one.
    if not (text.isascii() and text.isdigit() and len(text) <= 19) or int(text) >= EVENT_SEQ_LIMIT:
        raise InvalidRequest(
            f"{param} must be an event number below 2**63, got {text[:40]!r}", param=param
        )
    return int(text)


async def admit(
    store: AsyncStore, workers: WorkerClient, settings: Settings, principal: Principal
) -> None:
    """Refuse new work when the worker is dead, the queue is full, or the principal (a key that
    is not an admin's) already holds its share of the queue."""
    if workers.dead:
        raise WorkerDead(f"the worker stopped ({workers.dead}); restart the server")
    depth = await store.jobs.queue_depth()
    if depth >= settings.max_queue:
        raise QueueFull(
            f"the queue is full ({depth} jobs waiting); retry later",
            retry_after=workers.retry_after(),
        )
    if principal.admin:
        return
    mine = await store.jobs.queue_depth(owner=principal.owner)
    if mine >= settings.max_queue_per_key:
        raise QueueFull(
            f"this API key has {mine} jobs waiting, its share of the queue; retry when one "
            "has started",
            retry_after=workers.retry_after(),
        )


def check_priority(priority: int, principal: Principal) -> None:
    """Only an admin (or a server without keys) may put a job ahead of others."""
    if priority > 0 and not principal.admin:
        raise Forbidden(
            f"priority {priority} needs an admin key; other keys may use 0 or less",
            param="priority",
        )


async def wait_for(
    done: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.05
) -> bool:
    """Poll `await done()` without blocking the event loop; True if it became true in time."""
    deadline = time.monotonic() + timeout_s
    while not await done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval_s)
    return True
