"""Video jobs: create, look up, list, cancel, delete, and the files of a completed one."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from pathlib import Path
from typing import BinaryIO

from starlette.concurrency import run_in_threadpool

from megaslide.engine.atomic import atomic_write_bytes
from megaslide.engine.request import RequestError, ResolvedVideo, resolve

from ..auth import Principal
from ..datadir import DataDir
from ..errors import InvalidRequest, NotFound, NotReady
from ..protocol import ModelCard, WorkerClient
from ..records import VideoRecord
from ..schemas import Video, VideoCreate, VideoDeleted, page, video_object
from ..settings import Settings
from ..store import AsyncStore, Reservation, now
from .idempotency import IdempotencyKey, answer_once, create_once
from .jobs import admit, check_priority, new_id, wait_for
from .models import find_model
from .repeats import pixel_key, share_content

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # what a first-frame image may be uploaded as


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
    ) -> Video:
        """Queue a video (`image`: an uploaded first frame), or, unless `body.reuse` is off,
        answer it at once with the requester's finished video it repeats (repeats.py). A retry
        with the same key gets the video its first request made."""
        check_priority(body.priority, principal)
        served = self.workers.models()
        if not served:
            raise NotReady("no live worker serves a model yet; retry shortly")
        card = find_model(self.workers, body.model or served[0].name, principal)
        video_id = new_id("video_")
        stored = await self._store_image(card, video_id, image) if image is not None else None
        try:
            video = self._resolve(body, card, stored)
            image_sha256 = _digest(stored)
            parent = self.workers.model(card.parent) if card.parent else None
            pixels = pixel_key(video, card, image_sha256=image_sha256, parent=parent)

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
            payload = {**fields, "image": image_sha256}
            row, replayed = await create_once(
                self.store, key, payload, self.store.videos.get, insert
            )
        except BaseException:
            _discard(stored)
            raise
        if replayed:
            _discard(stored)  # the first request's image is the video's
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

    async def _store_image(self, card: ModelCard, video_id: str, image: BinaryIO) -> Path:
        """The uploaded first frame, checked and stored as the video's reference image."""
        if not card.limits.image_input:
            raise RequestError(
                f"model {card.name} does not take a first-frame image (input_reference)",
                param="input_reference",
                code="unsupported_parameter",
            )
        stored = self.data.reference(video_id)
        await run_in_threadpool(save_image, image, stored, self.settings.max_image_pixels)
        return stored

    def _resolve(self, body: VideoCreate, card: ModelCard, stored: Path | None) -> ResolvedVideo:
        """The request resolved against the model, as the workers will read it: adapters by id,
        the image relative to the storage."""
        video = resolve(
            body.to_request(image=str(stored) if stored else None),
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
        # The image is named relative to the storage, which hosts mount where they like.
        if stored is not None:
            video = dataclasses.replace(video, image=self.data.relative(stored))
        return video

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
