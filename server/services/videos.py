"""Video jobs: create, look up, list, cancel, delete, and the files of a completed one."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
from pathlib import Path
from typing import BinaryIO

from starlette.concurrency import run_in_threadpool

from megaslide.engine.atomic import atomic_write, atomic_write_bytes
from megaslide.engine.request import (
    ANIMATE_VIDEOS,
    INPUT_FILE_LISTS,
    INPUT_FILES,
    RequestError,
    ResolvedVideo,
    resolve,
)

from ..auth import Principal
from ..datadir import DataDir
from ..errors import InvalidRequest, NotFound, NotReady, PayloadTooLarge
from ..protocol import ModelCard, WorkerClient
from ..records import VideoRecord
from ..schemas import (
    FILE_FIELDS,
    FILE_LIST_FIELDS,
    Video,
    VideoCreate,
    VideoDeleted,
    page,
    video_object,
)
from ..settings import Settings
from ..store import AsyncStore, Reservation, now
from .files import INPUT_PURPOSE
from .idempotency import IdempotencyKey, answer_once, create_once
from .jobs import admit, check_priority, new_id, wait_for
from .models import find_model
from .repeats import pixel_key, share_content

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # what a first-frame image may be uploaded as
# What an input video may be uploaded as: FFmpeg's demuxer for each, picked by the file's first
# bytes and forced, so FFmpeg never probes for another (its playlist and concat demuxers open
# further files and URLs named inside the upload).
VIDEO_CONTAINERS = (
    ("MP4 or QuickTime", lambda head: head[4:8] == b"ftyp", "mov"),
    ("WebM or Matroska", lambda head: head.startswith(b"\x1a\x45\xdf\xa3"), "matroska"),
    ("GIF", lambda head: head.startswith((b"GIF87a", b"GIF89a")), "gif"),
)
COPY_CHUNK = 1 << 20

# Each file a request may bring, by its field on the API: the `ResolvedVideo` field it fills, the
# model limit that says the model takes it, and what it is (an image, or a video whose frames
# are counted). `reference_images` holds several.
UPLOADS = {
    "input_reference": ("image", "image_input", "a first-frame image"),
    "last_frame": ("last_image", "last_image_input", "a last-frame image"),
    "input_video": ("video", "video_input", "an input video"),
    "control_video": ("control_video", "vace_input", "a control video"),
    "mask": ("mask", "vace_input", "a mask video"),
    "reference_images": ("reference_images", "vace_input", "reference images"),
    "pose_video": ("pose_video", "animate_input", "a pose video"),
    "face_video": ("face_video", "animate_input", "a face video"),
    "background_video": ("background_video", "animate_input", "a background video"),
    "background_mask": ("background_mask", "animate_input", "a background mask video"),
}


class Videos:
    """The video jobs of one server, as its API's principals see them."""

    def __init__(
        self, store: AsyncStore, workers: WorkerClient, settings: Settings, data: DataDir
    ) -> None:
        self.store, self.workers, self.settings, self.data = store, workers, settings, data

    async def create(
        self,
        body: VideoCreate,
        principal: Principal,
        key: IdempotencyKey | None,
        image: BinaryIO | None = None,
        last_image: BinaryIO | None = None,
        input_video: BinaryIO | None = None,
        control_video: BinaryIO | None = None,
        mask: BinaryIO | None = None,
        reference_images: list[BinaryIO] | tuple = (),
        animate: dict[str, BinaryIO] | None = None,
    ) -> Video:
        """Queue a video (`image`, `last_image`, `input_video`: an uploaded first frame, last
        frame, input video; `control_video`, `mask`, `reference_images`: VACE's; `animate`: Wan
        Animate's videos by field (ANIMATE_VIDEOS); `body` may name
        files of /v1/files instead), or, unless
        `body.reuse` is off, answer it at once with the requester's finished video it repeats
        (repeats.py). A retry with the same key gets the video its first request made."""
        check_priority(body.priority, principal)
        served = self.workers.models()
        if not served:
            raise NotReady("no live worker serves a model yet; retry shortly")
        card = find_model(self.workers, body.model or served[0].name, principal)
        video_id = new_id("video_")
        stored: dict[str, Path | list[Path]] = {}
        named = await self._named_files(body, principal)
        uploads = {
            "input_reference": image,
            "last_frame": last_image,
            "input_video": input_video,
            "control_video": control_video,
            "mask": mask,
            "reference_images": list(reference_images) or None,
            **{field: (animate or {}).get(field) for field in ANIMATE_VIDEOS},
        }
        uploads = {field: named.get(field, file) for field, file in uploads.items()}
        body = body.model_copy(update=dict.fromkeys([*FILE_FIELDS, *FILE_LIST_FIELDS]))
        try:
            frames = await self._store_files(card, video_id, uploads, stored)
            video = self._resolve(body, card, stored, frames)
            digests = {
                name: [_digest(p) for p in path] if isinstance(path, list) else _digest(path)
                for name, path in stored.items()
            }
            digests = {name: digests.get(name) for name in (*INPUT_FILES, *INPUT_FILE_LISTS)}
            parent = self.workers.model(card.parent) if card.parent else None
            pixels = pixel_key(video, card, digests=digests, parent=parent)

            async def insert(idempotency) -> VideoRecord:
                if body.reuse:
                    owner = principal.owner
                    repeat = await self._repeat(video_id, video, pixels, owner, idempotency, body)
                    if repeat is not None:
                        return repeat  # no pass, so no place in the queue either
                await admit(self.store, self.workers, self.settings, principal)
                return await self.store.videos.insert(
                    video_id,
                    video.to_dict(),
                    priority=body.priority,
                    idempotency=idempotency,
                    owner=principal.owner,
                    pixel_key=pixels,
                )

            # `reuse` counts only when off: a request that leaves it out hashes as it did
            # before the field, so a key reserved then still answers its retries.
            fields = body.model_dump(exclude_none=True, exclude={"reuse"} if body.reuse else None)
            # The image's digest under its old name, so a key reserved before the other files
            # hashes as it did.
            files = {"image" if n == "image" else f"{n}_sha256": d for n, d in digests.items()}
            payload = {**fields, **{k: v for k, v in files.items() if k == "image" or v}}
            row, replayed = await create_once(
                self.store, key, payload, self.store.videos.get, insert
            )
        except BaseException:
            _discard(stored)
            raise
        finally:
            for file in _each(named):
                file.close()
        if replayed:
            _discard(stored)  # the first request's files are the video's
        elif row.cached_from is None:
            self.workers.wake()
        return video_object(row)

    async def _repeat(
        self,
        video_id: str,
        video: ResolvedVideo,
        pixels: str,
        owner: str | None,
        idempotency: Reservation | None,
        body: VideoCreate,
    ) -> VideoRecord | None:
        """`video_id` recorded completed with the content of `owner`'s newest finished video
        whose pixel key is `pixels`, when there is one and its MP4 is still there; else None
        and nothing done (the request runs)."""
        source = await self.store.videos.repeated(owner, pixels)
        if source is None:
            return None
        if not await run_in_threadpool(share_content, self.data, source.id, video_id):
            return None
        try:
            return await self.store.videos.insert_repeat(
                video_id,
                video.to_dict(),
                source,
                expires_at=now() + self.settings.video_ttl_s,
                priority=body.priority,
                idempotency=idempotency,
                owner=owner,
            )
        except BaseException:
            for path in self.data.video(video_id):
                path.unlink(missing_ok=True)
            raise

    async def _named_files(
        self, body: VideoCreate, principal: Principal
    ) -> dict[str, BinaryIO | list[BinaryIO]]:
        """The files `body` names by id (uploaded with purpose "input" to /v1/files), opened, by
        field (a list of them for `reference_images`); each is checked as an upload of its own
        would be (`_store_files`)."""
        named: dict[str, BinaryIO | list[BinaryIO]] = {}
        try:
            for field in FILE_FIELDS:
                file_id = getattr(body, field)
                if file_id is not None:
                    named[field] = await self._named_file(field, file_id, principal)
            for field, (_, most) in FILE_LIST_FIELDS.items():
                ids = getattr(body, field)
                if ids is None:
                    continue
                if not isinstance(ids, list) or len(ids) > most:
                    raise RequestError(
                        f"{field} must be a list of at most {most} ids of files uploaded with "
                        'purpose "input" to /v1/files (or files uploaded as multipart/form-data)',
                        param=field,
                    )
                named[field] = []
                for file_id in ids:
                    named[field].append(await self._named_file(field, file_id, principal))
        except BaseException:
            for file in _each(named):
                file.close()
            raise
        return named

    async def _named_file(self, field: str, file_id, principal: Principal) -> BinaryIO:
        """The file of /v1/files `file_id` names for `field`, opened."""
        if not isinstance(file_id, str) or not file_id.startswith("file-"):
            raise RequestError(
                f"{field} must be a file uploaded as multipart/form-data, or the id of a "
                'file uploaded with purpose "input" to /v1/files',
                param=field,
            )
        row = await self.store.files.get(file_id)
        if row is None or not principal.may_see(row.owner):
            raise NotFound(f"{field}: no file {file_id!r}", param=field)
        if row.purpose != INPUT_PURPOSE:
            raise RequestError(
                f"{field}: file {file_id} was uploaded with purpose {row.purpose!r}, not "
                f"{INPUT_PURPOSE!r}",
                param=field,
            )
        try:
            return await run_in_threadpool(self.data.resolve(row.path).open, "rb")
        except FileNotFoundError:  # deleted since it was looked up
            raise NotFound(f"{field}: no file {file_id!r}", param=field) from None

    async def _store_files(
        self,
        card: ModelCard,
        video_id: str,
        uploads: dict[str, BinaryIO | list[BinaryIO] | None],
        stored: dict[str, Path | list[Path]],
    ) -> dict[str, int]:
        """The uploaded files (by API field, `UPLOADS`), each checked against the model and the
        server's limits and stored under `video_id` (into `stored`, by `ResolvedVideo` field);
        each video's frame count, by API field."""
        limits, settings, data = card.limits, self.settings, self.data
        for param, file in uploads.items():
            _, takes, what = UPLOADS[param]
            if file is not None and not getattr(limits, takes):
                raise RequestError(
                    f"model {card.name} does not take {what} ({param})",
                    param=param,
                    code="unsupported_parameter",
                )
        images = {"input_reference": data.reference, "last_frame": data.last_frame}
        for param, where in images.items():
            if uploads.get(param) is not None:
                name = UPLOADS[param][0]
                stored[name] = where(video_id)
                max_pixels = settings.max_image_pixels
                await run_in_threadpool(save_image, uploads[param], stored[name], max_pixels, param)
        for i, file in enumerate(uploads.get("reference_images") or ()):
            path = data.reference_image(video_id, i)
            stored.setdefault("reference_images", []).append(path)
            await run_in_threadpool(
                save_image, file, path, settings.max_image_pixels, "reference_images"
            )
        videos = {
            "input_video": data.input_video,
            "control_video": data.control_video,
            "mask": data.mask_video,
            **{
                field: functools.partial(data.animate_video, name=field) for field in ANIMATE_VIDEOS
            },
        }
        frames = {}
        for param, where in videos.items():
            if uploads.get(param) is None:
                continue
            name = UPLOADS[param][0]
            stored[name] = where(video_id)
            frames[param] = await run_in_threadpool(
                save_video,
                uploads[param],
                stored[name],
                max_bytes=settings.max_video_bytes,
                max_pixels=settings.max_image_pixels,
                max_frames=settings.max_video_frames,
                param=param,
            )
        return frames

    def _resolve(
        self,
        body: VideoCreate,
        card: ModelCard,
        stored: dict[str, Path | list[Path]],
        frames: dict[str, int],
    ) -> ResolvedVideo:
        """The request resolved against the model, as the workers will read it: adapters by id,
        the files relative to the storage. Videos of `frames` frames (by API field: an input
        video, a control video, a mask) set the clip's length when the request gives none (the
        shortest's), and each must hold the clip's frames."""
        paths = {
            name: [str(p) for p in path] if isinstance(path, list) else str(path)
            for name, path in stored.items()
        }
        fit = card.limits.fit_frames(min(frames.values())) if frames else None
        video = resolve(
            body.to_request(
                image=paths.get("image"),
                last_image=paths.get("last_image"),
                video=paths.get("video"),
                frames=fit,
                control_video=paths.get("control_video"),
                mask=paths.get("mask"),
                reference_images=tuple(paths.get("reference_images", ())),
                animate={f: paths[f] for f in ANIMATE_VIDEOS if f in paths},
            ),
            card.limits,
            card.defaults,
            model=card.name,
            max_steps=self.settings.max_steps,
            max_prompt_chars=self.settings.max_prompt_chars,
            adapters=card.adapter_defaults(),
        )
        # The workers know each adapter by its id (an uploaded one's names its owner).
        ids = {a["name"]: a["id"] for a in card.adapters}
        loras = tuple(dataclasses.replace(c, name=ids[c.name]) for c in video.loras)
        video = dataclasses.replace(video, loras=loras)
        for param, count in frames.items():
            if count < video.frames:
                raise RequestError(
                    f"{param} has {count} frames; a clip of {video.frames} (num_frames) takes "
                    "its first ones: give a shorter clip or a longer video",
                    param=param,
                )
        # The files are named relative to the storage, which hosts mount where they like.
        relative = {
            name: tuple(map(self.data.relative, path))
            if isinstance(path, list)
            else self.data.relative(path)
            for name, path in stored.items()
        }
        return dataclasses.replace(video, **relative)

    async def find(self, video_id: str, principal: Principal) -> VideoRecord:
        """The video, if `principal` may see it; another key's answers 404 as if absent."""
        video = await self.store.videos.get(video_id)
        if video is None or not principal.may_see(video.owner):
            raise NotFound(f"No video found with id {video_id!r}", param="video_id")
        return video

    async def retrieve(self, video_id: str, principal: Principal) -> Video:
        return video_object(await self.find(video_id, principal))

    async def list(self, principal: Principal, after: str | None, limit: int, order: str) -> dict:
        rows, has_more = await self.store.videos.page(after, limit, order, principal.sees)
        return page([video_object(r) for r in rows], has_more)

    async def cancel(
        self, video_id: str, principal: Principal, key: IdempotencyKey | None
    ) -> Video:
        """Stop a queued or running video; a retry with the same key gets the first answer,
        whatever happened since."""

        async def work() -> Video:
            video = await self.find(video_id, principal)
            if video.status in ("completed", "failed"):
                raise InvalidRequest(
                    f"video {video_id} is already {video.status}; there is nothing to cancel",
                    param="video_id",
                    code="video_not_cancellable",
                )
            await self._stop(video_id)
            return video_object(await self.store.videos.get(video_id))

        return await answer_once(self.store, key, {"cancel": video_id}, Video, work)

    async def delete(
        self, video_id: str, principal: Principal, key: IdempotencyKey | None
    ) -> VideoDeleted:
        """Delete a video, its record and its files, stopping it first; `deleted: false` if it
        has not stopped within `cancel_wait_s`. A retry with the same key gets the first answer,
        not a 404."""

        async def work() -> VideoDeleted:
            await self.find(video_id, principal)
            status = await self._stop(video_id)
            if status == "in_progress":
                return VideoDeleted(id=video_id, deleted=False, status=status)
            await self.store.videos.delete(video_id)
            for path in self.data.video_files(video_id):
                path.unlink(missing_ok=True)
            return VideoDeleted(id=video_id, deleted=True, status="deleted")

        return await answer_once(self.store, key, {"delete": video_id}, VideoDeleted, work)

    async def _stop(self, video_id: str) -> str:
        """Cancel a queued video now, or a running one at its next step boundary, waiting up to
        `cancel_wait_s` for its worker to stop it; the status after."""
        if await self.store.videos.cancel(video_id) == "in_progress":
            self.workers.wake()

            async def stopped() -> bool:
                return (await self.store.videos.get(video_id)).status != "in_progress"

            await wait_for(stopped, self.settings.cancel_wait_s)
        return (await self.store.videos.get(video_id)).status

    async def content(self, video_id: str, principal: Principal, variant: str) -> tuple[Path, str]:
        """The file of a completed video's `variant` and its media type, or why there is none."""
        video = await self.find(video_id, principal)
        if video.status != "completed":
            raise InvalidRequest(
                f"video {video_id} is {video.status}; its content exists once it is completed",
                param="video_id",
                code="video_not_ready",
            )
        if video.expires_at is not None and video.expires_at < now():
            raise NotFound(
                f"the content of video {video_id} expired", param="video_id", code="video_expired"
            )
        mp4, png = self.data.video(video_id)
        path, media_type = (mp4, "video/mp4") if variant == "video" else (png, "image/png")
        if not path.is_file():
            raise NotFound(f"the {variant} of video {video_id} is gone from disk", param="video_id")
        return path, media_type


