"""The MegaSlide video Diffusion Transformer: configs, presets and the model, as plain math.

A clip `(B, C, F, H, W)` is cut into 3D patches `(pt, ph, pw)`, giving a token grid `(T, Y, X)`
and `N = T * Y * X` tokens of width `dim`. Each block applies self-attention over all video tokens
(3D RoPE positions, dense SDPA or 3D Deformable Slide Attention), cross-attention to text tokens
and an MLP, modulated by the timestep through adaLN-Zero. The velocity for rectified flow comes
out of a zero-initialised final layer and is folded back into a clip of the input's shape.

The model knows nothing of devices, streaming or I/O: those are transforms applied to a built
model (see `streaming.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .text import TextEncoderConfig

ATTENTION_BACKENDS = ("dense", "dsa")


@dataclass(frozen=True)
class DiTConfig:
    """Shape of a video DiT and the defaults it samples with."""

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
    )  # pixels per latent on (t, y, x); Wan's VAE: (4, 8, 8)
    max_frames: int = 32  # largest clip, in latent frames, that the positions are sized for
    max_size: int = 256  # largest latent height or width (pixels, for the identity autoencoder)
    rope_theta: float = 10000.0
    # Also add fixed 3D sine-cosine positions to the tokens (as DiT and Latte do). RoPE is relative:
    # in pure noise every token looks alike, so without these a token cannot tell the first frame
    # from the tenth, nor the left edge from the right, when it starts to draw a clip.
    absolute_positions: bool = False
    attention: str = "dense"  # self-attention backend: "dense" (SDPA) or "dsa" (3D-DSA)
    dsa_tile: tuple[int, int, int] = (1, 4, 4)  # 3D-DSA tile, in tokens (t, y, x)
    dsa_window: tuple[int, int, int] = (3, 3, 3)  # 3D-DSA window, in tiles (odd)
    # Sampling defaults: what `megaslide generate` uses when a flag is absent.
    frames: int = 16
    height: int = 32
    width: int = 32
    fps: int = 8
    steps: int = 20
    guidance: float = 4.0
    shift: float = 3.0  # timestep shift of the Euler schedule (SD3 / Wan convention)
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
        if self.prediction not in ("velocity", "data"):
            raise ValueError(f"prediction must be 'velocity' or 'data', got {self.prediction!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def token_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Token grid `(T, Y, X)` of a clip given in pixels (a causal VAE keeps the first frame alone)."""
        (st, sy, sx), (pt, ph, pw) = self.vae_stride, self.patch
        latent_frames = 1 + (frames - 1) // st if st > 1 else frames
        return latent_frames // pt, height // sy // ph, width // sx // pw

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
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        return cls(**d)


PRESETS: dict[str, DiTConfig] = {
    # Seconds per clip on two CPU cores; used by tests and the embedded default model.
    "tiny": DiTConfig(),
    # The embedded default model: tiny with 8x8 patches (4x fewer tokens, so four times the training
    # steps on a CPU), predicting clean patches (192 values per token against a width of 128), an
    # unshifted schedule, which suits 32x32 pixel-space clips, hashed word tokens for its prompts,
    # and absolute positions (RoPE alone cannot place an object in featureless noise).
    "megaslide-tiny": DiTConfig(
        patch=(1, 8, 8),
        shift=1.0,
        prediction="data",
        text=TextEncoderConfig(max_len=64, tokenizer="words"),
        # 32x32 clips are 4x4 tokens a frame: a 3D-DSA tile is 4 frames x 1 token.
        absolute_positions=True,
        dsa_tile=(4, 1, 1),
    ),
    # ~150M params: big enough that streaming its blocks costs real memory traffic on a CPU.
    "small": DiTConfig(
        dim=768,
        depth=12,
        heads=12,
        ffn_dim=3072,
        text=TextEncoderConfig(dim=512, layers=2, heads=8),
    ),
    # Wan2.1-14B's transformer dimensions (40 blocks of width 5120, FFN 13824, 40 heads, 16-channel
    # latents from its VAE with 1x2x2 patches).
    "wan-14b": DiTConfig(
        in_channels=16,
        patch=(1, 2, 2),
        dim=5120,
        depth=40,
        heads=40,
        ffn_dim=13824,
        text=TextEncoderConfig(dim=4096, layers=2, heads=32),
        autoencoder="wan-vae",
        vae_stride=(4, 8, 8),
        max_frames=21,
        max_size=160,
        frames=81,
        height=720,
        width=1280,
        fps=16,
        steps=50,
        guidance=5.0,
        shift=5.0,
    ),
    # The flagship: ~105B params, 210 GB in bf16, which only runs with its blocks streamed.
    "megaslide-105b": DiTConfig(
        in_channels=16,
        patch=(1, 2, 2),
        dim=12288,
        depth=44,
        heads=96,
        ffn_dim=46080,
        text=TextEncoderConfig(dim=4096, layers=2, heads=32),
        autoencoder="wan-vae",
        vae_stride=(4, 8, 8),
        max_frames=32,
        max_size=160,
        frames=81,
        height=720,
        width=1280,
        fps=16,
        steps=50,
        guidance=5.0,
        shift=5.0,
    ),
}


