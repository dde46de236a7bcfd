"""Configs of MegaSlide's own DiT, without torch: the architecture, the sampling defaults, presets.

The architecture (`DiTConfig`, with the text encoder's `TextEncoderConfig`) fixes the weights'
shapes and the maths; the sampling defaults (`SamplingDefaults`: clip shape, steps, guidance,
schedule shift) are what a request gets for a field it leaves out (diffusers keeps the same split
between a model's config and its scheduler/pipeline). A model directory stores both, under
"model" and "sampling" of its `config.json`.

Everything here is plain Python, so the server, the CLI's `info` and `plan`, and request
validation read configs without importing torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# Self-attention backends: "dense" (SDPA), "dsa" (3D-DSA, kernels/dsa.py), "sage" (8-bit attention
# over all tokens for inference, kernels/sage.py).
ATTENTION_BACKENDS = ("dense", "dsa", "sage")
TOKENIZERS = ("bytes", "words")
PREDICTIONS = ("velocity", "data")
# Distributions of training flow times (see `flow.sample_training_times`): spread over the whole
# path, next to pure noise only ("prior"), or a quarter "prior" mixed into a spread one.
_SPREAD = ("logit-normal", "noisy", "shifted", "uniform")
TIME_SAMPLING = (*_SPREAD, "prior", *(f"{kind}+prior" for kind in _SPREAD))


@dataclass(frozen=True)
class TextEncoderConfig:
    """Tokenizer, width and depth of the built-in text encoder."""

    dim: int = 128
    layers: int = 2
    heads: int = 4
    max_len: int = 128  # tokens, including BOS and EOS; longer prompts are rejected, not cut
    tokenizer: str = "bytes"  # "bytes" or "words" (see tokens.py)
    buckets: int = 4096  # hashed word ids ("words" only)

    def __post_init__(self):
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")

    @property
    def base(self) -> int:
        """Ids below this are text; PAD, BOS and EOS follow it."""
        return 256 if self.tokenizer == "bytes" else self.buckets

    @property
    def vocab_size(self) -> int:
        return self.base + 3


@dataclass(frozen=True)
class DiTConfig:
    """Architecture of a MegaSlide video DiT: what the weights' shapes and the maths depend on."""

    in_channels: int = 3  # latent channels; 3 = pixel space (identity autoencoder)
    patch: tuple[int, int, int] = (1, 4, 4)  # (pt, ph, pw) in latent frames and pixels
    dim: int = 128
    depth: int = 4
    heads: int = 4
    ffn_dim: int = 512
    text: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    autoencoder: str = "identity"  # "identity" = pixel space; anything else needs that VAE
    vae_stride: tuple[int, int, int] = (
        1,
        1,
        1,
    )  # pixels per latent (t, y, x); Wan's VAE: (4, 8, 8)
    max_frames: int = 32  # largest clip, in latent frames, that the positions are sized for
    max_size: int = 256  # largest latent height or width (pixels, for the identity autoencoder)
    rope_theta: float = 10000.0
    # Also add fixed 3D sine-cosine positions to the tokens (as DiT and Latte do). RoPE is relative:
    # in pure noise every token looks alike, so without these a token cannot tell the first frame
    # from the tenth, nor the left edge from the right, when it starts to draw a clip.
    absolute_positions: bool = False
    attention: str = "dense"  # self-attention backend: ATTENTION_BACKENDS
    dsa_tile: tuple[int, int, int] = (1, 4, 4)  # 3D-DSA tile, in tokens (t, y, x)
    dsa_window: tuple[int, int, int] = (3, 3, 3)  # 3D-DSA window, in tiles (odd)
    # What the network's last layer predicts: "velocity" (noise - data, as Wan and SD3) or "data"
    # (the clean clip, turned into a velocity in the epilogue). Predicting data suits pixel space
    # with patches wider than the model: a token cannot carry a patch's worth of noise through a
    # narrower hidden state, but a clean patch is simple (Li & He 2025, "Back to Basics").
    prediction: str = "velocity"

    def __post_init__(self):
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}"
            )
        if (self.dim // self.heads) % 2:
            raise ValueError("head dim must be even for rotary positions")
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"prediction must be one of {PREDICTIONS}, got {self.prediction!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def text_tokens(self) -> int:
        """Text tokens every block's cross-attention reads."""
        return self.text.max_len

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """`(C, F', H', W')` of the latent of a clip given in pixels (a causal VAE keeps the
        first frame alone)."""
        st, sy, sx = self.vae_stride
        latent_frames = 1 + (frames - 1) // st if st > 1 else frames
        return self.in_channels, latent_frames, height // sy, width // sx

    def token_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Token grid `(T, Y, X)` of a clip given in pixels."""
        _, f, h, w = self.latent_shape(frames, height, width)
        pt, ph, pw = self.patch
        return f // pt, h // ph, w // pw

    def check_latent(self, frames: int, height: int, width: int) -> None:
        """Raise ValueError naming the problem if a latent of this shape cannot go through the
        model (positions, patches, the 3D-DSA tiling)."""
        pt, ph, pw = self.patch
        if frames < 1 or frames > self.max_frames:
            raise ValueError(
                f"frames must be between 1 and {self.max_frames} for this model, got {frames}"
            )
        if max(height, width) > self.max_size or min(height, width) < 1:
            raise ValueError(
                f"height and width must be between 1 and {self.max_size}, got {width}x{height}"
            )
        for name, n, p in (("frames", frames, pt), ("height", height, ph), ("width", width, pw)):
            if n % p:
                raise ValueError(f"{name} ({n}) must be a multiple of the patch size {p}")
        if self.attention == "dsa":
            grid = (frames // pt, height // ph, width // pw)
            for axis, n, t, w in zip("tyx", grid, self.dsa_tile, self.dsa_window):
                if n % t or n // t < w:
                    raise ValueError(
                        f"3D-DSA needs the token grid's {axis} axis ({n}) to be a multiple of the "
                        f"tile ({t}) with at least {w} tiles"
                    )

    def replace(self, **changes) -> DiTConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DiTConfig:
        d = dict(d)
        d["text"] = TextEncoderConfig(**d.get("text", {}))
        for key in ("patch", "vae_stride", "dsa_tile", "dsa_window"):
            if key in d:
                d[key] = tuple(d[key])
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        return cls(**d)


# Samplers (engine/sampling/samplers.py holds their maths): "scheduler" walks the model's own
# schedule with its own update rule (its diffusers scheduler; our DiT's shifted Euler steps);
# "euler" and "consistency" walk an explicit list of training timesteps (a step-distilled model's
# `denoising_step_list`, 1000 = pure noise) mapped through a shift: "euler" moves along the
# predicted velocity, "consistency" predicts the clean clip and re-noises it at the next level
# with fresh noise from the request's generator (rCM, DMD and LCM samplers).
SAMPLERS = ("scheduler", "euler", "consistency")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for a field it leaves out, and the schedule a model samples with."""

    frames: int = 16  # in pixel-space frames
    height: int = 32
    width: int = 32
    fps: int = 8
    steps: int = 20
    guidance: float = 4.0
    shift: float = 3.0  # timestep shift of the Euler schedule (SD3 / Wan convention)
    # The sampler (one of SAMPLERS) and, for "euler" or "consistency", the timesteps it
    # visits (a step-distilled checkpoint's own schedule); None: spread evenly over `steps`.
    sampler: str = "scheduler"
    timesteps: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler {self.sampler!r} is unknown; known: {', '.join(SAMPLERS)}")

    def replace(self, **changes) -> SamplingDefaults:
        if changes.get("timesteps") is not None:  # JSON gives a list
            changes["timesteps"] = tuple(changes["timesteps"])
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """As a config file stores it; the sampler only when it is not the model's scheduler,
        so that a model's file reads as it always did."""
        d = dataclasses.asdict(self)
        if self.sampler == "scheduler" and self.timesteps is None:
            del d["sampler"], d["timesteps"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingDefaults:
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown sampling config keys: {unknown}")
        return cls().replace(**d)


@dataclass(frozen=True)
class Preset:
    """A named architecture with its sampling defaults."""

    model: DiTConfig
    sampling: SamplingDefaults = SamplingDefaults()


_WAN_SAMPLING = SamplingDefaults(
    frames=81, height=720, width=1280, fps=16, steps=50, guidance=5.0, shift=5.0
)
_WAN_TEXT = TextEncoderConfig(dim=4096, layers=2, heads=32)

PRESETS: dict[str, Preset] = {
    # Seconds per clip on two CPU cores; used by tests.
    "tiny": Preset(DiTConfig()),
    # The packaged default model's shape: tiny with 8x8 patches (4x fewer tokens, so four times
    # the training steps on a CPU), predicting clean patches (192 values per token against a width
    # of 128), hashed word tokens for its prompts, and absolute positions (RoPE alone cannot place
    # an object in featureless noise); an unshifted schedule suits its 32x32 pixel-space clips.
    "megaslide-tiny": Preset(
        DiTConfig(
            patch=(1, 8, 8),
            prediction="data",
            text=TextEncoderConfig(max_len=64, tokenizer="words"),
            absolute_positions=True,
            # 32x32 clips are 4x4 tokens a frame: a 3D-DSA tile is 4 frames x 1 token.
            dsa_tile=(4, 1, 1),
        ),
        SamplingDefaults(shift=1.0),
    ),
    # ~126M params: big enough that streaming its blocks costs real memory traffic on a CPU.
    "small": Preset(
        DiTConfig(
            dim=768,
            depth=12,
            heads=12,
            ffn_dim=3072,
            text=TextEncoderConfig(dim=512, layers=2, heads=8),
        )
    ),
    # Wan2.1-14B's transformer dimensions (40 blocks of width 5120, FFN 13824, 40 heads, 16-channel
    # latents from its VAE with 1x2x2 patches), in MegaSlide's own block maths.
    "wan-14b": Preset(
        DiTConfig(
            in_channels=16,
            patch=(1, 2, 2),
            dim=5120,
            depth=40,
            heads=40,
            ffn_dim=13824,
            text=_WAN_TEXT,
            autoencoder="wan-vae",
            vae_stride=(4, 8, 8),
            max_frames=21,
            max_size=160,
        ),
        _WAN_SAMPLING,
    ),
    # The flagship: ~105B params, 210 GB in bf16, which only runs with its blocks streamed.
    "megaslide-105b": Preset(
        DiTConfig(
            in_channels=16,
            patch=(1, 2, 2),
            dim=12288,
            depth=44,
            heads=96,
            ffn_dim=46080,
            text=_WAN_TEXT,
            autoencoder="wan-vae",
            vae_stride=(4, 8, 8),
            max_frames=32,
            max_size=160,
        ),
        _WAN_SAMPLING,
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
