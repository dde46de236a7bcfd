"""Where a broken stream picks up again: the state of a download and of an event stream, no I/O.

The clients' `get_stream` loops open a GET with `headers()`, hand the answer to `begin`, feed it
each piece of the body (bytes, or text lines when `lines` is set) and pass on what `feed` returns.
When the connection breaks they open a new GET with the headers as they stand then, so the state
object alone decides where the stream resumes; the twins differ only in how they read and sleep.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Union

import httpx

from ._constants import STREAM_READ_TIMEOUT
from ._sse import ServerSentEvent, SSEDecoder

PathLike = Union[str, "os.PathLike[str]"]


def stream_timeout(client_timeout: httpx.Timeout) -> httpx.Timeout:
    """The client's timeout with the longer read timeout of a stream (silent between steps)."""
    read = client_timeout.read
    return httpx.Timeout(
        connect=client_timeout.connect,
        read=None if read is None else max(read, STREAM_READ_TIMEOUT),
        write=client_timeout.write,
        pool=client_timeout.pool,
    )


def content_range_start(response: httpx.Response) -> int | None:
    """The first byte a 206 answer carries (`Content-Range: bytes START-END/TOTAL`)."""
    value = response.headers.get("content-range", "")
    try:
        return int(value.split()[1].split("-")[0])
    except (IndexError, ValueError):
        return None


class Resume:
    """A stream that can be reopened where it broke.

    Whatever `feed` returns shows that the connection works, so the loop starts counting breaks
    afresh after each item: only breaks in a row count against max_retries.
    """

    # Feed the body as text lines (Server-Sent Events) rather than as bytes.
    lines = False

    def headers(self) -> dict[str, str] | None:
        """Headers of the next (re)connection: what says where to start."""
        return None

    def begin(self, response: httpx.Response) -> None:
        """A connection was opened and answered; the body follows."""

    def feed(self, piece: Any) -> list[Any]:
        """Take one piece of the body; returns what it completes, for the caller."""
        return []

    def end(self) -> list[Any]:
        """The body ended cleanly; returns anything still held back."""
        return []


class Download(Resume):
    """A download into a file or into memory, resumed with `Range: bytes=N-` after a break.

    Used as a context manager: a file appears at `path` complete or not at all (bytes go to
    PATH.part, renamed at the end). `feed` returns nothing, so every break of one download counts
    against max_retries: a server that keeps cutting it off cannot keep it going forever.
    """

    def __init__(self, path: PathLike | None) -> None:
        self.path = None if path is None else Path(path)
        self.written = 0
        self._file: IO[bytes] = io.BytesIO()

    @property
    def _part(self) -> Path:
        assert self.path is not None
        return self.path.with_name(self.path.name + ".part")

    def __enter__(self) -> Download:
        if self.path is not None:
            self._file = open(self._part, "wb")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: Any) -> None:
        if self.path is None:
            return
        try:
            self._file.close()
            if exc_type is None:
                os.replace(self._part, self.path)
        finally:
            self._part.unlink(missing_ok=True)

    def headers(self) -> dict[str, str] | None:
        return {"Range": f"bytes={self.written}-"} if self.written else None

    def begin(self, response: httpx.Response) -> None:
        resumed = response.status_code == 206 and content_range_start(response) == self.written
        if self.written and not resumed:
            # The server sent the whole file again (or some other part of it): start over.
            self._file.seek(0)
            self._file.truncate()
            self.written = 0

    def feed(self, chunk: bytes) -> list[Any]:
        # Plain file writes even in the async client: chunks are small and local disks fast.
        self._file.write(chunk)
        self.written += len(chunk)
        return []

    def result(self) -> Path | bytes:
        """The file's path, or the bytes when there is no path."""
        if self.path is None:
            assert isinstance(self._file, io.BytesIO)
            return self._file.getvalue()
        return self.path


class EventStream(Resume):
    """Server-Sent Events, reopened after a break with `Last-Event-ID: <last event received>`.

    The server replays what came after that event, so nothing is lost or repeated; an event that
    was half received when the connection broke is dropped with it and arrives whole on the next.
    """

    lines = True

    def __init__(
        self,
        last_event_id: str | None = None,
        parse: Callable[[ServerSentEvent], Any] = lambda sse: sse,
    ) -> None:
        self.last_event_id = last_event_id
        self._parse = parse
        self._decoder = SSEDecoder()

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream"}
        if self.last_event_id:
            headers["Last-Event-ID"] = self.last_event_id
        return headers

    def begin(self, response: httpx.Response) -> None:
        self._decoder = SSEDecoder()

    def feed(self, line: str) -> list[Any]:
        return self._deliver(self._decoder.feed(line))

    def end(self) -> list[Any]:
        return self._deliver(self._decoder.flush())

    def _deliver(self, event: ServerSentEvent | None) -> list[Any]:
        if event is None:
            return []
        self.last_event_id = event.id or self.last_event_id
        return [self._parse(event)]
