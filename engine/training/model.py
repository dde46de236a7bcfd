"""What block-wise fine-tuning needs of a model family, and nothing of its maths.

A `TrainingModel` is a family's model cut in three, so `BlockwiseStep` can run the blocks one at
a time (streamed, recomputed in its backward) while the parts around them stay ordinary autograd:

    h, carried, static = prologue(x_t, t, condition)   # tokens, what every block reads
    h = block(i, h, carried, static)  for each block i   # carried: tensors that need gradients
    v = epilogue(h, carried, static)                     # the predicted velocity noise - x0

`carried` holds the prologue's outputs that blocks (and the epilogue) read and gradients must
reach (timestep modulation, projected text); `static` holds the rest (token grid, rotary
positions). `TrainingData` gives each family's examples: clips as the model's `x0` and their
conditions (prompts, or cached text embeddings), dropped captions replaced by the family's own
empty one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from .buckets import BucketPlan
from .data import BackgroundLoader, Batch


class TrainingModel(ABC):
    """A model as the block-wise step trains it."""

    modules: dict[str, nn.Module]  # the trained modules by name: a checkpoint holds their state
    blocks_owner: str  # the module the blocks belong to
    blocks_prefix: str = "blocks."  # their name inside it
    time_range: tuple[float, float] = (0.0, 1.0)  # flow times this model is trained on

    @property
    def blocks(self) -> nn.ModuleList:
        return self.modules[self.blocks_owner].get_submodule(self.blocks_prefix.rstrip("."))

    @abstractmethod
    def prologue(
        self, x_t: torch.Tensor, t: torch.Tensor, condition: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
        """Everything before the first block: tokens `(B, N, D)`, `carried`, `static`."""

    @abstractmethod
    def block(self, i: int, h: torch.Tensor, carried: dict, static: Any) -> torch.Tensor:
        """Block i on tokens `(B, N, D)`."""

    @abstractmethod
    def epilogue(self, h: torch.Tensor, carried: dict, static: Any) -> torch.Tensor:
        """Everything after the last block: the predicted velocity, shaped like `x_t`."""

    def aux_losses(self, i: int) -> list[torch.Tensor]:
        """Auxiliary losses block i recorded in its last training forward (cleared)."""
        return []


class TrainingData(ABC):
    """A family's training examples, validated, served in batches by a background loader."""

    loader: BackgroundLoader
    # The clips a validation split keeps out of training, as `(clean clip, caption)` by index
    # (`VideoDataset`'s items); None: no held-out loss.
    held_out: Any = None

    def __len__(self) -> int:
        return len(self.loader.dataset)

    @property
    def plan(self) -> BucketPlan | None:
        """The clips' aspect and length buckets (buckets.py); None: one clip size."""
        return self.loader.plan

    def x0(self, batch: Batch) -> torch.Tensor:
        """The batch's clips as the model's clean input `(B, C, F, H, W)`."""
        return batch.video

    @abstractmethod
    def condition(self, batch: Batch, drop: list[bool]) -> Any:
        """What the prologue conditions on; dropped captions become the empty one."""

    def close(self) -> None:
        self.loader.close()
