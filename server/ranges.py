"""Serving a file with HTTP Range support (RFC 9110 section 14): seeking players and resumed downloads.

One `bytes=` range is honoured with 206 Partial Content; a range that starts past the end is 416 with
`Content-Range: bytes */SIZE`. Anything else (several ranges, another unit, a header that is not
exactly `bytes=FIRST-LAST`, `bytes=FIRST-` or `bytes=-SUFFIX` in ASCII digits) gets the whole file
with 200, which the RFC allows. Parsing is strict: Python's int() would also read `1_0`, `+5` and
` 5 `, which no client means as a range. File reads run in a worker thread, never on the event loop.
"""

from __future__ import annotations

import re
from pathlib import Path

import anyio
from starlette.responses import StreamingResponse

from .errors import RangeNotSatisfiable

CHUNK = 256 * 1024
ONE_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
# No file is this large; a position with more digits is simply past the end (and int() refuses
# strings of over 4300 digits).
BEYOND_ANY_FILE = 10**18


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive byte span `(first, last)` one range asks for, or None to send the whole file."""
    match = ONE_RANGE.fullmatch(header or "")
    if match is None:
        return None
    first_text, last_text = match.groups()
    if first_text == "":  # suffix range: the last N bytes
        if last_text == "":
            return None
        n = _position(last_text)
        if n == 0:
            raise RangeNotSatisfiable(
                f"range {header[:64]!r} asks for no bytes", headers=_unsatisfiable(size)
            )
        return max(size - n, 0), size - 1
    first = _position(first_text)
    last = _position(last_text) if last_text else size - 1
    if first >= size:
        raise RangeNotSatisfiable(
            f"range {header[:64]!r} starts past the end of the {size}-byte file",
            headers=_unsatisfiable(size),
        )
    if last < first:
        return None
    return first, min(last, size - 1)


def _position(digits: str) -> int:
    return int(digits) if len(digits) < 18 else BEYOND_ANY_FILE


def _unsatisfiable(size: int) -> dict:
    return {"Content-Range": f"bytes */{size}"}


def file_response(
    path: Path, range_header: str | None, media_type: str, filename: str
) -> StreamingResponse:
    size = path.stat().st_size
    span = parse_range(range_header, size)
    first, last = span if span is not None else (0, size - 1)
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Length": str(last - first + 1 if size else 0),
        "Content-Disposition": f'inline; filename="{filename}"',
    }
    if span is not None:
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"

    async def body():
        async with await anyio.open_file(path, "rb") as f:
            await f.seek(first)
            left = last - first + 1 if size else 0
            while left > 0:
                chunk = await f.read(min(CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
                yield chunk

    return StreamingResponse(
        body(), status_code=206 if span else 200, headers=headers, media_type=media_type
    )
