"""`/v1/videos`: create (JSON or multipart), retrieve, list, cancel/delete, content, and SSE events."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import json
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from megaslide.engine.atomic import atomic_write_bytes
from megaslide.engine.request import RequestError, resolve

from ..auth import Principal
from ..deps import (
    DataDep,
    PrincipalDep,
    SettingsDep,
    StoreDep,
    WorkersDep,
    admit,
    check_priority,
    event_seq,
    find_model,
    idempotent,
    new_id,
    request_hash,
    wait_for,
)
from ..downloads import Download
from ..errors import InvalidRequest, NotFound, NotReady, invalid_request
from ..feed import EventFeed, Subscription
from ..links import DEFAULT_TTL_S, MAX_TTL_S
from ..protocol import WorkerClient
from ..schemas import (
    ContentLink,
    ListPage,
    Video,
    VideoCreate,
    VideoDeleted,
    error_responses,
    page,
    video_object,
)
from ..store import VIDEO_TERMINAL, AsyncStore, now

router = APIRouter(prefix="/v1/videos", tags=["videos"])

SSE_KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing a quiet stream
TEXT_FIELDS = ("prompt", "negative_prompt")  # an empty form value is meaningful for these only
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # what a first-frame image may be uploaded as


async def read_create_body(request: Request) -> tuple[VideoCreate, UploadFile | None]:
    """The create parameters from a JSON body or form fields (the openai SDK sends multipart),
    and the first-frame image (`input_reference`) when one was uploaded."""
    content_type = request.headers.get("content-type", "")
    image = None
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await request.form(max_files=1)
        data = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key != "input_reference":
                    raise InvalidRequest(f"{key} cannot be a file", param=key)
                image = value
            elif value != "" or key in TEXT_FIELDS:
                data[key] = value
    else:
        data = parse_json(await request.body())
        if not isinstance(data, dict):
            raise InvalidRequest(
                "the request body must be a JSON object (or multipart form fields)"
            )
    try:
        return VideoCreate.model_validate(data), image
    except ValidationError as e:
        raise invalid_request(e) from None


def parse_json(body: bytes):
    """A JSON body (RFC 8259: UTF-8) as Python values, or a 400 that says what is wrong with it."""
    try:
        return json.loads(body.decode("utf-8") or "null")
    except UnicodeDecodeError as e:
        raise InvalidRequest(
            f"the request body is not UTF-8 text: {e.reason} at byte {e.start}"
        ) from None
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("the request body nests lists or objects too deeply") from None


async def find_video(store: AsyncStore, video_id: str, principal: Principal) -> dict:
    """The video, if `principal` may see it; another key's answers 404 as if absent."""
    row = await store.get_video(video_id)
    if row is None or not principal.may_see(row["owner"]):
        raise NotFound(f"No video found with id {video_id!r}", param="video_id")
    return row


def poll_hint(response: Response, row: dict, settings) -> None:
    if row["status"] not in VIDEO_TERMINAL:
        response.headers["openai-poll-after-ms"] = str(settings.poll_after_ms)


# The body is parsed by hand (JSON or form), so its schema is declared here for the OpenAPI docs.
CREATE_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": VideoCreate.model_json_schema()},
            "multipart/form-data": {"schema": VideoCreate.model_json_schema()},
        },
    }
}


