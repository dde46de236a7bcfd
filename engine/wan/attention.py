"""3D Deformable Slide Attention in Wan's self-attention, as a diffusers attention processor.

`WanSlideAttnProcessor` computes exactly what Wan's own processor computes (projections, the
q/k RMSNorm across heads, rotary positions, the output projection) and replaces only the dense
attention over all video tokens by `dsa_attention` on the latent token grid. A fresh processor
has no motion (plain sliding-tile attention); a model fine-tuned with it learns to use the window.
The token grid is not in the processor's inputs, so the pipeline sets it before each pass
(`set_grid`); every row of a pass shares one latent shape.
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
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, N, h, d)
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, N, h, d)
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))  # (B, N, h, d)
        if rotary_emb is not None:
            q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, h, N, d)
        out = dsa_attention(q, k, v, grid=self.grid, tile=self.tile, window=self.window)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)  # (B, N, h*d)
        return attn.to_out[1](attn.to_out[0](out))


def use_slide_attention(model: nn.Module, tile, window) -> None:
    """Every block's self-attention (`attn1`) of a WanTransformer3DModel runs 3D-DSA."""
    for block in model.blocks:
        block.attn1.set_processor(WanSlideAttnProcessor(tile, window))


def set_grid(model: nn.Module, grid: tuple[int, int, int]) -> None:
    for block in model.blocks:
        block.attn1.processor.grid = tuple(grid)
