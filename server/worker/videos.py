"""Running video jobs: the batch a worker denoises one step at a time, jobs joining it at step
boundaries, clips decoded together when they finish, and MP4s encoded while they decode.

Jobs claimed together are prepared together (their prompts in one pass of the text encoder), and
clips that finish together decode together; when such a batched call raises, it runs again for
each job alone, so only the job at fault fails. A stored request (`engine.request.ResolvedVideo`)
goes to the model as stored.

Decoding and encoding overlap. The model hands out each clip's frames a chunk at a time as its
decoder makes them (`VideoModel.finish_batch_chunks`: a Wan VAE's latent frame, or a whole clip
from a decoder that is not causal in time), and each chunk goes at once to its clip's writer
(`Backend.open_video`), which encodes on a thread of its own. The writers take chunks without
bound, so the loop never waits for an encoder; once the clips are decoded, each is published on
the encoder thread (`Clip.publish`) while the loop takes the next denoising step. Cautions:

- a decode that raises voids every clip of its call: their writers are aborted (no file) and
  each clip decodes again alone, from its first chunk, into a new writer;
- the worker keeps every chunk until its MP4 is in place, so that a full disk can have the clip
  written again (the whole clip's frames, as when clips were decoded whole);
- while clips decode, the store is asked every `CANCEL_POLL_S` which were cancelled: such a
  clip's writer is aborted and it ends cancelled, and the decode stops once none is left. The
  other clips of the call go on: their frames do not depend on it;
- the decoding clips' claims sit in `_encoding` from the start of the decode, so the heartbeat
  renews them however long the decode takes (and leave it if recording the decode fails, so
  that their leases run out);
- clips that finish together encode at the same time, an encoder thread each (x264's own
  threads inside), where they were written one after another: the CPU they take is shared with
  the next steps.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaslide.engine.interfaces import VideoModel
from megaslide.engine.request import INPUT_FILE_LISTS, INPUT_FILES, RequestError, ResolvedVideo

from ..backend import Backend, VideoWriter
from ..store import UNAVAILABLE, is_disk_full, now
from .context import WorkerContext, backoff, message
from .models import Models

log = logging.getLogger("megaslide.server")
PREVIEW_QUALITY = 80  # JPEG quality of a preview: a 160-pixel image in a few kilobytes


def preview_uri(frame, size: int) -> str:
    """A uint8 frame `(H, W, 3)` as a JPEG data URI, its longest side at most `size` pixels."""
    from PIL import Image

    image = Image.fromarray(frame)
    image.thumbnail((size, size))  # keeps the aspect; never enlarges
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=PREVIEW_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode("ascii")


DENOISE_SHARE = 90  # progress points for denoising; decoding and encoding the MP4 take the rest
DECODED_PROGRESS = 95  # clip decoded, MP4 being written; 100 only once the file is in place
# How often a decode asks the store whether its clips were cancelled meanwhile: a long clip's
# decode stops early for a cancellation, and the store is not asked once a chunk.
CANCEL_POLL_S = 0.5


class Clip:
    """A finished video's frames on their way to its MP4: each chunk, as the decoder makes it,
    is kept (a full disk has the clip written again) and handed to the backend's writer, which
    encodes it meanwhile (`Backend.open_video`)."""

    def __init__(self, backend: Backend, run: Running, mp4_path: Path, thumbnail_path: Path):
        self.backend, self.fps = backend, run.video.fps
        self.mp4_path, self.thumbnail_path = mp4_path, thumbnail_path
        self.chunks: list = []
        self.writer: VideoWriter | None = backend.open_video(self.fps, mp4_path, thumbnail_path)
        self.error: Exception | None = None  # the writer's, from `add`: raised by `publish`

    def add(self, chunk) -> None:
        self.chunks.append(chunk)
        if self.writer is not None and self.error is None:
            try:
                self.writer.add(chunk)
            except Exception as exc:  # noqa: BLE001 - the decode goes on for the other clips
                self.error = exc

    def publish(self) -> None:
        """Publish the MP4 and thumbnail (`VideoWriter.close`), or raise why not. The first
        call ends the writer that took the chunks as they came; a later one (the disk was full)
        writes the kept chunks again through a new writer."""
        writer, self.writer = self.writer, None
        if writer is None:
            writer = self.backend.open_video(self.fps, self.mp4_path, self.thumbnail_path)
            try:
                for chunk in self.chunks:
                    writer.add(chunk)
            except BaseException:
                writer.abort()
                raise
        elif self.error is not None:
            raise self.error
        writer.close()

    def abort(self) -> None:
        """Give the clip up: its writer publishes nothing."""
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        self.chunks = []


@dataclass
class Running:
    """A video in the running batch, under the claim `token`."""

    id: str
    token: str
    video: ResolvedVideo
    state: Any
    started: float


class Videos:
    """The running batch of one worker: jobs with the same batch key (model, frames, size,
    steps) share one forward pass per step."""

    def __init__(self, ctx: WorkerContext, models: Models):
        self.ctx, self.models = ctx, models
        self.batch: list[Running] = []
        self._encoding: dict[str, str] = {}  # video id -> claim token, while its MP4 is written
        self._encoder = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="megaslide-encode"
        )  # MP4 writing overlaps the next denoising steps instead of delaying them

    def leases(self) -> list[str]:
        """The claims still worked on: the running batch and MP4s being written (read from the
        heartbeat thread)."""
        return [r.token for r in list(self.batch)] + list(self._encoding.values())

    def adapters_in_use(self) -> set[str]:
        return {c.name for r in self.batch for c in r.video.loras}

    def close(self) -> None:
        """Wait for the MP4s being written."""
        self._encoder.shutdown(wait=True)

    def park(self) -> None:
        """Put the running videos back in the queue (the worker stops)."""
        ctx = self.ctx
        claims = [(r.id, r.token) for r in self.batch]
        self.batch = []
        try:
            ctx.store.videos.requeue(claims, f"requeued: worker {ctx.name} stopped while it ran")
        except UNAVAILABLE:
            log.exception("could not requeue the running videos; their leases will expire")

    def drop_cancelled(self) -> None:
        """Running videos whose cancellation was requested leave the batch, recorded so."""
        store = self.ctx.store
        cancelled = store.videos.cancel_requested([r.id for r in self.batch])
        for run in [r for r in self.batch if r.id in cancelled]:
            self.batch.remove(run)
            if store.videos.finish(run.id, run.token, "cancelled"):
                self.ctx.count_finished("video", "cancelled")

    def claim(self) -> None:
        """Claim queued videos into the running batch, in queue order, as far as they can join
        it (see `Videos.claim`), and prepare them together."""
        ctx = self.ctx
        room = ctx.settings.max_batch - len(self.batch)
        running = self._batch_key(self.batch[0].video) if self.batch else None
        rows = ctx.store.videos.claim(
            ctx.name,
            self.models.served(),
            room,
            lambda row: self._batch_key(ResolvedVideo.from_dict(row.spec)),
            running,
            lease_s=ctx.settings.lease_s,
            runnable=self.models.runnable,
        )
        claimed = []
        for row in rows:
            video = ResolvedVideo.from_dict(row.spec)
            # Its files are stored relative to the storage (see the videos service).
            files = {
                name: str(ctx.data.resolve(path))
                for name in INPUT_FILES
                if (path := getattr(video, name)) is not None
            }
            for name in INPUT_FILE_LISTS:  # VACE's reference images
                files[name] = tuple(str(ctx.data.resolve(p)) for p in getattr(video, name))
            video = dataclasses.replace(video, **files)
            try:
                model = self.models.video_model(video.model)
                if self.models.as_delta(video.model):  # its base's model, with its delta
                    video = dataclasses.replace(video, fine_tune=video.model)
                self._check(video)
            except Exception as exc:  # noqa: BLE001 - this job fails, the batch goes on
                self._fail(row.id, row.lease_token, exc)
                continue
            claimed.append((row, video, model))
        # Jobs claimed together share a batch key, so a model: their prompts encode in one pass.
        for model in {id(m): m for _, _, m in claimed}.values():
            jobs = [(row, video) for row, video, m in claimed if m is model]
            prepared = self._together(
                lambda some, model=model: model.prepare_batch([video for _, video in some]),
                jobs,
                lambda job, exc: self._fail(job[0].id, job[0].lease_token, exc),
            )
            for (row, video), state in prepared:
                run = Running(row.id, row.lease_token, video, state, time.perf_counter())
                self.batch.append(run)

    def _batch_key(self, video: ResolvedVideo) -> tuple:
        """Videos with equal keys share a step: `batch_key` with the model whose weights run
        (fine-tunes kept as deltas share their base's passes)."""
        return (self.models.runs_on(video.model), *video.batch_key[1:])

    def _together(self, call, items: list, fail) -> list[tuple[Any, Any]]:
        """`call(items)`, one result per item, in one go; when that raises, `call([item])` for
        each item alone, so that only the items at fault fail (`fail(item, exc)`): a request
        that cannot be encoded or decoded does not take the others along. Returns (item,
        result) for the items that succeeded, in order."""
        backend = self.ctx.backend
        try:
            return list(zip(items, call(items), strict=True))
        except Exception as exc:  # noqa: BLE001
            backend.release_memory()
            if len(items) == 1:
                fail(items[0], exc)
                return []
        done = []
        for item in items:
            try:
                done.append((item, call([item])[0]))
            except Exception as exc:  # noqa: BLE001 - this job fails, the others go on
                backend.release_memory()
                fail(item, exc)
        return done

    def _check(self, video: ResolvedVideo) -> None:
        """The model's own rules, once more: an API host may have checked the request against
        published numbers only (see `protocol.card_from_dict`)."""
        limits = self.models.card(video.model).limits
        limits.check_clip(video.frames, video.width, video.height)
        limits.check_prompt(video.prompt, "prompt")
        limits.check_prompt(video.negative_prompt, "negative_prompt")

    def step(self) -> None:
        """One batched denoising step; records progress (which renews the leases) and finishes
        the clips done at it."""
        model = self.models.video_model(self.batch[0].video.model)
        start = time.perf_counter()
        transfers, advanced, passes = self._denoise(model)
        if not advanced:
            return
        elapsed = time.perf_counter() - start
        lost = self._record(advanced, transfers, passes, elapsed, self._previews(model, advanced))
        finished = []
        for run in [r for r in self.batch if r.id in lost or r.state.done]:
            self.batch.remove(run)
            if run.id not in lost:
                finished.append(run)
        if finished:
            self._finish(model, finished)

    def _denoise(self, model: VideoModel) -> tuple[dict[str, int], list[Running], int]:
        """Step the batch: the bytes moved, the runs that advanced and the passes that ran. A
        run whose step fails is failed and leaves the batch."""
        backend = self.ctx.backend
        joined = sum(r.state.passes for r in self.batch)
        try:
            transfers = model.denoise_step([r.state for r in self.batch])
            advanced = list(self.batch)
            # No pass ran when every request's step cache reused an earlier output.
            return transfers, advanced, int(sum(r.state.passes for r in advanced) > joined)
        except Exception as exc:  # noqa: BLE001
            # The batched pass raised before any state moved (the update follows the forward
            # pass), so each job is retried alone: one bad or oversized job fails without taking
            # the others along.
            backend.release_memory()
            if len(self.batch) == 1:
                run = self.batch.pop()
                self._fail(run.id, run.token, exc)
                return {}, [], 0
        advanced, passes = [], len(self.batch)  # one pass each
        for run in list(self.batch):
            try:
                model.denoise_step([run.state])
                advanced.append(run)
            except Exception as single_exc:  # noqa: BLE001
                backend.release_memory()
                self.batch.remove(run)
                self._fail(run.id, run.token, single_exc)
        return {}, advanced, passes

    def _previews(self, model: VideoModel, advanced: list[Running]) -> dict[str, str]:
        """Images of the clips as predicted now, by video id, for the runs at a multiple of
        `preview_every` steps that go on (as data URIs). A preview that cannot be made is
        logged and left out: it never fails a video."""
        every = self.ctx.settings.preview_every
        due = [r for r in advanced if every and not r.state.done and r.state.step % every == 0]
        if not due:
            return {}
        try:
            frames = model.preview_batch([r.state for r in due])
        except Exception:  # noqa: BLE001 - the video goes on without this preview
            log.warning("preview of %s failed", ", ".join(r.id for r in due), exc_info=True)
            self.ctx.backend.release_memory()
            return {}
        size = self.ctx.settings.preview_size
        return {r.id: preview_uri(f, size) for r, f in zip(due, frames) if f is not None}

    def _record(
        self,
        advanced: list[Running],
        transfers: dict[str, int],
        passes: int,
        elapsed: float,
        previews: dict[str, str],
    ) -> set[str]:
        """The step's metrics, and each advanced run's progress in the store (renewing its
        lease) with its preview when it has one; the ids of the runs whose lease was lost
        meanwhile."""
        ctx = self.ctx
        metrics = ctx.metrics
        metrics.passes.inc(passes)
        metrics.steps.inc(len(advanced))
        metrics.step_seconds.observe(elapsed)
        metrics.batch_size.observe(len(advanced))
        metrics.h2d_bytes.inc(transfers.get("h2d_bytes", 0))
        metrics.d2h_bytes.inc(transfers.get("d2h_bytes", 0))
        metrics.compile_recompiles.inc(transfers.get("compile_recompiles", 0))
        ctx.publish_metrics()
        progress = []
        for run in advanced:
            state = run.state
            share = DENOISE_SHARE * state.step // state.num_steps
            progress.append((run.id, run.token, state.step, share, state.passes))
        return ctx.store.videos.set_progress(
            progress, lease_s=ctx.settings.lease_s, previews=previews
        )

    def _finish(self, model: VideoModel, runs: list[Running]) -> None:
        """Decode the clips that finished at this step together (the model bounds how many per
        pass), each chunk handed to its clip's MP4 encoder as the decoder makes it, then publish
        each clip on the encoder thread. A clip cancelled while it decodes is dropped there."""
        for run in runs:  # the heartbeat renews their claims while they decode and encode
            self._encoding[run.id] = run.token
        ended: set[str] = set()  # cancelled while decoding: finished, nothing to publish

        def failed(run: Running, exc: BaseException) -> None:
            self._encoding.pop(run.id, None)
            self._fail(run.id, run.token, exc)

        # Decoding needs the device: it stays on this thread, the encoders run on their own.
        decoded = self._together(lambda some: self._decode(model, some, ended), runs, failed)
        decoded = [(run, clip) for run, clip in decoded if clip is not None]
        if not decoded:
            return
        update = [(run.id, run.token, run.state.step, DECODED_PROGRESS) for run, _ in decoded]
        try:
            lost = self.ctx.store.videos.set_progress(update, lease_s=self.ctx.settings.lease_s)
        except BaseException:
            # The store is out of reach: give the clips up (no encoder left waiting, no file)
            # and stop renewing their claims, so that their leases run out and the jobs are
            # claimed again.
            for run, clip in decoded:
                clip.abort()
                self._encoding.pop(run.id, None)
            raise
        for run, clip in decoded:
            if run.id in lost:  # not ours any more: whoever holds it writes it
                clip.abort()
                self._encoding.pop(run.id, None)
            else:
                self._encoder.submit(self._encode, run, clip)

    def _decode(self, model: VideoModel, runs: list[Running], ended: set[str]) -> list[Clip | None]:
        """Decode `runs` together, a chunk at a time (`finish_batch_chunks`), into a `Clip` each
        whose encoder takes the chunks as they come. Every `CANCEL_POLL_S` the store is asked
        which were cancelled meanwhile: those are given up (nothing published), recorded
        cancelled and added to `ended` (None in their place); the decode stops once none is
        left. When the decode raises, every clip of the batch is given up and the error raised."""
        ctx = self.ctx
        todo = [r for r in runs if r.id not in ended]  # (a retry alone after a failed batch)
        clips: list[Clip] = []
        try:
            for run in todo:
                clips.append(Clip(ctx.backend, run, *ctx.data.video(run.id)))
            if todo:
                self._feed(model, todo, clips, ended)
        except BaseException:
            for clip in clips:
                clip.abort()
            raise
        made = {run.id: clip for run, clip in zip(todo, clips)}
        return [None if run.id in ended else made[run.id] for run in runs]

    def _feed(
        self, model: VideoModel, runs: list[Running], clips: list[Clip], ended: set[str]
    ) -> None:
        """Each chunk the model decodes to its run's clip, as it comes (see `_decode`)."""
        live = {run.id for run in runs}
        polled = time.monotonic()
        chunks = model.finish_batch_chunks([run.state for run in runs])
        with contextlib.closing(chunks):  # stopped early: the decoder's memory goes now
            for i, chunk in chunks:
                if runs[i].id in live:
                    clips[i].add(chunk)
                if time.monotonic() - polled < CANCEL_POLL_S:
                    continue
                polled = time.monotonic()
                for k in self._cancelled_clips(runs, clips, live):
                    live.discard(runs[k].id)
                    ended.add(runs[k].id)
                    self._encoding.pop(runs[k].id, None)
                if not live:
                    return

    def _cancelled_clips(self, runs: list[Running], clips: list[Clip], live: set[str]) -> list[int]:
        """Indices of the `live` runs whose cancellation was asked for, their clips given up
        (the encoder stopped, its temporary file gone) and then recorded cancelled, so that a
        video seen cancelled has no file left (the store unreachable: none, ask again later)."""
        store = self.ctx.store
        try:
            asked = store.videos.cancel_requested(sorted(live))
        except UNAVAILABLE:
            return []
        cancelled = []
        for i, run in enumerate(runs):
            if run.id in asked:
                cancelled.append(i)
                clips[i].abort()
                if self.ctx.retrying(store.videos.finish, run.id, run.token, "cancelled"):
                    self.ctx.count_finished("video", "cancelled")
        return cancelled

    def _encode(self, run: Running, clip: Clip) -> None:
        """On the encoder thread: publish the MP4 and thumbnail, then mark the job completed."""
        try:
            self._write(run, clip)
        finally:
            self._encoding.pop(run.id, None)

    def _write(self, run: Running, clip: Clip) -> None:
        ctx = self.ctx
        for wait_s in backoff():
            try:
                clip.publish()
                break
            except Exception as exc:  # noqa: BLE001
                if not is_disk_full(exc):
                    self._fail(run.id, run.token, exc)
                    return
            # A full disk is the operator's to fix, not the video's fault: keep the frames, keep
            # the claim (the heartbeat renews it while the MP4 is pending), write again later.
            log.warning("video %s: the disk is full; writing it again in %.1f s", run.id, wait_s)
            if ctx.stop.wait(wait_s) or self._given_up(run):
                return  # stopping (its lease decides where it runs again), cancelled, or not ours
        mp4, png = clip.mp4_path, clip.thumbnail_path
        expires_at = now() + ctx.settings.video_ttl_s
        status = ctx.retrying(
            ctx.store.videos.finish, run.id, run.token, "completed", expires_at=expires_at
        )
        if status == "completed":
            ctx.metrics.video_seconds.observe(time.perf_counter() - run.started)
        if status is not None:
            ctx.count_finished("video", status)
        if status == "cancelled":  # cancelled while it was being encoded: nobody will fetch it
            for path in (mp4, png):
                path.unlink(missing_ok=True)

    def _given_up(self, run: Running) -> bool:
        """While `run`'s MP4 waits for disk space: True once it was cancelled (recorded so) or
        its claim is no longer this worker's."""
        ctx = self.ctx
        update = [(run.id, run.token, run.state.step, DECODED_PROGRESS)]
        try:
            if ctx.store.videos.set_progress(update, lease_s=ctx.settings.lease_s):
                return True
            if ctx.store.videos.cancel_requested([run.id]):
                ctx.retrying(ctx.store.videos.finish, run.id, run.token, "cancelled")
                ctx.count_finished("video", "cancelled")
                return True
        except UNAVAILABLE:
            pass  # the store is down too: keep trying both
        return False

    def _fail(self, video_id: str, token: str, exc: BaseException) -> None:
        """Record a failed video; stop the worker when the failure took the device with it."""
        ctx = self.ctx
        log.warning("video %s failed: %s: %s", video_id, type(exc).__name__, exc)
        code = _request_code(exc) or ctx.backend.error_code(exc) or "generation_failed"
        failed = (code, message(exc))
        if ctx.retrying(ctx.store.videos.finish, video_id, token, "failed", error=failed):
            ctx.count_finished("video", "failed")
        ctx.check_device(exc)


def _request_code(exc: BaseException) -> str | None:
    return "invalid_request" if isinstance(exc, RequestError) else None
