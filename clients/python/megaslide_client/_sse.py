"""A Server-Sent Events parser (https://html.spec.whatwg.org/multipage/server-sent-events.html).

Lines `event:`, `data:` (joined with newlines when repeated), `id:` and `retry:` build an event;
a blank line dispatches it; lines starting with `:` are comments (keep-alives) and are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass
class ServerSentEvent:
    """One raw event: name (None means the default "message"), data text, id and retry."""

    event: str | None
    data: str
    id: str | None
    retry: int | None


class SSEDecoder:
    """Feed it lines; it returns an event when a blank line completes one."""

    def __init__(self) -> None:
        self._event: str | None = None
        self._data: list[str] = []
        self._id: str | None = None
        self._retry: int | None = None

    def feed(self, line: str) -> ServerSentEvent | None:
        line = line.rstrip("\r\n")
        if not line:
            if self._event is None and not self._data and self._id is None and self._retry is None:
                return None
            event = ServerSentEvent(self._event, "\n".join(self._data), self._id, self._retry)
            self._event, self._data, self._retry = None, [], None
            # The spec keeps the last event id across events; we report it per event.
            self._id = None
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry":
            if value.isdigit():
                self._retry = int(value)
        return None

    def flush(self) -> ServerSentEvent | None:
        """The event left when the stream ended without a final blank line, if any."""
        return self.feed("")


def iter_sse(lines: Iterable[str]) -> Iterator[ServerSentEvent]:
    """The events in a whole sequence of lines (a stream read incrementally feeds SSEDecoder)."""
    decoder = SSEDecoder()
    for line in lines:
        event = decoder.feed(line)
        if event is not None:
            yield event
    event = decoder.flush()
    if event is not None:
        yield event