def get_preset(name: str) -> DiTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None


# ---------------------------------------------------------------------------------------------
# Positions


def axis_channels(d: int) -> tuple[int, int, int]:
    """Channels of `d` given to time, height and width: `2 * (d // 6)` to each spatial axis, the
    rest (at least as many) to time; all even when `d` is."""
    d_space = 2 * (d // 6)
    return d - 2 * d_space, d_space, d_space


def rope_frequencies(config: DiTConfig, grid: tuple[int, int, int], device=None) -> torch.Tensor:
    """Per-token rotary angles for a `(T, Y, X)` grid: `(N, head_dim // 2)` in fp32.

    The head dim is split across time, height and width as in Wan: each spatial axis gets
    `2 * (d // 6)` channels and time the rest, so every axis has its own frequency ladder and any
    grid up to the configured maximum gets distinct positions.
    """
    d = config.head_dim
    angles = []
    for axis, (n, dim_axis) in enumerate(zip(grid, axis_channels(d))):
        inv = config.rope_theta ** (-torch.arange(0, dim_axis, 2, device=device) / dim_axis)
        pos = torch.arange(n, device=device, dtype=torch.float32)
        a = torch.outer(pos, inv)  # (n, dim_axis // 2)
        shape = [1, 1, 1, a.shape[-1]]
        shape[axis] = n
        angles.append(a.view(shape).expand(*grid, a.shape[-1]))
    return torch.cat(angles, dim=-1).reshape(-1, d // 2)  # (N, d/2)


def sincos_positions(dim: int, grid: tuple[int, int, int], device=None) -> torch.Tensor:
    """Fixed absolute positions `(N, dim)` for a `(T, Y, X)` grid: each axis gets its share of the
    channels (`axis_channels`), half sines and half cosines of a frequency ladder."""
    parts = []
    for axis, (n, dim_axis) in enumerate(zip(grid, axis_channels(dim))):
        inv = 10000.0 ** (-torch.arange(dim_axis // 2, device=device) / (dim_axis // 2))
        a = torch.outer(
            torch.arange(n, device=device, dtype=torch.float32), inv
        )  # (n, dim_axis // 2)
        emb = torch.cat((a.sin(), a.cos()), dim=-1)  # (n, dim_axis)
        shape = [1, 1, 1, dim_axis]
        shape[axis] = n
        parts.append(emb.view(shape).expand(*grid, dim_axis))
    return torch.cat(parts, dim=-1).reshape(-1, dim)  # (N, dim)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs `(2i, 2i+1)` of `x (B, heads, N, d)` by `angles (N, d/2)`."""
    x_pairs = x.float().unflatten(-1, (-1, 2))  # (B, h, N, d/2, 2)
    cos, sin = angles.cos(), angles.sin()  # (N, d/2)
    x0, x1 = x_pairs[..., 0], x_pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)  # (B, h, N, d)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of flow times `t (B,)` in [0, 1], scaled to [0, 1000] like DiT's steps."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]  # (B, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, dim)


# ---------------------------------------------------------------------------------------------
# Layers


class SelfAttention(nn.Module):
    """Multi-head self-attention over all video tokens, dense or 3D Deformable Slide Attention."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(config.head_dim, eps=1e-6)
        self.out = nn.Linear(config.dim, config.dim)
        self.backend = config.attention
        self.tile, self.window = config.dsa_tile, config.dsa_window
        # Per-tile velocity head for 3D-DSA; zero-initialised so a fresh layer is plain sliding-tile
        # attention. See `motion_field` for how it learns.
        self.motion = nn.Linear(config.dim, 2 * config.heads)
        nn.init.zeros_(self.motion.weight)
        nn.init.zeros_(self.motion.bias)
        # Dense attention never reads the head: freeze it there so training leaves it untouched
        # (no weight decay on a parameter the loss cannot see).
        self.motion.requires_grad_(config.attention == "dsa")
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int], angles: torch.Tensor):
        B, N, D = x.shape
        q, k, v = (
            self.qkv(x).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        )  # (B, h, N, d) x3
        q, k = self.q_norm(q), self.k_norm(k)  # QK-norm keeps logits bounded in low precision
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        if self.backend == "dense":
            o = F.scaled_dot_product_attention(q, k, v)  # (B, h, N, d)
        else:
            o = self.slide_attention(x, q, k, v, grid)  # (B, h, N, d)
        return self.out(o.transpose(1, 2).reshape(B, N, D))  # (B, N, D)

    def slide_attention(self, x, q, k, v, grid):
        from megaslide.kernels import dsa_attention

        motion = self.motion_field(x, grid)  # (B, h, nT, nY, nX, 2)
        if self.training and torch.is_grad_enabled() and self.motion.weight.requires_grad:
            # Picked up (and cleared) by the training loop, which adds it to the loss; see below.
            self.aux_loss = motion_consistency_loss(k, motion, grid, self.tile)
        return dsa_attention(
            q, k, v, grid=grid, tile=self.tile, window=self.window, motion=motion.detach()
        )

    def motion_field(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Velocity `(vy, vx)` per head and query tile, in tiles per time-tile, from tile-pooled x.

        Rounding a velocity to whole tiles has no gradient, so the head cannot learn through the
        attention output. It learns instead from `motion_consistency_loss`: the pooled keys of each
        tile, moved by the predicted velocity, should land on the pooled keys of the next time-tile.
        """
        B, _, D = x.shape
        (T, Y, X), (tt, ty, tx) = grid, self.tile
        tiles = x.view(B, T // tt, tt, Y // ty, ty, X // tx, tx, D)
        pooled = tiles.mean(dim=(2, 4, 6))  # (B, nT, nY, nX, D)
        vel = self.motion(pooled).unflatten(-1, (self.heads, 2))  # (B, nT, nY, nX, h, 2)
        return vel.permute(0, 4, 1, 2, 3, 5)  # (B, h, nT, nY, nX, 2)


def motion_consistency_loss(k: torch.Tensor, motion: torch.Tensor, grid, tile) -> torch.Tensor:
    """How badly the velocities explain the keys' motion: a self-supervised signal for the motion head.

    Keys are pooled per tile (detached: only the head learns from this), and the next time-tile's
    pooled keys are sampled bilinearly at each tile's position moved by its velocity; the loss is the
    mean squared difference to the tile's own pooled keys, which is differentiable in the velocity.
    """
    B, h, N, d = k.shape
    (T, Y, X), (tt, ty, tx) = grid, tile
    nT, nY, nX = T // tt, Y // ty, X // tx
    if nT < 2 or nY < 2 or nX < 2:
        return k.new_zeros(())
    pooled = (
        k.detach().float().view(B, h, nT, tt, nY, ty, nX, tx, d).mean(dim=(3, 5, 7))
    )  # (B, h, nT, nY, nX, d)
    nxt = (
        pooled[:, :, 1:].permute(0, 1, 2, 5, 3, 4).reshape(-1, d, nY, nX)
    )  # (B*h*(nT-1), d, nY, nX)
    vel = motion[:, :, :-1].float()  # (B, h, nT-1, nY, nX, 2) as (vy, vx)
    ys = torch.arange(nY, device=k.device, dtype=torch.float32).view(nY, 1)
    xs = torch.arange(nX, device=k.device, dtype=torch.float32).view(1, nX)
    # grid_sample wants (x, y) in [-1, 1] with align_corners=True mapping -1/+1 to the first/last tile.
    gx = 2 * (xs + vel[..., 1]) / (nX - 1) - 1
    gy = 2 * (ys + vel[..., 0]) / (nY - 1) - 1
    where = torch.stack((gx, gy), dim=-1).reshape(-1, nY, nX, 2)  # (B*h*(nT-1), nY, nX, 2)
    moved = F.grid_sample(nxt, where, mode="bilinear", padding_mode="border", align_corners=True)
    here = pooled[:, :, :-1].permute(0, 1, 2, 5, 3, 4).reshape(-1, d, nY, nX)
    return F.mse_loss(moved, here)


class CrossAttention(nn.Module):
    """Attention from video tokens to text tokens, masking padded text positions."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.heads = config.heads
        self.q = nn.Linear(config.dim, config.dim)
        # No key bias: softmax is invariant to adding the same q.b to every logit of a row, so a key
        # bias would be a parameter whose true gradient is zero (and whose computed one is noise).
        self.k = nn.Linear(config.dim, config.dim, bias=False)
        self.v = nn.Linear(config.dim, config.dim)
        self.out = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor):
        B, N, D = x.shape
        L = ctx.shape[1]
        q = self.q(x).view(B, N, self.heads, -1).transpose(1, 2)  # (B, h, N, d)
        k = self.k(ctx).view(B, L, self.heads, -1).transpose(1, 2)  # (B, h, L, d)
        v = self.v(ctx).view(B, L, self.heads, -1).transpose(1, 2)  # (B, h, L, d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx_mask[:, None, None, :])
        return self.out(o.transpose(1, 2).reshape(B, N, D))  # (B, N, D)


class DiTBlock(nn.Module):
    """Self-attention, text cross-attention and MLP, with adaLN-Zero gates on the two modulated paths."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(config)
        self.norm_cross = nn.LayerNorm(config.dim, eps=1e-6)
        self.cross = CrossAttention(config)
        self.norm2 = nn.LayerNorm(config.dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, config.ffn_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(config.ffn_dim, config.dim),
        )
        # This block's share of the modulation: added to the shared timestep projection
        # (adaLN-single, as in PixArt-alpha and Wan), zero so the block starts as the identity.
        self.modulation = nn.Parameter(torch.zeros(6, config.dim))
        # The cross-attention path has no gate, so its output projection starts at zero instead.
        nn.init.zeros_(self.cross.out.weight)
        nn.init.zeros_(self.cross.out.bias)

    def forward(self, x: torch.Tensor, c: BlockInputs) -> torch.Tensor:
        mod = (c.t_mod + self.modulation).unsqueeze(2)  # (B, 6, 1, D)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(1)  # (B, 1, D) each
        x = x + gate1 * self.attn(
            self.norm1(x) * (1 + scale1) + shift1, c.grid, c.angles
        )  # (B, N, D)
        x = x + self.cross(self.norm_cross(x), c.ctx, c.ctx_mask)  # (B, N, D)
        x = x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)  # (B, N, D)
        return x


class FinalLayer(nn.Module):
    """adaLN-modulated norm and a zero-initialised projection back to patch pixels."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.dim, elementwise_affine=False, eps=1e-6)
        self.modulation = nn.Parameter(torch.zeros(2, config.dim))
        self.linear = nn.Linear(config.dim, math.prod(config.patch) * config.in_channels)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x, t_emb):
        shift, scale = (t_emb[:, None] + self.modulation).unsqueeze(2).unbind(1)  # (B, 1, D) each
        return self.linear(self.norm(x) * (1 + scale) + shift)  # (B, N, pt*ph*pw*C)


class VideoDiT(nn.Module):
    """Rectified-flow video DiT: predicts the velocity `noise - data` of a clip at flow time t."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = config
        C, D = config.in_channels, config.dim
        self.patch_embed = nn.Linear(C * math.prod(config.patch), D)
        self.time_embed = nn.Sequential(nn.Linear(256, D), nn.SiLU(), nn.Linear(D, D))
        self.time_mod = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))
        nn.init.zeros_(self.time_mod[1].weight)
        nn.init.zeros_(self.time_mod[1].bias)
        self.text_proj = nn.Sequential(
            nn.Linear(config.text.dim, D), nn.GELU(approximate="tanh"), nn.Linear(D, D)
        )
        # The mean of the text tokens joins the timestep embedding, so every adaLN modulation sees
        # the prompt as a whole (SD3's pooled text vector; DiT's class embedding), besides the
        # token-by-token cross-attention.
        self.text_pool = nn.Linear(D, D)
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.final = FinalLayer(config)

    def check_shape(self, frames: int, height: int, width: int) -> None:
        """Raise ValueError naming the problem if a clip of this shape cannot go through the model."""
        c, (pt, ph, pw) = self.config, self.config.patch
        if frames < 1 or frames > c.max_frames:
            raise ValueError(
                f"frames must be between 1 and {c.max_frames} for this model, got {frames}"
            )
        if max(height, width) > c.max_size or min(height, width) < 1:
            raise ValueError(
                f"height and width must be between 1 and {c.max_size}, got {width}x{height}"
            )
        for name, n, p in (("frames", frames, pt), ("height", height, ph), ("width", width, pw)):
            if n % p:
                raise ValueError(f"{name} ({n}) must be a multiple of the patch size {p}")
        if c.attention == "dsa":
            grid = (frames // pt, height // ph, width // pw)
            for axis, n, t, w in zip("tyx", grid, c.dsa_tile, c.dsa_window):
                if n % t or n // t < w:
                    raise ValueError(
                        f"3D-DSA needs the token grid's {axis} axis ({n}) to be a multiple of the tile ({t}) "
                        f"with at least {w} tiles"
                    )

    def patchify(self, x: torch.Tensor):
        """`(B, C, F, H, W)` -> tokens `(B, N, C*pt*ph*pw)` and the grid `(T, Y, X)`."""
        B, C, Fr, H, W = x.shape
        pt, ph, pw = self.config.patch
        T, Y, X = Fr // pt, H // ph, W // pw
        x = x.view(B, C, T, pt, Y, ph, X, pw).permute(
            0, 2, 4, 6, 1, 3, 5, 7
        )  # (B, T, Y, X, C, pt, ph, pw)
        return x.reshape(B, T * Y * X, -1), (T, Y, X)

    def unpatchify(self, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Inverse of `patchify`: `(B, N, C*pt*ph*pw)` -> `(B, C, F, H, W)`."""
        B = tokens.shape[0]
        (T, Y, X), (pt, ph, pw) = grid, self.config.patch
        C = self.config.in_channels
        x = tokens.view(B, T, Y, X, C, pt, ph, pw).permute(
            0, 4, 1, 5, 2, 6, 3, 7
        )  # (B, C, T, pt, Y, ph, X, pw)
        return x.reshape(B, C, T * pt, Y * ph, X * pw)

    def forward(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor):
        """x `(B, C, F, H, W)`, t `(B,)` in [0, 1], ctx `(B, L, text_dim)`, ctx_mask `(B, L)` bool."""
        h, c = self.prologue(x, t, ctx, ctx_mask)  # (B, N, D)
        for block in self.blocks:
            h = block(h, c)  # (B, N, D)
        return self.epilogue(h, c)  # (B, C, F, H, W)

    # The forward in three parts, so fine-tuning can run the blocks one at a time (and recompute
    # them in its backward pass) while the parts around them stay ordinary autograd.

    def prologue(self, x, t, ctx, ctx_mask) -> tuple[torch.Tensor, BlockInputs]:
        """Everything before the first block: tokens `(B, N, D)` and what every block reads."""
        tokens, grid = self.patchify(x)  # (B, N, C*pt*ph*pw)
        h = self.patch_embed(tokens)  # (B, N, D)
        if self.config.absolute_positions:
            h = h + sincos_positions(h.shape[-1], grid, device=x.device).to(h.dtype)  # (B, N, D)
        angles = rope_frequencies(self.config, grid, device=x.device)  # (N, d/2)
        ctx = self.text_proj(ctx.to(h.dtype))  # (B, L, D)
        valid = ctx_mask.unsqueeze(-1).to(h.dtype)  # (B, L, 1)
        pooled = (ctx * valid).sum(1) / valid.sum(1).clamp_min(1)  # (B, D) mean over real tokens
        t_emb = self.time_embed(timestep_embedding(t, 256).to(h.dtype)) + self.text_pool(
            pooled
        )  # (B, D)
        t_mod = self.time_mod(t_emb).unflatten(1, (6, -1))  # (B, 6, D)
        return h, BlockInputs(t_emb, t_mod, ctx, ctx_mask, grid, angles, x, t)

    def epilogue(self, h: torch.Tensor, c: BlockInputs) -> torch.Tensor:
        """Everything after the last block: tokens `(B, N, D)` -> velocity `(B, C, F, H, W)`."""
        out = self.unpatchify(self.final(h, c.t_emb), c.grid)  # (B, C, F, H, W)
        if self.config.prediction == "velocity":
            return out
        # x_t = (1 - t) x0 + t e  =>  velocity e - x0 = (x_t - x0) / t; t is floored so the division
        # stays tame at the clean end (JiT's 0.05), where the velocity matters least.
        t = c.t.float().clamp_min(0.05).view(-1, 1, 1, 1, 1)
        return ((c.x.float() - out.float()) / t).to(out.dtype)  # (B, C, F, H, W)


@dataclass
class BlockInputs:
    """What every block reads besides the hidden state: conditioning, text and positions."""

    t_emb: torch.Tensor  # (B, D) timestep embedding
    t_mod: torch.Tensor  # (B, 6, D) shared adaLN modulation
    ctx: torch.Tensor  # (B, L, D) projected text tokens
    ctx_mask: torch.Tensor  # (B, L) bool, True where a text token is real
    grid: tuple[int, int, int]  # token grid (T, Y, X)
    angles: torch.Tensor  # (N, head_dim / 2) rotary angles
    x: torch.Tensor  # (B, C, F, H, W) the noisy input, and t (B,) its flow time: the epilogue's
    t: torch.Tensor  # conversion from a data prediction to a velocity reads them


def pop_aux_losses(module: nn.Module) -> list[torch.Tensor]:
    """Auxiliary losses the layers of `module` recorded in their last training forward, cleared."""
    losses = []
    for m in module.modules():
        if getattr(m, "aux_loss", None) is not None:
            losses.append(m.aux_loss)
            m.aux_loss = None
    return losses


def count_parameters(config: DiTConfig) -> dict[str, int]:
    """Exact parameter counts of a config, built on the meta device (instant at any size)."""
    from .text import BuiltinTextEncoder

    with torch.device("meta"):
        dit, text = VideoDiT(config), BuiltinTextEncoder(config.text)
    n_dit = sum(p.numel() for p in dit.parameters())
    n_block = sum(p.numel() for p in dit.blocks[0].parameters()) if config.depth else 0
    n_text = sum(p.numel() for p in text.parameters())
    return {"total": n_dit + n_text, "dit": n_dit, "per_block": n_block, "text_encoder": n_text}
