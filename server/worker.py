"""The worker: one thread that owns the models, pulls jobs from the store and runs them step by step.

Scheduling happens at denoising-step boundaries. At each boundary the worker

1. drops running videos whose cancellation was requested (the model never runs another step for them);
2. admits queued videos into the running batch: jobs with the same batch key (model, frames, size,
   steps) share one forward pass per step, so a new request joins a running batch at the next step
   instead of waiting for it to finish. Admission follows the queue order (priority, then arrival) and
   stops at the first job that cannot join, so batching never lets a job overtake an earlier one;
3. runs one batched denoising step, records progress, and hands finished clips to the encoder thread;
4. only when no video is queued or running, runs one fine-tuning step. A running fine-tune thus
   yields to videos at its next step boundary and continues where it stopped once they are done.

Every job runs inside its own try/except: an exception (CUDA out of memory included) fails that job
with its message, and the next boundary proceeds as usual. Only an error outside any job kills the
worker, which `/healthz` then reports.

The models sit behind the `Backend` it is given (backend.py), so this module, like the routers,
never imports torch. A stored request (`engine.request.ResolvedVideo`) goes to the model as stored.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megaslide.engine.request import ResolvedVideo

from .backend import Backend, FinetuneJob, TrainingRun, VideoModel
from .datadir import DataDir
from .metrics import Registry
from .protocol import ModelCard, WorkerClient
from .settings import Settings
from .store import JobStore, now

log = logging.getLogger("megaslide.server")

IDLE_WAIT_S = 0.5  # how long an idle worker sleeps before looking at the store again if not woken
MAX_LOADED_FINE_TUNES = (
    2  # fine-tuned models kept loaded beside the base models (least recently used go)
)
DENOISE_SHARE = 90  # progress points for denoising; decoding and encoding the MP4 take the rest
DECODED_PROGRESS = 95  # clip decoded, MP4 being written; 100 only once the file is in place
HOUSEKEEPING_INTERVAL_S = 600.0  # how often an idle worker deletes expired outputs


# ---------------------------------------------------------------------------------------------
# The worker client that owns the worker thread


@dataclass
class _Running:
    """A video in the running batch."""

    id: str
    video: ResolvedVideo
    state: Any
    started: float


@dataclass
class _Tuning:
    """The fine-tune the worker is driving (kept in memory while it yields to videos)."""

    id: str
    trainer: TrainingRun
    parent: str
    suffix: str
    output_dir: Path
    paused: bool = False
    known_checkpoints: set = field(default_factory=set)


class EmbeddedWorker(WorkerClient):
    """Runs every job in one worker thread of this process, on the models `backend` provides."""

    def __init__(self, settings: Settings, backend: Backend):
        self.settings = settings
        self.backend = backend
        self.data = DataDir(settings.data_dir)
        self.store: JobStore | None = None
        self._metrics = Registry()
        self._cards: dict[str, ModelCard] = {}
        self._ft_cards: dict[str, ModelCard] = {}
        self._loaded: dict[str, VideoModel] = {}
        self._loaded_ft: OrderedDict[str, VideoModel] = OrderedDict()
        self._ready = False
        self._dead: str | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._encoder: concurrent.futures.ThreadPoolExecutor | None = None
        self._batch: list[_Running] = []
        self._tuning: _Tuning | None = None
        self._last_housekeeping = time.monotonic()  # start-up already cleaned (app.housekeeping)

    # --- WorkerClient ------------------------------------------------------------------------

    async def start(self, store: JobStore) -> None:
        self.store = store
        # A worker can start again after a shutdown (an app's lifespan run twice): fresh signals,
        # and not ready until its thread has loaded the models again.
        self._stop, self._wake = threading.Event(), threading.Event()
        self._ready, self._dead = False, None
        self._cards = {card.name: card for card in self.backend.cards()}
        # One encoder thread: MP4 writing overlaps the next denoising steps instead of delaying them.
        self._encoder = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="megaslide-encode"
        )
        self._thread = threading.Thread(target=self._main, name="megaslide-worker", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        import anyio

        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await anyio.to_thread.run_sync(self._thread.join)
        if self._encoder is not None:
            await anyio.to_thread.run_sync(lambda: self._encoder.shutdown(wait=True))

    @property
    def ready(self) -> bool:
        return self._ready and self._dead is None

    @property
    def dead(self) -> str | None:
        return self._dead

    @property
    def metrics(self) -> Registry:
        return self._metrics

    def models(self) -> list[ModelCard]:
        out = list(self._cards.values())
        for row in self.store.models() if self.store is not None else []:
            card = self._ft_cards.get(row["name"])
            parent = self._cards.get(row["parent"]) or self._ft_cards.get(row["parent"])
            if card is None and parent is not None:
                card = self.backend.fine_tuned_card(row["name"], parent, Path(row["path"]))
                card = card.replace(created=row["created_at"])
                self._ft_cards[row["name"]] = card
            if card is not None:
                out.append(card)
        return out

    def check_dataset(self, root: Path) -> int:
        return self.backend.check_dataset(root)

    def wake(self) -> None:
        self._wake.set()

    def retry_after(self) -> int:
        # One video's wall time is how long the head of the queue waits for a slot at worst-typical.
        mean = self._metrics.video_seconds.mean
        return max(1, math.ceil(mean)) if mean else 5

    # --- the worker thread -------------------------------------------------------------------

    def _main(self) -> None:
        try:
            for name, card in self._cards.items():
                log.info("loading model %s (%s)", name, card.source)
                self._loaded[name] = self.backend.load(card)
            self._ready = True
            log.info("worker ready: %s", ", ".join(self._cards))
            while not self._stop.is_set():
                if not self._tick():
                    self._housekeeping()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
            self._park()
        except BaseException as exc:  # noqa: BLE001 - anything here is outside a job: the worker is dead
            self._dead = f"{type(exc).__name__}: {exc}"
            log.exception("worker died")
            try:  # nothing may show as running without a live worker: back to the queue for a restart
                self._park()
            except Exception:  # noqa: BLE001 - the start-up reconciliation will do it instead
                log.exception("could not requeue the running jobs")

    def _tick(self) -> bool:
        """One scheduling decision at a step boundary; False when there was nothing to do."""
        self._drop_cancelled()
        # Checked here, not only when it trains: a fine-tune paused for videos is cancelled at once.
        if self._tuning is not None and self.store.finetune_cancel_requested(self._tuning.id):
            self._end_finetune("cancelled")
        self._admit()
        if self._batch:
            if self._tuning is not None and not self._tuning.paused:
                self._tuning.paused = True
                self.store.add_event(
                    self._tuning.id, "Paused at a step boundary: video jobs are waiting"
                )
            self._step_videos()
            return True
        return self._step_finetune()

    def _housekeeping(self) -> None:
        """When idle, now and then: delete the files of videos whose `expires_at` has passed."""
        if time.monotonic() - self._last_housekeeping < HOUSEKEEPING_INTERVAL_S:
            return
        self._last_housekeeping = time.monotonic()
        for video_id in self.store.expired_videos():
            for path in self.data.video_files(video_id):
                path.unlink(missing_ok=True)

    def _park(self) -> None:
        """Graceful stop: running videos go back to the queue, a running fine-tune checkpoints first."""
        self.store.requeue_videos(
            [r.id for r in self._batch], "requeued: the server shut down while it ran"
        )
        self._batch = []
        if self._tuning is not None:
            t, self._tuning = self._tuning, None
            try:
                path = t.trainer.save_checkpoint()
                self._record_checkpoints(t)
                reason = f"requeued: the server shut down; will resume from {Path(path).name}"
            except Exception as exc:  # noqa: BLE001 - the last automatic checkpoint still stands
                reason = f"requeued: the server shut down; checkpoint on shutdown failed ({exc})"
            t.trainer.close()
            self.store.requeue_finetune(t.id, reason)

    # --- videos ------------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        cancelled = self.store.cancel_requested_videos([r.id for r in self._batch])
        for run in [r for r in self._batch if r.id in cancelled]:
            self._batch.remove(run)
            self.store.finish_video(run.id, "cancelled")
            self._metrics.jobs_finished.inc(kind="video", status="cancelled")

    def _admit(self) -> None:
        room = self.settings.max_batch - len(self._batch)
        if room <= 0:
            return
        key = self._batch[0].video.batch_key if self._batch else None
        for row in self.store.queued_videos(limit=room):
            video = ResolvedVideo.from_dict(json.loads(row["spec"]))
            if key is None:
                key = video.batch_key
            elif video.batch_key != key:
                break  # strict queue order: a later compatible job may not pass this one
            if not self.store.start_video(row["id"]):
                continue  # cancelled between the read and now
            try:
                state = self._video_model(video.model).prepare(video)
            except Exception as exc:  # noqa: BLE001 - this job fails, the batch goes on
                self._fail_video(row["id"], exc)
                continue
            self._batch.append(_Running(row["id"], video, state, time.perf_counter()))

    def _video_model(self, name: str) -> VideoModel:
        if name in self._loaded:
            return self._loaded[name]
        if name in self._loaded_ft:
            self._loaded_ft.move_to_end(name)
            return self._loaded_ft[name]
        card = self.model(name)
        if card is None:
            raise ValueError(f"model {name!r} is no longer served")
        model = self.backend.load(card)
        self._loaded_ft[name] = model
        while len(self._loaded_ft) > MAX_LOADED_FINE_TUNES:
            self._loaded_ft.popitem(last=False)
        return model

    def _step_videos(self) -> None:
        model = self._video_model(self._batch[0].video.model)
        start = time.perf_counter()
        try:
            transfers = model.denoise_step([r.state for r in self._batch])
            advanced, passes = list(self._batch), 1
        except Exception as exc:  # noqa: BLE001
            # The batched pass raised before any state moved (the update follows the forward pass), so
            # each job is retried alone: one bad or oversized job fails without taking the others along.
            self.backend.release_memory()
            if len(self._batch) == 1:
                self._fail_video(self._batch.pop().id, exc)
                return
            transfers, advanced, passes = {}, [], len(self._batch)
            for run in list(self._batch):
                try:
                    model.denoise_step([run.state])
                    advanced.append(run)
                except Exception as single_exc:  # noqa: BLE001
                    self.backend.release_memory()
                    self._batch.remove(run)
                    self._fail_video(run.id, single_exc)
        if not advanced:
            return
        elapsed = time.perf_counter() - start
        self._metrics.passes.inc(passes)
        self._metrics.steps.inc(len(advanced))
        self._metrics.step_seconds.observe(elapsed)
        self._metrics.batch_size.observe(len(advanced))
        self._metrics.h2d_bytes.inc(transfers.get("h2d_bytes", 0))
        self._metrics.d2h_bytes.inc(transfers.get("d2h_bytes", 0))
        self.store.set_video_progress(
            [
                (r.id, r.state.step, DENOISE_SHARE * r.state.step // r.state.num_steps)
                for r in advanced
            ]
        )
        for run in [r for r in self._batch if r.state.done]:
            self._batch.remove(run)
            self._finish_video(model, run)

    def _finish_video(self, model: VideoModel, run: _Running) -> None:
        try:
            frames = model.finish(
                run.state
            )  # decoding needs the device, so it stays on this thread
        except Exception as exc:  # noqa: BLE001
            self.backend.release_memory()
            self._fail_video(run.id, exc)
            return
        self.store.set_video_progress([(run.id, run.state.step, DECODED_PROGRESS)])
        self._encoder.submit(self._encode, run, frames)

    def _encode(self, run: _Running, frames) -> None:
        """On the encoder thread: write the MP4 and thumbnail, then mark the job completed."""
        mp4, png = self.data.video(run.id)
        try:
            self.backend.save_video(frames, run.video.fps, mp4, png)
        except Exception as exc:  # noqa: BLE001
            self._fail_video(run.id, exc)
            return
        expires_at = now() + self.settings.video_ttl_s
        if self.store.finish_video(run.id, "completed", expires_at=expires_at):
            self._metrics.video_seconds.observe(time.perf_counter() - run.started)
            self._metrics.jobs_finished.inc(kind="video", status="completed")
        else:  # cancelled while it was being encoded: nobody will fetch the file
            self._metrics.jobs_finished.inc(kind="video", status="cancelled")
            for path in (mp4, png):
                path.unlink(missing_ok=True)

    def _fail_video(self, video_id: str, exc: BaseException) -> None:
        log.warning("video %s failed: %s: %s", video_id, type(exc).__name__, exc)
        code = self.backend.error_code(exc) or "generation_failed"
        self.store.finish_video(video_id, "failed", error=(code, _message(exc)))
        self._metrics.jobs_finished.inc(kind="video", status="failed")

    # --- fine-tunes --------------------------------------------------------------------------

    def _step_finetune(self) -> bool:
        if self._tuning is None:
            row = self.store.next_finetune()
            if row is None:
                return False
            self._start_finetune(row)
            return True
        t = self._tuning
        if t.paused:
            t.paused = False
            self.store.add_event(t.id, f"Resumed at step {t.trainer.step}")
        try:
            # A run resumed from its final checkpoint has no step left to take.
            if t.trainer.step < t.trainer.total_steps:
                metrics = _plain(t.trainer.train_step())
                self._metrics.train_steps.inc()
                self._metrics.h2d_bytes.inc(metrics.get("h2d_bytes") or 0)
                self._metrics.d2h_bytes.inc(metrics.get("d2h_bytes") or 0)
                total = t.trainer.total_steps
                self.store.finetune_progress(
                    t.id, t.trainer.step, total, {**metrics, "total_steps": total}
                )
                self._record_checkpoints(t, metrics)
            if t.trainer.step >= t.trainer.total_steps:
                name = f"ft:{t.parent}:{t.suffix}:{t.id.removeprefix('ftjob-')}"
                path = t.trainer.export(self.data.fine_tuned_model(t.id))
                self._end_finetune(
                    "succeeded", model={"name": name, "parent": t.parent, "path": str(path)}
                )
        except Exception as exc:  # noqa: BLE001 - the job fails; videos and later jobs go on
            self.backend.release_memory()
            self._end_finetune(
                "failed", error=(self.backend.error_code(exc) or "training_failed", _message(exc))
            )
        return True

    def _start_finetune(self, row: dict) -> None:
        attempt = self.store.start_finetune(row["id"])
        if attempt is None:
            return
        hyper = json.loads(row["hyperparameters"])
        try:
            base = self.model(row["model"])
            if base is None:
                raise ValueError(f"model {row['model']!r} is no longer served")
            file_row = self.store.get_file(row["training_file"])
            if file_row is None:
                raise ValueError(f"training file {row['training_file']} was deleted")
            job = FinetuneJob(
                base=base,
                data_dir=Path(file_row["path"]),
                output_dir=Path(row["output_dir"]),
                epochs=hyper["n_epochs"],
                batch_size=hyper["batch_size"],
                learning_rate=self.settings.finetune_lr * hyper["learning_rate_multiplier"],
                seed=row["seed"],
                save_every=self.settings.finetune_save_every,
                resume=attempt > 1,
                num_frames=hyper.get("num_frames"),
                width=hyper.get("width"),
                height=hyper.get("height"),
                expert=hyper.get("expert"),
            )
            trainer = self.backend.trainer(job)
        except Exception as exc:  # noqa: BLE001
            code = self.backend.error_code(exc) or "training_failed"
            self.store.finish_finetune(row["id"], "failed", error=(code, _message(exc)))
            self._metrics.jobs_finished.inc(kind="fine_tune", status="failed")
            return
        self._tuning = _Tuning(
            row["id"], trainer, row["model"], row["suffix"] or "", Path(row["output_dir"])
        )
        self._record_checkpoints(self._tuning)  # those of an earlier attempt, without events
        verb = f"Resumed at step {trainer.step}" if attempt > 1 else "Fine-tuning job started"
        self.store.add_event(row["id"], f"{verb} ({trainer.total_steps} steps)")
        self.store.finetune_progress(row["id"], trainer.step, trainer.total_steps, None)

    def _record_checkpoints(self, t: _Tuning, metrics: dict | None = None) -> None:
        """Store checkpoints the trainer wrote since the last look (with the metrics of their step)."""
        for ckpt in t.trainer.checkpoints():
            path = str(ckpt["path"])
            if path in t.known_checkpoints:
                continue
            t.known_checkpoints.add(path)
            summary = {"step": ckpt["step"]}
            if metrics is not None and metrics.get("step") == ckpt["step"]:
                summary.update(loss=metrics.get("loss"), lr=metrics.get("lr"))
            self.store.add_checkpoint(
                f"ftckpt-{t.id.removeprefix('ftjob-')}-{ckpt['step']}",
                t.id,
                ckpt["step"],
                path,
                summary,
            )
            if metrics is not None:
                self.store.add_event(t.id, f"Checkpoint saved at step {ckpt['step']}")

    def _end_finetune(self, status: str, error=None, model: dict | None = None) -> None:
        """Close the trainer and record the outcome; a success registers its model in the same write."""
        t, self._tuning = self._tuning, None
        try:
            t.trainer.close()
        finally:
            self.store.finish_finetune(t.id, status, error=error, model=model)
            self._metrics.jobs_finished.inc(kind="fine_tune", status=status)


def _message(exc: BaseException) -> str:
    text = str(exc).strip() or "no message"
    return f"{type(exc).__name__}: {text}"


def _plain(metrics: dict) -> dict:
    """Trainer metrics as JSON-safe numbers (tensors and numpy scalars become floats)."""
    out = {}
    for k, v in metrics.items():
        out[k] = v if isinstance(v, (int, str)) or v is None else float(v)
    return out
