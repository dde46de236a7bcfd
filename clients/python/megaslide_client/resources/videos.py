"""`client.videos`: create, retrieve, list, delete, poll, create_and_poll, download_content, events."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    Union,
)

import httpx

from .. import _base_client as base
from .._constants import DEFAULT_POLL_INTERVAL_MS, STREAM_READ_TIMEOUT
from .._exceptions import APIConnectionError, APITimeoutError
from .._pagination import AsyncCursorPage, AsyncPaginator, SyncCursorPage, list_params
from .._progress import ProgressBar
from .._sse import ServerSentEvent, aiter_sse, iter_sse
from ..types import Video, VideoDeleted, VideoEvent

if TYPE_CHECKING:
    from .._base_client import AsyncAPIClient, SyncAPIClient

Variant = Literal["video", "thumbnail"]
PathLike = Union[str, "os.PathLike[str]"]


def create_body(
    *,
    prompt: str,
    model: str | None,
    seconds: str | float | None,
    size: str | None,
    num_frames: int | None,
    fps: int | None,
    num_inference_steps: int | None,
    guidance_scale: float | None,
    negative_prompt: str | None,
    seed: int | None,
    priority: int | None,
    extra_body: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The JSON body of POST /v1/videos; unset fields are left for the server's defaults."""
    body = {
        "prompt": prompt,
        "model": model,
        "seconds": None if seconds is None else str(seconds),
        "size": size,
        "num_frames": num_frames,
        "fps": fps,
        "num_inference_steps": num_inference_steps,
        "guidance_scale": guidance_scale,
        "negative_prompt": negative_prompt,
        "seed": seed,
        "priority": priority,
    }
    body = {k: v for k, v in body.items() if v is not None}
    body.update(extra_body or {})
    return body


def poll_interval_s(response: httpx.Response, poll_interval_ms: int | None) -> float:
    """Seconds until the next poll: the caller's interval, else the server's openai-poll-after-ms."""
    if poll_interval_ms is not None:
        return poll_interval_ms / 1000.0
    header = response.headers.get("openai-poll-after-ms")
    try:
        return (
            max(int(header), 0) / 1000.0
            if header is not None
            else DEFAULT_POLL_INTERVAL_MS / 1000.0
        )
    except ValueError:
        return DEFAULT_POLL_INTERVAL_MS / 1000.0


def to_video_event(sse: ServerSentEvent) -> VideoEvent:
    """Parse an SSE event's data as JSON, and as a Video when it carries one."""
    try:
        data: Any = json.loads(sse.data) if sse.data else None
    except json.JSONDecodeError:
        data = sse.data
    video = None
    if isinstance(data, dict) and ("status" in data or data.get("object") == "video"):
        video = Video.from_dict(data)
    return VideoEvent(event=sse.event, data=data, id=sse.id, video=video)


def stream_timeout(client_timeout: httpx.Timeout) -> httpx.Timeout:
    """The client's timeout with the longer read timeout of a stream (silent between steps)."""
    read = client_timeout.read
    return httpx.Timeout(
        connect=client_timeout.connect,
        read=None if read is None else max(read, STREAM_READ_TIMEOUT),
        write=client_timeout.write,
        pool=client_timeout.pool,
    )


def sse_headers(last_event_id: str | None) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    return headers


def stream_error(e: httpx.TransportError, request: httpx.Request) -> APIConnectionError:
    """The typed error for a stream that broke and could not be resumed."""
    if isinstance(e, httpx.TimeoutException):
        return APITimeoutError(request)
    return APIConnectionError(f"the stream broke: {e}", request)


def _content_range_start(response: httpx.Response) -> int | None:
    """The first byte a 206 answer carries (`Content-Range: bytes START-END/TOTAL`)."""
    value = response.headers.get("content-range", "")
    try:
        return int(value.split()[1].split("-")[0])
    except (IndexError, ValueError):
        return None


def _check_deadline(deadline: float | None, wait: float, video: Video) -> None:
    if deadline is not None and time.monotonic() + wait > deadline:
        raise TimeoutError(
            f"video {video.id} still {video.status} ({video.progress}%) after max_wait"
        )


