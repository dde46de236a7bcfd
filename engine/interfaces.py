"""What a server drives: a video model sampled a step at a time, and a fine-tuning run.

The engine owns these contracts and its classes declare them (`pipeline.Pipeline` is a
`VideoModel`, `finetune.Trainer` a `TrainingRun`); a server types against them without importing
the tensor library, and its tests plug in fakes that declare them too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from .request import ResolvedVideo


class VideoModel(Protocol):
    """A loaded video model, stepped one denoising step at a time. Each method takes the
    requests that reach it together; when it raises, a caller may retry each request alone, so
    that only the one at fault fails."""

    def prepare_batch(self, videos: list[ResolvedVideo]) -> list:
        """Sampling states for requests that arrive together (their prompts encoded in one pass),
        each with `.step`, `.num_steps`, `.done` and `.passes` (steps that ran a pass of the
        model: fewer than `.step` when a step cache reused)."""
        ...

    def denoise_step(self, states: list) -> dict[str, int]:
        """Advance every unfinished state one step; return the step's counters (bytes moved,
        recompiles of compiled blocks)."""
        ...

    def finish_batch(self, states: list) -> list:
        """Decode finished states, in bounded chunks, to uint8 frames `(F, H, W, 3)` each."""
        ...

    def finish_batch_chunks(self, states: list) -> Iterator[tuple[int, Any]]:
        """`finish_batch` as the decoder makes the frames: `(i, chunk)` pairs, `chunk` the next
        uint8 frames `(f, H, W, 3)` of `states[i]`, so that a caller can encode each while the
        next decodes. Each state's chunks, in order, concatenate to its `finish_batch` frames,
        bitwise. This default, for a decoder that is not causal in time, yields each clip whole
        once the batch has decoded; when it raises, the chunks already yielded are void."""
        yield from enumerate(self.finish_batch(states))

    def preview_batch(self, states: list) -> list:
        """A small uint8 frame `(H, W, 3)` of each state's clip as its last step predicts it, or
        None where there is none (a model that keeps no predictions: every one)."""
        return [None] * len(states)

    def close(self) -> None:
        """Free what the model holds beyond its memory (a group of devices: its processes);
        called once the caller is done with it."""
        ...


class TrainingRun(Protocol):
    """A fine-tuning run, one optimizer step per `train_step()`."""

    step: int
    total_steps: int
    # The context its checkpoints and exports are published in; it raises to refuse them.
    fence: Callable[[], AbstractContextManager] | None

    def train_step(self) -> dict:
        """One optimizer step; its metrics (loss, lr, timings)."""
        ...

    def clip_plan(self) -> str | None:
        """How the clips train, in a line a job's log shows before the first step: their aspect
        and length buckets (training/buckets.py); None for one clip size."""
        return None

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of the run as it stands, atomically; its directory."""
        ...

    def checkpoints(self) -> list[dict]:
        """The checkpoints written so far, oldest first: `{"step", "path", "created_at"}`, and
        for a run that validates, `"validation"` (its videos: each prompt's sampling, `status`,
        `error`, `path`) and `"validation_loss"`."""
        ...

    def export(self, path: Path) -> Path:
        """Write the fine-tuned model, servable, at `path`."""
        ...

    def close(self) -> None:
        """Release the run's memory and workers."""
        ...
