"""Files served for download and playback: Starlette's `FileResponse`, with the API's error shape.

Starlette does the HTTP work: one range (206 with `Content-Range`), several (206
`multipart/byteranges`), suffix ranges, `If-Range`, HEAD, `ETag` and `Last-Modified`, and the file
read in a worker thread. Two things are ours. A `Range` in a unit other than bytes is ignored, as
RFC 9110 section 14.2 requires (Starlette refuses it). And Starlette's refusals, 400 for a range
it cannot parse and 416 for one outside the file, are plain text: they reach the client in the
API's JSON error envelope instead, with `param` "range".
"""

from __future__ import annotations

from starlette.responses import FileResponse
from starlette.types import Message, Receive, Scope, Send

from .errors import envelope


class Download(FileResponse):
    """A file inline (`Content-Disposition: inline; filename=...`), with Range support."""

    def __init__(self, path, media_type: str, filename: str):
        super().__init__(
            path, media_type=media_type, filename=filename, content_disposition_type="inline"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        asked = _header(scope, b"range")
        if asked is not None and not asked.lower().startswith("bytes="):
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"range"]}
        await super().__call__(scope, receive, _in_envelope(send, asked))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _in_envelope(send: Send, asked: str | None) -> Send:
    """`send`, except that a 400 or 416 answer goes out as the API's JSON error."""
    refusal: dict = {}

    async def enveloped(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] in (400, 416):
            refusal.update(status=message["status"], headers=message.get("headers", []))
            return
        if not refusal:
            await send(message)
            return
        if message["type"] != "http.response.body" or message.get("more_body"):
            return
        status = refusal["status"]
        shown = (asked or "")[:64]
        if status == 416:
            detail = dict(refusal["headers"]).get(b"content-range", b"").decode("latin-1")
            size = detail.rpartition("/")[2]
            message_text = f"range {shown!r} lies outside the {size}-byte file"
            code, headers = "range_not_satisfiable", {"Content-Range": detail}
        else:
            reason = message.get("body", b"").decode("utf-8", "replace") or "malformed"
            message_text = f"cannot serve range {shown!r}: {reason}"
            code, headers = "invalid_range", None
        body = envelope(status, message_text, "invalid_request_error", "range", code, headers)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": body.raw_headers,
            }
        )
        await send({"type": "http.response.body", "body": body.body})

    return enveloped
