"""What clips a fine-tuning run trains on: the one shape, or the bounds of its buckets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingShape:
    """The clips a fine-tuning run trains on and how its loader serves them."""

    frames: int
    width: int
    height: int
    batch_size: int = 1
    seed: int = 0
    cache_mb: int = 1024  # decoded clips kept in RAM
    device: str = "cpu"  # where frozen encoders run, when the data is encoded ahead
    # Aspect and length buckets (training/buckets.py): True, False (every clip resized and
    # cropped to this one shape), or None: buckets when the dataset's clips differ in size or
    # length. The frames above are a bucket's most; the budget (default: the tokens of a clip of
    # this shape) bounds a clip's tokens.
    buckets: bool | None = False
    token_budget: int | None = None
    held_out: float = 0  # ValidationSpec.split: clips kept out of training for a held-out loss
