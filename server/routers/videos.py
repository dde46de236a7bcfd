"""`/v1/videos`: create (JSON or multipart), retrieve, list, cancel/delete, content, and SSE events."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from megaslide.engine.request import ANIMATE_VIDEOS

from ..deps import IdempotencyKeyDep, PrincipalDep, SettingsDep, StoreDep, VideosDep
from ..downloads import Download
from ..errors import InvalidRequest, invalid_request
from ..feed import EventFeed, Subscription
from ..links import DEFAULT_TTL_S, MAX_TTL_S
from ..schemas import (
    FILE_FIELDS,
    FILE_LIST_FIELDS,
    ContentLink,
    ListPage,
    Video,
    VideoCreate,
    VideoDeleted,
    body_schema,
    error_responses,
    video_object,
)
from ..services.jobs import event_seq
from ..services.videos import save_image  # noqa: F401  (the upload check, tested on its own)
from ..store import VIDEO_TERMINAL, AsyncStore

router = APIRouter(prefix="/v1/videos", tags=["videos"])

SSE_KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing a quiet stream
TEXT_FIELDS = ("prompt", "negative_prompt")  # an empty form value is meaningful for these only


async def read_create_body(
    request: Request,
) -> tuple[VideoCreate, dict[str, UploadFile | list[UploadFile]]]:
    """The create parameters from a JSON body or form fields (the openai SDK sends multipart),
    and the files uploaded, by field: the first-frame image (`input_reference`), the last-frame
    one (`last_frame`), the input video (`input_video`), VACE's control video and mask
    (`control_video`, `mask`), a list of VACE's reference images (`reference_images`, the
    field repeated), and Wan Animate's videos (`pose_video`, `face_video`, `background_video`,
    `background_mask`)."""
    content_type = request.headers.get("content-type", "")
    files = {}
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        most = len(FILE_FIELDS) + sum(n for _, n in FILE_LIST_FIELDS.values())
        form = await request.form(max_files=most)
        data = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key in FILE_LIST_FIELDS:
                    files.setdefault(key, []).append(value)
                    if len(files[key]) > FILE_LIST_FIELDS[key][1]:
                        raise InvalidRequest(
                            f"{key}: at most {FILE_LIST_FIELDS[key][1]} files", param=key
                        )
                    continue
                if key not in FILE_FIELDS:
                    raise InvalidRequest(f"{key} cannot be a file", param=key)
                if key in files:
                    raise InvalidRequest(f"{key}: one file only", param=key)
                files[key] = value
            elif value != "" or key in TEXT_FIELDS:
                data[key] = value
    else:
        data = parse_json(await request.body())
        if not isinstance(data, dict):
            raise InvalidRequest(
                "the request body must be a JSON object (or multipart form fields)"
            )
    try:
        return VideoCreate.model_validate(data), files
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


def poll_hint(response: Response, video: Video, settings) -> None:
    if video.status not in VIDEO_TERMINAL:
        response.headers["openai-poll-after-ms"] = str(settings.poll_after_ms)


# The body is parsed by hand (JSON or form), so its schema is declared here for the OpenAPI docs.
CREATE_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": body_schema(VideoCreate)},
            "multipart/form-data": {"schema": body_schema(VideoCreate)},
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
    videos: VideosDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    key: IdempotencyKeyDep,
):
    body, uploads = await read_create_body(request)
    files = {k: [f.file for f in v] if isinstance(v, list) else v.file for k, v in uploads.items()}
    video = await videos.create(
        body,
        principal,
        key,
        image=files.get("input_reference"),
        last_image=files.get("last_frame"),
        input_video=files.get("input_video"),
        control_video=files.get("control_video"),
        mask=files.get("mask"),
        reference_images=files.get("reference_images", []),
        animate={f: files[f] for f in ANIMATE_VIDEOS if f in files},
    )
    poll_hint(response, video, settings)
    return video


@router.get("", response_model=ListPage[Video], responses=error_responses(400))
async def list_videos(
    videos: VideosDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
):
    return await videos.list(principal, after, limit, order)


@router.get("/{video_id}", response_model=Video, responses=error_responses(404))
async def retrieve_video(
    video_id: str,
    response: Response,
    videos: VideosDep,
    settings: SettingsDep,
    principal: PrincipalDep,
):
    video = await videos.retrieve(video_id, principal)
    poll_hint(response, video, settings)
    return video


@router.post("/{video_id}/cancel", response_model=Video, responses=error_responses(400, 404, 409))
async def cancel_video(
    video_id: str, videos: VideosDep, principal: PrincipalDep, key: IdempotencyKeyDep
):
    """Stop a queued or running video; its record stays, `cancelled`. A running one stops at its
    next step boundary (the answer waits up to `cancel_wait_s` for it). Cancelling a cancelled
    video answers it as it is; a retry with the same Idempotency-Key gets the first answer."""
    return await videos.cancel(video_id, principal, key)


@router.delete("/{video_id}", response_model=VideoDeleted, responses=error_responses(404, 409))
async def delete_video(
    video_id: str, videos: VideosDep, principal: PrincipalDep, key: IdempotencyKeyDep
):
    """Delete a video, its record and its files. One still queued or running is stopped first (a
    running one at its next step boundary; the answer waits up to `cancel_wait_s`, and if it has
    not stopped by then says `deleted: false` while the cancellation goes on). A retry with the
    same Idempotency-Key gets the first answer, not a 404."""
    return await videos.delete(video_id, principal, key)


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
    videos: VideosDep,
    principal: PrincipalDep,
    variant: Literal["video", "thumbnail"] = "video",
    # Declared for the OpenAPI document; `require_key_or_link` checks them.
    expires: str | None = Query(None, description="A signed link's expiry (see `/content/link`)"),
    signature: str | None = Query(None, description="A signed link's signature, in place of a key"),
):
    """The MP4 (with Range support) or the first frame as a PNG."""
    path, media_type = await videos.content(video_id, principal, variant)
    return Download(path, media_type, f"{video_id}{path.suffix}")


@router.post(
    "/{video_id}/content/link",
    response_model=ContentLink,
    responses=error_responses(400, 404),
)
async def video_content_link(
    video_id: str,
    request: Request,
    videos: VideosDep,
    principal: PrincipalDep,
    variant: Literal["video", "thumbnail"] = "video",
    expires_in: int = Query(DEFAULT_TTL_S, ge=60, le=MAX_TTL_S, description="Seconds"),
):
    """A signed link to the content that works without a key until it expires: for players
    (`<video src>`) and for sharing one video. It opens that file alone."""
    await videos.content(video_id, principal, variant)
    query, expires_at = request.app.state.links.query(video_id, variant, expires_in)
    url = f"{request.url_for('video_content', video_id=video_id)}?{query}"
    return ContentLink(url=url, expires_at=expires_at)


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
    videos: VideosDep,
    principal: PrincipalDep,
):
    """Server-Sent Events of status and progress, replayed from the start (or `Last-Event-ID`),
    ending once the video is completed, failed or cancelled.

    While the video waits, its data carries `queue_position` (1 = next to run): on the latest
    `video.queued` event, then in a `video.queue_position` event, without an id, each time the
    position changes (jobs ahead start or are cancelled, a higher priority one arrives)."""
    await videos.find(video_id, principal)
    last = event_seq(request.headers.get("last-event-id") or "0", "Last-Event-ID")
    feed: EventFeed = request.app.state.feed
    feed.admit(principal.scope)  # an early 429; the stream checks again as it takes its place
    return _EventStream(
        feed, video_id, principal.scope, lambda sub: _sse(store, video_id, last, sub)
    )


class _EventStream(StreamingResponse):
    """A stream that holds its place in the feed exactly while its answer is being sent.

    Subscribed here, not in the route nor in the body's generator: a place taken in the route
    is held for ever by a response whose client left before it started (its generator never
    runs), and one taken in the generator is taken after the 200 went out, too late for a 429,
    and after other requests' checks in between. `feed.subscribe` raises `TooManyStreams` before
    the answer starts, which the error handlers turn into the 429."""

    def __init__(self, feed: EventFeed, video_id: str, scope: str, body):
        super().__init__((), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.feed, self.video_id, self.principal_scope, self.body = feed, video_id, scope, body

    async def __call__(self, scope, receive, send) -> None:
        with self.feed.subscribe(self.video_id, self.principal_scope) as sub:
            self.body_iterator = self.body(sub)
            await super().__call__(scope, receive, send)


def _sse_event(seq: int | None, kind: str, body: dict) -> str:
    # No id for news of the moment (a queue position): nothing stored to resume after.
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(body)}\n\n"


async def _sse(store: AsyncStore, video_id: str, last: int, sub: Subscription):
    """The video's stored events after `last`, then what the feed brings, until a terminal one."""
    # The replay reads the log only once the feed watches it: an event written between a replay
    # and the feed's first look would reach neither.
    await sub.watching.wait()
    replay = await store.videos.events_after(video_id, last, limit=10_000)
    news: list[tuple[str, object]] = [("event", row) for row in replay]
    told = None  # the queue position this stream last told
    if replay and (replay[-1].data or {}).get("status") == "queued":
        told = await store.videos.queue_position(video_id)  # told on that event
    elif not replay:
        video = await store.videos.get(video_id)
        if video is None or video.status in VIDEO_TERMINAL:
            return  # deleted, or the client resumed after the terminal event
    while True:
        for kind, item in news:
            if kind == "position":
                if item == told:
                    continue
                video = await store.videos.get(video_id)
                if video is None or video.status != "queued":
                    continue  # the news is stale: an event about it follows
                told = item
                body = {
                    "id": video.id,
                    "status": video.status,
                    "progress": video.progress,
                    "step": video.step,
                }
                body |= {"object": "video", "queue_position": item}
                yield _sse_event(None, "video.queue_position", body)
                continue
            if item.seq <= last:
                continue  # replayed already
            last = item.seq
            data = item.data or {}
            if data.get("status") in VIDEO_TERMINAL:
                video = await store.videos.get(video_id)
                body = video_object(video).model_dump() if video is not None else data
                yield _sse_event(last, item.type, body)
                return
            body = {"id": video_id, "object": "video", **data}
            if replay and item is replay[-1] and told is not None:
                body["queue_position"] = told
            yield _sse_event(last, item.type, body)
        try:
            news = [await asyncio.wait_for(sub.next(), SSE_KEEPALIVE_S)]
        except TimeoutError:
            news = []
            yield ": keep-alive\n\n"
        while not sub.inbox.empty():
            news.append(sub.inbox.get_nowait())