@router.post(
    "",
    response_model=Video,
    openapi_extra=CREATE_BODY_DOC,
    responses=error_responses(400, 403, 404, 409, 429, 503),
)
async def create_video(
    request: Request,
    response: Response,
    store: StoreDep,
    workers: WorkersDep,
    settings: SettingsDep,
    data: DataDep,
    principal: PrincipalDep,
):
    body, upload = await read_create_body(request)
    check_priority(body.priority, principal)
    served = workers.models()
    if not served:
        raise NotReady("no live worker serves a model yet; retry shortly")
    card = find_model(workers, body.model or served[0].name, principal)
    video_id = new_id("video_")
    image = None
    if upload is not None:
        if not card.limits.image_input:
            raise RequestError(
                f"model {card.name} does not take a first-frame image (input_reference)",
                param="input_reference",
                code="unsupported_parameter",
            )
        image = data.reference(video_id)
        await run_in_threadpool(save_image, upload.file, image, settings.max_image_pixels)
    try:
        video = resolve(
            body.to_request(image=str(image) if image else None),
            card.limits,
            card.defaults,
            model=card.name,
            max_steps=settings.max_steps,
            max_prompt_chars=settings.max_prompt_chars,
            adapters=card.adapter_defaults(),
        )
        if image is not None:  # stored relative to the storage, which hosts mount where they like
            video = dataclasses.replace(video, image=data.relative(image))
        payload = request_hash({**body.model_dump(exclude_none=True), "image": _digest(image)})
        async with idempotent(request, store, payload) as replay:
            if replay.replayed and (row := await store.get_video(replay.resource_id)) is not None:
                _discard(image)
                poll_hint(response, row, settings)
                return video_object(row)
            await admit(store, workers, settings, principal)
            row = await store.insert_video(
                video_id,
                video.to_dict(),
                priority=body.priority,
                idempotency=replay.key,
                owner=principal.owner,
            )
    except BaseException:
        _discard(image)
        raise
    workers.wake()
    poll_hint(response, row, settings)
    return video_object(row)


