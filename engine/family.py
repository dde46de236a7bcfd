"""A model family behind one small interface: what the loader, the streamer, the worker and the
optimizer need of a family, and nothing of its maths.

A family (MegaSlide's own DiT in native/family.py; more can follow) says how a described model
(`sources.ModelInfo`) is built as `Component`s on the meta device and where each component's
weights are, and how the placed components become a sampling `Pipeline`. The loader fills and
places the components (loader.py); everything family-neutral stays out of the family.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .training.shape import TrainingShape as TrainingShape  # where the families read it

if TYPE_CHECKING:
    from .lora import Adapter
    from .sampling.pipeline import Pipeline
    from .sources import ModelInfo
    from .streaming.streamer import StreamHandle
    from .training.model import TrainingData, TrainingModel


@dataclass(eq=False)  # compared by identity: `weights` may be a lazy mapping of a whole file
class Component:
    """One module of a model as the loader sees it.

    `module` is built on the meta device (tensors it computes rather than stores, such as rotary
    tables, may be real already); `blocks` (submodules of it, in the order they run) are what
    streaming moves; `weights` maps the module's own state-dict names to tensors, read lazily
    (`host_store.SafetensorsFile`; None: a preset's random initial weights). Floating tensors take
    the compute dtype, or `dtype` when the component fixes its own (a VAE in fp32); tensors under a
    submodule named in `keep_fp32` stay fp32 (diffusers' `_keep_in_fp32_modules`).
    """

    name: str
    module: nn.Module
    blocks: Sequence[nn.Module] | None = None
    weights: Mapping[str, torch.Tensor] | None = None
    dtype: torch.dtype | None = None
    keep_fp32: tuple[str, ...] = ()


class Family(ABC):
    """How one model family is built and sampled."""

    name: str
    # Components that decode finished clips: a fine-tune kept as a delta over its base
    # (deltas.py) may not change them, since clips of several fine-tunes decode together.
    decoders: tuple[str, ...] = ()

    @abstractmethod
    def components(self, info: ModelInfo) -> list[Component]:
        """The model's modules built on the meta device, in construction order (a preset's random
        weights are drawn in this order), with the files their weights come from."""

    @abstractmethod
    def pipeline(
        self,
        info: ModelInfo,
        parts: dict[str, nn.Module],
        handles: dict[str, StreamHandle],
        *,
        batched: bool = True,
    ) -> Pipeline:
        """A sampling pipeline over the placed modules (`handles`: the streamed ones). `batched`
        runs every request of a step, both halves of each guidance pair, in one forward pass;
        False runs each row alone (a reference mode, as a one-request-at-a-time sampler does)."""

    # -- LoRA adapters ------------------------------------------------------------------------------

    def adaptable(self, denoiser: nn.Module) -> dict[str, nn.Linear]:
        """The layers of a denoiser a LoRA adapter may change, by qualified name (none: this
        family takes no adapters)."""
        return {}

    def adapter_targets(self, info: ModelInfo) -> list[dict[str, nn.Linear]]:
        """The adaptable layers of each denoiser, built on the meta device (no weights read), for
        checking an adapter against a model before it opens."""
        return []

    def load_adapter(self, name: str, path: Path) -> Adapter:
        """A LoRA file converted to the canonical form (`lora.Adapter`), from whichever key layout
        this family's adapters are shared in; AdapterError naming the first key it cannot take."""
        from .lora import AdapterError

        raise AdapterError(f"{self.name} models take no LoRA adapters")

    # -- several devices ---------------------------------------------------------------------------

    def check_parallel(self, info: ModelInfo, frames: int, height: int, width: int, world: int):
        """ValueError naming the problem unless one clip of this shape (in pixels) can be split
        over `world` devices by sequence parallelism (`Pipeline.parallelize`)."""
        raise ValueError(f"{info.name}: sequence parallel is not built for {self.name} models")

    # -- fine-tuning ------------------------------------------------------------------------------

    def training_components(self, info: ModelInfo, expert: str | None) -> set[str] | None:
        """The components a fine-tuning run opens (None: all of them)."""
        return None

    @abstractmethod
    def training_model(
        self, info: ModelInfo, parts: dict[str, nn.Module], expert: str | None = None
    ) -> TrainingModel:
        """The opened model as the block-wise step trains it (`expert`: which denoiser of a
        multi-expert model)."""

    def training_models(
        self, info: ModelInfo, parts: dict[str, nn.Module], expert: str | None = None
    ) -> dict[str, TrainingModel]:
        """The models one run trains, by label: several experts of a multi-expert model, each on
        the flow times it owns (training/experts.py), or the one `training_model` ("")."""
        return {"": self.training_model(info, parts, expert)}

    @abstractmethod
    def training_data(
        self, info: ModelInfo, data: Path, run: Path, shape: TrainingShape
    ) -> TrainingData:
        """The dataset at `data`, validated and made ready for training (a family whose frozen
        encoders can be run ahead encodes it once into `run`)."""

    @abstractmethod
    def save_trained(self, info: ModelInfo, states: dict[str, dict], path: Path) -> None:
        """Write a servable model directory at `path` from the trained modules' states."""

    @abstractmethod
    def count_parameters(self, info: ModelInfo) -> dict[str, int]:
        """Exact parameter counts, built on the meta device: `total`, `per_block` (of one streamed
        denoiser block), `blocks` (denoiser blocks in all), `denoiser` (what one step runs),
        `text_encoder`."""

    def kept_across_steps(self, info: ModelInfo, rows: int, dtype_bytes: int) -> int:
        """Device bytes a sampling pass over `rows` rows keeps from one step to the next, at most
        (the planner counts them; none by default)."""
        return 0


# Families by the name `sources.describe` gives them, imported only when a model of theirs opens.
FAMILIES = {
    "megaslide": "megaslide.engine.native.family:MegaSlideFamily",
    "wan": "megaslide.engine.wan.family:WanFamily",
}


def family(name: str) -> Family:
    try:
        module, cls = FAMILIES[name].split(":")
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None
    return getattr(importlib.import_module(module), cls)()
