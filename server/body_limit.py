"""A cap on every request body, counted as its bytes arrive.

`Content-Length` alone cannot be trusted (a chunked body has none), and `request.form()` or
`request.body()` take in a whole body before a handler can look at its size: an upload spools to
disk, a JSON body fills memory and blocks the event loop while it parses. `BodyLimit` sits in
front of every route, counts the bytes of each `http.request` message and answers 413, in the
error envelope, as soon as a body crosses its limit; the rest of the body is never read.

A file upload (a multipart body to a route listed in `uploads`) may be as large as that route
allows; every other body is held to one smaller default.

A body must also arrive whole in time: within `body_timeout_s` of the route's first read, plus
one second for every `min_body_rate` bytes received, else 408 and the connection closed. The
deadline is the body's, not each part's: a client that sent a byte every few seconds used to
reset a per-part timer for ever, and 512 such sockets held every connection. The allowance per
byte received lets a large upload at a fair rate run as long as it needs, while a trickle falls
behind its deadline within about `body_timeout_s`. Once a body is whole, waits are the route's
own (a stream waiting for its client to leave is no slow body).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import PayloadTooLarge, RequestTimeout, envelope

MULTIPART_SLACK = 64 * 1024  # form boundaries, part headers and small fields around the file


@dataclass(frozen=True)
class Upload:
    """A route that takes a file in a multipart body, and the largest file it takes."""

    method: str
    path: str
    max_file_bytes: int
    field: str  # the form field that carries the file, named in the 413

    @property
    def max_body_bytes(self) -> int:
        return self.max_file_bytes + MULTIPART_SLACK


class BodyLimit:
    """Pure ASGI middleware: 413 for a body over its route's limit, before more of it is read."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        uploads: list[Upload],
        body_timeout_s: float = 30.0,
        min_body_rate: float = 64 * 1024,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.min_body_rate = min_body_rate
        self.uploads = {(u.method, u.path): u for u in uploads}

    def rule(self, scope: Scope) -> tuple[int, str, str | None]:
        """The largest body this request may have, what a 413 says and the field it names."""
        upload = self.uploads.get((scope["method"], scope["path"]))
        if upload is not None and _header(scope, b"content-type").startswith(
            b"multipart/form-data"
        ):
            refusal = (
                f"{upload.field}: this server accepts files up to {upload.max_file_bytes} bytes"
            )
            return upload.max_body_bytes, refusal, upload.field
        refusal = (
            f"the request body is larger than this server's limit of {self.max_body_bytes} bytes"
        )
        return self.max_body_bytes, refusal, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, refusal, field = self.rule(scope)
        declared = _header(scope, b"content-length")
        # More digits than any limit has are over it; int() would refuse the longest anyway.
        if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
            await _too_large(refusal, field)(scope, receive, send)
            return

        received = 0
        deadline: float | None = None  # set by the route's first read
        whole = False  # the last of the body arrived
        started = False  # the route began its answer: too late for a 413
        answered = False  # the 413 went out: the route's own answer, if any, goes nowhere

        async def counting_receive() -> Message:
            nonlocal received, answered, whole, deadline
            if answered:
                return {"type": "http.disconnect"}
            if whole:
                return await receive()
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.body_timeout_s
            allowance = deadline + received / self.min_body_rate - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(allowance, 0.0))
            except TimeoutError:
                if not started:
                    await _too_slow(self.body_timeout_s)(scope, receive, send)
                    answered = True
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                whole = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > limit:
                    if not started:
                        await _too_large(refusal, field)(scope, receive, send)
                        answered = True
                    # The route stops reading as it would for a client that went away.
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if answered:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not answered:
                raise
            # The route failed on the body that was cut short; the client has its answer already.


def _too_slow(timeout_s: float) -> JSONResponse:
    error = RequestTimeout(
        f"the request body did not arrive in time ({timeout_s:g} s, longer as its bytes come)"
    )
    headers = {"Connection": "close"}  # the rest of the body is not wanted
    return envelope(error.status, error.message, error.type, error.param, error.code, headers)


def _too_large(message: str, field: str | None) -> JSONResponse:
    error = PayloadTooLarge(message, param=field)
    return envelope(error.status, error.message, error.type, error.param, error.code)


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return b""