def save_image(src, dst: Path, max_pixels: int) -> None:
    """Check an uploaded first-frame image and store it as PNG; RequestError if it is not one.

    The pixel count is read from the header and bounded before anything is decoded, so a small
    file that would inflate to gigabytes is refused cheaply. Only the formats a first frame comes
    in are opened: PIL's other decoders (TIFF, PSD, EPS, ...) are more ways in for a crafted file.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(src, formats=IMAGE_FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise RequestError(
                    f"input_reference is {width}x{height} pixels; at most {max_pixels} are accepted",
                    param="input_reference",
                )
            image = image.convert("RGB")
    except RequestError:
        raise
    except UnidentifiedImageError:
        formats = f"{', '.join(IMAGE_FORMATS[:-1])} or {IMAGE_FORMATS[-1]}"
        raise RequestError(
            f"input_reference is not a readable image: not a {formats} file",
            param="input_reference",
        ) from None
    # PIL reports a damaged file as SyntaxError ("broken PNG file") or ValueError as well as
    # OSError.
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise RequestError(
            f"input_reference is not a readable image ({e})", param="input_reference"
        ) from None
    png = io.BytesIO()
    image.save(png, format="PNG")
    atomic_write_bytes(dst, png.getvalue())


def _digest(path: Path | None) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None else None


def _discard(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


@router.get("", response_model=ListPage[Video], responses=error_responses(400))
async def list_videos(
    store: StoreDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
):
    rows, has_more = await store.list_videos(after, limit, order, principal.sees)
    return page([video_object(r) for r in rows], has_more)


@router.get("/{video_id}", response_model=Video, responses=error_responses(404))
async def retrieve_video(
    video_id: str,
    response: Response,
    store: StoreDep,
    settings: SettingsDep,
    principal: PrincipalDep,
):
    row = await find_video(store, video_id, principal)
    poll_hint(response, row, settings)
    return video_object(row)


async def stop(store: AsyncStore, workers: WorkerClient, video_id: str, wait_s: float) -> str:
    """Cancel a queued video now, or a running one at its next step boundary, waiting up to
    `wait_s` for its worker to stop it; the status after."""
    if await store.cancel_video(video_id) == "in_progress":
        workers.wake()

        async def stopped() -> bool:
            return (await store.get_video(video_id))["status"] != "in_progress"

        await wait_for(stopped, wait_s)
    return (await store.get_video(video_id))["status"]


@router.post("/{video_id}/cancel", response_model=Video, responses=error_responses(400, 404, 409))
async def cancel_video(
    video_id: str,
    request: Request,
    store: StoreDep,
    workers: WorkersDep,
    settings: SettingsDep,
    principal: PrincipalDep,
):
    """Stop a queued or running video; its record stays, `cancelled`. A running one stops at its
    next step boundary (the answer waits up to `cancel_wait_s` for it). Cancelling a cancelled
    video answers it as it is; a retry with the same Idempotency-Key gets the first answer."""
    async with idempotent(request, store, request_hash({"cancel": video_id})) as replay:
        if replay.response is not None:  # a retry: the first answer, whatever happened since
            return replay.response
        row = await find_video(store, video_id, principal)
        if row["status"] in ("completed", "failed"):
            raise InvalidRequest(
                f"video {video_id} is already {row['status']}; there is nothing to cancel",
                param="video_id",
                code="video_not_cancellable",
            )
        await stop(store, workers, video_id, settings.cancel_wait_s)
        answer = video_object(await store.get_video(video_id))
        await replay.answer(answer)
    return answer


@router.delete("/{video_id}", response_model=VideoDeleted, responses=error_responses(404, 409))
async def delete_video(
    video_id: str,
    request: Request,
    store: StoreDep,
    workers: WorkersDep,
    settings: SettingsDep,
    data: DataDep,
    principal: PrincipalDep,
):
    """Delete a video, its record and its files. One still queued or running is stopped first (a
    running one at its next step boundary; the answer waits up to `cancel_wait_s`, and if it has
    not stopped by then says `deleted: false` while the cancellation goes on). A retry with the
    same Idempotency-Key gets the first answer, not a 404."""
    async with idempotent(request, store, request_hash({"delete": video_id})) as replay:
        if replay.response is not None:  # a retry: the first answer, not a 404
            return replay.response
        await find_video(store, video_id, principal)
        status = await stop(store, workers, video_id, settings.cancel_wait_s)
        if status == "in_progress":
            answer = VideoDeleted(id=video_id, deleted=False, status=status)
        else:
            await store.delete_video(video_id)
            for path in data.video_files(video_id):
                path.unlink(missing_ok=True)
            answer = VideoDeleted(id=video_id, deleted=True, status="deleted")
        await replay.answer(answer)
    return answer


# Content answers a key or a signed link (app.py includes this router with its own check).
content_router = APIRouter(prefix="/v1/videos", tags=["videos"])


@content_router.get(
    "/{video_id}/content",
    response_class=Response,
    responses={
        200: {"content": {"video/mp4": {}, "image/png": {}}, "description": "The whole file"},
        206: {"content": {"video/mp4": {}, "image/png": {}}, "description": "The range asked for"},
        **error_responses(400, 404, 416),
    },
)
async def video_content(
    video_id: str,
    store: StoreDep,
    data: DataDep,
    principal: PrincipalDep,
    variant: Literal["video", "thumbnail"] = "video",
    # Declared for the OpenAPI document; `require_key_or_link` checks them.
    expires: str | None = Query(None, description="A signed link's expiry (see `/content/link`)"),
    signature: str | None = Query(None, description="A signed link's signature, in place of a key"),
):
    """The MP4 (with Range support) or the first frame as a PNG."""
    path, media_type = await content_file(store, data, video_id, principal, variant)
    return Download(path, media_type, f"{video_id}{path.suffix}")


@router.post(
    "/{video_id}/content/link",
    response_model=ContentLink,
    responses=error_responses(400, 404),
)
async def video_content_link(
    video_id: str,
    request: Request,
    store: StoreDep,
    data: DataDep,
    principal: PrincipalDep,
    variant: Literal["video", "thumbnail"] = "video",
    expires_in: int = Query(DEFAULT_TTL_S, ge=60, le=MAX_TTL_S, description="Seconds"),
):
    """A signed link to the content that works without a key until it expires: for players
    (`<video src>`) and for sharing one video. It opens that file alone."""
    await content_file(store, data, video_id, principal, variant)
    query, expires_at = request.app.state.links.query(video_id, variant, expires_in)
    url = f"{request.url_for('video_content', video_id=video_id)}?{query}"
    return ContentLink(url=url, expires_at=expires_at)


async def content_file(
    store: AsyncStore, data, video_id: str, principal: Principal, variant: str
) -> tuple[Path, str]:
    """The file of a completed video's `variant` and its media type, or why there is none."""
    row = await find_video(store, video_id, principal)
    if row["status"] != "completed":
        raise InvalidRequest(
            f"video {video_id} is {row['status']}; its content exists once it is completed",
            param="video_id",
            code="video_not_ready",
        )
    if row["expires_at"] is not None and row["expires_at"] < now():
        raise NotFound(
            f"the content of video {video_id} expired", param="video_id", code="video_expired"
        )
    mp4, png = data.video(video_id)
    path, media_type = (mp4, "video/mp4") if variant == "video" else (png, "image/png")
    if not path.is_file():
        raise NotFound(f"the {variant} of video {video_id} is gone from disk", param="video_id")
    return path, media_type


