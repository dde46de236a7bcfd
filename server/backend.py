"""What the worker needs from the model side: a `Backend` that describes, loads and trains models.

The worker (the worker/ package) drives these interfaces and never imports torch; `TorchBackend`
(torch_backend.py) implements them on the engine, and the tests plug in a fake. What a backend
loads and opens are the engine's own contracts (engine/interfaces.py): a `VideoModel`, sampled a
step at a time, and a `TrainingRun`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from megaslide.engine.interfaces import TrainingRun, VideoModel
from megaslide.engine.training.finetune_spec import (
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    ScheduleSpec,
    ValidationPrompt,
    ValidationSpec,
)

from .protocol import ModelCard
from .settings import Settings


@dataclass(frozen=True)
class FinetuneJob:
    """A fine-tuning job resolved into what a training run needs: its spec's runtime section is
    the backend's to fill (device, offload)."""

    base: ModelCard
    data_dir: Path
    spec: FinetuneSpec
    resume: bool


def finetune_spec(hyper: dict, *, output: Path, seed: int, settings: Settings) -> FinetuneSpec:
    """A job's stored `hyperparameters` (the API's names, "auto" already resolved by the
    fine-tuning router) as a fine-tuning spec: the one place the API's names map onto it."""
    return FinetuneSpec(
        run=RunSpec(
            output=str(output),
            seed=seed,
            save_every=settings.finetune_save_every,
            expert=hyper.get("expert"),
        ),
        schedule=ScheduleSpec(epochs=hyper["n_epochs"]),
        optimizer=OptimizerSpec(
            lr=settings.finetune_lr * hyper["learning_rate_multiplier"],
            state=hyper.get("optimizer_state", OptimizerSpec.state),  # (jobs stored before it)
            state_tier=hyper.get("optimizer_state_tier", OptimizerSpec.state_tier),
        ),
        clips=ClipSpec(
            frames=hyper.get("num_frames"),
            width=hyper.get("width"),
            height=hyper.get("height"),
            batch_size=hyper["batch_size"],
            buckets=hyper.get("buckets"),
            token_budget=hyper.get("token_budget"),
        ),
        validation=ValidationSpec(
            prompts=tuple(ValidationPrompt(**p) for p in hyper.get("validation", ())),
            split=hyper.get("validation_split", 0),
        ),
    )


class Backend(ABC):
    """Describes, loads and trains models; the only code that touches the tensor library."""

    @property
    def device_name(self) -> str:
        """The device the models run on, as the worker registers it ("cuda:0", "cpu"; the
        devices a video is split over, comma-separated: "cuda:0,cuda:1")."""
        return "cpu"

    @property
    def takes_adapters(self) -> bool:
        """Whether the models served here take LoRA adapters at all: a worker whose backend
        does not leaves uploaded adapters to the others (and never refuses them for all)."""
        return True

    @abstractmethod
    def cards(self) -> list[ModelCard]:
        """The base models to serve, from their configs alone (cheap: no weights are read)."""

    @abstractmethod
    def fine_tuned_card(self, name: str, parent: ModelCard, path: Path) -> ModelCard: ...

    @abstractmethod
    def load(self, card: ModelCard) -> VideoModel: ...

    def add_fine_tune(self, model: VideoModel, card: ModelCard) -> bool:
        """Serve the fine-tune `card` from its base's loaded `model`, kept as a delta over it:
        True when `model` now takes requests for it (they name it in `fine_tune`), False when
        it must load whole instead (this backend, or that model, keeps no deltas; or the
        fine-tune cannot be one, which is logged)."""
        return False

    def add_adapter(self, card: ModelCard, model: VideoModel | None, name: str, path: Path) -> dict:
        """Convert and check the LoRA file at `path` for the base model `card` and register it
        under `name` (on `model` too when it is loaded); returns the adapter's card (name, rank,
        bytes, defaults). ValueError naming what does not fit."""
        raise ValueError(f"{card.name} takes no LoRA adapters here")

    def remove_adapter(self, card: ModelCard, model: VideoModel | None, name: str) -> None:
        """Unregister adapter `name` of base model `card` (from `model` too when it is loaded):
        its factors leave the device. No video being sampled applies it."""
        raise ValueError(f"{card.name} takes no LoRA adapters here")

    @abstractmethod
    def check_dataset(self, root: Path) -> int: ...

    @abstractmethod
    def trainer(self, job: FinetuneJob) -> TrainingRun: ...

    @abstractmethod
    def save_video(self, frames, fps: int, mp4_path: Path, thumbnail_path: Path) -> None:
        """Write the MP4 (atomically) and a PNG of its first frame."""

    def open_video(self, fps: int, mp4_path: Path, thumbnail_path: Path) -> VideoWriter:
        """A writer of one clip handed over a chunk of frames at a time, as its decoder makes
        them: `save_video` of their concatenation once closed. This default keeps the chunks
        and calls `save_video` in `close`; a backend that can encode as the chunks come (on a
        thread, while the next decodes) returns a writer that does."""
        return WholeClipWriter(self, fps, mp4_path, thumbnail_path)

    def error_code(self, exc: BaseException) -> str | None:
        """A specific error code for this exception (e.g. "out_of_memory"), or None for the
        generic one."""
        return None

    def release_memory(self) -> None:
        """Called after a job fails, before the next one runs (e.g. to empty the CUDA cache)."""
        return None

    def is_fatal(self, exc: BaseException) -> bool:
        """Whether an error inside a job left the device unusable for any other (a CUDA context
        poisoned by an illegal memory access, say): the worker then stops. Out of memory is not:
        that job fails and the next one runs."""
        return False


class VideoWriter(ABC):
    """One clip on its way to an MP4 and its thumbnail, fed a chunk of frames at a time.

    The worker calls `add` for each chunk in order, then `close` (perhaps from another thread,
    never both at once), or `abort` to give the clip up. Nothing is published at the MP4's path
    unless `close` returns: a writer that raised, or was aborted, leaves no MP4 (nor any
    temporary file)."""

    @abstractmethod
    def add(self, chunk) -> None:
        """The clip's next uint8 frames `(f, H, W, 3)`; may wait while the encoder catches up.
        Raises when the encoder has failed (the writer has stopped then: `close` raises too)."""

    @abstractmethod
    def close(self) -> None:
        """Finish the clip and publish the MP4 (atomically) and a PNG of its first frame, the
        PNG first, so that once the MP4 exists both do."""

    @abstractmethod
    def abort(self) -> None:
        """Give the clip up: stop encoding, publish nothing. Safe after `close` or a failure."""


class WholeClipWriter(VideoWriter):
    """`open_video` for a backend that writes whole clips only: the chunks are kept and
    written together by `save_video` in `close` (the clip's frames held whole, as before)."""

    def __init__(self, backend: Backend, fps: int, mp4_path: Path, thumbnail_path: Path):
        self.backend, self.fps = backend, fps
        self.mp4_path, self.thumbnail_path = mp4_path, thumbnail_path
        self.chunks: list = []

    def add(self, chunk) -> None:
        self.chunks.append(chunk)

    def close(self) -> None:
        import numpy as np

        if not self.chunks:
            raise ValueError("no frames to write")
        frames = self.chunks[0] if len(self.chunks) == 1 else np.concatenate(self.chunks)
        self.backend.save_video(frames, self.fps, self.mp4_path, self.thumbnail_path)

    def abort(self) -> None:
        self.chunks = []
