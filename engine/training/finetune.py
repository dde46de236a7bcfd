"""Adaptation mode: full-parameter fine-tuning of a video DiT on a directory of captioned clips.

`open_trainer(source, data, spec)` opens a run (`FinetuneSpec`: finetune_spec.py); the `Trainer`
owns it: it validates the dataset (and plans its aspect and length buckets, buckets.py) before
the first step, opens the model through the loader
(in its masters' dtype: fp32, or bf16 for a bf16 master state format; streamed or resident),
streams decoded clips from a background loader, runs
`BlockwiseStep` (see blockwise.py), appends one JSON line of metrics per step to
`<output>/metrics.jsonl`, and writes checkpoints atomically:

    <output>/checkpoints/step-000050/
        model/            master weights as stored (fp32, or bf16), a servable model directory
        optimizer.pt      AdamW's state in its format (m, v, step counts; a bf16-split master's
                          low halves), and the seed of a bf16-sr master's rounding
        state.pt          step, data-loader position and RNG state
    <output>/validation/step-000050/   with `spec.validation.prompts`: the videos sampled from
                          that checkpoint (validation.py)
    <output>/model/       the final export (`export()`), in the same servable format
                          (several experts trained in one run, experts.py: model/ holds them
                          all and optimizer.pt each one's state)
    <output>/optimizer-state/   with `optimizer.state_tier="disk"`: the optimizer's working
                          state files (optim_disk.py); optimizer.pt holds their copy, so a
                          killed run's half-written files are simply overwritten on resume

Resuming from a checkpoint continues exactly: a run killed after step k and resumed ends with
bitwise the weights of an uninterrupted run (same machine, CPU), because the masters, the moments,
the noise generator and the data position are all restored, in every optimizer state format. The
export holds the masters' fp32 values (a bf16-split master's halves joined: the fp32 master).

A run over several devices (`runtime.devices`) is launched by parallel/data_parallel.py: a
`Trainer` per rank, each given its `DataParallel` place (group.py); rank 0 alone holds the
optimizer and writes metrics, checkpoints and exports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..atomic import atomic_directory, remove_stale
from ..family import TrainingShape, family
from ..interfaces import TrainingRun
from ..loader import as_source, open_model
from ..sources import ModelInfo, ModelSource, describe
from .blockwise import BlockwiseStep, StepConfig, master_dtype
from .experts import ExpertSteps
from .finetune_spec import FinetuneSpec
from .group import OneProcess, TrainingGroup
from .validation import (
    VALIDATION,
    held_out_loss,
    read_validation,
    sample_validation,
    validation_dir,
)

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
STATE_DIR = "optimizer-state"  # the disk tier's optimizer state files (OptimizerSpec.state_tier)


def learning_rate(spec: FinetuneSpec, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based) of `total_steps`: a pure function of
    the step, so a resumed run follows the same schedule."""
    lr, schedule = spec.optimizer.lr, spec.schedule
    if step < schedule.warmup_steps:
        return lr * (step + 1) / schedule.warmup_steps
    if schedule.lr_schedule == "constant":
        return lr
    decay = max(1, total_steps - schedule.warmup_steps)
    progress = min(1.0, (step - schedule.warmup_steps) / decay)
    return lr * 0.5 * (1 + math.cos(math.pi * progress))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def list_checkpoints(output: str | os.PathLike) -> list[dict]:
    """Complete checkpoints of a run, oldest first: `{"step", "path", "created_at"}`."""
    root = Path(output) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith("step-") and (d / "state.pt").is_file():
            found.append(
                {"step": int(d.name[5:]), "path": str(d), "created_at": int(d.stat().st_mtime)}
            )
    for checkpoint in found:
        validation = read_validation(Path(output), checkpoint["step"])
        if validation is not None:
            checkpoint["validation_loss"] = validation["validation_loss"]
            checkpoint["validation"] = validation["videos"]
    return sorted(found, key=lambda c: c["step"])


def resumed_in_buckets(output: Path) -> bool | None:
    """Whether the run at `output` trained its clips in buckets, by its newest checkpoint's data
    position (a bucket plan's counts batches); None without a checkpoint. A resumed run left to
    choose keeps how it started, a run started before buckets existed included."""
    checkpoints = list_checkpoints(output)
    if not checkpoints:
        return None
    state = torch.load(Path(checkpoints[-1]["path"]) / "state.pt", weights_only=True)
    return "plan" in state["loader"]