@router.get(
    "/{video_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"},
        **error_responses(400, 404, 429),
    },
)
async def video_events(
    video_id: str,
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    principal: PrincipalDep,
):
    """Server-Sent Events of status and progress, replayed from the start (or `Last-Event-ID`),
    ending once the video is completed, failed or cancelled.

    While the video waits, its data carries `queue_position` (1 = next to run): on the latest
    `video.queued` event, then in a `video.queue_position` event, without an id, each time the
    position changes (jobs ahead start or are cancelled, a higher priority one arrives)."""
    await find_video(store, video_id, principal)
    last = event_seq(request.headers.get("last-event-id") or "0", "Last-Event-ID")
    feed: EventFeed = request.app.state.feed
    feed.admit(principal.scope)  # a 429 past the key's limit, before the answer starts

    async def stream():
        # Subscribed here, not in the route: a response that never starts (its client gone
        # first) never runs this, and would otherwise hold its place for ever.
        with feed.subscribe(video_id, principal.scope) as sub:
            async for chunk in _sse(store, video_id, last, sub):
                yield chunk

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _sse_event(seq: int | None, kind: str, body: dict) -> str:
    # No id for news of the moment (a queue position): nothing stored to resume after.
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(body)}\n\n"


async def _sse(store: AsyncStore, video_id: str, last: int, sub: Subscription):
    """The video's stored events after `last`, then what the feed brings, until a terminal one."""
    # The replay reads the log only once the feed watches it: an event written between a replay
    # and the feed's first look would reach neither.
    await sub.watching.wait()
    replay = await store.events_after(video_id, last, limit=10_000)
    news: list[tuple[str, object]] = [("event", row) for row in replay]
    told = None  # the queue position this stream last told
    if replay and json.loads(replay[-1]["data"] or "{}").get("status") == "queued":
        told = await store.queue_position(video_id)  # told on that event
    elif not replay:
        row = await store.get_video(video_id)
        if row is None or row["status"] in VIDEO_TERMINAL:
            return  # deleted, or the client resumed after the terminal event
    while True:
        for kind, item in news:
            if kind == "position":
                if item == told:
                    continue
                row = await store.get_video(video_id)
                if row is None or row["status"] != "queued":
                    continue  # the news is stale: an event about it follows
                told = item
                body = {k: row[k] for k in ("id", "status", "progress", "step")}
                body |= {"object": "video", "queue_position": item}
                yield _sse_event(None, "video.queue_position", body)
                continue
            if item["seq"] <= last:
                continue  # replayed already
            last = item["seq"]
            data = json.loads(item["data"] or "{}")
            if data.get("status") in VIDEO_TERMINAL:
                row = await store.get_video(video_id)
                body = video_object(row).model_dump() if row is not None else data
                yield _sse_event(last, item["type"], body)
                return
            body = {"id": video_id, "object": "video", **data}
            if replay and item is replay[-1] and told is not None:
                body["queue_position"] = told
            yield _sse_event(last, item["type"], body)
        try:
            news = [await asyncio.wait_for(sub.next(), SSE_KEEPALIVE_S)]
        except TimeoutError:
            news = []
            yield ": keep-alive\n\n"
        while not sub.inbox.empty():
            news.append(sub.inbox.get_nowait())
