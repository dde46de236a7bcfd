"""Text-to-video generation: prompts in, uint8 frames out.

`VideoPipeline` bundles the DiT, the text encoder and the autoencoder. It exposes the sampler
step-wise (`prepare` -> `denoise_step` ... -> `finish`) so a scheduler can batch requests at
denoising-step granularity, and `generate` for the simple case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .autoencoder import build_autoencoder
from .checkpoint import load_model
from .dit import DiTConfig, VideoDiT, get_preset
from .flow import SampleState, denoise_step, shifted_schedule
from .text import BuiltinTextEncoder
from .video import float_to_frames


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate. `None` fields take the model's defaults."""

    prompt: str
    negative_prompt: str = ""
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int = 0
    fps: int | None = None


class VideoPipeline:
    """A loaded model ready to sample clips."""

    def __init__(self, dit: VideoDiT, text_encoder: BuiltinTextEncoder, name: str = "model"):
        self.dit, self.text_encoder, self.name = dit, text_encoder, name
        self.config: DiTConfig = dit.config
        self.autoencoder = build_autoencoder(self.config.autoencoder)

    @classmethod
    def from_preset(
        cls, preset: str, *, seed: int = 0, device="cpu", dtype=torch.float32, **overrides
    ):
        """Random weights of a named preset (for tests and benchmarks), deterministic from `seed`."""
        config = get_preset(preset).replace(**overrides)
        torch.manual_seed(seed)
        dit, text = VideoDiT(config), BuiltinTextEncoder(config.text)
        return cls(dit.to(device, dtype).eval(), text.to(device, dtype).eval(), name=preset)

    @classmethod
    def from_pretrained(cls, path, *, device="cpu", dtype=None, **overrides):
        dit, text, _ = load_model(path, device=device, dtype=dtype, **overrides)
        return cls(dit, text, name=Path(path).name)

    @property
    def device(self) -> torch.device:
        return self.text_encoder.embed.weight.device

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """Fill defaults and validate; raises ValueError naming the bad field."""
        c = self.config
        r = GenerationRequest(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            frames=request.frames or c.frames,
            height=request.height or c.height,
            width=request.width or c.width,
            steps=request.steps or c.steps,
            guidance=c.guidance if request.guidance is None else request.guidance,
            seed=request.seed,
            fps=request.fps or c.fps,
        )
        if not r.prompt.strip():
            raise ValueError("prompt must not be empty")
        if r.height % 2 or r.width % 2:
            raise ValueError(
                f"size {r.width}x{r.height}: width and height must be even (H.264 yuv420p)"
            )
        if r.steps < 1:
            raise ValueError(f"steps must be at least 1, got {r.steps}")
        if r.fps < 1:
            raise ValueError(f"fps must be at least 1, got {r.fps}")
        _, frames, height, width = self.autoencoder.latent_shape(r.frames, r.height, r.width)
        self.dit.check_shape(frames, height, width)
        return r

    def prepare(self, request: GenerationRequest) -> SampleState:
        """Encode the prompts and draw the starting noise for one request."""
        r = self.resolve(request)
        prompts = [r.prompt, r.negative_prompt] if r.guidance != 1.0 else [r.prompt]
        with torch.no_grad():
            ctx, mask = self.text_encoder.encode(prompts)  # (1 or 2, L, text_dim)
        shape = (1, *self.autoencoder.latent_shape(r.frames, r.height, r.width))
        # Noise is drawn on the CPU from the request's own generator: the same seed gives the same
        # starting point on every device and whatever else is in the batch.
        noise = torch.randn(
            shape, generator=torch.Generator().manual_seed(r.seed), dtype=torch.float32
        )
        return SampleState(
            noise.to(self.device),
            ctx,
            mask,
            shifted_schedule(r.steps, self.config.shift),
            r.guidance,
        )

    def denoise_step(self, states: list[SampleState]) -> None:
        """One Euler step for every state in one batched forward pass."""
        denoise_step(self.dit, states)

    def finish(self, state: SampleState) -> np.ndarray:
        """Decode a finished state to uint8 frames `(F, H, W, 3)`."""
        if not state.done:
            raise RuntimeError(f"state is at step {state.step} of {state.num_steps}")
        with torch.no_grad():
            pixels = self.autoencoder.decode(state.latents.float())[0]  # (3, F, H, W) in [-1, 1]
        return float_to_frames(pixels, layout="CFHW")  # (F, H, W, 3) uint8, round and clip

    def generate(
        self, request: GenerationRequest, progress: Callable[[int, int], None] | None = None
    ) -> np.ndarray:
        """Sample one clip; `progress(step, total)` is called after every step."""
        state = self.prepare(request)
        for _ in range(state.num_steps):
            self.denoise_step([state])
            if progress is not None:
                progress(state.step, state.num_steps)
        return self.finish(state)