def trained_model(
    source: ModelSource, spec: FinetuneSpec, resume: bool
) -> tuple[ModelInfo, Path | None]:
    """The model a run trains and the checkpoint it resumes from: the newest checkpoint's model
    when resuming from one, else `source` (with the run's attention backend)."""
    overrides = {"attention": spec.run.attention} if spec.run.attention else {}
    checkpoints = list_checkpoints(spec.run.output) if resume else []
    if not checkpoints:
        return describe(source, **overrides), None
    latest = Path(checkpoints[-1]["path"])
    # A checkpoint's masters and optimizer state are in its run's format: refused now, before
    # a model is opened in another dtype.
    saved = torch.load(latest / "state.pt", weights_only=True)["spec"]
    state = saved.get("optimizer", {}).get("state", "fp32")
    if state != spec.optimizer.state:
        raise ValueError(
            f"{latest} holds optimizer state {state!r}, the run asks for "
            f"{spec.optimizer.state!r}: resume with the format it was trained in"
        )
    # Its optimizer state is that of the experts it trained (None and "both": the same ones).
    expert = saved.get("run", {}).get("expert")
    if (expert or "both") != (spec.run.expert or "both"):
        raise ValueError(
            f"{latest} trained expert {expert or 'both'}, the run asks for "
            f"{spec.run.expert or 'both'}: resume with the experts it was trained with"
        )
    base = describe(source, **overrides)
    source = ModelSource("directory", base.name, path=latest / "model")
    return describe(source, **overrides), latest


def open_trainer(
    source: ModelSource | str | Path | None,
    data: str | os.PathLike,
    spec: FinetuneSpec,
    *,
    resume: bool = False,
) -> Trainer:
    """A fine-tuning run of the model at `source` (as for `open_pipeline`) on the dataset at
    `data`; with `resume`, it continues from the newest checkpoint in `spec.run.output`. A spec
    with `runtime.devices` runs through `data_parallel.finetune_on_devices` instead."""
    if spec.runtime.devices:
        raise ValueError("runtime.devices runs one process per device: finetune_on_devices")
    return Trainer(as_source(source), data, spec, resume=resume)


