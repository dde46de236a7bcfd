"""Aspect and length buckets: a dataset of clips of different sizes and lengths trained as they
come, each batch one bucket, instead of every clip cropped to one size.

A bucket is a clip shape `(frames, height, width)` the model takes. Each clip gets the bucket
`BucketRules.bucket` computes from its own size and length:

* frames: the clip's, at most `max_frames` (the run's clip length), rounded down to a count the
  model takes (`frames_offset + k * frames_multiple`); the clip's first frames are kept;
* size: the clip's, scaled (never up) to keep its aspect ratio while the clip's tokens (latent
  frames x latent height x latent width, over the patch) fit the token budget and each side the
  model's largest, then each side rounded down to the model's size multiple. The clip is resized
  to cover the bucket and centre-cropped: what the rounding drops, less than one multiple a side;
* a clip too small for the smallest bucket (a side under one multiple, fewer frames than the
  shortest legal count) is refused, by its line and file, with the reason.

`plan_buckets` places every clip and checks every bucket against the model (`check_clip`) before
a step runs; the `BucketPlan` is what the run prints: each bucket's clips, tokens and batches. An
epoch is every bucket's clips in an order drawn from (seed, epoch, bucket), cut into batches of
`batch_size` (a bucket's last batch topped up with its own first clips again, so every batch is
whole: data parallel splits it into equal shares), then the batches shuffled by (seed, epoch).
Every rank of a data-parallel run draws the same order, so all take the same bucket at each step.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..request import ModelLimits
from .data import (
    DatasetError,
    Sample,
    held_out_split,
    sample_name,
    too_short,
    validate_dataset,
)
from .finetune_spec import ValidationSpec
from .shape import TrainingShape

if TYPE_CHECKING:
    from ..sources import ModelInfo

# Tokens of a clip of (frames, height, width) pixels: the model's token grid, multiplied out.
TokenCount = Callable[[int, int, int], int]


@dataclass(frozen=True, order=True)
class Bucket:
    """A clip shape the model takes, in pixels: every clip of a batch has it."""

    frames: int
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


@dataclass(frozen=True)
class BucketRules:
    """What a clip's bucket must be for one model: its multiples and largest sides (`limits`),
    at most `budget` tokens and `max_frames` frames."""

    limits: ModelLimits
    tokens: TokenCount
    budget: int
    max_frames: int

    def legal_frames(self, frames: int) -> int | None:
        """The most frames the model takes that are at most `frames` (None: none are)."""
        offset, multiple = self.limits.frames_offset, self.limits.frames_multiple
        n = offset + (frames - offset) // multiple * multiple if frames >= offset else 0
        return n if n >= 1 else None

    @property
    def shortest(self) -> int:
        """The fewest frames the model takes."""
        return self.legal_frames(self.limits.frames_offset) or self.limits.frames_multiple

    def bucket(self, frames: int, width: int, height: int) -> Bucket | str:
        """The bucket of a clip of `frames` frames of `width` x `height`, or why it has none."""
        limits = self.limits
        mh, mw = limits.size_multiple
        if width < mw or height < mh:
            return f"{width}x{height} is smaller than the smallest size the model takes ({mw}x{mh})"
        f = self.legal_frames(min(frames, self.max_frames, limits.max_frames))
        if f is None:
            return (
                f"{frames} frames: fewer than the shortest clip the model takes ({self.shortest})"
            )
        # The smallest frame, one multiple a side, must fit: else fewer frames.
        while self.tokens(f, mh, mw) > self.budget:
            f = self.legal_frames(f - 1)
            if f is None:
                return f"the token budget ({self.budget}) holds no clip of the smallest size"
        cells = self.budget // self.tokens(f, mh, mw)  # multiples-squares of a frame that fit
        scale = min(
            1.0,
            limits.max_size / max(width, height),
            math.sqrt(cells * mh * mw / (width * height)),
        )
        # Rounded down (a hair of slack: a side exactly on a multiple stays there).
        h = max(mh, int(height * scale / mh + 1e-9) * mh)
        w = max(mw, int(width * scale / mw + 1e-9) * mw)
        # An extreme aspect kept at one multiple a side may still be over: trim the longer side.
        while self.tokens(f, h, w) > self.budget:
            if w / mw >= h / mh:
                w -= mw
            else:
                h -= mh
        return Bucket(f, h, w)


@dataclass(frozen=True)
class BucketPlan:
    """Every clip's bucket and the batches of an epoch (module docstring)."""

    buckets: dict[Bucket, tuple[int, ...]]  # bucket -> its clips' dataset indices, ascending
    tokens: dict[Bucket, int]  # tokens of one clip of each bucket
    batch_size: int
    budget: int

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """Each clip's `(frames, height, width)`, by dataset index."""
        out: dict[int, tuple[int, int, int]] = {}
        for b, clips in self.buckets.items():
            for i in clips:
                out[i] = (b.frames, b.height, b.width)
        return [out[i] for i in range(len(out))]

    def batches(self, bucket: Bucket) -> int:
        """Batches of `bucket` in one epoch."""
        return math.ceil(len(self.buckets[bucket]) / self.batch_size)

    @property
    def batches_per_epoch(self) -> int:
        return sum(self.batches(b) for b in self.buckets)

    @property
    def fingerprint(self) -> str:
        """What a saved data position counts batches of: the clips' buckets and the batch."""
        plain = [[str(b), list(c)] for b, c in sorted(self.buckets.items())] + [self.batch_size]
        return hashlib.sha256(json.dumps(plain).encode()).hexdigest()[:16]

    def epoch_batches(self, seed: int, epoch: int) -> list[list[int]]:
        """Epoch `epoch`'s batches, in order: a pure function of (seed, epoch, plan)."""
        batches = []
        for k, (bucket, clips) in enumerate(sorted(self.buckets.items())):
            drawn = np.random.default_rng([seed, epoch, k + 1]).permutation(len(clips))
            # Topped up with the bucket's own clips again: every batch is whole.
            need = self.batches(bucket) * self.batch_size
            order = [clips[drawn[j % len(clips)]] for j in range(need)]
            batches += [order[j : j + self.batch_size] for j in range(0, need, self.batch_size)]
        shuffle = np.random.default_rng([seed, epoch, 0]).permutation(len(batches))
        return [batches[j] for j in shuffle]

    def summary(self) -> str:
        """The plan in one line."""
        each = "; ".join(
            f"{b} ({len(c)} clip(s), {self.tokens[b]} tokens, {self.batches(b)} batch(es))"
            for b, c in sorted(self.buckets.items())
        )
        return f"{self.lines()[0][:-1]}: {each}"

    def lines(self) -> list[str]:
        """The plan as a table: the totals, then a line per bucket."""
        clips = sum(len(c) for c in self.buckets.values())
        out = [
            f"{len(self.buckets)} bucket(s) of at most {self.budget} tokens, {clips} clip(s), "
            f"{self.batches_per_epoch} batch(es) of {self.batch_size} an epoch:",
            f"  {'WxHxF':>14} {'clips':>6} {'tokens':>7} {'batches':>8}",
        ]
        for b, c in sorted(self.buckets.items()):
            out.append(f"  {str(b):>14} {len(c):>6} {self.tokens[b]:>7} {self.batches(b):>8}")
        return out


