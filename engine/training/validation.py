"""What a fine-tuning run's checkpoints are judged by (`ValidationSpec`, finetune_spec.py).

The held-out loss is the training loss on clips the run never trains on (`held_out_split`,
data.py), computed with the weights as they stand: the same noise and flow times at every
checkpoint (drawn from the run's seed), so the curve moves only with the weights.

Validation videos are sampled from the checkpoint just written, through the one front door
(`open_pipeline`) with the run's placement: a streamed run streams them too, its blocks read from
RAM or from the checkpoint's files (`host_tier="auto"`: disk when another copy would not fit
beside the run's masters). Each lands beside the checkpoint, written whole:

    <output>/validation/step-000050/
        0.mp4, 1.mp4, ...   one per prompt, in the spec's order
        videos.json         {"step", "validation_loss", "videos": [{"index", "prompt", ...,
                            "status": "succeeded" | "failed", "error", "file"}]}

A prompt that fails to sample is recorded as failed with its reason; the run goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..atomic import atomic_directory
from ..loader import open_pipeline
from ..placement import Placement
from ..request import VideoRequest
from ..sources import ModelInfo, ModelSource, describe
from ..video import write_mp4
from .blockwise import BlockwiseStep
from .data import Batch
from .finetune_spec import ValidationPrompt
from .model import TrainingData

VALIDATION = "validation"
VIDEOS = "videos.json"
HELD_OUT_SEED_OFFSET = 1  # the held-out draws' generator: the run's seed + this, apart from its own


def held_out_loss(step: BlockwiseStep, data: TrainingData, seed: int) -> float | None:
    """The mean loss over the held-out clips, one clip at a time; None without any."""
    held = data.held_out
    if held is None or len(held) == 0:
        return None
    generator = torch.Generator().manual_seed(seed + HELD_OUT_SEED_OFFSET)
    total = 0.0
    for i in range(len(held)):
        video, text = held[i]  # (3, F, H, W)
        batch = Batch(video[None], [text], [i], 0)  # (1, 3, F, H, W)
        total += step.held_out_loss(data.x0(batch), data.condition(batch, [False]), generator)
    return total / len(held)


def validation_dir(output: Path, step: int) -> Path:
    return Path(output) / VALIDATION / f"step-{step:06d}"


def read_validation(output: Path, step: int) -> dict | None:
    """A checkpoint's `videos.json`, each video's `file` made a full path; None when none was
    written (no validation asked for, or the run stopped while sampling)."""
    folder = validation_dir(output, step)
    record = folder / VIDEOS
    if not record.is_file():
        return None
    found = json.loads(record.read_text())
    for video in found["videos"]:
        if video.get("file"):
            video["path"] = str(folder / video["file"])
    return found


def sample_validation(
    info: ModelInfo,
    model_dir: Path,
    placement: Placement,
    prompts: tuple[ValidationPrompt, ...],
    folder: Path,
    *,
    step: int,
    loss: float | None,
    fence: Callable[[], contextlib.AbstractContextManager] | None = None,
    **overrides,
) -> dict:
    """Sample `prompts` from the model at `model_dir` (a checkpoint of `info`'s run) and write
    them with their record into `folder`, atomically; the record."""
    videos = [dict(dataclasses.asdict(p), index=i) for i, p in enumerate(prompts)]
    with atomic_directory(folder, guard=fence) as tmp:
        if videos:
            pipeline, opened = None, None
            try:
                source = ModelSource("directory", info.name, path=Path(model_dir))
                streams = placement.offload == "stream"
                pipeline = open_pipeline(
                    describe(source, **overrides),
                    placement.replace(host_tier="auto") if streams else placement,
                )
            except Exception as exc:  # noqa: BLE001 - every video fails with the reason
                opened = f"the checkpoint could not be opened for sampling: {exc}"
            try:
                for video, prompt in zip(videos, prompts):
                    video.update(_sample(pipeline, prompt, tmp / f"{video['index']}.mp4", opened))
            finally:
                if pipeline is not None:
                    pipeline.close()
        record = {"step": step, "validation_loss": loss, "videos": videos}
        (tmp / VIDEOS).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _sample(pipeline, prompt: ValidationPrompt, path: Path, opened: str | None) -> dict:
    """One prompt sampled and encoded at `path`: its status, error and file name."""
    if opened is not None:
        return {"status": "failed", "error": opened, "file": None}
    request = VideoRequest(
        prompt=prompt.prompt,
        seed=prompt.seed,
        width=prompt.width,
        height=prompt.height,
        frames=prompt.frames,
        steps=prompt.steps,
        guidance=prompt.guidance,
    )
    try:
        video = pipeline.resolve(request)
        frames = pipeline.generate(video)
        write_mp4(path, frames, fps=video.fps)
    except Exception as exc:  # noqa: BLE001 - this video fails; the others and the run go on
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "file": None}
    return {"status": "succeeded", "error": None, "file": path.name}