class Trainer(TrainingRun):
    """A fine-tuning run, one optimizer step per `train_step()`; with `group`, one process's part
    of a run several train together (a `DataParallel` rank's: its model opened from the group's
    shared master)."""

    def __init__(
        self,
        source: ModelSource,
        data: str | os.PathLike,
        spec: FinetuneSpec,
        *,
        resume: bool,
        group: TrainingGroup | None = None,
    ):
        spec.validate()
        group = OneProcess() if group is None else group
        self.spec, self.group, self.owner = spec, group, group.owner
        run, clips, runtime = spec.run, spec.clips, spec.runtime
        self.output = Path(run.output)
        overrides = {"attention": run.attention} if run.attention else {}
        info = describe(source, **overrides)
        s = info.sampling
        self.frames, self.height, self.width = (
            clips.frames or s.frames,
            clips.height or s.height,
            clips.width or s.width,
        )
        info.limits.check_clip(self.frames, self.width, self.height)
        self.family = family(info.family)
        self.output.mkdir(parents=True, exist_ok=True)
        if self.owner:
            remove_stale(self.output / CHECKPOINTS)  # what a killed run left half-written
            remove_stale(self.output / VALIDATION)
        buckets = clips.buckets
        if buckets is None and (clips.width or clips.height):
            buckets = False  # a size asked for is one size for every clip, unless buckets are too
        if buckets is None and resume:
            buckets = resumed_in_buckets(self.output)
        shape = TrainingShape(
            frames=self.frames,
            width=self.width,
            height=self.height,
            batch_size=clips.batch_size,
            seed=run.seed,
            cache_mb=runtime.cache_mb,
            device=runtime.device,
            buckets=buckets,
            token_budget=clips.token_budget,
            held_out=spec.validation.split,
        )
        # The dataset is checked (and, for a family with frozen encoders, encoded) before anything
        # else happens: a bad file fails the run now. Rank 0 first: the other ranks then find the
        # encoded dataset in the run instead of encoding it again, at the same time, in one place.
        with group.owner_first():
            self.data = self.family.training_data(info, Path(data), self.output, shape)
        self.loader = self.data.loader
        # The clips' aspect and length buckets, checked (None: one size); `plan.lines()` is what
        # a front end prints before the first step.
        self.plan = self.data.plan
        steps, epochs = spec.schedule.length
        per_step = clips.batch_size * spec.optimizer.grad_accum
        per_epoch = self.loader.samples_per_epoch
        self.total_steps = steps or max(1, math.ceil(epochs * per_epoch / per_step))
        self.generator = torch.Generator().manual_seed(run.seed)
        self.step = 0
        # The context checkpoints and exports are published in (renamed into place): a server
        # holds its claim's lock there and raises once the run is no longer its own, so a run
        # presumed dead cannot overwrite the checkpoints of the one that took over.
        self.fence: Callable[[], contextlib.AbstractContextManager] | None = None

        info, latest = trained_model(source, spec, resume)
        self.info = info
        self.base = source  # what exports are deltas over (`info` may be a checkpoint's)
        self.blockwise = self._open_step(info)
        if latest is not None:
            self._restore(latest)
        elif self.owner:
            (self.output / METRICS).write_text("")  # a fresh run: no metrics from an earlier one
        self._metrics = open(self.output / METRICS, "a") if self.owner else None

    def _open_step(self, info: ModelInfo) -> BlockwiseStep | ExpertSteps:
        """The model `info` describes, opened in its masters' dtype where the placement says
        (from the group's shared master, in a group that shares one), and the blockwise step that
        trains it (several experts: a step each, experts.py). A bf16 master computes under bf16
        autocast on every device."""
        spec, runtime = self.spec, self.spec.runtime
        dtype = master_dtype(spec.optimizer)
        parts, handles = open_model(
            info,
            runtime.placement.on(runtime.device),
            dtype=dtype,
            only=self.family.training_components(info, spec.run.expert),
            shared=self.group.shared,
            keep_fp32=dtype == torch.float32,  # every trained tensor is a master of one dtype
        )
        for module in parts.values():
            module.train()
        models = self.family.training_models(info, parts, spec.run.expert)
        cuda = torch.device(runtime.device).type == "cuda"
        optimizer = spec.optimizer
        if optimizer.state_tier == "disk" and optimizer.state_dir is None:
            # The state's working files (a checkpoint holds a copy, optimizer.pt): the run's.
            optimizer = dataclasses.replace(optimizer, state_dir=str(self.output / STATE_DIR))
        step_config = StepConfig(
            optimizer=optimizer,
            offload=runtime.offload,
            autocast=torch.bfloat16 if cuda or dtype == torch.bfloat16 else None,
            timing=runtime.timing,
            time_sampling=spec.clips.time_sampling,
            seed=spec.run.seed,
        )

        def step(label: str, model) -> BlockwiseStep:
            config = step_config
            if label and optimizer.state_dir is not None:  # an expert's state files: its own
                expert = dataclasses.replace(optimizer, state_dir=f"{optimizer.state_dir}/{label}")
                config = dataclasses.replace(step_config, optimizer=expert)
            handle = handles.get(model.blocks_owner)
            return BlockwiseStep(model, runtime.device, config, handle, self.group)

        if len(models) == 1:
            return step("", *models.values())
        return ExpertSteps({k: step(k, m) for k, m in models.items()}, spec.clips.time_sampling)

    def clip_plan(self) -> str | None:
        return None if self.plan is None else self.plan.summary()

    # -- training ---------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """At the end of the schedule, or at the step this part of the run stops at."""
        until = self.spec.schedule.until
        return self.step >= min(self.total_steps, until or self.total_steps)

    def train_step(self) -> dict:
        """One optimizer step (`grad_accum` micro-batches); checkpoints every `save_every` steps."""
        start = time.perf_counter()
        h2d0, d2h0 = self.blockwise.h2d_bytes, self.blockwise.d2h_bytes
        losses, norm, experts = [], 0.0, {}
        lr = learning_rate(self.spec, self.step, self.total_steps)
        if self.blockwise.optimizer is not None:
            self.blockwise.optimizer.lr = lr
        for _ in range(self.spec.optimizer.grad_accum):
            batch = next(self.loader)
            # Dropped captions teach the model the unconditional velocity guidance extrapolates from.
            dropout = self.spec.clips.caption_dropout
            drop = torch.rand(len(batch.text), generator=self.generator) < dropout
            # Every process of a group draws for the whole batch (the same numbers), then keeps
            # its rows.
            rows = self.group.rows(len(batch.text))
            batch = dataclasses.replace(
                batch, video=batch.video[rows], text=batch.text[rows], indices=batch.indices[rows]
            )
            drop = drop[rows]
            condition = self.data.condition(batch, drop.tolist())
            out = self.blockwise.micro_step(self.data.x0(batch), condition, self.generator)
            losses.append(out["loss"])
            norm = out["grad_norm"]
            for key in [k for k in out if k.startswith("loss_")]:  # several experts: each one's
                experts.setdefault(key, []).append(out[key])
        self.step += 1
        metrics = {
            "step": self.step,
            "loss": sum(losses) / len(losses),
            # Several experts: each one's loss over its rows (None: no row's time was its own).
            **{k: _mean([x for x in v if x is not None]) for k, v in experts.items()},
            "lr": lr,
            "grad_norm": norm,
            "step_time_s": time.perf_counter() - start,
            "h2d_bytes": self.blockwise.h2d_bytes - h2d0,
            "d2h_bytes": self.blockwise.d2h_bytes - d2h0,
            "epoch": self.loader.state_dict()["epoch"],
            "time": time.time(),
        }
        if not self.owner:
            return metrics  # rank 0's are the run's: the whole batch's loss and gradient norm
        checkpoint = self.step % self.spec.run.save_every == 0
        loss = self.validation_loss() if checkpoint else None
        if loss is not None:
            metrics["validation_loss"] = loss
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()
        if checkpoint:
            self.validate(self.save_checkpoint(), loss)
        return metrics

    def run(self, progress=None) -> dict | None:
        """Train to the end; `progress(metrics)` after every step. Returns the last metrics."""
        metrics = None
        while not self.done:
            metrics = self.train_step()
            if progress is not None:
                progress(metrics)
        return metrics

    # -- checkpoints -------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write `checkpoints/step-N` atomically: the model, the optimizer's state and the run's
        position (step, data order, noise generator), all or nothing."""
        if not self.owner:
            raise RuntimeError("rank 0 of a data-parallel run writes its checkpoints")
        final = self.output / CHECKPOINTS / f"step-{self.step:06d}"
        with atomic_directory(final, guard=self.fence) as tmp:
            self._save_model(tmp / "model")
            torch.save(self.blockwise.optimizer.state_dict(), tmp / "optimizer.pt")
            state = {
                "step": self.step,
                "loader": self.loader.state_dict(),
                "generator": self.generator.get_state(),
                "spec": self.spec.to_dict(),
            }
            torch.save(state, tmp / "state.pt")
        return final

    def checkpoints(self) -> list[dict]:
        return list_checkpoints(self.output)

    def validation_loss(self) -> float | None:
        """The loss on the held-out clips (`validation.split`) with the weights as they stand."""
        return held_out_loss(self.blockwise, self.data, self.spec.run.seed)

    def validate(self, checkpoint: Path, loss: float | None) -> dict | None:
        """Sample the validation prompts from `checkpoint`'s weights, beside it (validation.py);
        None without prompts or a held-out loss."""
        validation = self.spec.validation
        if not validation.prompts and loss is None:
            return None
        runtime = self.spec.runtime
        return sample_validation(
            self.info,
            checkpoint / "model",
            runtime.placement.on(runtime.device),
            validation.prompts,
            validation_dir(self.output, self.step),
            step=self.step,
            loss=loss,
            fence=self.fence,
            **({"attention": self.spec.run.attention} if self.spec.run.attention else {}),
        )

    def _restore(self, path: Path) -> None:
        if self.blockwise.optimizer is not None:
            self.blockwise.optimizer.load_state_dict(
                # Mapped, not read: the state is copied into the optimizer's own tensors (or its
                # disk tier's files) a tensor at a time, so RAM never holds a second copy of it.
                torch.load(path / "optimizer.pt", weights_only=True, mmap=True)
            )
        state = torch.load(path / "state.pt", weights_only=True)
        self.step = int(state["step"])
        self.loader.load_state_dict(state["loader"])
        self.generator.set_state(state["generator"])
        if not self.owner:
            return
        # Metrics past the checkpoint belong to the lost part of the killed run.
        metrics = self.output / METRICS
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= self.step]
        metrics.write_text("".join(line + "\n" for line in kept))

    def _save_model(self, path: Path, values: bool = False) -> None:
        """The masters as stored (a checkpoint: with optimizer.pt, exactly the run's state), or
        with `values` their fp32 values (an export)."""
        states = self.blockwise.state_dicts(values=values)
        self.family.save_trained(self.info, states, path)

    def export(self, path: str | os.PathLike | None = None) -> Path:
        """Write the current weights as a servable model directory (default `<output>/model`),
        atomically: a server may pick it up the moment it appears."""
        if not self.owner:
            raise RuntimeError("rank 0 of a data-parallel run writes its exports")
        path = Path(path) if path is not None else self.output / "model"
        with atomic_directory(path, guard=self.fence) as tmp:
            self._save_model(tmp, values=True)
        self.export_delta(path)
        return path

    def export_delta(self, path: Path) -> Path | None:
        """Beside the export at `path`, its lossless delta over the base in bf16 (deltas.py: what
        a GPU serves it as, for a fraction of a copy's bytes); None when the base is a preset
        (no files to be a delta over) or the run changed its architecture (3D-DSA)."""
        from ..deltas import DeltaError, write_delta

        base = describe(self.base)
        if base.source.kind != "directory":
            return None
        tuned = describe(ModelSource("directory", base.name, path=Path(path)))
        try:
            return write_delta(tuned, base, torch.bfloat16)[0]
        except DeltaError:
            return None  # served whole, as before

    def close(self) -> None:
        self.data.close()
        self.blockwise.close()
        if self._metrics is not None:
            self._metrics.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
