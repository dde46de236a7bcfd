"""`client.videos`: create, retrieve, list, delete, poll, create_and_poll, download_content, events."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from .._pagination import AsyncPaginator, SyncCursorPage
from .._polling import Watch
from .._progress import ProgressBar
from .._sse import ServerSentEvent
from .._streaming import EventStream, PathLike
from ..types import Video, VideoContentLink, VideoDeleted, VideoEvent
from .files import FileInput, Uploads

if TYPE_CHECKING:
    from .._base_client import AsyncAPIClient, SyncAPIClient

Variant = Literal["video", "thumbnail"]


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
    cache: str | Mapping[str, Any] | None,
    extra_body: Mapping[str, Any] | None,
    loras: Sequence[LoraSpec] | None = None,
    sampler: str | None = None,
    timesteps: Sequence[int] | None = None,
    shift: float | None = None,
    guidance_interval: Sequence[float] | None = None,
    reuse: bool | None = None,
    strength: float | None = None,
    conditioning_scale: float | None = None,
    segment_frame_length: int | None = None,
    prev_segment_conditioning_frames: int | None = None,
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
        "cache": cache if cache is None or isinstance(cache, str) else dict(cache),
        "loras": None if loras is None else [lora_entry(x) for x in loras],
        "sampler": sampler,
        "timesteps": None if timesteps is None else list(timesteps),
        "shift": shift,
        "guidance_interval": None if guidance_interval is None else list(guidance_interval),
        "reuse": reuse,
        "strength": strength,
        "conditioning_scale": conditioning_scale,
        "segment_frame_length": segment_frame_length,
        "prev_segment_conditioning_frames": prev_segment_conditioning_frames,
    }
    body = {k: v for k, v in body.items() if v is not None}
    body.update(extra_body or {})
    return body


def upload_fields(
    reference_images: Sequence[FileInput] | None = None, **files: FileInput | None
) -> list[tuple[str, FileInput]]:
    """The files of a create call as `(form field, file)`, those given: `files` by their field
    (`input_reference`, `last_frame`, `input_video`, VACE's and Animate's videos), then the
    reference images each under their one field, in order."""
    if isinstance(reference_images, (str, bytes, os.PathLike)):
        raise TypeError("reference_images is a list of files (paths, bytes or binary files)")
    pairs = [(k, v) for k, v in files.items() if v is not None]
    return pairs + [("reference_images", f) for f in reference_images or ()]


def form_fields(body: Mapping[str, Any]) -> dict[str, str]:
    """A create body as multipart form fields, sent when a first-frame image goes with it: each
    value as text, lists and objects as JSON text (the server reads them back so)."""
    return {
        k: json.dumps(v) if isinstance(v, (list, dict, bool)) else str(v) for k, v in body.items()
    }


# A LoRA adapter registered on the model: its name, (name, scale), or {"name", "scale", "expert"}.
LoraSpec = str | tuple[str, float] | Mapping[str, Any]


def lora_entry(spec: LoraSpec) -> dict[str, Any]:
    """One entry of a request's `loras`, from any of `LoraSpec`'s forms."""
    if isinstance(spec, str):
        return {"name": spec}
    if isinstance(spec, tuple):
        name, scale = spec
        return {"name": name, "scale": scale}
    return dict(spec)


def link_params(variant: str, expires_in: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {"variant": variant}
    if expires_in is not None:
        params["expires_in"] = expires_in
    return params


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


class VideoWatch(Watch[Video]):
    """Polls GET /v1/videos/{id}: the bar shows its progress in %, the server sets the pace."""

    def __init__(
        self,
        video_id: str,
        *,
        progress: bool,
        poll_interval_ms: int | None,
        max_wait: float | None,
    ) -> None:
        bar = ProgressBar(progress, total=100, desc=f"video {video_id}")
        super().__init__(bar, poll_interval_ms=poll_interval_ms, max_wait=max_wait)

    def observe(self, response: httpx.Response) -> bool:
        self.result = video = Video.from_dict(response.json())
        self.bar.update_to(video.progress, video.status)
        return video.done

    def server_poll_ms(self, response: httpx.Response) -> str | None:
        return response.headers.get("openai-poll-after-ms")

    def still(self) -> str:
        video = self.result
        return f"video {video.id} still {video.status} ({video.progress}%)"


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
        cache: str | Mapping[str, Any] | None = None,
        loras: Sequence[LoraSpec] | None = None,
        sampler: str | None = None,
        timesteps: Sequence[int] | None = None,
        shift: float | None = None,
        guidance_interval: Sequence[float] | None = None,
        input_reference: FileInput | None = None,
        last_frame: FileInput | None = None,
        input_video: FileInput | None = None,
        strength: float | None = None,
        reference_images: Sequence[FileInput] | None = None,
        control_video: FileInput | None = None,
        mask: FileInput | None = None,
        conditioning_scale: float | None = None,
        pose_video: FileInput | None = None,
        face_video: FileInput | None = None,
        background_video: FileInput | None = None,
        background_mask: FileInput | None = None,
        segment_frame_length: int | None = None,
        prev_segment_conditioning_frames: int | None = None,
        reuse: bool | None = None,
        extra_body: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Video:
        """Queue a video. Returns at once with `status="queued"`; see `poll` / `create_and_poll`.

        `size` is "WIDTHxHEIGHT"; `seconds` and `num_frames` are two ways to give the length.
        `cache` asks for a step cache: a preset ("quality", "balanced", "fast") or
        `{"policy": "output-change" | "adaptive" | "first-block", "threshold": ..., "forecast":
        "none" | "linear" | "quadratic"}` (forecast optional: what a reused step takes, the last
        computed output or its extrapolation in flow time; see `Video.passes`; a model lists the
        policies it takes in its limits' `cache_policies`).
        `loras` names adapters registered on the model, each as a name, `(name, scale)` or
        `{"name", "scale", "expert"}` (`expert`: "high" or "low" on a Wan2.2 two-expert model).
        `sampler` is "scheduler" (the model's own), "euler" or "consistency" (a step-distilled
        model's), the last two over `timesteps` (e.g. `[1000, 750, 500, 250]`) with `shift`;
        `guidance_interval` `(start, end)` guides only that fraction of the steps.
        `input_reference` is a first-frame image (a path, bytes, a binary file or `(filename,
        content)`; PNG, JPEG or WebP) for a model that takes one (`Model.inputs`); `last_frame`
        a last-frame image besides (first-last-frame-to-video); `input_video` a video to remake
        (MP4, WebM or GIF; the clip's length by default, else its first `num_frames` frames) at
        `strength`, the fraction of the schedule that runs (0.8 by default). A VACE model
        (`Model.inputs` lists them) takes `reference_images` (a list of images, at most 4),
        `control_video` and `mask` (videos: white where the clip is generated, black where the
        control video is kept; the clip's length by default) and `conditioning_scale` (the
        weight of its VACE blocks' hints, 1 by default). A Wan Animate model takes
        `input_reference` (the character), `pose_video` and `face_video` (their first
        `num_frames` frames; the clip's length by default), and for its replace mode
        `background_video` with `background_mask` (white: the person to replace); it makes the
        clip in segments of `segment_frame_length` frames (4k + 1; the clip's by default), each
        after the first continuing from the last `prev_segment_conditioning_frames` (1 or 5,
        default 1) of the one before. With a file the
        request goes as multipart form fields. Every retry of this call carries the same Idempotency-Key, so it makes at most one job.
        A request equal to one of this key's completed videos in everything that decides the
        pixels (a fixed `seed` among them) comes back completed at once with that video's MP4,
        naming it in `Video.cached_from`; `reuse=False` runs it again.
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
            cache=cache,
            extra_body=extra_body,
            loras=loras,
            sampler=sampler,
            timesteps=timesteps,
            shift=shift,
            guidance_interval=guidance_interval,
            reuse=reuse,
            strength=strength,
            conditioning_scale=conditioning_scale,
            segment_frame_length=segment_frame_length,
            prev_segment_conditioning_frames=prev_segment_conditioning_frames,
        )
        files = upload_fields(
            reference_images,
            input_reference=input_reference,
            last_frame=last_frame,
            input_video=input_video,
            control_video=control_video,
            mask=mask,
            pose_video=pose_video,
            face_video=face_video,
            background_video=background_video,
            background_mask=background_mask,
        )
        if not files:
            response = self._client.post("/v1/videos", json=body, idempotency_key=idempotency_key)
        else:
            with Uploads(files) as uploads:
                response = self._client.post(
                    "/v1/videos",
                    data=form_fields(body),
                    files=uploads,
                    idempotency_key=idempotency_key,
                )
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
        return self._client.get_page("/v1/videos", Video, after=after, limit=limit, order=order)

    def cancel(self, video_id: str, *, idempotency_key: str | None = None) -> Video:
        """Stop a queued or running video (a running one at its next step); its record stays,
        `cancelled`."""
        response = self._client.post(
            f"/v1/videos/{video_id}/cancel", idempotency_key=idempotency_key
        )
        return Video.from_dict(response.json())

    def delete(self, video_id: str, *, idempotency_key: str | None = None) -> VideoDeleted:
        """Delete the video, its record and its files, stopping it first if it is queued or
        running (the server stops it at its next step)."""
        response = self._client.delete(f"/v1/videos/{video_id}", idempotency_key=idempotency_key)
        return VideoDeleted.from_dict(response.json())

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
        with VideoWatch(
            video_id, progress=progress, poll_interval_ms=poll_interval_ms, max_wait=max_wait
        ) as watch:
            return self._client.poll(lambda: self._client.get(f"/v1/videos/{video_id}"), watch)

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
        url = f"/v1/videos/{video_id}/content"
        return self._client.download(url, params={"variant": variant}, to=path)

    def content_link(
        self, video_id: str, *, variant: Variant = "video", expires_in: int | None = None
    ) -> VideoContentLink:
        """A signed URL to the content that needs no key until it expires (`expires_in`
        seconds, 60 to 7 days; the server's default is an hour)."""
        params = link_params(variant, expires_in)
        response = self._client.post(f"/v1/videos/{video_id}/content/link", params=params)
        return VideoContentLink.from_dict(response.json())

    def events(self, video_id: str, *, last_event_id: str | None = None) -> Iterator[VideoEvent]:
        """The video's Server-Sent Events (status and progress) until it reaches a terminal state.

        The server replays the stream from the start, or after `last_event_id`. A connection that
        breaks is reopened (up to max_retries times in a row) from the last event received.
        """
        stream = EventStream(last_event_id, parse=to_video_event)
        return self._client.get_stream(f"/v1/videos/{video_id}/events", stream)


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
        cache: str | Mapping[str, Any] | None = None,
        loras: Sequence[LoraSpec] | None = None,
        sampler: str | None = None,
        timesteps: Sequence[int] | None = None,
        shift: float | None = None,
        guidance_interval: Sequence[float] | None = None,
        input_reference: FileInput | None = None,
        last_frame: FileInput | None = None,
        input_video: FileInput | None = None,
        strength: float | None = None,
        reference_images: Sequence[FileInput] | None = None,
        control_video: FileInput | None = None,
        mask: FileInput | None = None,
        conditioning_scale: float | None = None,
        pose_video: FileInput | None = None,
        face_video: FileInput | None = None,
        background_video: FileInput | None = None,
        background_mask: FileInput | None = None,
        segment_frame_length: int | None = None,
        prev_segment_conditioning_frames: int | None = None,
        reuse: bool | None = None,
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
            cache=cache,
            extra_body=extra_body,
            loras=loras,
            sampler=sampler,
            timesteps=timesteps,
            shift=shift,
            guidance_interval=guidance_interval,
            reuse=reuse,
            strength=strength,
            conditioning_scale=conditioning_scale,
            segment_frame_length=segment_frame_length,
            prev_segment_conditioning_frames=prev_segment_conditioning_frames,
        )
        files = upload_fields(
            reference_images,
            input_reference=input_reference,
            last_frame=last_frame,
            input_video=input_video,
            control_video=control_video,
            mask=mask,
            pose_video=pose_video,
            face_video=face_video,
            background_video=background_video,
            background_mask=background_mask,
        )
        if not files:
            response = await self._client.post(
                "/v1/videos", json=body, idempotency_key=idempotency_key
            )
        else:
            with Uploads(files) as uploads:
                response = await self._client.post(
                    "/v1/videos",
                    data=form_fields(body),
                    files=uploads,
                    idempotency_key=idempotency_key,
                )
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
        return self._client.get_page("/v1/videos", Video, after=after, limit=limit, order=order)

    async def cancel(self, video_id: str, *, idempotency_key: str | None = None) -> Video:
        response = await self._client.post(
            f"/v1/videos/{video_id}/cancel", idempotency_key=idempotency_key
        )
        return Video.from_dict(response.json())

    async def delete(self, video_id: str, *, idempotency_key: str | None = None) -> VideoDeleted:
        response = await self._client.delete(
            f"/v1/videos/{video_id}", idempotency_key=idempotency_key
        )
        return VideoDeleted.from_dict(response.json())

    async def poll(
        self,
        video_id: str,
        *,
        poll_interval_ms: int | None = None,
        progress: bool = False,
        max_wait: float | None = None,
    ) -> Video:
        """Wait until the video is completed, failed or cancelled (see `Videos.poll`)."""
        with VideoWatch(
            video_id, progress=progress, poll_interval_ms=poll_interval_ms, max_wait=max_wait
        ) as watch:
            return await self._client.poll(
                lambda: self._client.get(f"/v1/videos/{video_id}"), watch
            )

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
        url = f"/v1/videos/{video_id}/content"
        return await self._client.download(url, params={"variant": variant}, to=path)

    async def content_link(
        self, video_id: str, *, variant: Variant = "video", expires_in: int | None = None
    ) -> VideoContentLink:
        """A signed URL to the content that needs no key until it expires (`expires_in`
        seconds, 60 to 7 days; the server's default is an hour)."""
        params = link_params(variant, expires_in)
        response = await self._client.post(f"/v1/videos/{video_id}/content/link", params=params)
        return VideoContentLink.from_dict(response.json())

    def events(
        self, video_id: str, *, last_event_id: str | None = None
    ) -> AsyncIterator[VideoEvent]:
        """The video's Server-Sent Events until it reaches a terminal state (see `Videos.events`)."""
        stream = EventStream(last_event_id, parse=to_video_event)
        return self._client.get_stream(f"/v1/videos/{video_id}/events", stream)
