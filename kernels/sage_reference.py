"""8-bit attention (SageAttention's recipe): the quantization both backends share, and the
PyTorch reference of the attention over the quantized operands.

The operator's exact semantics are documented in `kernels/sage.py`. This file holds:

- `smooth_keys` subtracts K's mean over tokens, per (batch, head, channel). Every query sees the
  same shift `q . mean(k)` on all its logits, so softmax ignores it; what it removes is the
  channel-wise offset that trained models put in K, which would otherwise set each block's int8
  scale and leave the token-to-token differences, the part softmax reads, a few int8 steps.
- `quantize_int8` rounds a `(B, N, H, D)` tensor to int8 with one fp32 scale per group of
  tokens of one (batch, head), one per token by default, laid out `(B, H, N_padded, D)` with
  zero padding and each token's scale beside it. The Triton kernel reads exactly these tensors,
  so the two backends cannot disagree about a rounding.
- `values_fp16` turns V into the fp16 operand of the P V product, with a power-of-two scale per
  (batch, head, channel) that keeps it in fp16's range.
- `sage_attention_reference` is the readable PyTorch implementation of the attention over those
  operands, the CPU path, and (`pv="exact"`) the float64 oracle the kernel's tests use.

Nothing here imports Triton, so it works wherever torch does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The kernel's tiles: 128 query tokens per program, 64 keys per step of its loop (SageAttention's).
DEFAULT_BLOCKS = (128, 64)
# Tokens per int8 scale of Q and of smoothed K: one scale per token. SageAttention's first recipe
# shared one scale per tile, (128, 64). A scale moves every logit of its rows by up to half a step
# of the largest value it covers, and that int8 rounding of Q and K is nearly all of the recipe's
# error (P's and V's fp16 rounding cost next to nothing): on very peaked rows tile scales fell
# short of cosine 0.999 against exact attention, per-token ones meet it
# (docs/benchmarks.md#8-bit-attention). SageAttention2 likewise refines Q's and K's scales. The
# cost on a GPU: a vector of BLOCK_N fp32 scales per key tile instead of one number (1/32 of the
# int8 K tile's bytes at head dim 128) and one more multiply per score.
DEFAULT_GROUPS = (1, 1)
INT8_MAX = 127
# fp16's largest finite value is 65504; V channels whose magnitude reaches this are scaled down by
# a power of two (exact) before the cast, and the output is scaled back in fp32.
_V_LIMIT = 2.0**14
# Query rows per reference chunk, so the (rows x N) fp32 scores stay near 32 MiB per (batch, head).
_CHUNK_SCORES = 8 * 2**20


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None, blocks, groups=DEFAULT_GROUPS
) -> float:
    """Raise ValueError with a clear message on any inconsistency; return the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, N, heads, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            "q must be (B, Nq, heads, D) and k, v (B, Nk, heads, D) with the same B, heads and D, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[1] < 1 or q.shape[1] < 1:
        raise ValueError(f"q and k need at least one token, got {q.shape[1]} and {k.shape[1]}")
    block_q, block_k = blocks
    for name, b in (("query", block_q), ("key", block_k)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"the {name} block must be a power of two >= 16, got {b}")
    if len(groups) != 2 or not all(isinstance(g, int) and g >= 1 for g in groups):
        raise ValueError(f"groups must be two positive token counts (query, key), got {groups}")
    D = q.shape[-1]
    if D * INT8_MAX * INT8_MAX >= 2**24:
        # Integer dot products are exact in fp32 below 2**24 (the interpreter and the reference
        # rely on it); no attention head comes near this (Wan: 128).
        raise ValueError(f"head dim {D} is too large for exact int8 products in fp32 (max 1040)")
    if scale is None:
        return 1.0 / math.sqrt(D)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def smooth_keys(k: Tensor) -> Tensor:
    """`k - mean(k over tokens)` per (batch, head, channel), in fp32 (or fp64): `(B, N, H, D)`."""
    k = k.to(torch.promote_types(k.dtype, torch.float32))
    return k - k.mean(dim=1, keepdim=True)


