"""Wan as a MegaSlide model family: diffusers' and transformers' own modules, MegaSlide's sampler.

The modules are the libraries' classes (`WanTransformer3DModel`, `AutoencoderKLWan`,
`UMT5EncoderModel`, `CLIPVisionModel`), built on the meta device from their configs and filled by
the loader from the directory's safetensors, so the streamer can keep their blocks in host RAM. Sampling follows
`diffusers.WanPipeline` step for step, so a seed gives the same video:

- prompts are cleaned, tokenized to 512 tokens and encoded by UMT5; positions past a prompt's end
  are zeroed, as the pipeline does;
- the starting latents are drawn on the CPU from the request's own generator, in the pipeline's
  shape and dtype;
- each request keeps its own scheduler (UniPC keeps a history of model outputs);
- each step runs the expert that owns the current timestep (Wan2.2-A14B: the high-noise expert
  while `t >= boundary_ratio * 1000`, then the low-noise one), guidance combined in the model's
  output dtype: `uncond + g * (cond - uncond)`;
- Wan2.2-TI2V with a first-frame image (`WanImageToVideoPipeline`'s way): the image's normalised
  VAE latent stands in for the first latent frame of every input, whose tokens get timestep 0;
- Wan2.1-I2V and Wan2.2-I2V-A14B (`WanImageToVideoPipeline`): the image, resized to the clip and
  followed by black frames, is encoded by the VAE once; its latent, behind a mask that is 1 on
  the first latent frame, rides along every input as extra channels (36 in all for Wan's VAE).
  Wan2.1-I2V's transformer also cross-attends the image's CLIP features (the second-to-last
  layer's hidden states), the same for both halves of a guidance pair;
- a last frame as well (`WanImageToVideoPipeline`'s `last_image`): black frames between the two
  images, the mask also 1 on the last pixel frame; Wan2.1-FLF2V's transformer cross-attends both
  images' CLIP features, which its embedder lays side by side;
- VACE (`WanVACEPipeline`): a control video (black frames without one) is split by its mask
  (thresholded at one half; all ones without one) into the frames kept and the frames to
  generate, each encoded by the VAE; each reference image, resized into the clip's frame on
  white, is encoded alone and put before them as a latent frame of its own (the last image
  first, as the pipeline's loop stacks them), and the mask, folded to one channel per pixel of a
  latent pixel and resampled to the latent frames, joins them: the conditioning latents
  `(1, 2C + s^2, R + F', H', W')`, the same on every step and both halves of a guidance pair.
  The starting noise has the R reference frames too, dropped before decoding. The VACE blocks
  run first on the conditioning, and each one's hint, times the request's conditioning scale,
  adds to the output of its block (`vace_layers`): the transformer's own forward, given a scale
  per row so requests of different scales share a pass. The streamed blocks are the VACE blocks
  and then the blocks, the order they run in;
- Animate (`WanAnimatePipeline`, in segments of `segment_frame_length` frames, the clip's by
  default, each after the first starting from the last frames of the one before: animate.py):
  the character image, resized to fill the clip's frame (its aspect kept, black around), is
  encoded by the VAE as a latent frame of its own behind a mask of ones;
  after it come the latents of black frames (animate) or of the background video (replace),
  behind a mask of zeros (animate) or of where the background is kept (one minus the mask
  video, nearest-resampled, the first frame's mask repeated over its latent frame's channels).
  These ride along every input as I2V's extra channels; the starting noise has the leading
  frame too, dropped before decoding. The pose video's latents join the tokens after the first
  frame's through the pose patch embedding; the face video, resized to the motion encoder's
  square, feeds the motion and face encoders (in the transformer's forward), whose features the
  face adapters add after their blocks; the unconditional half of a guidance pair sees a face
  of all -1, as the pipeline blanks it. CLIP features are the character image's. The streamed
  blocks are the blocks with the face adapters between them, the order they run in. When a
  segment's steps are done and another follows, the request's next step starts it (decoding
  the segment, re-encoding its last frames, fresh noise and scheduler) before the batch's pass:
  the other requests step on, and `step` counts every segment's steps;
- video-to-video (`WanVideoToVideoPipeline`): the input video's first frames, resized to the
  clip, are encoded by the VAE; the schedule's first `1 - strength` is skipped, and the
  latent is noised to the first step kept by the scheduler's `add_noise` (or `scale_noise`) with
  the noise drawn as the starting latents are;
- latents are de-normalised with the VAE's `latents_mean` / `latents_std` and decoded (tiled
  above 256 pixels, so decoding memory does not grow with the frame size), a latent frame at a
  time with the VAE's elementwise chains fused (vae_decode.py: bitwise the unfused VAE);
  `finish_batch_chunks` (and `finish_chunks`, for one clip) hands each latent frame's pixels
  out as they exist, for an MP4 encoder to take while the next decode (`megaslide generate` and
  the server's worker both do).

Requests that arrive together have their prompts encoded in one UMT5 pass, and clips that finish
together decode `decode_chunk` per VAE pass (pipeline.py's `DECODE_CHUNK`), each within a level
of its decode alone.

With `batched` (the default) one forward pass per step and expert carries every request and both
halves of every guidance pair, so a streamed model moves its weights once per step for all of
them; the reference mode runs each row alone, as WanPipeline does, and equals it bitwise.
The batched mode also keeps each row's cross-attention keys and values from its first pass
(prompt_cache.py: the prompt does not change across steps) and decodes with the VAE's channel
norms summed directly (encoders.py `fast_vae_norms`), both within a level of diffusers' frames.

A step is the sampler loop every family shares (sampling/loop.py: experts as groups of requests,
guidance pairs, step caches, adapters' rows); Wan gives it its model inputs and each request's
scheduler as the update rule, and cuts the transformer's forward once (forward.py), for the
first-block cache and for fine-tuning alike.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..family import Component, Family
from ..lora import Adapter, AdapterRouter, linear_targets
from ..request import (
    ResolvedVideo,
    check_animate,
    check_image,
    check_last_image,
    check_loras,
    check_vace,
    check_video,
    kept_steps,
)
from ..sampling.loop import GuidanceMemory, Sampler, sample_step
from ..sampling.pipeline import CPU_ROWS_PER_PASS, Pipeline, decode_chunks, distinct
from ..sampling.samplers import flow_scheduler, timestep_sigmas
from ..sampling.step_cache import StepCache
from ..sources import ModelInfo
from ..streaming.host_store import RenamedWeights, SafetensorsFile
from .animate import Segments, prepare_segments, segment_inputs
from .config import ANIMATE_TRANSFORMER, TEXT_TOKENS, VACE_TRANSFORMER, WanConfig, weight_files
from .encoders import WanEncoders, fast_vae_norms, libraries
from .forward import WanCut, streamed_blocks
from .prompt_cache import PromptCache, PromptKV, entry_bytes
from .vae_decode import fuse_chains

# Bytes of cross-attention keys and values the batched mode keeps across steps (prompt_cache.py):
# the requests of a step fill entries in order while their total fits. 1 GiB holds 8 guided
# requests of a 1.3B Wan in bf16 at 512 text tokens (189 MB each), one of a 14B (839 MB).
PROMPT_CACHE_BYTES = 1 << 30


class WanFamily(Family):
    name = "wan"
    decoders = ("vae",)

    def components(self, info: ModelInfo) -> list[Component]:
        diffusers, transformers = libraries()
        path, config = info.source.path, info.config
        text_config = transformers.UMT5Config.from_pretrained(
            path / "text_encoder", local_files_only=True
        )
        with torch.device("meta"):
            text = transformers.UMT5EncoderModel(text_config)
            experts = [_meta_transformer(diffusers, path / name) for name in config.experts]
            vae = diffusers.AutoencoderKLWan.from_config(
                diffusers.AutoencoderKLWan.load_config(path / "vae", local_files_only=True)
            )
        if config.attention == "dsa":
            if config.vace or config.animate:
                raise ValueError(
                    f"3D-DSA is not built for {'VACE' if config.vace else 'Animate'}'s blocks: "
                    "open it with dense attention"
                )
            from .attention import use_slide_attention

            for expert in experts:
                use_slide_attention(expert, config.dsa_tile, config.dsa_window)
        elif config.attention == "sage":
            from .attention import use_sage_attention

            for expert in experts:
                use_sage_attention(expert)
        keep = tuple(type(experts[0])._keep_in_fp32_modules)
        text_keep = tuple(
            getattr(transformers.UMT5EncoderModel, "_keep_in_fp32_modules", None) or ()
        )

        def weights(folder: str):
            if config.transformer_files and folder in config.experts:
                return _single_file(config, folder, experts[config.experts.index(folder)])
            if folder == "image_encoder":
                return _clip_weights(path / folder)
            return SafetensorsFile(weight_files(path / folder))

        image = []
        if config.image_encoder:
            encoder = _meta_image_encoder(transformers, path)
            # CLIP runs in fp32, as diffusers' Wan I2V examples load it; its layers stream like
            # UMT5's (the pipeline keeps `hidden_states[-2]`, but the last layer still runs).
            layers = encoder.encoder.layers
            image = [
                Component("image_encoder", encoder, layers, weights("image_encoder"), torch.float32)
            ]
        return [
            Component(
                "text_encoder",
                text,
                text.encoder.block,
                weights("text_encoder"),
                keep_fp32=text_keep,
            ),
            *image,
            *(
                Component(name, expert, streamed_blocks(expert), weights(name), keep_fp32=keep)
                for name, expert in zip(config.experts, experts)
            ),
            # The VAE decodes in fp32, as Wan's pipelines are run.
            Component("vae", vae, None, weights("vae"), dtype=torch.float32),
        ]

    def pipeline(self, info, parts, handles, *, batched: bool = True) -> WanVideoPipeline:
        return WanVideoPipeline(info, parts, handles, batched=batched)

    # -- LoRA adapters: on any Linear layer of a transformer, in diffusers' module names ----------

    def adaptable(self, denoiser: nn.Module) -> dict[str, nn.Linear]:
        return linear_targets(denoiser)

    def adapter_targets(self, info: ModelInfo) -> list[dict[str, nn.Linear]]:
        diffusers, _ = libraries()
        with torch.device("meta"):
            experts = [
                _meta_transformer(diffusers, info.source.path / n) for n in info.config.experts
            ]
        return [self.adaptable(e) for e in experts]

    def load_adapter(self, name: str, path) -> Adapter:
        from .lora import load_wan_adapter

        return load_wan_adapter(name, path)

    # -- fine-tuning: one expert or both train; UMT5 and the VAE encode the data once, ahead -------

    def training_components(self, info: ModelInfo, expert: str | None) -> set[str]:
        from .training import experts_for

        _check_trainable(info)
        return {name for name, _ in experts_for(info.config, expert).values()}

    def training_model(self, info, parts, expert=None):
        from .training import WanTrainingModel, expert_for

        _check_trainable(info)
        name, time_range = expert_for(info.config, expert)
        return WanTrainingModel(name, parts[name], info.config, time_range)

    def training_models(self, info, parts, expert=None):
        from .training import WanTrainingModel, experts_for

        _check_trainable(info)
        return {
            label: WanTrainingModel(name, parts[name], info.config, time_range)
            for label, (name, time_range) in experts_for(info.config, expert).items()
        }

    def training_data(self, info, data, run, shape):
        from .training import latent_cache

        _check_trainable(info)  # before the dataset is encoded
        return latent_cache(info, data, run, shape)

    def save_trained(self, info, states, path) -> None:
        from .training import save_diffusers

        save_diffusers(info, states, path)

    # -- several devices: diffusers' own Ulysses context parallelism on each expert ----------------

    def check_parallel(self, info: ModelInfo, frames: int, height: int, width: int, world: int):
        config = info.config
        if config.attention != "dense":
            raise ValueError(
                "sequence parallel for Wan runs dense attention only (not 3D-DSA or sage)"
            )
        heads = config.heads
        grid = config.token_grid(frames, height, width)
        if heads % world or math.prod(grid) % world:
            raise ValueError(
                f"sequence parallel over {world} devices needs the heads ({heads}) and the "
                f"token count ({'x'.join(map(str, grid))}) to be multiples of {world}"
            )
        if (config.vace or config.animate) and math.prod(grid[1:]) % world:
            # Reference images (VACE) and the character's frame and segments (Animate) add or
            # set latent frames apart from the clip's: a frame's tokens must split alone.
            raise ValueError(
                f"sequence parallel of a {'VACE' if config.vace else 'Animate'} model over "
                f"{world} devices needs a frame's tokens ({'x'.join(map(str, grid[1:]))}) to be "
                f"a multiple of {world}"
            )

    def kept_across_steps(self, info: ModelInfo, rows: int, dtype_bytes: int) -> int:
        # Each row's cross-attention keys and values of its 512 text tokens (prompt_cache.py;
        # fp32 rows keep fewer) and Wan2.1-I2V's image tokens (its CLIP ViT-H/14 at 224 pixels:
        # 256 patches and the class token; FLF2V's two images, twice), within the pipeline's budget.
        # VACE's blocks keep theirs too.
        c = info.config
        tokens = TEXT_TOKENS + (257 * (1 + c.first_last_frame) if c.image_encoder else 0)
        per_row = tokens * 2 * c.dim * (c.depth + len(c.vace_layers)) * dtype_bytes
        return min(WanVideoPipeline.prompt_cache_bytes, rows * per_row)

    def count_parameters(self, info: ModelInfo) -> dict[str, int]:
        diffusers, transformers = libraries()
        path, config = info.source.path, info.config
        with torch.device("meta"):
            text = transformers.UMT5EncoderModel(
                transformers.UMT5Config.from_pretrained(
                    path / "text_encoder", local_files_only=True
                )
            )
            expert = _meta_transformer(diffusers, path / config.experts[0])
            vae = diffusers.AutoencoderKLWan.from_config(
                diffusers.AutoencoderKLWan.load_config(path / "vae", local_files_only=True)
            )
        # VACE's blocks stream with the blocks: each a block's size and a projection or two more.
        blocks = streamed_blocks(expert)
        n_expert, per_block = _numel(expert), max(_numel(b) for b in blocks)
        n_text, experts = _numel(text), len(config.experts)
        image = {}
        if config.image_encoder:
            clip = _meta_image_encoder(transformers, path)
            layers = clip.encoder.layers
            image = {
                "image_encoder": _numel(clip),
                "image_per_block": _numel(layers[0]),
                "image_blocks": len(layers),
            }
        return {
            "total": experts * n_expert + n_text + image.get("image_encoder", 0) + _numel(vae),
            "per_block": per_block,
            "blocks": len(blocks),
            "experts": experts,
            "denoiser": n_expert,
            "denoiser_non_block": n_expert - sum(_numel(b) for b in blocks),
            "text_encoder": n_text,
            "text_per_block": _numel(text.encoder.block[0]),
            "text_blocks": len(text.encoder.block),
            "vae": _numel(vae),
            "trainable": n_expert,  # one expert at a time; the text encoder and VAE stay frozen
            **image,
        }


def _meta_transformer(diffusers, folder: Path) -> nn.Module:
    """A WanTransformer3DModel (or WanVACETransformer3DModel or WanAnimateTransformer3DModel, as
    its config names) on the meta device (call inside `torch.device("meta")`), with the buffers
    it computes rather than stores (its rotary tables, Animate's blur kernels) built for real on
    the CPU."""
    config = diffusers.WanTransformer3DModel.load_config(folder, local_files_only=True)
    cls = {
        VACE_TRANSFORMER: diffusers.WanVACETransformer3DModel,
        ANIMATE_TRANSFORMER: diffusers.WanAnimateTransformer3DModel,
    }.get(config.get("_class_name"), diffusers.WanTransformer3DModel)
    model = cls.from_config(config)
    rope = type(model.rope)
    with torch.device("cpu"):
        model.rope = rope(
            model.rope.attention_head_dim, model.rope.patch_size, model.rope.max_seq_len
        )
    if hasattr(model, "motion_encoder"):
        # Animate's motion encoder blurs with a FIR kernel its convolutions compute, not store
        # (a buffer outside the state dict): without this it would be uninitialised memory.
        # Its residual blocks all take the default kernel, so a one-channel block's is theirs.
        from diffusers.models.transformers.transformer_wan_animate import MotionEncoderResBlock

        with torch.device("cpu"):
            kernel = MotionEncoderResBlock(1, 1).conv2.blur_kernel
        for module in model.motion_encoder.modules():
            if getattr(module, "blur", False):
                module.blur_kernel = kernel.clone()
    return model


def _check_trainable(info: ModelInfo) -> None:
    if info.config.vace:
        raise ValueError(
            f"{info.name} is a VACE model: fine-tuning trains on captioned clips without VACE's "
            "conditioning, so it takes text-to-video Wan models (and TI2V) only"
        )
    if info.config.image_condition:
        raise ValueError(
            f"{info.name} is an image-to-video model: fine-tuning trains on captioned clips "
            "without an image condition, so it takes text-to-video Wan models (and TI2V) only"
        )


def _meta_image_encoder(transformers, path: Path) -> nn.Module:
    """Wan2.1-I2V's CLIPVisionModel on the meta device, with its position ids, which it computes
    rather than stores, built for real on the CPU."""
    config = transformers.CLIPVisionConfig.from_pretrained(
        path / "image_encoder", local_files_only=True
    )
    with torch.device("meta"):
        model = transformers.CLIPVisionModel(config)
    embeddings = model.embeddings
    embeddings.position_ids = torch.arange(embeddings.num_positions).expand((1, -1))  # (1, N)
    return model


def _clip_weights(folder: Path) -> RenamedWeights:
    """CLIPVisionModel's weights in transformers 5's names. Files written by transformers 4 (the
    published Wan2.1-I2V ones) put `vision_model.` in front of every key; transformers 5's model
    has no such level and strips it when it loads them (the `PrefixChange` of its conversion
    mapping), as this key map does."""
    file = SafetensorsFile(weight_files(folder))
    return RenamedWeights(file, {k.removeprefix("vision_model."): k for k in file})


def _single_file(config: WanConfig, folder: str, expert: nn.Module):
    """An expert's weights from its single file, checked against the model built on meta."""
    from .single_file import SingleFileWeights

    weights = SingleFileWeights(config.transformer_files[config.experts.index(folder)])
    weights.check({k: tuple(v.shape) for k, v in expert.state_dict().items()})
    return weights


def _noised(scheduler, latent: torch.Tensor, noise: torch.Tensor, start: int) -> torch.Tensor:
    """`latent` noised to the scheduler's timestep `start`, as WanVideoToVideoPipeline does it:
    by the scheduler's `add_noise`, or the flow-matching schedulers' `scale_noise`."""
    timestep = scheduler.timesteps[start : start + 1]  # (1,)
    if hasattr(scheduler, "add_noise"):
        return scheduler.add_noise(latent, noise, timestep)
    return scheduler.scale_noise(latent, timestep, noise)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@dataclass
class WanState:
    """One request on its way from noise to a clip."""

    video: ResolvedVideo
    latents: torch.Tensor  # (1, C, F', H', W') fp32, as the scheduler keeps them
    context: torch.Tensor  # (1 or 2, 512, text_dim): the prompt, then the negative when guided
    scheduler: object  # this request's own scheduler (UniPC keeps a history)
    grid: tuple[int, int, int]  # token grid of the latents
    # With a first-frame image, as the model's config says (config.py):
    # - TI2V: `condition` is the image's normalised latent `(1, C, 1, H', W')`, and `mask` `(1, 1,
    #   F', H', W')` is 0 on the first latent frame (taken from the image) and 1 elsewhere;
    # - I2V (`image_condition`): `condition` `(1, 4 + C, F', H', W')` fp32 is the mask of the
    #   frames given and the latent of the image and black frames, the input's extra channels;
    #   `mask` is None. `image_embeds`: Wan2.1-I2V's CLIP features `(1, N, image_dim)`, or
    #   FLF2V's of the first and the last frame `(2, N, image_dim)`.
    condition: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    # Animate: the pose video's latents `(1, C, F', H', W')` and the face video `(1, 3, F,
    # face, face)` in [-1, 1], both in the model's dtype (the character image's latent frame is
    # `condition`'s first, its CLIP features `image_embeds`, and `references` is 1).
    pose: torch.Tensor | None = None
    face: torch.Tensor | None = None
    # VACE: the conditioning latents `(1, 2C + s^2, R + F', H', W')` in the model's dtype, the
    # weight of the VACE blocks' hints, and the R reference images' latent frames that lead
    # `latents` (dropped before decoding).
    control: torch.Tensor | None = None
    control_scale: float = 1.0
    references: int = 0
    cache: StepCache | None = None  # a step cache: may reuse an earlier output instead of a pass
    # Cross-attention keys and values of its rows by (expert, half), kept across steps.
    prompt_kv: dict[tuple[int, int], PromptKV] = field(default_factory=dict)
    # What the scheduler's step takes besides the output: a consistency sampler's generator
    # (samplers.py), the request's own, continued past its starting noise.
    step_args: dict = field(default_factory=dict)
    lengths: tuple[int, ...] = field(init=False)  # each prompt's tokens in `context`
    step: int = 0
    num_steps: int = field(init=False)
    row_passes: int = 0  # rows of the model's passes it ran: two a guided step, one otherwise
    keep_x0: bool = False  # keep `x0`, the clean clip its last step predicted (previews)
    x0: torch.Tensor | None = None
    # The guidance direction for the steps a guidance interval leaves out (loop.py).
    guidance_memory: GuidanceMemory | None = None
    # Video-to-video: the schedule's steps skipped (the scheduler's timesteps from this one on).
    start: int = 0
    # Animate: the clip's segments (animate.py). `step` and `num_steps` count the steps of all
    # of them; each segment runs the schedule's `segment_steps` from its start.
    segments: Segments | None = None
    segment_steps: int = field(init=False)

    def __post_init__(self):
        self.segment_steps = len(self.scheduler.timesteps) - self.start
        self.num_steps = self.segment_steps * (1 if self.segments is None else self.segments.count)
        # The encoder zeroes the positions past a prompt's end (encoders.py): its length is up
        # to the last token that is not all zeros.
        tokens = self.context.ne(0).any(dim=-1)  # (rows, 512)
        last = torch.arange(1, tokens.shape[1] + 1, device=tokens.device) * tokens
        self.lengths = tuple(int(n) for n in last.amax(dim=1))  # host sync: once per request

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    def _in_segment(self, step: int) -> int:
        """The scheduler's index of `step` (of all the request runs): its segment's own."""
        index = 0 if self.segments is None else self.segments.index
        return self.start + step - index * self.segment_steps

    @property
    def segment_done(self) -> bool:
        """Whether an Animate segment's steps are done and another segment follows."""
        return (
            self.segments is not None
            and not self.segments.last
            and self._in_segment(self.step) == len(self.scheduler.timesteps)
        )

    @property
    def guidance(self) -> float:
        return self.video.guidance

    @property
    def guided(self) -> bool:
        """Whether this step runs the guidance pair: WanPipeline's rule (a scale above 1), on
        the steps of the request's guidance interval."""
        return self.video.guidance > 1.0 and self.video.guided_at(self._in_segment(self.step))

    @property
    def passes(self) -> int:
        """Steps that ran a pass of the model (fewer than `step` when the cache reused)."""
        return self.step if self.cache is None else self.cache.passes

    @property
    def fine_tune(self) -> str | None:
        return self.video.fine_tune

    @property
    def timestep(self) -> torch.Tensor:
        return self.scheduler.timesteps[self._in_segment(self.step)]

    def flow_time(self, step: int) -> float:
        """The flow time (1: noise, 0: data) at `step` (of those it runs); 0 past the last."""
        timesteps = self.scheduler.timesteps
        step = self._in_segment(step)
        t = timesteps[step] if step < len(timesteps) else 0
        return float(t) / self.scheduler.config.num_train_timesteps

    def model_input(self) -> torch.Tensor:
        """The latents as the model sees them: TI2V's first frame from the image, or I2V's image
        condition as extra channels `(1, 2C + 4, F', H', W')`."""
        if self.condition is None:
            return self.latents
        if self.mask is None:
            return torch.cat([self.latents, self.condition], dim=1)
        return self.clip_latents()

    def clip_latents(self) -> torch.Tensor:
        """The latents of the clip as it stands `(1, C, F', H', W')`: TI2V's first frame is the
        image's (I2V's model denoises the first frame itself)."""
        if self.mask is None:
            return self.latents
        return (1 - self.mask) * self.condition + self.mask * self.latents


class WanVideoPipeline(Pipeline, Sampler):
    """Text-to-video sampling of a Wan model, batched at denoising-step granularity: the shared
    sampler loop (sampling/loop.py) with Wan's inputs and the model's own scheduler as the update."""

    prompt_cache_bytes: int = PROMPT_CACHE_BYTES  # 0: recompute the prompt's keys every step
    # Kept keys hold a prompt's tokens and one padding token (prompt_cache.py, fp32 passes only):
    # within a level of recomputing them, not bitwise.
    prompt_cache_compact: bool = True

    def __init__(self, info: ModelInfo, parts: dict[str, nn.Module], handles, *, batched: bool):
        super().__init__(info, handles, parts)
        diffusers, _ = libraries()
        config: WanConfig = info.config
        path = info.source.path
        self.config = config
        self.batched = batched
        self.encoders = WanEncoders(
            path, config, parts["text_encoder"], parts["vae"], parts.get("image_encoder")
        )
        self.experts = [parts[name] for name in config.experts]
        self.denoisers = tuple(config.experts)
        scheduler_class = getattr(diffusers, config.scheduler)
        self.scheduler = scheduler_class.from_pretrained(
            path, subfolder="scheduler", local_files_only=True
        )
        self.boundary = (
            config.boundary_ratio * config.num_train_timesteps
            if config.boundary_ratio is not None and len(self.experts) > 1
            else None
        )
        # LoRA adapters: factors on the device, applied per row by hooks on the experts' Linears.
        # The reference mode applies them in PEFT's own sequence: bitwise diffusers.
        self.adapters = AdapterRouter(
            self.experts, WanFamily().adaptable, self.device, self.dtype, exact=not batched
        )
        self.load_adapter = WanFamily().load_adapter
        self.expert_names = ("high", "low") if len(self.experts) > 1 else (None,)
        # The batched mode keeps each row's cross-attention keys and values across steps; the
        # reference mode recomputes them, as WanPipeline does.
        self.prompt_caches = [PromptCache(m) for m in self.experts] if batched else None
        self._keep: set[int] = set()  # ids of the states keeping keys and values this step
        if batched:  # the reference mode decodes with diffusers' own norms: bitwise its frames
            fast_vae_norms(self.encoders.vae)
        else:  # the elementwise chains fused, bitwise diffusers' (vae_decode.py)
            fuse_chains(self.encoders.vae, norm="exact")

    @property
    def device(self) -> torch.device:
        return self.encoders.device

    @property
    def dtype(self) -> torch.dtype:
        return self.experts[0].proj_out.weight.dtype

    def parallelize(self, sp) -> None:
        """Each expert's tokens split over the ranks of `sp` by diffusers' own Ulysses context
        parallelism (its `_cp_plan` hooks shard the tokens and rotary tables at the first block
        and gather them at `proj_out`; its attention dispatch does the all-to-alls).

        The gather after `proj_out` is a forward hook of ours in place of diffusers' (which wraps
        the layer's forward): an adapter's delta on `proj_out` (a forward hook put first,
        lora.py) then adds to this rank's tokens' output, from this rank's tokens, before the
        gather, as every other adapted layer does.

        Animate (diffusers gives its transformer no plan: Wan's fits, the pose tokens being added
        before the split at the first block): each face adapter attends frame by frame, its
        queries grouped into the latent frames (`unflatten(1, (T, -1))`) against each frame's
        motion vectors, so it must see whole frames. It sees all the tokens: hooks of ours gather
        them before it and keep this rank's shard of its output after, and its attention runs
        without the Ulysses all-to-alls (no parallel config on its processor). Its compute is
        repeated on every rank (a projection in and out and an attention over a few motion
        tokens per frame, once every `inject_face_latents_blocks` blocks) and each call gathers
        the tokens once; its output is the one-process output's rows, op for op."""
        from diffusers import ContextParallelConfig, WanTransformer3DModel
        from diffusers.hooks.context_parallel import apply_context_parallel
        from diffusers.models._modeling_parallel import ContextParallelInput, ParallelConfig
        from torch.distributed.device_mesh import init_device_mesh

        from ..parallel.sequence import gather_tokens

        if sp.group is not None:
            raise ValueError("Wan sequence parallel runs over the default process group")
        # `enable_parallelism` would do this, but it places rank r on accelerator r and has no
        # CPU path; the same steps with this rank's own device.
        cp = ContextParallelConfig(ulysses_degree=sp.world)
        config = ParallelConfig(context_parallel_config=cp)
        mesh = init_device_mesh(self.device.type, cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
        config.setup(sp.rank, sp.world, self.device, mesh=mesh)
        for expert in self.experts:
            expert._parallel_config = config
            faces = set(getattr(expert, "face_adapter", ()))  # Animate's: they see every token
            for module in expert.modules():
                processor = getattr(module, "processor", None)
                if hasattr(processor, "_parallel_config") and module not in faces:
                    processor._parallel_config = config
            for face in faces:
                face.register_forward_pre_hook(
                    lambda module, args: (gather_tokens(args[0], sp), *args[1:])  # (B, N, D)
                )
                face.register_forward_hook(
                    lambda module, args, out: out[:, sp.shard(out.shape[1])]  # (B, n, D)
                )
            # diffusers gives its VACE transformer no plan: Wan's, with the VACE blocks' two token
            # inputs split where they enter (VACE block 0), so each rank's hints are its tokens'.
            plan = dict(expert._cp_plan or WanTransformer3DModel._cp_plan)
            if self.config.vace:
                split = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
                plan["vace_blocks.0"] = {"hidden_states": split, "control_hidden_states": split}
            plan = {k: v for k, v in plan.items() if k != "proj_out"}
            apply_context_parallel(expert, cp, plan)
            expert.proj_out.register_forward_hook(
                lambda module, args, out: gather_tokens(out, sp)  # (B, N, pt*ph*pw*C)
            )
        self.sp = sp

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """UMT5 embeddings `(B, 512, text_dim)` in the denoiser's dtype, zero past each prompt:
        in one pass, or on a CPU with the encoder resident CPU_ROWS_PER_PASS prompts a pass."""
        size = len(prompts) if self.one_pass("text_encoder") else CPU_ROWS_PER_PASS
        parts = [
            self.encoders.prompts(prompts[i : i + size])[0] for i in range(0, len(prompts), size)
        ]
        return torch.cat(parts).to(self.device, self.dtype)

    # -- sampling ------------------------------------------------------------------------------

    def _prepare_batch(self, videos: list[ResolvedVideo]) -> list[WanState]:
        checked = []
        for video in videos:
            # The adapters it names must be registered here (a request stored elsewhere may not
            # know); those registered are every tenant's, so the refusal lists none.
            check_loras(video.loras, self.info.limits, self.adapter_defaults(), list_known=False)
            # nor its rules for images and videos (an older card's)
            check_image(video.image, self.info.limits)
            check_last_image(video.last_image, video.image, video.frames, self.info.limits)
            check_video(video.video, video.strength, video.image, self.info.limits)
            scale = check_vace(video, video.frames, self.info.limits)
            if scale is not None and video.conditioning_scale is None:  # the default, as resolved
                video = replace(video, conditioning_scale=scale)
            segments = check_animate(video, video.frames, self.info.limits)
            if segments is not None:  # one resolved before its segments were fields: the defaults
                length, carried = segments
                video = replace(
                    video, segment_frame_length=length, prev_segment_conditioning_frames=carried
                )
            checked.append(video)
        contexts = self._contexts(checked)
        return [self._prepare(video, context) for video, context in zip(checked, contexts)]

    def _contexts(self, videos: list[ResolvedVideo]) -> list[torch.Tensor]:
        """Each request's prompt embeddings `(1 or 2, 512, text_dim)`: the prompt, then the
        negative prompt when guided. Batched, every distinct prompt of every request together
        (`encode`: a streamed encoder's weights cross once for all); the reference mode encodes
        each prompt alone, as WanPipeline does."""
        rows = [[v.prompt, v.negative_prompt][: 1 + (v.guidance > 1.0)] for v in videos]
        if not self.batched:
            return [torch.cat([self.encode([p]) for p in prompts]) for prompts in rows]
        unique, where = distinct([p for prompts in rows for p in prompts])
        context = self.encode(unique)[torch.tensor(where)]  # (sum rows, 512, D)
        return list(context.split([len(prompts) for prompts in rows]))

    def _prepare(self, video: ResolvedVideo, context: torch.Tensor) -> WanState:
        # VACE's reference images lead the clip, a latent frame each (WanVACEPipeline draws the
        # noise for `frames + R * vae_temporal` pixel frames).
        # Animate: the character image's latent frame leads each segment the same way.
        references = 1 if self.config.animate else len(video.reference_images)
        length = video.segment_frame_length if self.config.animate else video.frames
        frames = length + references * self.config.vae_temporal
        shape = (1, *self.config.latent_shape(frames, video.height, video.width))
        # Video-to-video: the input video's latent, encoded before the noise is drawn, as
        # WanVideoToVideoPipeline does (the VAE's mode draws nothing from the generator).
        source = self._video_latents(video) if video.video is not None else None
        # Drawn on the CPU from the request's own generator: the same seed gives the same start on
        # every device and whatever else is in the batch (WanPipeline with a CPU generator).
        generator = torch.Generator().manual_seed(video.seed)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        scheduler = self._scheduler(video)
        start = len(scheduler.timesteps) - kept_steps(video.steps, video.strength)
        if source is not None:
            # Its steps and the noise's level count from the first step kept.
            scheduler.set_begin_index(start)
            latents = _noised(scheduler, source, latents, start)
        grid = self.config.token_grid(frames, video.height, video.width)
        cache = StepCache.from_spec(video.cache, self.step_curve)
        segments = None
        if self.config.animate:  # the input videos read, the character's latent frame encoded
            segments = prepare_segments(self.encoders, self.config, video, generator)
        state = WanState(
            video, latents, context, scheduler, grid, cache=cache, start=start, segments=segments
        )
        state.references = references
        if video.sampler == "consistency":
            state.step_args["generator"] = generator
        if video.guidance_interval is not None:
            state.guidance_memory = GuidanceMemory()
        if self.config.animate:
            self._animate_condition(state)
        elif video.image is not None:
            self._condition(state)
        if self.config.vace:
            self._vace_condition(state)
        return state

    def _scheduler(self, video: ResolvedVideo):
        """The request's own scheduler, at its first step: the model's (with the request's or an
        adapter's shift), or a flow scheduler over the request's timesteps (samplers.py)."""
        if video.sampler != "scheduler":
            shift = self.info.sampling.shift if video.shift is None else video.shift
            train = self.config.num_train_timesteps
            sigmas = timestep_sigmas(video.timesteps, shift, train)
            return flow_scheduler(video.sampler, sigmas, train, self.device)
        scheduler = copy.deepcopy(self.scheduler)
        if video.shift is not None:  # the request's or an adapter's own shift
            key = "flow_shift" if "flow_shift" in scheduler.config else "shift"
            scheduler = type(scheduler).from_config(scheduler.config, **{key: video.shift})
        scheduler.set_timesteps(video.steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    @torch.no_grad()
    def _video_latents(self, video: ResolvedVideo) -> torch.Tensor:
        """The input video's normalised latent `(1, C, F', H', W')` fp32, as
        WanVideoToVideoPipeline encodes it: its first `frames` frames resized to the clip by
        diffusers' own video processor, then the VAE's mode."""
        from diffusers.video_processor import VideoProcessor

        processor = VideoProcessor(vae_scale_factor=self.config.vae_spatial)
        pixels = _video_pixels(processor, video.video, video.frames, video.height, video.width)
        return self.encoders.clip(pixels)  # (1, C, F', H', W')

    @torch.no_grad()
    def _condition(self, state: WanState) -> None:
        """Condition `state` on its first-frame image, as WanImageToVideoPipeline does: the image
        resized to the clip by diffusers' own video processor and encoded by the VAE (I2V: followed
        by black frames, the clip's length in all), and Wan2.1-I2V's CLIP features of it; with a
        last frame, that image closes the black frames (and FLF2V's CLIP features are both
        images')."""
        from diffusers.video_processor import VideoProcessor
        from PIL import Image

        video, (_, _, frames, h, w) = state.video, state.latents.shape
        processor = VideoProcessor(vae_scale_factor=self.config.vae_spatial)
        images = []
        for file in (video.image, video.last_image):
            if file is not None:
                with Image.open(file) as image:
                    images.append(image.convert("RGB"))
        pixels = [
            processor.preprocess(image, height=video.height, width=video.width)
            .to(torch.float32)
            .unsqueeze(2)  # (1, 3, 1, H, W) in [-1, 1]
            for image in images
        ]
        if not self.config.image_condition:  # TI2V: the image's latent is the first frame
            state.condition = self.encoders.clip(pixels[0])  # (1, C, 1, H', W')
            state.mask = torch.ones((1, 1, frames, h, w), dtype=torch.float32, device=self.device)
            state.mask[:, :, 0] = 0
            return
        first, *last = pixels
        black = first.new_zeros((1, 3, video.frames - len(pixels), video.height, video.width))
        latent = self.encoders.clip(torch.cat([first, black, *last], dim=2))  # (1, C, F', H', W')
        # One mask channel per pixel frame of a latent frame (the first latent frame holds the
        # image alone, repeated): 1 where the frame is given.
        given = torch.zeros((1, self.config.vae_temporal, frames, h, w), device=self.device)
        given[:, :, 0] = 1
        if last:  # the clip's last pixel frame: the last channel of the last latent frame
            given[:, -1, -1] = 1
        state.condition = torch.cat([given, latent], dim=1)  # (1, 4 + C, F', H', W')
        if self.encoders.image_encoder is not None:
            # (1 or 2, N, image_dim): FLF2V's embedder lays the two images' tokens side by side.
            state.image_embeds = self.encoders.image(images).to(self.device, self.dtype)

    @torch.no_grad()
    def _vace_condition(self, state: WanState) -> None:
        """VACE's conditioning latents of `state`, as WanVACEPipeline makes them (see the module's
        docstring): the control video's and the mask's first `frames` frames resized to the clip
        by diffusers' own video processor (the mask as greyscale), the reference images fitted
        into the clip's frame on white."""
        from diffusers.video_processor import VideoProcessor

        video, config = state.video, self.config
        height, width, frames = video.height, video.width, video.frames
        processor = VideoProcessor(vae_scale_factor=config.vae_spatial)

        def clip(file: str, mode: str) -> torch.Tensor:  # (1, 1 or 3, F, H, W) in [-1, 1]
            return _video_pixels(processor, file, frames, height, width, mode)

        if video.control_video is not None:
            pixels = clip(video.control_video, "RGB")
        else:
            pixels = torch.zeros((1, 3, frames, height, width))
        if video.mask is not None:
            mask = torch.clamp((clip(video.mask, "L") + 1) / 2, min=0, max=1)  # (1, 1, F, H, W)
        else:
            mask = torch.ones_like(pixels)
        given = torch.where(mask > 0.5, 1.0, 0.0)  # 1: generate, 0: keep the control video
        inactive = self.encoders.clip(pixels * (1 - given))  # (1, C, F', H', W')
        reactive = self.encoders.clip(pixels * given)
        latents = torch.cat([inactive, reactive], dim=1)  # (1, 2C, F', H', W')
        for file in video.reference_images:  # each in front of those before: the last first
            latent = self.encoders.clip(self._reference(processor, file, height, width))
            latent = torch.cat([latent, torch.zeros_like(latent)], dim=1)  # (1, 2C, 1, H', W')
            latents = torch.cat([latent, latents], dim=2)
        # The mask (its first channel), one channel per pixel of a latent pixel, resampled to the
        # latent frames; zero on the reference images' frames.
        s = config.vae_spatial
        h, w = height // s, width // s
        folded = mask[0, 0].view(frames, h, s, w, s).permute(2, 4, 0, 1, 3).flatten(0, 1)
        latent_frames = (frames + config.vae_temporal - 1) // config.vae_temporal
        folded = torch.nn.functional.interpolate(
            folded.unsqueeze(0), size=(latent_frames, h, w), mode="nearest-exact"
        )  # (1, s^2, F', H', W')
        lead = folded.new_zeros((1, s * s, state.references, h, w))
        folded = torch.cat([lead, folded], dim=2).to(latents.device)
        control = torch.cat([latents, folded], dim=1)  # (1, 2C + s^2, R + F', H', W')
        state.control = control.to(self.device, self.dtype)
        state.control_scale = video.conditioning_scale

    @torch.no_grad()
    def _animate_condition(self, state: WanState, prev: torch.Tensor | None = None) -> None:
        """Animate's inputs of `state`'s segment, as WanAnimatePipeline makes them (animate.py):
        the condition channels, the pose latents and the face frames; `prev`: the frames the
        segment before carries over (None for the first). The character's CLIP features once."""
        from PIL import Image

        video = state.video
        condition, pose, face = segment_inputs(
            self.encoders, self.config, video, state.segments, prev
        )
        state.condition = condition  # (1, t + C, 1 + F', H', W')
        state.pose = pose.to(self.device, self.dtype)  # (1, C, F', H', W')
        state.face = face.to(self.device, self.dtype)  # (1, 3, L, face, face)
        if state.image_embeds is None:
            with Image.open(video.image) as image:
                character = image.convert("RGB")
            state.image_embeds = self.encoders.image([character]).to(self.device, self.dtype)

    @torch.no_grad()
    def _next_segment(self, state: WanState) -> None:
        """Start `state`'s next Animate segment, as WanAnimatePipeline's loop does: the segment
        just denoised decoded (its new frames kept), its last frames carried over into the next
        one's condition, fresh noise from the request's generator and a fresh scheduler."""
        seg = state.segments
        latents = state.clip_latents()[:, :, state.references :]  # without the character's
        # The VAE is every fine-tune's (a delta may not change it: `decoders`).
        # (1, L, H, W, 3) uint8, and (1, 3, P, H, W) in [-1, 1] as the VAE decoded them
        frames, prev = self.encoders.decode_tail(latents, seg.carried)
        seg.made.append(frames[0] if seg.index == 0 else frames[0][seg.carried :])
        seg.index += 1
        # Drawn after the segment before's, on the CPU, as the pipeline's `prepare_latents`.
        noise = torch.randn(state.latents.shape, generator=seg.generator, dtype=torch.float32)
        state.latents = noise.to(self.device)
        state.scheduler = self._scheduler(state.video)
        if state.guidance_memory is not None:  # the directions were the segment before's
            state.guidance_memory = GuidanceMemory()
        if state.cache is not None:  # so were the outputs its step cache holds
            state.cache.restart()
        self._animate_condition(state, prev)

    @staticmethod
    def _reference(processor, file: str, height: int, width: int) -> torch.Tensor:
        """A reference image as WanVACEPipeline fits it into the clip's frame: at its own size
        (to the processor's multiple), scaled bilinearly to fit, centred on white; `(1, 3, 1,
        H, W)` fp32 in [-1, 1]."""
        from PIL import Image

        with Image.open(file) as image:
            image = processor.preprocess(image.convert("RGB"), None, None).float()  # (1, 3, h, w)
        h, w = image.shape[-2:]
        scale = min(height / h, width / w)
        fitted_h, fitted_w = int(h * scale), int(w * scale)
        image = torch.nn.functional.interpolate(
            image, size=(fitted_h, fitted_w), mode="bilinear", align_corners=False
        ).squeeze(0)  # (3, h', w')
        top, left = (height - fitted_h) // 2, (width - fitted_w) // 2
        canvas = torch.ones((3, height, width))
        canvas[:, top : top + fitted_h, left : left + fitted_w] = image
        return canvas[None, :, None]

    def expert(self, state: WanState) -> int:
        """The expert that owns the state's timestep (Wan2.2-A14B: the high-noise one while
        `t >= boundary_ratio * 1000`, then the low-noise one)."""
        return 0 if self.boundary is None or state.timestep >= self.boundary else 1

    def _step(self, states: list[WanState]) -> None:
        for s in states:
            # An Animate request whose segment's steps are done starts its next segment as its
            # next step begins (the segment's last latents stay in view until then): its own VAE
            # passes, before the batch's pass.
            if s.segment_done:
                self._next_segment(s)
        # The rows whose cross-attention keys and values are kept this step (prompt_cache.py).
        self._keep = self._prompt_kv_budget([s for s in states if not s.done])
        sample_step(self, states)

    # -- the sampler loop's hooks (sampling/loop.py) ----------------------------------------------------

    def forward(self, e: int, states: list[WanState]) -> list[torch.Tensor]:
        model = self.experts[e]
        if not self.batched:  # as WanPipeline does: each request alone, its conditional pass first
            (s,) = states
            return [torch.cat([self._forward(model, [s], (h,)) for h in (0, 1)[: 1 + s.guided]])]
        outputs = self._forward(model, states, (0, 1), self._keep)  # (rows, C, F', H', W')
        return list(outputs.split([2 if s.guided else 1 for s in states]))

    def cut(self, e: int, states: list[WanState]) -> WanCut:
        """The pass of `forward` cut at its blocks (forward.py), for a first-block cache: its
        inputs are those of a pass that keeps no cross-attention keys and values (and a VACE
        or Animate model's own, as `_forward` gives them)."""
        model = self.experts[e]
        *inputs, adapters = self._inputs(model, states, (0, 1))
        extra = self._control(states, (0, 1)) if self.config.vace else {}
        if self.config.animate:
            extra = self._motion(states, (0, 1))
        return WanCut(
            model, self.config.patch, tuple(inputs), adapters, self.adapters, self.sp, extra
        )

    def interleaves(self, parts: list[list]) -> bool:
        # A VACE or Animate model's fine-tunes run one pass each (the interleaved pass is not
        # built for what runs between their blocks: VACE blocks, face adapters).
        return not (self.config.vace or self.config.animate) and super().interleaves(parts)

    def update(self, s: WanState, noise: torch.Tensor) -> None:
        if s.references and s.keep_x0:
            # The loop has just set this step's prediction of the clean latents: a preview shows
            # the clip's first frame, not the reference images' frames before it.
            s.x0 = s.x0[:, :, s.references :]
        s.latents = s.scheduler.step(
            noise, s.timestep, s.latents, return_dict=False, **s.step_args
        )[0]
        s.step += 1
        if s.done:
            s.prompt_kv.clear()

    def _forward(
        self, model: nn.Module, group: list[WanState], halves, keep: set[int] = frozenset()
    ) -> torch.Tensor:
        """One pass of `model` over the rows of `group`: each request's conditional row and (when
        guided) its unconditional row, for the halves asked for; `(rows, C, F', H', W')`. When
        every request of `group` is in `keep` (ids), the cross-attentions read the rows' kept
        keys and values, or fill them in a pass on the prompt embeddings (prompt_cache.py)."""
        latents, timesteps, context, image, adapters = self._inputs(model, group, halves)
        e = self.experts.index(model)
        rows, fill = self._prompt_rows(e, group, halves, adapters, keep)
        cache = contextlib.nullcontext()
        if rows is not None:
            cache = self.prompt_caches[e].rows(
                rows, fill=fill, dtype=self.dtype, device=self.device
            )
            if not fill:  # no text or image token to embed: the keys and values are kept
                context, image = context[:, :0], None  # (B, 0, text_dim)
        vace = self._control(group, halves) if self.config.vace else {}
        if self.config.animate:
            vace = self._motion(group, halves)
        with torch.no_grad(), self.adapters.rows(adapters), cache:
            return model(
                hidden_states=latents,
                timestep=timesteps,
                encoder_hidden_states=context,
                encoder_hidden_states_image=image,
                return_dict=False,
                **vace,
            )[0]

    def _control(self, group: list[WanState], halves) -> dict:
        """VACE's inputs of a pass over `group`'s rows (in `_inputs`' order): the conditioning
        latents, and the hints' scales `(layers,)` as WanVACEPipeline gives them (the reference
        mode's one row), or `(layers, rows, 1, 1)`, each row its request's: diffusers' forward
        multiplies each hint by its layer's entry, which broadcasts over the rows."""
        controls, scales = [], []
        for s in group:
            for half in halves:
                if half == 0 or s.guided:  # both halves take the same conditioning
                    controls.append(s.control)
                    scales.append(s.control_scale)
        layers = len(self.config.vace_layers)
        if len(scales) == 1:
            scale = torch.tensor(scales * layers)  # (layers,)
        else:
            scale = torch.tensor(scales).view(1, -1, 1, 1).expand(layers, -1, 1, 1)
        return {
            "control_hidden_states": torch.cat(controls),  # (rows, 2C + s^2, R + F', H', W')
            # A few numbers a pass: queued without waiting for the device (a blocking copy
            # would wait for the passes queued before it).
            "control_hidden_states_scale": scale.to(self.dtype).to(self.device, non_blocking=True),
        }

    @staticmethod
    def _motion(group: list[WanState], halves) -> dict:
        """Animate's inputs of a pass over `group`'s rows (in `_inputs`' order): the pose
        latents, the same for both halves, and the face frames, all -1 on an unconditional row
        (WanAnimatePipeline blanks the face for guidance)."""
        poses, faces = [], []
        for s in group:
            for half in halves:
                if half == 0 or s.guided:
                    poses.append(s.pose)
                    faces.append(s.face if half == 0 else torch.full_like(s.face, -1.0))
        return {
            "pose_hidden_states": torch.cat(poses),  # (rows, C, F', H', W')
            "face_pixel_values": torch.cat(faces),  # (rows, 3, F, face, face)
        }

    @property
    def _compact_prompt_kv(self) -> bool:
        """Whether kept entries hold a prompt's tokens and one padding token (fp32 passes only:
        in bf16 the padding token's `log n` bias would be rounded)."""
        return self.prompt_cache_compact and self.dtype == torch.float32

    def _prompt_kv_budget(self, states: list[WanState]) -> set[int]:
        """The ids of the states that keep cross-attention keys and values this step: in order,
        while their entries' total fits `prompt_cache_bytes`; the others drop theirs."""
        if self.prompt_caches is None:
            return set()
        compact = self._compact_prompt_kv
        total, keep = 0, set()
        for s in states:
            # Image tokens of a row: one image's, or FLF2V's two side by side.
            image = 0 if s.image_embeds is None else s.image_embeds.shape[:2].numel()
            model = self.experts[self.expert(s)]
            need = sum(
                entry_bytes(model, image + PromptKV(length=n, compact=compact).kept, self.dtype)
                for n in s.lengths
            )
            if total + need <= self.prompt_cache_bytes:
                total += need
                keep.add(id(s))
            else:
                s.prompt_kv.clear()
        return keep

    def _prompt_rows(self, e: int, group: list[WanState], halves, adapters, keep: set[int]):
        """The kept keys and values of a pass's rows (in `_inputs`' order) for expert `e`, and
        whether the pass must fill them: some row has none, or one computed with other adapters.
        None when a request of `group` keeps none."""
        if not keep or any(id(s) not in keep for s in group):
            return None, False
        depth = self.prompt_caches[e].depth
        slots, fill = [], False
        for s in group:
            for key in [k for k in s.prompt_kv if k[0] != e]:  # an expert it has left
                del s.prompt_kv[key]
            for half in halves:
                if half == 1 and not s.guided:
                    continue
                named = adapters[len(slots)]
                signature = tuple((self.adapters.adapters[n], float(c)) for n, c in named)
                entry = s.prompt_kv.get((e, half))
                fill = fill or entry is None or not entry.valid(signature, depth)
                slots.append((s, half, signature, entry))
        if fill:  # every row refilled: the pass computes them all anyway
            compact = self._compact_prompt_kv
            for s, half, signature, _ in slots:
                length = s.lengths[half]
                s.prompt_kv[(e, half)] = PromptKV(signature, length, compact)
        return [s.prompt_kv[(e, half)] for s, half, _, _ in slots], fill

    def _inputs(self, model: nn.Module, group: list[WanState], halves):
        """The rows of a pass of `model` over `group` (the halves asked for): latents, timesteps,
        text context, Wan2.1-I2V's CLIP features (None without), and each row's adapters."""
        latents, timesteps, context, images, adapters = [], [], [], [], []
        expert = self.expert_names[self.experts.index(model)]
        for s in group:
            for half in halves:
                if half == 1 and not s.guided:
                    continue
                latents.append(s.model_input())
                timesteps.append(self._timestep(s))
                context.append(s.context[half : half + 1])
                images.append(s.image_embeds)  # both halves see the image, as in diffusers
                # Both halves of a guidance pair take the request's adapters, as diffusers does.
                adapters.append(
                    [(c.name, c.scale) for c in s.video.loras if c.expert in (None, expert)]
                )
        if self.config.attention == "dsa":
            from .attention import set_grid

            set_grid(model, group[0].grid)  # a batch shares one latent shape
        # Every row of a model with an image encoder has its image (it is required).
        # (rows, N, image_dim); FLF2V's (2 rows, N, image_dim), a row's two images together.
        image = torch.cat(images) if images[0] is not None else None
        latents = torch.cat(latents).to(self.dtype)
        return latents, torch.cat(timesteps), torch.cat(context), image, adapters

    def _timestep(self, s: WanState) -> torch.Tensor:
        """The timestep input of one row: `(1,)`, or one per token with `expand_timesteps`."""
        t = s.timestep
        if not self.config.expand_timesteps:
            return t.expand(1)
        _, ph, pw = self.config.patch
        if s.mask is not None:  # the image's tokens are clean: timestep 0
            mask = s.mask[0, 0]
        else:
            mask = torch.ones(s.latents.shape[2:], dtype=torch.float32, device=s.latents.device)
        return (mask[:, ::ph, ::pw] * t).flatten().unsqueeze(0)  # (1, tokens)

    def decode_preview(self, x0: torch.Tensor) -> np.ndarray:
        """The first frame alone: Wan's VAE decodes its first latent frame into one frame."""
        return self.encoders.decode(x0[:, :, :1])[:, 0]  # (B, H, W, 3)

    def finish_batch(self, states: list[WanState]) -> list[np.ndarray]:
        frames: list[list[np.ndarray]] = [[] for _ in states]
        for i, chunk in self.finish_batch_chunks(states):
            frames[i].append(chunk)
        return [np.concatenate(chunks) for chunks in frames]  # (F, H, W, 3) each

    def finish_batch_chunks(self, states: list[WanState]) -> Iterator[tuple[int, np.ndarray]]:
        """`finish_batch` a latent frame's pixels at a time (1 frame, then 4 with Wan's VAEs):
        `(i, chunk)`, uint8 `(f, H, W, 3)` chunks of `states[i]` as the VAE decodes them, the
        clips of one VAE pass (`decode_chunk` of them) a chunk of each in turn, one pass after
        the other. The same VAE calls on the same tensors as decoding each pass whole; an
        Animate clip's chunks are stitched after its earlier segments' frames and cut to the
        clip's length (`Segments.stitch_chunks`)."""
        for state in states:
            if not state.done:
                raise RuntimeError(f"state is at step {state.step} of {state.num_steps}")
        # (1, C, F', H', W') each, without VACE's reference frames
        latents = [s.clip_latents()[:, :, s.references :] for s in states]
        # The reference mode decodes each clip alone, as WanPipeline does one request.
        chunk = self.decode_chunk if self.batched else 1
        for rows in decode_chunks([x.shape for x in latents], chunk):
            decoded = self.encoders.frames(torch.cat([latents[i] for i in rows]))  # (B, f, ...)
            streams = []
            for row, stream in zip(rows, _rows_of(decoded, len(rows))):
                segments = states[row].segments
                if segments is not None:  # Animate: after the segments before, to its length
                    stream = segments.stitch_chunks(stream, states[row].video.frames)
                streams.append((row, stream))
            while streams:  # a chunk of each clip in turn, as long as it has chunks
                for row, stream in list(streams):
                    frames = next(stream, None)
                    if frames is None:
                        streams.remove((row, stream))
                    else:
                        yield row, frames


def _video_pixels(processor, file: str, frames: int, height: int, width: int, mode="RGB"):
    """`file`'s first `frames` frames (ValueError naming it when it holds fewer) in `mode`,
    resized to the clip by diffusers' video processor `processor`: `(1, 1 or 3, F, H, W)` fp32
    in [-1, 1]."""
    from PIL import Image

    from ..video import read_video

    images = [
        Image.fromarray(f).convert(mode)
        for f in read_video(file, num_frames=frames, sampling="first")  # (F, H, W, 3) uint8
    ]
    return processor.preprocess_video(images, height=height, width=width).float()


def _rows_of(decoded: Iterator[np.ndarray], rows: int) -> list[Iterator[np.ndarray]]:
    """One iterator of `(f, H, W, 3)` chunks per row of a batched decode's `(B, f, H, W, 3)`
    chunks: each draws the decoder on when its own chunks run out, and keeps the other rows'
    for them (a chunk or two: the rows are drawn in turn)."""
    waiting: list[collections.deque] = [collections.deque() for _ in range(rows)]
    done = [False] * rows

    def draw() -> bool:
        chunk = next(decoded, None)
        if chunk is None:
            return False
        for k, frames in enumerate(chunk):
            if not done[k]:  # a row its consumer stopped drawing keeps nothing
                waiting[k].append(frames)
        return True

    def row(k: int) -> Iterator[np.ndarray]:
        try:
            while waiting[k] or draw():
                yield waiting[k].popleft()
        finally:
            done[k] = True
            waiting[k].clear()

    return [row(k) for k in range(rows)]
