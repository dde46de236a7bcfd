"""A model family behind one small interface: what the loader, the streamer, the worker and the
optimizer need of a family, and nothing of its maths.

A family (MegaSlide's own DiT in native.py; more can follow) says how a described model
(`sources.ModelInfo`) is built as `Component`s on the meta device and where each component's
weights are, and how the placed components become a sampling `Pipeline`. The loader fills and
places the components (loader.py); everything family-neutral stays out of the family.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .pipeline import Pipeline
    from .sources import ModelInfo
    from .streaming import StreamHandle


@dataclass
class Component:
    """One module of a model as the loader sees it.

    `module` is built on the meta device; `blocks` (a ModuleList inside it) are the repeated
    blocks that streaming moves; `files` are the safetensors files holding its weights under the
    module's own state-dict names (none: a preset's random initial weights).
    """

    name: str
    module: nn.Module
    blocks: nn.ModuleList | None = None
    files: tuple[Path, ...] = field(default_factory=tuple)


class Family(ABC):
    """How one model family is built and sampled."""

    name: str

    @abstractmethod
    def components(self, info: ModelInfo) -> list[Component]:
        """The model's modules built on the meta device, in construction order (a preset's random
        weights are drawn in this order), with the files their weights come from."""

    @abstractmethod
    def pipeline(
        self, info: ModelInfo, parts: dict[str, nn.Module], handles: dict[str, StreamHandle]
    ) -> Pipeline:
        """A sampling pipeline over the placed modules (`handles`: the streamed ones)."""


# Families by the name `sources.describe` gives them, imported only when a model of theirs opens.
FAMILIES = {"megaslide": "megaslide.engine.native:MegaSlideFamily"}


def family(name: str) -> Family:
    try:
        module, cls = FAMILIES[name].split(":")
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None
    return getattr(importlib.import_module(module), cls)()