def quantize_int8(x: Tensor, group: int, pad: int) -> tuple[Tensor, Tensor]:
    """int8 `(B, H, N_pad, D)` and fp32 per-token scales `(B, H, N_pad)` of `x (B, N, H, D)`,
    N_pad being N rounded up to a multiple of `pad` (the kernel's tile), both contiguous.

    Each group of `group` consecutive tokens of one (batch, head) (1: each token alone) gets
    `scale = max|x| / 127` and holds `round(x / scale)`, so `x ~ int8 * scale` with an error of at
    most half a step; every token carries its group's scale, so the kernel reads one scale per
    token whatever the grouping. Tokens past N are zero with scale 0 (they never raise a group's
    maximum); an all-zero group gets scale 0 and zeros, not 0/0. Rounding is half to even.
    """
    B, N, H, D = x.shape
    n_groups = -(-N // group)
    n_pad = -(-N // pad) * pad
    xf = x.float().transpose(1, 2)  # (B, H, N, D)
    xf = torch.nn.functional.pad(xf, (0, 0, 0, n_groups * group - N))  # (B, H, groups * group, D)
    tiles = xf.reshape(B, H, n_groups, group, D)
    scale = tiles.abs().amax(dim=(3, 4)) / INT8_MAX  # (B, H, n_groups)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(tiles / safe[..., None, None]).clamp_(-INT8_MAX, INT8_MAX)
    q = q.reshape(B, H, n_groups * group, D)[:, :, :N]  # (B, H, N, D)
    scale = scale.repeat_interleave(group, dim=2)[:, :, :N]  # (B, H, N): each token's group's
    # Contiguous: the kernel computes offsets in this layout (pad and round may keep the
    # transposed strides of x).
    q = torch.nn.functional.pad(q, (0, 0, 0, n_pad - N)).to(torch.int8).contiguous()
    return q, torch.nn.functional.pad(scale, (0, n_pad - N)).contiguous()


def values_fp16(v: Tensor) -> tuple[Tensor, Tensor]:
    """V as the fp16 operand of P V: `(v / s).half()` `(B, N, H, D)` and `s` fp32 `(B, H, D)`.

    `s` is a power of two, 1 unless a channel's magnitude reaches 2**14 (bf16 and fp32 values
    can exceed fp16's 65504, which would turn into inf and then NaN frames), so the division is
    exact and the output, a convex combination of V's rows, is multiplied back by `s` in fp32.
    """
    amax = v.detach().abs().amax(dim=1).float()  # (B, H, D)
    exponent = torch.ceil(torch.log2(amax / _V_LIMIT)).clamp_(min=0)
    s = torch.exp2(torch.nan_to_num(exponent, nan=0.0, posinf=0.0))  # nan/inf: inputs' problem
    s = s.contiguous()  # (B, H, D): the kernel reads it as such
    # Always divided (exact for a power of two in v's own dtype), so no branch on the data: a
    # host sync on a GPU, and a graph break under torch.compile.
    return (v / s[:, None].to(v.dtype)).to(torch.float16), s


def quantized_operands(
    q: Tensor, k: Tensor, v: Tensor, blocks, groups=DEFAULT_GROUPS, smooth: bool = True
):
    """What the attention reads: `(q_int8, q_scale, k_int8, k_scale, v_fp16, v_scale)`, Q and K
    padded to whole `blocks` (the kernel's tiles) with one scale per token."""
    block_q, block_k = blocks
    group_q, group_k = groups
    q8, qs = quantize_int8(q, group_q, block_q)
    k8, ks = quantize_int8(smooth_keys(k) if smooth else k, group_k, block_k)
    vh, vs = values_fp16(v)
    return q8, qs, k8, ks, vh, vs


def sage_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    blocks: tuple[int, int] = DEFAULT_BLOCKS,
    groups: tuple[int, int] = DEFAULT_GROUPS,
    smooth: bool = True,
    pv: str = "fp16",
) -> Tensor:
    """8-bit attention in PyTorch: `q (B, Nq, H, D)`, `k, v (B, Nk, H, D)` -> like q.

    Scores are the int8 products (exact integers in fp32) times the query's and the key's int8
    scales and the softmax scale, in fp32; the softmax is taken over all keys at once (the kernel's online
    softmax gives the same values up to rounding). `pv="fp16"` rounds the unnormalised
    probabilities and V to fp16 and sums in fp32, as the kernel does; `pv="exact"` does the rest
    in float64 from the same int8 scores: the oracle tests compare both against. `blocks` are the
    kernel's tiles (they only pad here); `groups` the tokens per int8 scale of Q and K,
    `(128, 64)` being SageAttention's first per-tile recipe. `smooth=False` quantizes K as it
    is. Both are there to measure what the default buys. Inference only: no gradient.
    """
    if pv not in ("fp16", "exact"):
        raise ValueError(f"pv must be 'fp16' or 'exact', got {pv!r}")
    blocks, groups = tuple(blocks), tuple(groups)
    scale = check_inputs(q, k, v, scale, blocks, groups)
    B, Nq, H, D = q.shape
    Nk = k.shape[1]
    block_q = blocks[0]
    with torch.no_grad():
        q8, qs, k8, ks, vh, vs = quantized_operands(q, k, v, blocks, groups, smooth)
        work = torch.float64 if pv == "exact" else torch.float32
        k_rows = k8[:, :, :Nk].float()  # (B, H, Nk, D) integer-valued
        k_scale = ks[:, :, :Nk]  # (B, H, Nk)
        q_scale = qs[:, :, :Nq]  # (B, H, Nq)
        values = vh.transpose(1, 2).to(work)  # (B, H, Nk, D), fp16-rounded
        out = torch.empty(B, H, Nq, D, dtype=work, device=q.device)
        chunk = max(block_q, _CHUNK_SCORES // max(Nk, 1) // block_q * block_q)
        for start in range(0, Nq, chunk):
            rows = slice(start, min(Nq, start + chunk))
            dots = q8[:, :, rows].float() @ k_rows.transpose(-1, -2)  # (B, H, m, Nk) exact ints
            s = dots * (q_scale[:, :, rows, None] * k_scale[:, :, None, :] * scale)  # fp32
            s = s.to(work)
            p = torch.exp(s - s.amax(dim=-1, keepdim=True))  # (B, H, m, Nk) unnormalised
            total = p.sum(dim=-1, keepdim=True)
            if pv == "fp16":
                p = p.to(torch.float16).float()  # the kernel's fp16 P operand
            out[:, :, rows] = (p @ values) / total
        out = out * vs[:, :, None, :].to(work)  # undo V's power-of-two scale
    return out.transpose(1, 2).to(q.dtype)  # (B, Nq, H, D)