def save_image(src, dst: Path, max_pixels: int, param: str = "input_reference") -> None:
    """Check an uploaded first- (or last-) frame image and store it as PNG; RequestError naming
    `param` if it is not one.

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
                    f"{param} is {width}x{height} pixels; at most {max_pixels} are accepted",
                    param=param,
                )
            image = image.convert("RGB")
    except RequestError:
        raise
    except UnidentifiedImageError:
        formats = f"{', '.join(IMAGE_FORMATS[:-1])} or {IMAGE_FORMATS[-1]}"
        raise RequestError(
            f"{param} is not a readable image: not a {formats} file",
            param=param,
        ) from None
    # PIL reports a damaged file as SyntaxError ("broken PNG file") or ValueError as well as
    # OSError.
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise RequestError(f"{param} is not a readable image ({e})", param=param) from None
    png = io.BytesIO()
    image.save(png, format="PNG")
    atomic_write_bytes(dst, png.getvalue())


def save_video(
    src,
    dst: Path,
    *,
    max_bytes: int,
    max_pixels: int,
    max_frames: int,
    param: str = "input_video",
) -> int:
    """Store an uploaded video (an input video, a control video, a mask) as it is and check it
    by decoding every frame with PyAV (FFmpeg); its frame count, or RequestError naming `param`
    (PayloadTooLarge past `max_bytes`), and nothing left behind.

    A hostile file is bounded before it costs much: its bytes as they are copied, its container
    by its first bytes (one of `VIDEO_CONTAINERS`, the demuxer forced), its frame size from the
    stream's header before any frame is decoded and again on each frame (a stream may change
    size midway), and its frames as they are decoded."""
    try:
        _copy_bounded(src, dst, max_bytes, param)
        return _count_video_frames(dst, max_pixels, max_frames, param)
    except BaseException:
        dst.unlink(missing_ok=True)
        raise


def _copy_bounded(src, dst: Path, max_bytes: int, param: str) -> None:
    def write(tmp: Path) -> None:
        written = 0
        with tmp.open("wb") as out:
            while chunk := src.read(COPY_CHUNK):
                written += len(chunk)
                if written > max_bytes:
                    raise PayloadTooLarge(
                        f"{param}: this server accepts videos up to {max_bytes} bytes",
                        param=param,
                    )
                out.write(chunk)

    atomic_write(dst, write)


def _count_video_frames(path: Path, max_pixels: int, max_frames: int, param: str) -> int:
    import av

    with path.open("rb") as f:
        head = f.read(16)
    demuxer = next((d for _, is_it, d in VIDEO_CONTAINERS if is_it(head)), None)
    if demuxer is None:
        kinds = ", ".join(name for name, _, _ in VIDEO_CONTAINERS)
        raise RequestError(f"{param} is not a readable video: not a {kinds} file", param=param)

    def refuse(problem: str) -> RequestError:
        return RequestError(f"{param} {problem}", param=param)

    def check_size(w: int, h: int) -> None:
        if w * h > max_pixels:
            raise refuse(f"has frames of {w}x{h} pixels; at most {max_pixels} are accepted")

    frames = 0
    try:
        with av.open(str(path), format=demuxer) as container:
            if not container.streams.video:
                raise refuse("holds no video stream")
            stream = container.streams.video[0]
            check_size(stream.codec_context.width, stream.codec_context.height)
            for frame in container.decode(stream):
                check_size(frame.width, frame.height)
                frames += 1
                if frames > max_frames:
                    raise refuse(f"has more than {max_frames} frames, the most this server decodes")
    except RequestError:
        raise
    except (av.FFmpegError, ValueError, OSError) as e:
        raise refuse(f"is not a readable video ({e})") from None
    if frames == 0:
        raise refuse("holds no frame")
    return frames


def _digest(path: Path | None) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None else None


def _each(files: dict) -> list:
    """The values of `files`, a list among them spread."""
    return [f for v in files.values() for f in (v if isinstance(v, list) else [v])]


def _discard(stored: dict[str, Path | list[Path]]) -> None:
    for path in _each(stored):
        path.unlink(missing_ok=True)