def plan_buckets(
    root: Path, samples: list[Sample], rules: BucketRules, batch_size: int
) -> BucketPlan:
    """Every clip's bucket, checked: DatasetError naming each clip that has none (line, file,
    why) or whose bucket the model refuses (`check_clip`: e.g. a 3D-DSA tiling)."""
    problems: list[str] = []
    buckets: dict[Bucket, list[int]] = {}
    for i, s in enumerate(samples):
        width, height = s.size
        b = rules.bucket(s.num_frames, width, height)
        if isinstance(b, str):
            problems.append(f"{sample_name(root, s)}: no bucket: {b}")
        else:
            buckets.setdefault(b, []).append(i)
    for b, clips in sorted(buckets.items()):
        try:
            rules.limits.check_clip(b.frames, b.width, b.height)
        except ValueError as e:
            first = sample_name(root, samples[clips[0]])
            problems.append(f"bucket {b} ({len(clips)} clip(s), first {first}): {e}")
    if problems:
        raise DatasetError(root, problems[:20], total=len(problems))
    plan = BucketPlan(
        {b: tuple(c) for b, c in buckets.items()},
        {b: rules.tokens(b.frames, b.height, b.width) for b in buckets},
        batch_size,
        rules.budget,
    )
    placed = sum(len(c) for c in plan.buckets.values())
    if placed != len(samples):  # each clip in exactly one bucket: a broken plan fails here
        raise RuntimeError(f"bucket plan places {placed} of {len(samples)} clips")
    return plan


def check_lengths(root: Path, samples: list[Sample], frames: int) -> None:
    """DatasetError naming each clip shorter than `frames` (one clip size for the whole run)."""
    short = [s for s in samples if s.num_frames < frames]
    problems = [too_short(sample_name(root, s), s.num_frames, frames) for s in short]
    if problems:
        raise DatasetError(root, problems[:20], total=len(problems))


def training_clips(
    info: ModelInfo, data: Path, shape: TrainingShape
) -> tuple[list[Sample], BucketPlan | None]:
    """The dataset at `data`, validated, and how its clips train: every clip resized and cropped
    to `shape`'s one size (None), or in buckets (a checked plan). `shape.buckets`: True, False,
    or None for buckets exactly when the clips differ in size or length. A family that takes a
    held-out split calls `split_clips` instead."""
    if shape.held_out:
        raise ValueError(
            f"validation.split: {info.name} computes no held-out loss yet (pixel-space "
            "MegaSlide models do); leave it at 0"
        )
    samples, plan, _ = split_clips(info, data, shape)
    return samples, plan


def split_clips(
    info: ModelInfo, data: Path, shape: TrainingShape
) -> tuple[list[Sample], BucketPlan | None, list[Sample]]:
    """`training_clips`, with the clips `shape.held_out` keeps out of training (the validation
    loss's, read at the run's one clip shape) drawn first: the plan holds only the others."""
    if shape.buckets is False:
        samples = validate_dataset(data, num_frames=shape.frames)
    else:
        samples = validate_dataset(data)  # any length: a clip's bucket says what it needs
    count = ValidationSpec(split=shape.held_out).held_out(len(samples))
    samples, held = held_out_split(samples, shape.seed, count)
    check_lengths(data, held, shape.frames)
    if shape.buckets is False:
        return samples, None, held
    if shape.buckets is None and len({(s.num_frames, s.size) for s in samples}) == 1:
        check_lengths(data, samples, shape.frames)
        return samples, None, held

    def tokens(frames: int, height: int, width: int) -> int:
        return math.prod(info.config.token_grid(frames, height, width))

    budget = shape.token_budget or tokens(shape.frames, shape.height, shape.width)
    rules = BucketRules(info.limits, tokens, budget, max_frames=shape.frames)
    return samples, plan_buckets(data, samples, rules, shape.batch_size), held
