"""Wan-like attention inputs for the 8-bit attention tests and benchmark.

`wan_like_qkv` makes q, k, v `(B, N, heads, d)` the way Wan's self-attention does: a linear
projection of hidden states, RMSNorm across all heads with a learned gain ("rms_norm_across_heads"),
then Wan's own 3D rotary positions (diffusers' `WanRotaryPosEmbed`) on a `(T, Y, X)` token grid.
Hidden states are spatially smooth (neighbouring tokens alike, as in a video latent), so attention
is peaked and local rather than uniform. `k_offset` adds a channel-wise bias to the key projection
on a few channels, the outliers trained models put in K that SageAttention's smoothing removes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rotary(d: int, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    T, Y, X = grid
    rope = WanRotaryPosEmbed(d, (1, 1, 1), max_seq_len=max(1024, T, Y, X))
    return rope(torch.zeros(1, 1, T, Y, X))  # (1, N, 1, d) each


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary positions on `(B, N, heads, d)` (the pairs `(2i, 2i+1)`)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def _smooth_field(B: int, grid, dim: int, g: torch.Generator) -> torch.Tensor:
    """(B, N, dim) hidden states: noise blurred over the token grid, plus a little white noise."""
    T, Y, X = grid
    x = torch.randn(B * dim, 1, T, Y, X, generator=g)
    kt = 3 if T >= 3 else 1
    kernel = torch.ones(1, 1, kt, 3, 3) / (kt * 9)
    pad = (1, 1, 1, 1, kt // 2, kt // 2)
    for _ in range(2):
        x = F.conv3d(F.pad(x, pad, mode="replicate"), kernel)
    x = x / x.std() + 0.3 * torch.randn(x.shape, generator=g)
    return x.view(B, dim, T * Y * X).transpose(1, 2)  # (B, N, dim)


def wan_like_qkv(
    grid: tuple[int, int, int],
    heads: int,
    d: int,
    *,
    batch: int = 1,
    gain: float = 2.0,
    k_offset: float = 0.0,
    outlier_channels: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v `(batch, N, heads, d)`, N = T*Y*X, as Wan's self-attention computes them.

    `gain` scales the RMSNorm weights (logits grow with its square: 2.0 gives rows whose
    largest probability is typically a few percent to tens of percent over thousands of keys).
    `k_offset` is the size, in units of a normed channel's typical value, of an offset on
    `outlier_channels` channels of every head's keys, shared by all tokens.
    """
    g = torch.Generator().manual_seed(seed)
    dim = heads * d
    x = _smooth_field(batch, grid, dim, g)  # (B, N, dim)
    w_q, w_k, w_v = (torch.randn(dim, dim, generator=g) / math.sqrt(dim) for _ in range(3))
    cos, sin = _rotary(d, grid)
    # Outliers sit on the channels rotary positions turn slowest, as trained models' massive
    # q/k values do (Jin et al. 2025, "Massive values in self-attention modules"): there they stay
    # a per-channel offset shared by the tokens, the pattern SageAttention measured in K.
    channels = cos[0, :, 0].var(dim=0).argsort()[:outlier_channels]
    offset = torch.zeros(heads, d)
    offset[:, channels] = k_offset * torch.randn(heads, outlier_channels, generator=g).sign()
    q, k, v = x @ w_q, x @ w_k, x @ w_v  # (B, N, dim)
    gain_q = gain * (1 + 0.2 * torch.randn(dim, generator=g))
    gain_k = gain * (1 + 0.2 * torch.randn(dim, generator=g))
    q = F.rms_norm(q, (dim,), eps=1e-6) * gain_q
    # After the norm: a learned gain on a channel the projection keeps offset, which the norm
    # cannot dilute.
    k = F.rms_norm(k, (dim,), eps=1e-6) * gain_k + gain * offset.flatten()
    q = _rotate(q.unflatten(2, (heads, d)), cos, sin)  # (B, N, heads, d)
    k = _rotate(k.unflatten(2, (heads, d)), cos, sin)
    v = v.unflatten(2, (heads, d))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact attention in float64 on `(B, N, heads, d)`: the accuracy target."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)  # (B, N, heads, d)


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (SageAttention's accuracy measure)."""
    return F.cosine_similarity(x.double().flatten(), ref.double().flatten(), dim=0).item()
