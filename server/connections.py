"""uvicorn's HTTP protocol with the guards it leaves out: a deadline for a request's headers, a
cap on open connections, and a cap on those of any one client address.

uvicorn starts no timer on a new connection, so a client that sends its headers a byte at a time
(slowloris) holds a connection, and a file descriptor, for as long as it likes; a thousand of them
at `ulimit -n 1024` and nobody else is served. Here a connection whose request line and headers
are not complete within `header_timeout_s` (from its first byte on a kept-alive connection, from
the connection itself on a new one) is answered 408 and closed, and a connection past
`max_connections` is answered 503 at once and closed, so the server always keeps descriptors for
the clients it serves.

The global cap alone lets one client take it all: 512 sockets from one address, or a header
trickler that reconnects each time it is cut (it needs no API key), and every new client got
503. So one address may hold `max_per_client` open connections, and `max_pending_per_client` of
them still sending headers; past either its new connection is answered 429 at once and closed,
while other addresses are still served. Slow bodies are `BodyLimit`'s business (body_limit.py):
the ASGI app sees those.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _refusal(status: bytes, message: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: "
        + str(len(message)).encode()
        + b"\r\n"
        + extra
        + b"connection: close\r\n\r\n"
        + message
    )


TOO_SLOW = _refusal(b"408 Request Timeout", b"the request's headers took too long to arrive")
TOO_MANY = _refusal(b"503 Service Unavailable", b"too many open connections; retry shortly")
CLIENT_TOO_MANY = _refusal(
    b"429 Too Many Requests",
    b"this address holds as many open connections as it may; close one first",
    b"retry-after: 1\r\n",
)
CLIENT_TOO_SLOW = _refusal(
    b"429 Too Many Requests",
    b"this address holds as many connections still sending headers as it may",
    b"retry-after: 1\r\n",
)


def _address(transport: asyncio.Transport) -> str:
    peer = transport.get_extra_info("peername")
    # A Unix socket's peer has no address: its clients count as one.
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


def guarded_protocol(
    *,
    header_timeout_s: float,
    max_connections: int,
    max_per_client: int | None = None,
    max_pending_per_client: int | None = None,
) -> type:
    """An httptools protocol class for `uvicorn.run(http=...)` with these guards. Each class
    counts its own connections per address: make one per server."""
    max_per_client = max_per_client or max_connections
    max_pending_per_client = max_pending_per_client or max_per_client
    open_by: Counter[str] = Counter()  # counted connections per client address
    pending_by: Counter[str] = Counter()  # those of them whose headers are still coming

    class GuardedProtocol(HttpToolsProtocol):
        _header_deadline: asyncio.TimerHandle | None = None
        _client: str | None = None  # the address this connection is counted against

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            address = _address(transport)
            if len(self.connections) > max_connections:
                self._refuse(TOO_MANY)
            elif open_by[address] >= max_per_client:
                self._refuse(CLIENT_TOO_MANY)
            elif pending_by[address] >= max_pending_per_client:
                self._refuse(CLIENT_TOO_SLOW)
            else:
                self._client = address
                open_by[address] += 1
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
            if self._client is not None:
                _release(open_by, self._client)
                self._client = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._client is None:
                return  # refused: closing already
            self._header_deadline = self.loop.call_later(header_timeout_s, self._timed_out)
            pending_by[self._client] += 1

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None
                _release(pending_by, self._client)

        def _timed_out(self) -> None:
            self._disarm()
            self._refuse(TOO_SLOW)

        def _refuse(self, answer: bytes) -> None:
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    return GuardedProtocol


def _release(counts: Counter, address: str) -> None:
    counts[address] -= 1
    if counts[address] <= 0:
        del counts[address]  # an address that left holds no entry


def uvicorn_options(settings) -> dict:
    """What `uvicorn.run` / `uvicorn.Config` need for `settings`' guards."""
    guarded = guarded_protocol(
        header_timeout_s=settings.header_timeout_s,
        max_connections=settings.max_connections,
        max_per_client=settings.max_connections_per_client,
        max_pending_per_client=settings.max_pending_per_client,
    )
    return {"http": guarded}
