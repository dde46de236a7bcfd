"""The one interface between the HTTP layer and whatever runs the jobs (after vLLM's `EngineClient`).

Routers see only `WorkerClient` and `ModelCard`: plain Python, no torch. Work reaches the workers
through the job store (request -> store -> worker), so this interface is small: which models are
served, whether the workers live, their metrics, a dataset check, and a nudge that the store has
new work.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megaslide.engine.request import ModelLimits

if TYPE_CHECKING:
    from .metrics import Registry
    from .store import JobStore


@dataclass(frozen=True)
class ModelCard:
    """A servable model: its name, where it comes from, and its defaults and limits."""

    name: str
    kind: str  # "preset" | "model" | "fine-tune"
    created: int
    source: str  # preset name, or model directory
    limits: ModelLimits
    parent: str | None = None  # the base model of a fine-tune

    @property
    def inputs(self) -> tuple[str, ...]:
        """What a request may condition on: "text" (prompt, negative prompt), and "image" for a
        model that takes a first frame (`input_reference`). The playground shows fields from it."""
        return ("text", "image") if self.limits.image_input else ("text",)

    def replace(self, **changes) -> ModelCard:
        return dataclasses.replace(self, **changes)


class WorkerClient(ABC):
    """What the HTTP layer may ask of the workers that run its jobs."""

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
    def check_dataset(self, root: Path) -> int:
        """Validate an unpacked training set; return its clip count or raise ValueError naming
        the member. May decode videos: call it off the event loop."""

    @abstractmethod
    def wake(self) -> None:
        """The store has new work or a cancellation: look now rather than at the next poll."""

    @abstractmethod
    def retry_after(self) -> int:
        """Seconds until a queue slot is likely to free, for 429 answers."""
