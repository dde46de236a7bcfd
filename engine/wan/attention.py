"""Wan's self-attention on our kernels, as diffusers attention processors.

Both processors compute exactly what Wan's own processor computes (projections, the q/k RMSNorm
across heads, rotary positions, the output projection) and replace only the dense attention over
all video tokens; cross-attention (`attn2`) keeps diffusers' processor.

- `WanSlideAttnProcessor` runs `dsa_attention` on the latent token grid. A fresh processor has no
  motion (plain sliding-tile attention); a model fine-tuned with it learns to use the window. The
  token grid is not in the processor's inputs, so the pipeline sets it before each pass
  (`set_grid`); every row of a pass shares one latent shape.
- `WanSageAttnProcessor` runs `sage_attention`, 8-bit attention (SageAttention's recipe) over all
  tokens, for a dense (pretrained) model as it is: no fine-tune, inference only.
"""

from __future__ import annotations

import torch
from torch import nn


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary positions on `(B, N, heads, d)`: pairs `(2i, 2i+1)` rotated by the angles."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _self_attention_qkv(attn: nn.Module, hidden_states: torch.Tensor, rotary_emb):
    """Wan's q, k, v `(B, N, heads, d)` of self-attention, normed and rotated as Wan's own
    processor makes them."""
    q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, N, h, d)
    k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, N, h, d)
    v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))  # (B, N, h, d)
    if rotary_emb is not None:
        q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
    return q, k, v


class WanSlideAttnProcessor:
    """Wan self-attention with 3D-DSA over the `(T, Y, X)` token grid set by `set_grid`."""

    def __init__(self, tile: tuple[int, int, int], window: tuple[int, int, int]):
        self.tile, self.window = tuple(tile), tuple(window)
        self.grid: tuple[int, int, int] | None = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from megaslide.kernels import dsa_attention

        if encoder_hidden_states is not None or self.grid is None:
            raise RuntimeError("3D-DSA serves self-attention only, after set_grid()")
        q, k, v = _self_attention_qkv(attn, hidden_states, rotary_emb)  # (B, N, h, d) x3
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, h, N, d)
        out = dsa_attention(q, k, v, grid=self.grid, tile=self.tile, window=self.window)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)  # (B, N, h*d)
        return attn.to_out[1](attn.to_out[0](out))


class WanSageAttnProcessor:
    """Wan self-attention with 8-bit attention (smoothed K, int8 QK^T, fp16 PV) over all tokens."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from megaslide.kernels import sage_attention

        if encoder_hidden_states is not None or attention_mask is not None:
            raise RuntimeError("8-bit attention serves unmasked self-attention only")
        q, k, v = _self_attention_qkv(attn, hidden_states, rotary_emb)  # (B, N, h, d) x3
        out = sage_attention(q, k, v)  # (B, N, h, d), q's dtype
        out = out.flatten(2, 3).type_as(q)  # (B, N, h*d)
        return attn.to_out[1](attn.to_out[0](out))


def use_sage_attention(model: nn.Module) -> None:
    """Every block's self-attention (`attn1`) of a WanTransformer3DModel runs 8-bit attention,
    a VACE model's VACE blocks' too."""
    for block in [*getattr(model, "vace_blocks", ()), *model.blocks]:
        block.attn1.set_processor(WanSageAttnProcessor())


def use_slide_attention(model: nn.Module, tile, window) -> None:
    """Every block's self-attention (`attn1`) of a WanTransformer3DModel runs 3D-DSA."""
    for block in model.blocks:
        block.attn1.set_processor(WanSlideAttnProcessor(tile, window))


def set_grid(model: nn.Module, grid: tuple[int, int, int]) -> None:
    for block in model.blocks:
        block.attn1.processor.grid = tuple(grid)
