"""Adaptation mode: full-parameter fine-tuning of a video DiT on a directory of captioned clips.

`open_trainer(source, data, config)` opens a run; the `Trainer` owns it: it validates the dataset
before the first step, opens the model through the loader (fp32, streamed or resident), streams
decoded clips from a background loader, runs `BlockwiseStep` (see blockwise.py), appends one JSON
line of metrics per step to `<output>/metrics.jsonl`, and writes checkpoints atomically:

    <output>/checkpoints/step-000050/
        model/            fp32 master weights, a servable model directory
        optimizer.pt      AdamW m, v and step counts of every block
        state.pt          step, data-loader position and RNG state
    <output>/model/       the final export (`export()`), in the same servable format

Resuming from a checkpoint continues exactly: a run killed after step k and resumed ends with
bitwise the weights of an uninterrupted run (same machine, CPU), because the masters, the moments,
the noise generator and the data position are all restored.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .atomic import atomic_directory, remove_stale
from .blockwise import BlockwiseStep, StepConfig, master_state_dicts
from .family import TrainingShape, family
from .loader import as_source, open_model
from .sources import ModelSource, describe

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class FinetuneConfig:
    """How a fine-tuning run trains: `steps` or `epochs`, the optimizer, the clips, the device.

    The model it starts from and the data it reads are arguments of `open_trainer`.
    """

    output: str
    steps: int | None = None
    epochs: float | None = None
    lr: float = 1e-4
    batch_size: int = 1
    grad_accum: int = 1
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    save_every: int = 50
    seed: int = 0
    device: str = "cpu"
    offload: str = "none"
    frames: int | None = None  # training clip shape (default: the model's sampling default)
    height: int | None = None
    width: int | None = None
    attention: str | None = None  # train with this self-attention backend (default: the model's)
    timing: bool = False  # streamer timings for stats and traces
    caption_dropout: float = (
        0.1  # fraction of captions replaced by "" so guidance has an unconditional model
    )
    time_sampling: str = "logit-normal"  # training flow times: flow.TIME_SAMPLING
    lr_schedule: str = "constant"  # LR_SCHEDULES; "cosine" decays to 0 at the run's last step
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr
    cache_mb: int = 1024  # decoded training clips kept in RAM (a small dataset is decoded once)
    until: int | None = None  # stop after this step of the schedule; a resumed run continues it
    expert: str | None = None  # a multi-expert model (Wan2.2-A14B): "high" or "low" noise

    def validate(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of steps and epochs")
        for name in (
            "steps",
            "batch_size",
            "grad_accum",
            "save_every",
            "frames",
            "height",
            "width",
            "until",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"epochs must be positive, got {self.epochs}")
        if not 0 <= self.caption_dropout < 1:
            raise ValueError(f"caption_dropout must be in [0, 1), got {self.caption_dropout}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.cache_mb < 0:
            raise ValueError(f"cache_mb must be >= 0, got {self.cache_mb}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.offload not in ("none", "stream"):
            raise ValueError(f"offload must be 'none' or 'stream', got {self.offload!r}")


def learning_rate(config: FinetuneConfig, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based) of `total_steps`: a pure function of
    the step, so a resumed run follows the same schedule."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    decay = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay)
    return config.lr * 0.5 * (1 + math.cos(math.pi * progress))


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
    return sorted(found, key=lambda c: c["step"])


def open_trainer(
    source: ModelSource | str | Path | None,
    data: str | os.PathLike,
    config: FinetuneConfig,
    *,
    resume: bool = False,
) -> Trainer:
    """A fine-tuning run of the model at `source` (as for `open_pipeline`) on the dataset at
    `data`; with `resume`, it continues from the newest checkpoint in `config.output`."""
    return Trainer(as_source(source), data, config, resume=resume)


class Trainer:
    """A fine-tuning run, one optimizer step per `train_step()`."""

    def __init__(
        self, source: ModelSource, data: str | os.PathLike, config: FinetuneConfig, *, resume: bool
    ):
        config.validate()
        self.config = config
        self.output = Path(config.output)
        overrides = {"attention": config.attention} if config.attention else {}
        info = describe(source, **overrides)
        s = info.sampling
        self.frames, self.height, self.width = (
            config.frames or s.frames,
            config.height or s.height,
            config.width or s.width,
        )
        info.limits.check_clip(self.frames, self.width, self.height)
        self.family = family(info.family)
        self.output.mkdir(parents=True, exist_ok=True)
        remove_stale(self.output / CHECKPOINTS)  # what a killed run left half-written
        shape = TrainingShape(
            frames=self.frames,
            width=self.width,
            height=self.height,
            batch_size=config.batch_size,
            seed=config.seed,
            cache_mb=config.cache_mb,
            device=config.device,
        )
        # The dataset is checked (and, for a family with frozen encoders, encoded) before anything
        # else happens: a bad file fails the run now.
        self.data = self.family.training_data(info, Path(data), self.output, shape)
        self.loader = self.data.loader
        per_step = config.batch_size * config.grad_accum
        self.total_steps = config.steps or max(
            1, math.ceil(config.epochs * len(self.data) / per_step)
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step = 0
        # The context checkpoints and exports are published in (renamed into place): a server
        # holds its claim's lock there and raises once the run is no longer its own, so a run
        # presumed dead cannot overwrite the checkpoints of the one that took over.
        self.fence: Callable[[], contextlib.AbstractContextManager] | None = None

        checkpoints = list_checkpoints(self.output) if resume else []
        if checkpoints:
            latest = Path(checkpoints[-1]["path"])
            source = ModelSource("directory", info.name, path=latest / "model")
            info = describe(source, **overrides)
        self.info = info
        parts, handles = open_model(
            info,
            device=config.device,
            dtype=torch.float32,
            offload=config.offload,
            timing=config.timing,
            only=self.family.training_components(info, config.expert),
        )
        for module in parts.values():
            module.train()
        model = self.family.training_model(info, parts, config.expert)
        cuda = torch.device(config.device).type == "cuda"
        step_config = StepConfig(
            lr=config.lr,
            weight_decay=config.weight_decay,
            grad_accum=config.grad_accum,
            max_grad_norm=config.max_grad_norm,
            offload=config.offload,
            autocast=torch.bfloat16 if cuda else None,
            timing=config.timing,
            time_sampling=config.time_sampling,
        )
        handle = handles.get(model.blocks_owner)
        self.blockwise = BlockwiseStep(model, config.device, step_config, handle)
        if checkpoints:
            self._restore(latest)
        else:
            (self.output / METRICS).write_text("")  # a fresh run: no metrics from an earlier one
        self._metrics = open(self.output / METRICS, "a")

    # -- training ---------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """At the end of the schedule, or at the step this part of the run stops at."""
        return self.step >= min(self.total_steps, self.config.until or self.total_steps)

    def train_step(self) -> dict:
        """One optimizer step (`grad_accum` micro-batches); checkpoints every `save_every` steps."""
        start = time.perf_counter()
        h2d0, d2h0 = self.blockwise.h2d_bytes, self.blockwise.d2h_bytes
        losses, norm = [], 0.0
        self.blockwise.optimizer.lr = learning_rate(self.config, self.step, self.total_steps)
        for _ in range(self.config.grad_accum):
            batch = next(self.loader)
            # Dropped captions teach the model the unconditional velocity guidance extrapolates from.
            drop = (
                torch.rand(len(batch.text), generator=self.generator) < self.config.caption_dropout
            )
            condition = self.data.condition(batch, drop.tolist())
            out = self.blockwise.micro_step(self.data.x0(batch), condition, self.generator)
            losses.append(out["loss"])
            norm = out["grad_norm"]
        self.step += 1
        metrics = {
            "step": self.step,
            "loss": sum(losses) / len(losses),
            "lr": self.blockwise.optimizer.lr,
            "grad_norm": norm,
            "step_time_s": time.perf_counter() - start,
            "h2d_bytes": self.blockwise.h2d_bytes - h2d0,
            "d2h_bytes": self.blockwise.d2h_bytes - d2h0,
            "epoch": self.loader.state_dict()["epoch"],
            "time": time.time(),
        }
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()
        if self.step % self.config.save_every == 0:
            self.save_checkpoint()
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
        final = self.output / CHECKPOINTS / f"step-{self.step:06d}"
        with atomic_directory(final, guard=self.fence) as tmp:
            self._save_model(tmp / "model")
            torch.save(self.blockwise.optimizer.state_dict(), tmp / "optimizer.pt")
            state = {
                "step": self.step,
                "loader": self.loader.state_dict(),
                "generator": self.generator.get_state(),
                "config": asdict(self.config),
            }
            torch.save(state, tmp / "state.pt")
        return final

    def checkpoints(self) -> list[dict]:
        return list_checkpoints(self.output)

    def _restore(self, path: Path) -> None:
        self.blockwise.optimizer.load_state_dict(
            torch.load(path / "optimizer.pt", weights_only=True)
        )
        state = torch.load(path / "state.pt", weights_only=True)
        self.step = int(state["step"])
        self.loader.load_state_dict(state["loader"])
        self.generator.set_state(state["generator"])
        # Metrics past the checkpoint belong to the lost part of the killed run.
        metrics = self.output / METRICS
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= self.step]
        metrics.write_text("".join(line + "\n" for line in kept))

    def _save_model(self, path: Path) -> None:
        self.family.save_trained(self.info, master_state_dicts(self.blockwise), path)

    def export(self, path: str | os.PathLike | None = None) -> Path:
        """Write the current weights as a servable model directory (default `<output>/model`),
        atomically: a server may pick it up the moment it appears."""
        path = Path(path) if path is not None else self.output / "model"
        with atomic_directory(path, guard=self.fence) as tmp:
            self._save_model(tmp)
        return path

    def close(self) -> None:
        self.data.close()
        self.blockwise.close()
        self._metrics.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
