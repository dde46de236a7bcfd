"""Full fine-tuning of a Wan denoiser: every transformer parameter trains, UMT5 and the VAE stay
frozen and run once, ahead of training.

`WanTrainingModel` runs `WanTransformer3DModel.forward` in the pieces forward.py cuts it into, as
sampling does: the prologue (rotary positions, patch embedding, the condition embedder fed
`timestep = sigma * 1000` as Wan's pipelines feed it), the blocks, and the epilogue (the output
norm and projection, unpatchified), whose output is Wan's flow-matching velocity `noise - x0`.

`LatentCache` encodes the dataset once, before the first step: every clip by the VAE (its mode,
normalised by `latents_mean` / `latents_std`, as the pipelines normalise) and every caption by
UMT5 (cleaned, 512 tokens, kept up to the caption's length), into safetensors shards under
`<run>/cache/`, with a manifest naming what they were made from. A resumed run, or a new one on
the same data and model, reuses them. Clips are resized and centre-cropped to the training size
and `frames` of them sampled evenly, as for MegaSlide's own model; in aspect and length buckets
(training/buckets.py), each to its bucket's shape, keeping its first frames.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_directory, atomic_write_text
from ..family import TrainingShape
from ..streaming.host_store import SafetensorsFile
from ..training.buckets import BucketPlan, training_clips
from ..training.data import BackgroundLoader, Batch, VideoDataset
from ..training.model import TrainingData, TrainingModel
from . import forward
from .config import EXPERTS, SAMPLING_FILE, TEXT_TOKENS, WanConfig

CACHE = "cache"
MANIFEST = "manifest.json"
SHARD_SAMPLES = 256  # samples per cache shard


class WanTrainingModel(TrainingModel):
    """One Wan expert as the block-wise step trains it."""

    def __init__(self, name: str, transformer: nn.Module, config: WanConfig, time_range):
        self.transformer, self.config = transformer, config
        self.modules = {name: transformer}
        self.blocks_owner = name
        self.time_range = time_range

    def prologue(self, x_t, t, embeddings: torch.Tensor):
        m, config = self.transformer, self.config
        B, _, F, H, W = x_t.shape
        pt, ph, pw = config.patch
        grid = (F // pt, H // ph, W // pw)
        if config.attention == "dsa":
            from .attention import set_grid

            set_grid(m, grid)
        timestep = t.float() * config.num_train_timesteps  # (B,): sigma * 1000, as in sampling
        if config.expand_timesteps:  # one timestep per token (every token noised alike here)
            timestep = timestep[:, None].expand(B, grid[0] * grid[1] * grid[2])  # (B, N)
        h, temb, projection, context, rotary = forward.prologue(m, x_t, timestep, embeddings)
        carried = {"projection": projection, "context": context, "temb": temb}
        return h, carried, (rotary, grid)  # (B, N, D)

    def block(self, i, h, carried, static):
        rotary, _ = static
        context, projection = carried["context"], carried["projection"]
        return forward.block(self.transformer, i, h, context, projection, rotary)  # (B, N, D)

    def epilogue(self, h, carried, static):
        _, grid = static
        return forward.epilogue(self.transformer, h, carried["temb"], grid, self.config.patch)


EXPERT_CHOICES = ("high", "low", "both")  # RunSpec.expert on a two-expert model


def experts_for(
    config: WanConfig, expert: str | None
) -> dict[str, tuple[str, tuple[float, float]]]:
    """The components a run trains and the flow times each trains on, by label: the high-noise
    expert from `boundary_ratio` of pure noise up, the low-noise one below it, as Wan2.2 samples
    and was trained. A two-expert model trains both unless one is named; a one-expert model
    trains its transformer ("", every time) and takes no expert."""
    if len(config.experts) == 1:
        if expert is not None:
            raise ValueError(
                f"this Wan model has one transformer: expert {expert!r} does not apply (high, "
                "low and both name the experts of a two-expert model, Wan2.2-A14B)"
            )
        return {"": (config.experts[0], (0.0, 1.0))}
    if expert not in (None, *EXPERT_CHOICES):
        raise ValueError(
            f"this Wan model has two experts: expert must be one of {EXPERT_CHOICES} "
            f"(default both), got {expert!r}"
        )
    boundary = config.boundary_ratio
    experts = {"high": (EXPERTS[0], (boundary, 1.0)), "low": (EXPERTS[1], (0.0, boundary))}
    if expert in (None, "both"):
        return experts
    return {expert: experts[expert]}


def expert_for(config: WanConfig, expert: str | None) -> tuple[str, tuple[float, float]]:
    """The one component a run trains and its flow times (`experts_for`, one expert named)."""
    chosen = experts_for(config, expert)
    if len(chosen) != 1:
        raise ValueError("this Wan model has two experts: choose high or low to train one")
    return next(iter(chosen.values()))


# ------------------------------------------------------------------------------------------------
# The dataset, encoded once


@dataclass
class LatentDataset:
    """Cached latents `(C, F', H', W')` with their captions, like `VideoDataset` for the loader."""

    files: SafetensorsFile
    captions: list[str]

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        return self.files[f"latent.{i}"].float(), self.captions[i]


class LatentCache(TrainingData):
    """Clips and captions encoded by the frozen VAE and UMT5, served to training."""

    def __init__(
        self, root: Path, captions: list[str], shape: TrainingShape, plan: BucketPlan | None = None
    ):
        self.root = root
        self.files = SafetensorsFile(sorted(root.glob("*.safetensors")))
        self.empty = self.embedding("empty")
        self.loader = BackgroundLoader(
            LatentDataset(self.files, captions),
            batch_size=shape.batch_size,
            seed=shape.seed,
            plan=plan,
        )

    def embedding(self, key: str) -> torch.Tensor:
        """A caption's embedding `(512, text_dim)`: zero past its end, as the pipelines make it."""
        e = self.files[f"text.{key}"].float()
        return torch.cat([e, e.new_zeros(TEXT_TOKENS - e.shape[0], e.shape[1])])

    def condition(self, batch: Batch, drop: list[bool]) -> torch.Tensor:
        rows = [self.empty if d else self.embedding(str(i)) for d, i in zip(drop, batch.indices)]
        return torch.stack(rows)  # (B, 512, text_dim)


