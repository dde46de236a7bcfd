"""MegaSlide's own DiT as a model family: its modules, its weights' files, its sampling pipeline.

A model is two modules, the DiT (`dit`, whose `blocks` stream) and the built-in text encoder
(`text_encoder`), and an autoencoder between pixels and latents (identity: pixel space). A model
directory holds their weights in `model.safetensors` and `text_encoder.safetensors` (see
checkpoint.py); a preset's random weights are drawn as constructing `VideoDiT` and then
`BuiltinTextEncoder` on the CPU after `torch.manual_seed(seed)` draws them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..family import Component, Family, TrainingShape
from ..parallel.sequence import SequenceGroup, check_shardable, parallelize_dit
from ..request import ResolvedVideo
from ..sampling.flow import EulerSampler, SampleState, shifted_schedule
from ..sampling.loop import GuidanceMemory, sample_step
from ..sampling.pipeline import Pipeline, decode_chunks, distinct
from ..sampling.samplers import flow_times, timestep_sigmas
from ..sampling.step_cache import StepCache
from ..sources import ModelInfo
from ..streaming.host_store import SafetensorsFile
from ..streaming.streamer import StreamHandle
from ..training.buckets import split_clips
from ..training.data import BackgroundLoader, Batch, VideoDataset
from ..training.model import TrainingData, TrainingModel
from ..video import float_to_frames
from .autoencoder import build_autoencoder, check_autoencoder
from .checkpoint import MODEL_FILE, TEXT_FILE, save_model
from .config import DiTConfig
from .dit import BlockInputs, VideoDiT, pop_aux_losses
from .text import BuiltinTextEncoder


class MegaSlideFamily(Family):
    name = "megaslide"

    def components(self, info: ModelInfo) -> list[Component]:
        check_autoencoder(info.config.autoencoder)  # an autoencoder that cannot be built fails now
        with torch.device("meta"):
            dit, text = VideoDiT(info.config), BuiltinTextEncoder(info.config.text)
        path = info.source.path
        if path is None:  # a preset: random weights
            return [Component("dit", dit, dit.blocks), Component("text_encoder", text)]
        return [
            Component("dit", dit, dit.blocks, SafetensorsFile(path / MODEL_FILE)),
            Component("text_encoder", text, None, SafetensorsFile(path / TEXT_FILE)),
        ]

    def pipeline(self, info, parts, handles, *, batched: bool = True) -> DiTPipeline:
        return DiTPipeline(info, parts["dit"], parts["text_encoder"], handles, batched=batched)

    def check_parallel(self, info: ModelInfo, frames: int, height: int, width: int, world: int):
        grid = info.config.token_grid(frames, height, width)
        check_shardable(info.config, grid, world)

    def count_parameters(self, info: ModelInfo) -> dict[str, int]:
        counts = count_parameters(info.config)
        depth = info.config.depth
        return {
            **counts,
            "blocks": depth,
            "experts": 1,
            "denoiser_non_block": counts["dit"] - depth * counts["per_block"],
            "text_per_block": 0,  # the built-in text encoder stays resident
            "text_blocks": 0,
            "vae": 0,  # pixel space
            "trainable": counts["total"],  # the text encoder trains too
        }

    # -- fine-tuning: every parameter of the DiT and the text encoder trains ---------------------

    def training_model(self, info, parts, expert=None) -> DiTTrainingModel:
        if expert is not None:
            raise ValueError(f"{info.name} has one denoiser: --expert does not apply")
        if info.config.autoencoder != "identity":
            raise ValueError(
                f"{info.name} works in the latent space of {info.config.autoencoder!r}: "
                "fine-tuning trains pixel-space MegaSlide models only"
            )
        return DiTTrainingModel(parts["dit"], parts["text_encoder"])

    def training_data(self, info, data, run, shape: TrainingShape) -> ClipData:
        # The whole dataset is checked before anything else happens: a bad file fails the run now.
        samples, plan, held = split_clips(info, data, shape)
        dataset = VideoDataset(
            data,
            shape.frames,
            (shape.width, shape.height),
            samples=samples,
            cache_bytes=shape.cache_mb << 20,
            # In buckets, a clip keeps its first frames: its own motion, not a faster one.
            sampling="uniform" if plan is None else "first",
            shapes=None if plan is None else plan.shapes,
        )
        loader = BackgroundLoader(dataset, batch_size=shape.batch_size, seed=shape.seed, plan=plan)
        clips = ClipData(loader)
        if held:
            size = (shape.width, shape.height)
            clips.held_out = VideoDataset(data, shape.frames, size, samples=held)
        return clips

    def save_trained(self, info, states, path: Path) -> None:
        with torch.device("meta"):
            dit, text = VideoDiT(info.config), BuiltinTextEncoder(info.config.text)
        dit.load_state_dict(states["dit"], assign=True)
        text.load_state_dict(states["text_encoder"], assign=True)
        save_model(path, dit, text, info.sampling, extra=info.extra)


class DiTPipeline(Pipeline):
    """Rectified-flow sampling of a MegaSlide DiT with classifier-free guidance."""

    def __init__(
        self,
        info: ModelInfo,
        dit: VideoDiT,
        text_encoder: BuiltinTextEncoder,
        handles: dict[str, StreamHandle],
        *,
        batched: bool = True,
    ):
        super().__init__(info, handles, {"dit": dit, "text_encoder": text_encoder})
        self.dit, self.text_encoder = dit, text_encoder
        self.denoisers = ("dit",)
        self.batched = batched
        self.config: DiTConfig = dit.config
        self.autoencoder = build_autoencoder(self.config.autoencoder, info.source.seed)

    @property
    def device(self) -> torch.device:
        return self.text_encoder.embed.weight.device

    def parallelize(self, sp: SequenceGroup) -> None:
        parallelize_dit(self.dit, sp)
        self.sp = sp

    def _prepare_batch(self, videos: list[ResolvedVideo]) -> list[SampleState]:
        rows = [[v.prompt, v.negative_prompt] if v.guidance != 1.0 else [v.prompt] for v in videos]
        if self.batched:  # every distinct prompt of every request in one pass of the encoder
            prompts, where = distinct([p for r in rows for p in r])
            with torch.no_grad():
                ctx, mask = self.text_encoder.encode(prompts)  # (distinct, L, D)
            where, sizes = torch.tensor(where), [len(r) for r in rows]
            encoded = list(zip(ctx[where].split(sizes), mask[where].split(sizes)))
        else:  # each request's prompts in a pass of their own
            with torch.no_grad():
                encoded = [self.text_encoder.encode(r) for r in rows]  # (1 or 2, L, text_dim)
        return [self._prepare(v, ctx, mask) for v, (ctx, mask) in zip(videos, encoded)]

    def _prepare(self, video: ResolvedVideo, ctx: torch.Tensor, mask: torch.Tensor) -> SampleState:
        shape = (1, *self.autoencoder.latent_shape(video.frames, video.height, video.width))
        # Noise is drawn on the CPU from the request's own generator: the same seed gives the same
        # starting point on every device and whatever else is in the batch.
        generator = torch.Generator().manual_seed(video.seed)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        shift = self.info.sampling.shift if video.shift is None else video.shift
        if video.sampler == "scheduler":
            times = shifted_schedule(video.steps, shift)
        else:  # an explicit list of timesteps (samplers.py)
            times = flow_times(timestep_sigmas(video.timesteps, shift))
        cache = StepCache.from_spec(video.cache, self.step_curve)
        return SampleState(
            noise.to(self.device),
            ctx,
            mask,
            times,
            video.guidance,
            cache=cache,
            fine_tune=video.fine_tune,
            # A consistency sampler's fresh noise continues the request's own generator.
            renoise=generator if video.sampler == "consistency" else None,
            guidance_interval=video.guidance_interval,
            guidance_memory=None if video.guidance_interval is None else GuidanceMemory(),
        )

    def _step(self, states: list[SampleState]) -> None:
        sampler = EulerSampler(
            self.dit, self.passes, self.first_block_only, self.sp, self.weights, self.interleaves
        )
        sample_step(sampler, states)

    def decode_preview(self, x0: torch.Tensor) -> np.ndarray:
        """The middle frame of the decoded clips (the autoencoder is small)."""
        with torch.no_grad():
            pixels = self.autoencoder.decode(x0.float())  # (B, 3, F, H, W) in [-1, 1]
        middle = pixels[:, :, pixels.shape[2] // 2]  # (B, 3, H, W)
        return np.stack([float_to_frames(m[:, None], layout="CFHW")[0] for m in middle])

    def finish_batch(self, states: list[SampleState]) -> list[np.ndarray]:
        for state in states:
            if not state.done:
                raise RuntimeError(f"state is at step {state.step} of {state.num_steps}")
        frames: list[np.ndarray] = [None] * len(states)
        chunk = self.decode_chunk if self.batched else 1
        for rows in decode_chunks([s.latents.shape for s in states], chunk):
            latents = torch.cat([states[i].latents.float() for i in rows])  # (B, C, F', H', W')
            with torch.no_grad():
                pixels = self.autoencoder.decode(latents)  # (B, 3, F, H, W) in [-1, 1]
            for i, clip in zip(rows, pixels):
                frames[i] = float_to_frames(clip, layout="CFHW")  # (F, H, W, 3) uint8
        return frames


def count_parameters(config: DiTConfig) -> dict[str, int]:
    """Exact parameter counts of a config, built on the meta device (instant at any size)."""
    with torch.device("meta"):
        dit, text = VideoDiT(config), BuiltinTextEncoder(config.text)
    n_dit = _numel(dit)
    n_block = _numel(dit.blocks[0]) if config.depth else 0
    n_text = _numel(text)
    return {"total": n_dit + n_text, "dit": n_dit, "per_block": n_block, "text_encoder": n_text}


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class DiTTrainingModel(TrainingModel):
    """The DiT and its text encoder, trained together from prompts."""

    blocks_owner = "dit"

    def __init__(self, dit: VideoDiT, text_encoder: BuiltinTextEncoder):
        self.dit, self.text_encoder = dit, text_encoder
        self.modules = {"dit": dit, "text_encoder": text_encoder}

    def prologue(self, x_t, t, prompts: list[str]):
        ctx, mask = self.text_encoder.encode(prompts)  # (B, L, text_dim), with autograd
        h, c = self.dit.prologue(x_t, t, ctx, mask)  # (B, N, D)
        # What the blocks and the epilogue read, and gradients must reach.
        carried = {"t_mod": c.t_mod, "ctx": c.ctx, "t_emb": c.t_emb}
        return h, carried, c

    def block(self, i: int, h, carried, static: BlockInputs):
        return self.dit.blocks[i](h, dataclasses.replace(static, **carried))

    def epilogue(self, h, carried, static: BlockInputs):
        return self.dit.epilogue(h, dataclasses.replace(static, **carried))

    def aux_losses(self, i: int) -> list[torch.Tensor]:
        return pop_aux_losses(self.dit.blocks[i])


class ClipData(TrainingData):
    """Decoded clips in pixel space, conditioned on their captions (dropped: the empty prompt)."""

    def __init__(self, loader: BackgroundLoader):
        self.loader = loader

    def condition(self, batch: Batch, drop: list[bool]) -> list[str]:
        return ["" if d else text for d, text in zip(drop, batch.text)]
