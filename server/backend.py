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
