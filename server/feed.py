"""One feed of the job store's events for every Server-Sent Events stream of an API process.

Each stream used to poll the store itself (its events, its video, its queue position) every
`sse_interval_s`: a thousand open streams were thousands of queries a second, and the engine and
status polls starved. Here one task polls the store for every job's new events at that interval
(one query; a second one for the queue's order when a video was queued, started or ended), while
anyone listens, and hands each stream the events of its own job and its new queue position. A
stream reads the store itself only to replay what came before it subscribed, and for the video
object of its last event. Each principal may hold `max_streams` streams at once, and the
process `max_total` (set well below its connection cap: ten keys within their own limits once
held 511 of 512 connections, and every new client got 503).

Events reach every API host this way, whichever worker wrote them: the feed reads the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from .errors import TooManyStreams
from .records import EventRecord
from .store import AsyncStore

log = logging.getLogger("megaslide.server")

# Events after which videos may stand elsewhere in the queue.
QUEUE_MOVES = frozenset(
    f"video.{s}" for s in ("queued", "in_progress", "completed", "failed", "cancelled")
)
EVENTS_PER_POLL = 1000


@dataclass(eq=False)
class Subscription:
    """What one stream is told: its job's events, and its queue position when that changes."""

    job_id: str
    # Set once the feed knows where the log stood when it began watching: a stream replays the
    # store only after that, so no event falls between its replay and what the feed hands it.
    watching: asyncio.Event
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    position: int | None = None  # the last position put in the inbox

    def tell_position(self, position: int | None) -> None:
        if position is not None and position != self.position:
            self.position = position
            self.inbox.put_nowait(("position", position))

    async def next(self) -> tuple[str, object]:
        """`("event", EventRecord)` or `("position", n)`, as they come."""
        return await self.inbox.get()


class EventFeed:
    """The store's new events, polled once per interval for all of this process's streams."""

    def __init__(
        self, store: AsyncStore, interval_s: float, max_streams: int, max_total: int | None = None
    ):
        self.store, self.interval_s, self.max_streams = store, interval_s, max_streams
        self.max_total = max_total
        self._subscribers: dict[str, set[Subscription]] = defaultdict(set)
        self._open: Counter[str] = Counter()  # streams per principal scope
        self._task: asyncio.Task | None = None
        self._cursor: int | None = None  # the newest event seen
        self._watching = asyncio.Event()  # set while the cursor is

    @property
    def streams(self) -> int:
        return sum(self._open.values())

    def admit(self, scope: str) -> None:
        """429 when `scope` (a principal) already holds `max_streams`, or this process
        `max_total`."""
        if self._open[scope] >= self.max_streams:
            raise TooManyStreams(
                f"this API key has {self._open[scope]} event streams open, its limit; close one",
                retry_after=1,
            )
        if self.max_total is not None and self.streams >= self.max_total:
            raise TooManyStreams(
                f"this server holds {self.streams} event streams, its limit; retry shortly",
                retry_after=1,
            )

    @contextlib.contextmanager
    def subscribe(self, job_id: str, scope: str) -> Iterator[Subscription]:
        """A subscription to `job_id`'s news for the length of the block, counted against
        `scope`; `TooManyStreams` past a limit. The check and the count share no `await`, so
        a thousand streams opened at once cannot all pass the check before any counts."""
        self.admit(scope)
        sub = Subscription(job_id, self._watching)
        self._open[scope] += 1
        self._subscribers[job_id].add(sub)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            yield sub
        finally:
            self._open[scope] -= 1
            self._subscribers[job_id].discard(sub)
            if not self._subscribers[job_id]:
                del self._subscribers[job_id]

    async def _run(self) -> None:
        """Poll while anyone listens; a store error is logged and the poll tried again."""
        moved = True  # positions are new to the first subscribers
        while self._subscribers:
            rows = []
            try:
                if self._cursor is None:  # first poll: where the log ends now
                    self._cursor = await self.store.videos.last_event_seq()
                    self._watching.set()
                else:
                    rows = await self.store.videos.events_since(self._cursor, EVENTS_PER_POLL)
                moved = self._deliver(rows) or moved
                if moved:
                    positions = await self.store.videos.queue_positions()
                    for subs in list(self._subscribers.values()):
                        for sub in subs:
                            sub.tell_position(positions.get(sub.job_id))
                    moved = False
            except Exception:  # noqa: BLE001 - the streams wait; the next poll tries again
                log.exception("the event feed could not read the job store")
            if len(rows) < EVENTS_PER_POLL:  # caught up: wait for more
                await asyncio.sleep(self.interval_s)
        self._cursor = None  # nobody listens: start from the end again next time
        self._watching = asyncio.Event()

    def _deliver(self, events: list[EventRecord]) -> bool:
        """Hand out `events`; whether any may have moved the queue."""
        moved = False
        for event in events:
            self._cursor = event.seq
            moved = moved or event.type in QUEUE_MOVES
            for sub in self._subscribers.get(event.job_id, ()):
                sub.inbox.put_nowait(("event", event))
        return moved