def _fingerprint(info, data: Path, samples, shape: TrainingShape, plan: BucketPlan | None) -> dict:
    """What a cache was made from: the dataset's files, captions and sizes, the clip shape (each
    clip's, in buckets), and the encoders' configs and weights' sizes."""
    files = []
    for s in samples:
        stat = s.path.stat()
        relative = str(s.path.relative_to(data.absolute()))
        files.append(
            {"file": relative, "size": stat.st_size, "mtime": int(stat.st_mtime), "text": s.text}
        )
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    encoders = {}
    for component in ("vae", "text_encoder", "tokenizer"):
        folder = info.source.path / component
        for f in sorted(folder.iterdir()):
            if f.is_file():
                encoders[f"{component}/{f.name}"] = f.stat().st_size
    fingerprint = {
        "samples": len(samples),
        "dataset": digest,
        "frames": shape.frames,
        "width": shape.width,
        "height": shape.height,
        "encoders": encoders,
    }
    if plan is not None:
        fingerprint["shapes"] = [list(s) for s in plan.shapes]
    return fingerprint


def latent_cache(info, data: Path, run: Path, shape: TrainingShape) -> LatentCache:
    """The run's encoded dataset, made now unless a cache of the same data and model exists."""
    samples, plan = training_clips(info, data, shape)
    root = run / CACHE
    fingerprint = _fingerprint(info, data, samples, shape, plan)
    manifest = root / MANIFEST
    if not (manifest.is_file() and json.loads(manifest.read_text()) == fingerprint):
        _encode(info, data, samples, shape, plan, root)
        atomic_write_text(manifest, json.dumps(fingerprint, indent=2) + "\n")
    return LatentCache(root, [s.text for s in samples], shape, plan)


@torch.no_grad()
def _encode(
    info, data: Path, samples, shape: TrainingShape, plan: BucketPlan | None, root: Path
) -> None:
    """Encode every clip and caption into safetensors shards at `root`, written atomically."""
    from safetensors.torch import save_file

    from ..loader import open_model
    from .encoders import WanEncoders

    # Only the frozen ends are opened; the same code encodes prompts and images for sampling.
    parts, _ = open_model(info, device=shape.device, only={"text_encoder", "vae"})
    encoders = WanEncoders(
        info.source.path, info.config, parts["text_encoder"].eval(), parts["vae"].eval()
    )
    clips = VideoDataset(
        data,
        shape.frames,
        (shape.width, shape.height),
        samples=samples,
        sampling="uniform" if plan is None else "first",
        shapes=None if plan is None else plan.shapes,
    )

    def text(caption: str) -> torch.Tensor:  # kept up to the caption's length: the rest is zeros
        embedding, length = encoders.prompts([caption])
        return embedding[0, : int(length[0])].float().cpu().contiguous()

    with atomic_directory(root) as tmp:
        texts = {"text.empty": text("")}
        for start in range(0, len(samples), SHARD_SAMPLES):
            shard = {}
            for i in range(start, min(start + SHARD_SAMPLES, len(samples))):
                pixels, caption = clips[i]  # (3, F, H, W) in [-1, 1]
                shard[f"latent.{i}"] = encoders.clip(pixels[None])[0].cpu().contiguous()
                texts[f"text.{i}"] = text(caption)
            save_file(shard, tmp / f"latents-{start // SHARD_SAMPLES:05d}.safetensors")
        save_file(texts, tmp / "text.safetensors")


# ------------------------------------------------------------------------------------------------
# A trained expert in the diffusers layout


def save_diffusers(info, states: dict[str, dict[str, torch.Tensor]], path: Path) -> None:
    """Write a complete pipeline directory: the trained transformer(s) as safetensors beside its
    config, every other component hard-linked (copied across file systems) from the base."""
    from safetensors.torch import save_file

    base = info.source.path
    path.mkdir(parents=True, exist_ok=True)
    for item in sorted(base.iterdir()):
        if item.name in states or item.name.startswith("."):
            continue
        if item.is_dir():
            shutil.copytree(item, path / item.name, copy_function=_link_or_copy, dirs_exist_ok=True)
        elif item.suffix == ".json" or item.name == SAMPLING_FILE:
            shutil.copy2(item, path / item.name)
    for name, state in states.items():
        folder = path / name
        folder.mkdir(exist_ok=True)
        shutil.copy2(base / name / "config.json", folder / "config.json")
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(
            tensors, folder / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"}
        )


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: a copy is as good
        shutil.copy2(src, dst)
    return dst
