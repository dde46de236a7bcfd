"""Text the job store can hold: no NUL character in a request's path or query.

PostgreSQL's `text` type cannot hold U+0000 (SQLite's can), so an id, an `after=` cursor or a
`purpose=` carrying `%00` would reach the store, fail there with a `DataError` and be answered 500
on PostgreSQL alone. No id, cursor or name the server makes or accepts contains one, so such a
request is refused before any route runs. JSON bodies are checked field by field by the schemas
(`schemas.Request`), form fields and file names where the form is read.
"""

from __future__ import annotations

from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import InvalidRequest, envelope

NUL = "\x00"
NUL_MESSAGE = "must not contain a NUL character (U+0000)"


def check_plain(value: str | None, param: str) -> None:
    """Raise InvalidRequest naming `param` when `value` holds a NUL character."""
    if value is not None and NUL in value:
        raise InvalidRequest(f"{param}: {NUL_MESSAGE}", param=param)


def _refusal(scope: Scope) -> InvalidRequest | None:
    if NUL in scope["path"]:  # already percent-decoded by the server
        return InvalidRequest(f"the URL path {NUL_MESSAGE}", param="path")
    query = scope.get("query_string", b"").decode("latin-1")
    for name, value in parse_qsl(query, keep_blank_values=True):
        if NUL in name or NUL in value:
            param = name.replace(NUL, "") or "query"
            return InvalidRequest(f"{param}: {NUL_MESSAGE}", param=param)
    return None


class RefuseNul:
    """Pure ASGI middleware: 400, in the error envelope, for a NUL in the path or the query."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (err := _refusal(scope)) is not None:
            response = envelope(err.status, err.message, err.type, err.param, err.code)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
