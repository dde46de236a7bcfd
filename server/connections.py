"""uvicorn's HTTP protocol with the guards it leaves out: a deadline for a request's headers and a
cap on open connections.

uvicorn starts no timer on a new connection, so a client that sends its headers a byte at a time
(slowloris) holds a connection, and a file descriptor, for as long as it likes; a thousand of them
at `ulimit -n 1024` and nobody else is served. Here a connection whose request line and headers
are not complete within `header_timeout_s` (from its first byte on a kept-alive connection, from
the connection itself on a new one) is answered 408 and closed, and a connection past
`max_connections` is answered 503 at once and closed, so the server always keeps descriptors for
the clients it serves. Slow bodies are `BodyLimit`'s business (body_limit.py): the ASGI app sees
those.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _refusal(status: bytes, message: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: "
        + str(len(message)).encode()
        + b"\r\nconnection: close\r\n\r\n"
        + message
    )


TOO_SLOW = _refusal(b"408 Request Timeout", b"the request's headers took too long to arrive")
TOO_MANY = _refusal(b"503 Service Unavailable", b"too many open connections; retry shortly")


def guarded_protocol(*, header_timeout_s: float, max_connections: int) -> type:
    """An httptools protocol class for `uvicorn.run(http=...)` with both guards."""

    class GuardedProtocol(HttpToolsProtocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse(TOO_MANY)
                return
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_deadline is None:  # a kept-alive connection's next request
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_deadline = self.loop.call_later(header_timeout_s, self._refuse, TOO_SLOW)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _refuse(self, answer: bytes) -> None:
            self._header_deadline = None
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    return GuardedProtocol


def uvicorn_options(settings) -> dict:
    """What `uvicorn.run` / `uvicorn.Config` need for `settings`' guards."""
    guarded = guarded_protocol(
        header_timeout_s=settings.header_timeout_s, max_connections=settings.max_connections
    )
    return {"http": guarded}
