"""The MegaSlide video Diffusion Transformer, as plain math (its config is in config.py).

A clip `(B, C, F, H, W)` is cut into 3D patches `(pt, ph, pw)`, giving a token grid `(T, Y, X)`
and `N = T * Y * X` tokens of width `dim`. Each block applies self-attention over all video tokens
(3D RoPE positions, dense SDPA or 3D Deformable Slide Attention), cross-attention to text tokens
and an MLP, modulated by the timestep through adaLN-Zero. The velocity for rectified flow comes
out of a zero-initialised final layer and is folded back into a clip of the input's shape.

The model knows nothing of devices, streaming or I/O: those are transforms applied to a built
model (see `streaming/streamer.py`). A layer with an initialisation of its own says so in
`reset_parameters`, which runs after its children's (as the constructor does), so a model built on
the meta device can be given the same random weights part by part (see `initialization.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import DiTConfig

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
    """Multi-head self-attention over all video tokens: dense, 8-bit, or 3D Deformable Slide
    Attention."""

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
        # Dense attention never reads the head: freeze it there so training leaves it untouched
        # (no weight decay on a parameter the loss cannot see).
        self.motion.requires_grad_(config.attention == "dsa")
        self.aux_loss: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """After the layers' own initialisation: the motion head starts at zero."""
        nn.init.zeros_(self.motion.weight)
        nn.init.zeros_(self.motion.bias)

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int], angles: torch.Tensor):
        B, N, D = x.shape
        q, k, v = (
            self.qkv(x).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        )  # (B, h, N, d) x3
        q, k = self.q_norm(q), self.k_norm(k)  # QK-norm keeps logits bounded in low precision
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        motion = None
        if self.backend == "dsa":
            motion = self.motion_field(x, grid)  # (B, h, nT, nY, nX, 2)
            if self.training and torch.is_grad_enabled() and self.motion.weight.requires_grad:
                # Picked up (and cleared) by the training loop, which adds it to the loss; see
                # `motion_field` for why the head learns from this and not from the output.
                self.aux_loss = motion_consistency_loss(k, motion, grid, self.tile)
        o = self.attend(q, k, v, grid, motion)  # (B, h, N, d)
        return self.out(o.transpose(1, 2).reshape(B, N, D))  # (B, N, D)

    def attend(self, q, k, v, grid, motion=None) -> torch.Tensor:
        """The attention itself, `(B, h, N, d)` x3 -> `(B, h, N, d)`: heads are independent here,
        the one place a transform may regroup tokens and heads (see `parallel/sequence.py`)."""
        if self.backend == "dense":
            return F.scaled_dot_product_attention(q, k, v)  # (B, h, N, d)
        if self.backend == "sage":
            from megaslide.kernels import sage_attention

            # The kernel's layout is (B, N, h, d): transposed views, no copies.
            o = sage_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return o.transpose(1, 2)  # (B, h, N, d)
        from megaslide.kernels import dsa_attention

        return dsa_attention(
            q, k, v, grid=grid, tile=self.tile, window=self.window, motion=motion.detach()
        )  # (B, h, N, d)

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
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """After the layers' own initialisation: zero modulation, and a zero cross-attention
        output (that path has no gate, so its projection starts at zero instead)."""
        nn.init.zeros_(self.modulation)
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


class ZeroProjection(nn.Sequential):
    """SiLU and a linear map that starts at zero: the shared adaLN-Zero modulation."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__(nn.SiLU(), nn.Linear(dim, out_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self[1].weight)
        nn.init.zeros_(self[1].bias)


class FinalLayer(nn.Module):
    """adaLN-modulated norm and a zero-initialised projection back to patch pixels."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.dim, elementwise_affine=False, eps=1e-6)
        self.modulation = nn.Parameter(torch.zeros(2, config.dim))
        self.linear = nn.Linear(config.dim, math.prod(config.patch) * config.in_channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero modulation and projection: a fresh model predicts zero."""
        nn.init.zeros_(self.modulation)
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
        self.time_mod = ZeroProjection(D, 6 * D)
        self.text_proj = nn.Sequential(
            nn.Linear(config.text.dim, D), nn.GELU(approximate="tanh"), nn.Linear(D, D)
        )
        # The mean of the text tokens joins the timestep embedding, so every adaLN modulation sees
        # the prompt as a whole (SD3's pooled text vector; DiT's class embedding), besides the
        # token-by-token cross-attention.
        self.text_pool = nn.Linear(D, D)
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.final = FinalLayer(config)

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

    def rows(self, index: torch.Tensor) -> BlockInputs:
        """The inputs of some rows of the batch (`index`: row numbers); positions are shared."""
        return dataclasses.replace(
            self,
            t_emb=self.t_emb[index],
            t_mod=self.t_mod[index],
            ctx=self.ctx[index],
            ctx_mask=self.ctx_mask[index],
            x=self.x[index],
            t=self.t[index],
        )


def pop_aux_losses(module: nn.Module) -> list[torch.Tensor]:
    """Auxiliary losses the layers of `module` recorded in their last training forward, cleared."""
    losses = []
    for m in module.modules():
        if getattr(m, "aux_loss", None) is not None:
            losses.append(m.aux_loss)
            m.aux_loss = None
    return losses
