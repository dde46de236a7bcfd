"""When a polling loop stops and how long it waits between looks: the I/O-free half of polling.

The clients' `poll` loops call a fetch function, hand what it returned to `Watch.see` and sleep
for as long as `see` says, until it says the job is over; only their I/O differs.
"""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar

from ._constants import DEFAULT_POLL_INTERVAL_MS
from ._progress import ProgressBar

T = TypeVar("T")
W = TypeVar("W", bound="Watch")


def poll_interval_s(poll_interval_ms: int | None, server_ms: str | None) -> float:
    """Seconds until the next look: the caller's interval, else the server's, else the default."""
    if poll_interval_ms is not None:
        return poll_interval_ms / 1000.0
    if server_ms is not None:
        try:
            return max(int(server_ms), 0) / 1000.0
        except ValueError:
            pass  # a header we cannot read is no request
    return DEFAULT_POLL_INTERVAL_MS / 1000.0


class Watch(Generic[T]):
    """Follows one job to its end, look by look, drawing an optional progress bar.

    A subclass reads one look in `observe`: it sets `result`, moves the bar and says whether the
    job is over. It may read the server's requested pace in `server_poll_ms`, and says what an
    unfinished job is doing in `still`, for the timeout message. Use it as a context manager, so
    the bar is closed however the wait ends.
    """

    result: T

    def __init__(
        self, bar: ProgressBar, *, poll_interval_ms: int | None, max_wait: float | None
    ) -> None:
        self.bar = bar
        self._interval_ms = poll_interval_ms
        self._deadline = None if max_wait is None else time.monotonic() + max_wait

    def observe(self, seen: Any) -> bool:
        """Take in one look; True once the job is over."""
        raise NotImplementedError

    def server_poll_ms(self, seen: Any) -> str | None:
        """How many milliseconds the server asked to wait before the next look, if it said."""
        return None

    def still(self) -> str:
        """What the unfinished job is doing, e.g. "video v1 still queued (0%)"."""
        raise NotImplementedError

    def see(self, seen: Any) -> float | None:
        """None once the job is over, else the seconds to wait before the next look.

        Raises TimeoutError when that wait would end past `max_wait`.
        """
        if self.observe(seen):
            return None
        wait = poll_interval_s(self._interval_ms, self.server_poll_ms(seen))
        if self._deadline is not None and time.monotonic() + wait > self._deadline:
            raise TimeoutError(f"{self.still()} after max_wait")
        return wait

    def __enter__(self: W) -> W:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
