"""The one interface between the HTTP layer and the engine (after vLLM's `EngineClient`).

Routers see only `EngineClient`, `ModelCard` and `VideoSpec`: plain Python, no torch. Work reaches
the engine through the job store (request -> store -> worker), so this interface is small: which
models exist, whether a request fits a model, and a nudge that the store has new work.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .metrics import Registry
    from .store import JobStore


def _utf8_bytes(prompt: str) -> int:
    return len(prompt.encode("utf-8"))


@dataclass(frozen=True)
class ModelCard:
    """A servable model: its name, where it comes from, its sampling defaults and its limits."""

    name: str
    kind: str  # "preset" | "model" | "fine-tune"
    created: int
    source: str  # preset name, or model directory
    # Sampling defaults (what a request gets for an absent field).
    frames: int
    height: int
    width: int
    fps: int
    steps: int
    guidance: float
    # Limits a request is validated against before it is queued.
    max_frames: int
    max_size: int
    patch: tuple[int, int, int]  # (frames, height, width) multiples
    max_prompt_tokens: int  # in the model's own tokens, BOS and EOS not counted
    # The model's token count of a prompt, and its unit (the engine's count for a real model).
    prompt_tokens: Callable[[str], int] = _utf8_bytes
    prompt_unit: str = "bytes (UTF-8)"
    parent: str | None = None  # the base model of a fine-tune

    def replace(self, **changes) -> ModelCard:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class VideoSpec:
    """A fully resolved video request: every default filled in, every limit checked."""

    model: str
    prompt: str
    negative_prompt: str
    frames: int
    width: int
    height: int
    fps: int
    steps: int
    guidance: float
    seed: int
    priority: int = 0

    @property
    def batch_key(self) -> tuple:
        """Jobs with equal keys share one denoising pass: same weights, latent shape and schedule."""
        return (self.model, self.frames, self.height, self.width, self.steps)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> VideoSpec:
        return cls(**d)


class EngineClient(ABC):
    """What the HTTP layer may ask of the engine."""

    @abstractmethod
    async def start(self, store: JobStore) -> None:
        """Begin serving `store`; returns at once while weights load in the background."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop at the next step boundary, requeue unfinished work, release the models."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """True once the served models are loaded."""

    @property
    @abstractmethod
    def dead(self) -> str | None:
        """Why the worker died, or None while it lives. A failed job does not kill it."""

    @property
    @abstractmethod
    def metrics(self) -> Registry:
        """Counters and histograms the worker keeps (step latency, H2D bytes, ...)."""

    @abstractmethod
    def models(self) -> list[ModelCard]:
        """Base models, then fine-tuned ones, in registration order."""

    def model(self, name: str) -> ModelCard | None:
        return next((m for m in self.models() if m.name == name), None)

    @abstractmethod
    def check_video(self, spec: VideoSpec) -> None:
        """Raise ValueError if the model cannot sample this shape (beyond the card's limits)."""

    @abstractmethod
    def check_dataset(self, root: Path) -> int:
        """Validate an unpacked training set; return its clip count or raise ValueError naming the member.

        May decode videos: call it off the event loop.
        """

    @abstractmethod
    def wake(self) -> None:
        """The store has new work or a cancellation: look now rather than at the next poll."""

    @abstractmethod
    def retry_after(self) -> int:
        """Seconds until a queue slot is likely to free, for 429 answers."""