class Videos:
    """Video generation jobs."""

    def __init__(self, client: SyncAPIClient) -> None:
        self._client = client

    def create(
        self,
        *,
        prompt: str,
        model: str | None = None,
        seconds: str | float | None = None,
        size: str | None = None,
        num_frames: int | None = None,
        fps: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        negative_prompt: str | None = None,
        seed: int | None = None,
        priority: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Video:
        """Queue a video. Returns at once with `status="queued"`; see `poll` / `create_and_poll`.

        `size` is "WIDTHxHEIGHT"; `seconds` and `num_frames` are two ways to give the length.
        Every retry of this call carries the same Idempotency-Key, so it makes at most one job.
        """
        body = create_body(
            prompt=prompt,
            model=model,
            seconds=seconds,
            size=size,
            num_frames=num_frames,
            fps=fps,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            negative_prompt=negative_prompt,
            seed=seed,
            priority=priority,
            extra_body=extra_body,
        )
        response = self._client.post("/v1/videos", json=body, idempotency_key=idempotency_key)
        return Video.from_dict(response.json())

    def retrieve(self, video_id: str) -> Video:
        """The video's current status and progress."""
        return Video.from_dict(self._client.get(f"/v1/videos/{video_id}").json())

    def list(
        self,
        *,
        after: str | None = None,
        limit: int | None = None,
        order: str | None = None,
    ) -> SyncCursorPage[Video]:
        """A page of videos; iterating over it walks every following page too."""

        def fetch(cursor: str | None) -> SyncCursorPage[Video]:
            params = list_params(after=cursor, limit=limit, order=order)
            return SyncCursorPage(
                self._client.get("/v1/videos", params=params).json(), Video, fetch
            )

        return fetch(after)

    def delete(self, video_id: str) -> VideoDeleted:
        """Cancel the video if it is queued or running (the server stops at its next step) and delete it."""
        return VideoDeleted.from_dict(self._client.delete(f"/v1/videos/{video_id}").json())

    def poll(
        self,
        video_id: str,
        *,
        poll_interval_ms: int | None = None,
        progress: bool = False,
        max_wait: float | None = None,
    ) -> Video:
        """Wait until the video is completed, failed or cancelled, and return it.

        Between polls it waits `poll_interval_ms`, or else what the server asks in
        `openai-poll-after-ms`. `progress=True` draws a tqdm bar when tqdm is installed.
        `max_wait` (seconds) raises TimeoutError instead of waiting forever.
        """
        deadline = None if max_wait is None else time.monotonic() + max_wait
        with ProgressBar(progress, total=100, desc=f"video {video_id}") as bar:
            while True:
                response = self._client.get(f"/v1/videos/{video_id}")
                video = Video.from_dict(response.json())
                bar.update_to(video.progress, video.status)
                if video.done:
                    return video
                wait = poll_interval_s(response, poll_interval_ms)
                _check_deadline(deadline, wait, video)
                base._sleep(wait)

    def create_and_poll(
        self,
        *,
        prompt: str,
        poll_interval_ms: int | None = None,
        progress: bool = False,
        max_wait: float | None = None,
        **create_kwargs: Any,
    ) -> Video:
        """`create` then `poll`: returns the finished (or failed, or cancelled) video."""
        video = self.create(prompt=prompt, **create_kwargs)
        return self.poll(
            video.id, poll_interval_ms=poll_interval_ms, progress=progress, max_wait=max_wait
        )

    def download_content(
        self, video_id: str, *, variant: Variant = "video", path: PathLike | None = None
    ) -> Path | bytes:
        """The MP4 (or the thumbnail image): streamed into `path` and that Path returned, or as bytes.

        The file appears complete or not at all: bytes go to `PATH.part`, renamed at the end. A
        connection that breaks mid-download resumes with an HTTP Range request where it stopped.
        """
        url, params = f"/v1/videos/{video_id}/content", {"variant": variant}
        if path is None:
            return self._client.get(
                url, params=params, timeout=stream_timeout(self._client.timeout)
            ).content
        path = Path(path)
        part = path.with_name(path.name + ".part")
        written, attempt = 0, 0
        try:
            with open(part, "wb") as f:
                while True:
                    headers = {"Range": f"bytes={written}-"} if written else None
                    response = self._client.get(
                        url,
                        params=params,
                        headers=headers,
                        stream=True,
                        timeout=stream_timeout(self._client.timeout),
                    )
                    try:
                        if written and (
                            response.status_code != 206 or _content_range_start(response) != written
                        ):
                            f.seek(0)  # the server sent the whole file again: start over
                            f.truncate()
                            written = 0
                        for chunk in response.iter_bytes():
                            f.write(chunk)
                            written += len(chunk)
                        break
                    except httpx.TransportError as e:
                        if attempt >= self._client.max_retries:
                            raise stream_error(e, response.request) from e
                        base._sleep(base.retry_delay(attempt))
                        attempt += 1
                    finally:
                        response.close()
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
        return path

    def events(self, video_id: str, *, last_event_id: str | None = None) -> Iterator[VideoEvent]:
        """The video's Server-Sent Events (status and progress) until it reaches a terminal state.

        The server replays the stream from the start, or after `last_event_id`. A connection that
        breaks is reopened (up to max_retries times in a row) from the last event received.
        """
        attempt = 0
        while True:
            response = self._client.get(
                f"/v1/videos/{video_id}/events",
                stream=True,
                headers=sse_headers(last_event_id),
                timeout=stream_timeout(self._client.timeout),
            )
            try:
                for sse in iter_sse(response.iter_lines()):
                    last_event_id, attempt = sse.id or last_event_id, 0
                    yield to_video_event(sse)
                return
            except httpx.TransportError as e:
                if attempt >= self._client.max_retries:
                    raise stream_error(e, response.request) from e
                base._sleep(base.retry_delay(attempt))
                attempt += 1
            finally:
                response.close()


class AsyncVideos:
    """Async twin of Videos."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self._client = client

    async def create(
        self,
        *,
        prompt: str,
        model: str | None = None,
        seconds: str | float | None = None,
        size: str | None = None,
        num_frames: int | None = None,
        fps: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        negative_prompt: str | None = None,
        seed: int | None = None,
        priority: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Video:
        """Queue a video (see `Videos.create`)."""
        body = create_body(
            prompt=prompt,
            model=model,
            seconds=seconds,
            size=size,
            num_frames=num_frames,
            fps=fps,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            negative_prompt=negative_prompt,
            seed=seed,
            priority=priority,
            extra_body=extra_body,
        )
        response = await self._client.post("/v1/videos", json=body, idempotency_key=idempotency_key)
        return Video.from_dict(response.json())

    async def retrieve(self, video_id: str) -> Video:
        """The video's current status and progress."""
        return Video.from_dict((await self._client.get(f"/v1/videos/{video_id}")).json())

    def list(
        self,
        *,
        after: str | None = None,
        limit: int | None = None,
        order: str | None = None,
    ) -> AsyncPaginator[Video]:
        """`await` it for the first page, or `async for` over every video of every page."""

        async def fetch(cursor: str | None) -> AsyncCursorPage[Video]:
            params = list_params(after=cursor, limit=limit, order=order)
            return AsyncCursorPage(
                (await self._client.get("/v1/videos", params=params)).json(), Video, fetch
            )

        return AsyncPaginator(lambda: fetch(after))

    async def delete(self, video_id: str) -> VideoDeleted:
        """Cancel the video if it is queued or running and delete it."""
        return VideoDeleted.from_dict((await self._client.delete(f"/v1/videos/{video_id}")).json())

    async def poll(
        self,
        video_id: str,
        *,
        poll_interval_ms: int | None = None,
        progress: bool = False,
        max_wait: float | None = None,
    ) -> Video:
        """Wait until the video is completed, failed or cancelled (see `Videos.poll`)."""
        deadline = None if max_wait is None else time.monotonic() + max_wait
        with ProgressBar(progress, total=100, desc=f"video {video_id}") as bar:
            while True:
                response = await self._client.get(f"/v1/videos/{video_id}")
                video = Video.from_dict(response.json())
                bar.update_to(video.progress, video.status)
                if video.done:
                    return video
                wait = poll_interval_s(response, poll_interval_ms)
                _check_deadline(deadline, wait, video)
                await base._async_sleep(wait)

    async def create_and_poll(
        self,
        *,
        prompt: str,
        poll_interval_ms: int | None = None,
        progress: bool = False,
        max_wait: float | None = None,
        **create_kwargs: Any,
    ) -> Video:
        """`create` then `poll`."""
        video = await self.create(prompt=prompt, **create_kwargs)
        return await self.poll(
            video.id, poll_interval_ms=poll_interval_ms, progress=progress, max_wait=max_wait
        )

    async def download_content(
        self, video_id: str, *, variant: Variant = "video", path: PathLike | None = None
    ) -> Path | bytes:
        """The MP4 or thumbnail, into `path` (returned) or as bytes (see `Videos.download_content`)."""
        url, params = f"/v1/videos/{video_id}/content", {"variant": variant}
        timeout = stream_timeout(self._client.timeout)
        if path is None:
            return (await self._client.get(url, params=params, timeout=timeout)).content
        path = Path(path)
        part = path.with_name(path.name + ".part")
        written, attempt = 0, 0
        try:
            # Plain file writes: chunks are small and local disks fast, so they do not stall the loop.
            with open(part, "wb") as f:
                while True:
                    headers = {"Range": f"bytes={written}-"} if written else None
                    response = await self._client.get(
                        url, params=params, headers=headers, stream=True, timeout=timeout
                    )
                    try:
                        if written and (
                            response.status_code != 206 or _content_range_start(response) != written
                        ):
                            f.seek(0)
                            f.truncate()
                            written = 0
                        async for chunk in response.aiter_bytes():
                            f.write(chunk)
                            written += len(chunk)
                        break
                    except httpx.TransportError as e:
                        if attempt >= self._client.max_retries:
                            raise stream_error(e, response.request) from e
                        await base._async_sleep(base.retry_delay(attempt))
                        attempt += 1
                    finally:
                        await response.aclose()
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
        return path

    async def events(
        self, video_id: str, *, last_event_id: str | None = None
    ) -> AsyncIterator[VideoEvent]:
        """The video's Server-Sent Events until it reaches a terminal state (see `Videos.events`)."""
        attempt = 0
        while True:
            response = await self._client.get(
                f"/v1/videos/{video_id}/events",
                stream=True,
                headers=sse_headers(last_event_id),
                timeout=stream_timeout(self._client.timeout),
            )
            try:
                async for sse in aiter_sse(response.aiter_lines()):
                    last_event_id, attempt = sse.id or last_event_id, 0
                    yield to_video_event(sse)
                return
            except httpx.TransportError as e:
                if attempt >= self._client.max_retries:
                    raise stream_error(e, response.request) from e
                await base._async_sleep(base.retry_delay(attempt))
                attempt += 1
            finally:
                await response.aclose()
