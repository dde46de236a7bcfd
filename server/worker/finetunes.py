"""Running fine-tuning jobs: one at a time per worker, one optimizer step per idle tick. A run
yields to videos at its next step boundary (paused, kept in memory) and continues where it stopped
once they are done; its checkpoints and exported model are published only while its claim holds."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from megaslide.engine.interfaces import TrainingRun

from ..backend import FinetuneJob, finetune_spec
from ..records import FineTuneRecord
from ..store import UNAVAILABLE, ClaimLost
from .context import WorkerContext, message
from .models import Models

log = logging.getLogger("megaslide.server")


@dataclass
class Tuning:
    """The fine-tune the worker is driving (kept in memory while it yields to videos)."""

    id: str
    token: str
    trainer: TrainingRun
    parent: str
    suffix: str
    paused: bool = False
    known_checkpoints: set = field(default_factory=set)


class FineTunes:
    """The fine-tune one worker drives, if any: claimed, stepped, paused, parked, ended."""

    def __init__(self, ctx: WorkerContext, models: Models):
        self.ctx, self.models = ctx, models
        self.tuning: Tuning | None = None

    def leases(self) -> list[str]:
        """The claim of the running fine-tune, if any (read from the heartbeat thread)."""
        tuning = self.tuning
        return [tuning.token] if tuning is not None else []

    def cancel_if_requested(self) -> None:
        """Checked at every tick, not only when it trains: a fine-tune paused for videos is
        cancelled at once."""
        if self.tuning is not None and self.ctx.store.fine_tunes.cancel_requested(self.tuning.id):
            self._end("cancelled")

    def pause(self) -> None:
        """Videos are waiting: the running fine-tune (if any) yields at this step boundary."""
        if self.tuning is not None and not self.tuning.paused:
            self.tuning.paused = True
            self._event("Paused at a step boundary: video jobs are waiting")

    def step(self) -> bool:
        """Claim a fine-tune if none runs, or take one optimizer step of the running one;
        False when there was nothing to do."""
        ctx = self.ctx
        if self.tuning is None:
            row = ctx.store.fine_tunes.claim(
                ctx.name, self.models.served(), lease_s=ctx.settings.lease_s
            )
            if row is None:
                return False
            self._start(row)
            return True
        t = self.tuning
        try:
            if t.paused:
                t.paused = False
                self._event(f"Resumed at step {t.trainer.step}")
            # A run resumed from its final checkpoint has no step left to take.
            if t.trainer.step < t.trainer.total_steps:
                metrics = _plain(t.trainer.train_step())
                ctx.metrics.train_steps.inc()
                ctx.metrics.h2d_bytes.inc(metrics.get("h2d_bytes") or 0)
                ctx.metrics.d2h_bytes.inc(metrics.get("d2h_bytes") or 0)
                ctx.publish_metrics()
                total = t.trainer.total_steps
                if not ctx.store.fine_tunes.set_progress(
                    t.id,
                    t.token,
                    t.trainer.step,
                    total,
                    {**metrics, "total_steps": total},
                    lease_s=ctx.settings.lease_s,
                ):
                    raise ClaimLost(t.id)
                self._record_checkpoints(t, metrics)
            if t.trainer.step >= t.trainer.total_steps:
                name = f"ft:{t.parent}:{t.suffix}:{t.id.removeprefix('ftjob-')}"
                path = t.trainer.export(ctx.data.fine_tuned_model(t.id))
                model = {"name": name, "parent": t.parent, "path": ctx.data.relative(path)}
                self._end("succeeded", model=model)
        except ClaimLost:
            log.warning("fine-tune %s: another worker holds it now; dropping it here", t.id)
            self.tuning = None
            t.trainer.close()
        except UNAVAILABLE:
            raise  # the store, not the job: the run loop retries
        except Exception as exc:  # noqa: BLE001 - the job fails; videos and later jobs go on
            ctx.backend.release_memory()
            code = ctx.backend.error_code(exc) or "training_failed"
            self._end("failed", error=(code, message(exc)))
            ctx.check_device(exc)
        return True

    def park(self) -> None:
        """Checkpoint the running fine-tune and put it back in the queue (the worker stops)."""
        if self.tuning is None:
            return
        ctx = self.ctx
        t, self.tuning = self.tuning, None
        try:
            path = t.trainer.save_checkpoint()
            self._record_checkpoints(t)
            reason = f"requeued: worker {ctx.name} stopped; will resume from {Path(path).name}"
        except Exception as exc:  # noqa: BLE001 - the last automatic checkpoint still stands
            reason = f"requeued: worker {ctx.name} stopped; checkpoint on stop failed ({exc})"
        t.trainer.close()
        try:
            ctx.store.fine_tunes.requeue(t.id, t.token, reason)
        except UNAVAILABLE:
            log.exception("could not requeue fine-tune %s; its lease will expire", t.id)

    def _event(self, text: str) -> None:
        t = self.tuning
        if not self.ctx.store.fine_tunes.add_event(t.id, text, token=t.token):
            raise ClaimLost(t.id)

    def _start(self, row: FineTuneRecord) -> None:
        ctx = self.ctx
        token, attempt = row.lease_token, row.attempts
        try:
            base = self.models.card(row.model)
            file = ctx.store.files.get(row.training_file)
            if file is None:
                raise ValueError(f"training file {row.training_file} was deleted")
            job = FinetuneJob(
                base=base,
                data_dir=ctx.data.resolve(file.path),
                spec=finetune_spec(
                    row.hyperparameters,
                    output=ctx.data.resolve(row.output_dir),
                    seed=row.seed,
                    settings=ctx.settings,
                ),
                resume=attempt > 1,
            )
            trainer = ctx.backend.trainer(job)
        except UNAVAILABLE:
            raise
        except Exception as exc:  # noqa: BLE001
            code = ctx.backend.error_code(exc) or "training_failed"
            failed = (code, message(exc))
            if ctx.store.fine_tunes.finish(row.id, token, "failed", error=failed):
                ctx.count_finished("fine_tune", "failed")
            ctx.check_device(exc)
            return
        # Checkpoints and the exported model are published only while this claim holds the job.
        trainer.fence = functools.partial(ctx.store.fine_tunes.fenced, row.id, token)
        t = Tuning(row.id, token, trainer, row.model, row.suffix or "")
        self.tuning = t
        try:
            self._record_checkpoints(t)  # those of an earlier attempt, without events
            if attempt > 1 and not ctx.store.fine_tunes.rewind(t.id, token, trainer.step):
                raise ClaimLost(t.id)
            verb = f"Resumed at step {trainer.step}" if attempt > 1 else "Fine-tuning job started"
            self._event(f"{verb} ({trainer.total_steps} steps)")
            plan = trainer.clip_plan()
            if plan is not None:
                self._event(f"Clips in aspect and length buckets: {plan}")
            if not ctx.store.fine_tunes.set_progress(
                t.id, token, trainer.step, trainer.total_steps, None, lease_s=ctx.settings.lease_s
            ):
                raise ClaimLost(t.id)
        except ClaimLost:
            self.tuning = None
            trainer.close()

    def _record_checkpoints(self, t: Tuning, metrics: dict | None = None) -> None:
        """Store checkpoints the trainer wrote since the last look (with the metrics of their
        step)."""
        ctx = self.ctx
        for ckpt in t.trainer.checkpoints():
            path = ctx.data.relative(ckpt["path"])
            if path in t.known_checkpoints:
                continue
            t.known_checkpoints.add(path)
            summary = {"step": ckpt["step"]}
            if metrics is not None and metrics.get("step") == ckpt["step"]:
                summary.update(loss=metrics.get("loss"), lr=metrics.get("lr"))
            if ckpt.get("validation_loss") is not None:
                summary["validation_loss"] = ckpt["validation_loss"]
            videos = self._validation_videos(t, ckpt)
            checkpoint_id = f"ftckpt-{t.id.removeprefix('ftjob-')}-{ckpt['step']}"
            if not ctx.store.fine_tunes.add_checkpoint(
                checkpoint_id, t.id, t.token, ckpt["step"], path, summary, videos
            ):
                raise ClaimLost(t.id)
            if metrics is not None:
                self._event(f"Checkpoint saved at step {ckpt['step']}")
                if videos:
                    made = sum(v["status"] == "succeeded" for v in videos)
                    step = ckpt["step"]
                    self._event(
                        f"Validation videos sampled at step {step}: {made} of {len(videos)}"
                    )

    def _validation_videos(self, t: Tuning, ckpt: dict) -> list[dict] | None:
        """The checkpoint's validation videos as the store keeps them (paths relative to the
        storage); a failed one is logged with its reason, and fails nothing else."""
        videos = ckpt.get("validation")
        if videos is None:
            return None
        kept = []
        for video in videos:
            video = dict(video)
            path = video.pop("path", None)
            video.pop("file", None)
            video["path"] = self.ctx.data.relative(path) if path else None
            if video["status"] == "failed":
                log.warning(
                    "fine-tune %s: validation video %d at step %d failed: %s",
                    t.id,
                    video["index"],
                    ckpt["step"],
                    video["error"],
                )
            kept.append(video)
        return kept

    def _end(self, status: str, error=None, model: dict | None = None) -> None:
        """Close the trainer and record the outcome; a success registers its model in the same
        write."""
        ctx = self.ctx
        t, self.tuning = self.tuning, None
        try:
            t.trainer.close()
        finally:
            recorded = ctx.retrying(
                ctx.store.fine_tunes.finish, t.id, t.token, status, error=error, model=model
            )
            if recorded:
                ctx.count_finished("fine_tune", status)


def _plain(metrics: dict) -> dict:
    """Trainer metrics as JSON-safe numbers (tensors and numpy scalars become floats)."""
    out = {}
    for k, v in metrics.items():
        out[k] = v if isinstance(v, (int, str)) or v is None else float(v)
    return out
