"""`WanTransformer3DModel.forward` cut in three, once, for sampling and training alike.

`prologue` is everything before the blocks (rotary tables, patch embedding, the condition
embedder, Wan2.1-I2V's image tokens before the text), `epilogue` everything after (the output
norm and projection, unpatchified); between them each block is the model's own, called as its
forward calls it. Run in a row, they are the model's forward op for op. The first-block step
cache cuts its passes here (`WanCut`), and block-wise fine-tuning runs the blocks one at a time
between them (training.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..sampling.loop import ForwardCut


def streamed_blocks(model: nn.Module) -> list[nn.Module]:
    """A transformer's blocks in the order its forward runs them: a VACE transformer's VACE
    blocks (all of them, before any block), then the blocks; an Animate transformer's blocks
    with its face adapters between them (adapter `i // n` after each block `i` that `n =
    inject_face_latents_blocks` divides)."""
    adapters = getattr(model, "face_adapter", None)
    if adapters is not None:
        every = model.config.inject_face_latents_blocks
        order = []
        for i, block in enumerate(model.blocks):
            order.append(block)
            if i % every == 0:
                order.append(adapters[i // every])
        return order
    return [*getattr(model, "vace_blocks", ()), *model.blocks]


def attention_blocks(model: nn.Module) -> list[nn.Module]:
    """The streamed blocks that cross-attend the prompt (`attn2`): all but Animate's face
    adapters, which attend the face's motion features."""
    return [b for b in streamed_blocks(model) if hasattr(b, "attn2")]


def prologue(model: nn.Module, x, timestep, context, image=None):
    """Tokens `(B, N, D)`, the time embedding, the blocks' modulation `(B, [N,] 6, D)`, the
    embedded text (after Wan2.1-I2V's embedded image features) and the rotary tables. `timestep`
    is `(B,)`, or `(B, N)` one per token (Wan2.2-TI2V's `expand_timesteps`)."""
    rotary = model.rope(x)
    h = model.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()  # (B, N, D)
    seq_len = None
    if timestep.ndim == 2:  # one timestep per token
        seq_len = timestep.shape[1]
        timestep = timestep.flatten()
    temb, projection, context, image = model.condition_embedder(
        timestep, context, image, timestep_seq_len=seq_len
    )
    if image is not None:  # the image's tokens first, as the model's cross-attention expects
        context = torch.concat([image, context], dim=1)  # (B, N_image + 512, D)
    projection = projection.unflatten(2 if seq_len else 1, (6, -1))  # (B, [N,] 6, D)
    return h, temb, projection, context, rotary


def block(model: nn.Module, i: int, h, context, projection, rotary) -> torch.Tensor:
    """Block `i` on tokens `(B, N, D)`."""
    return model.blocks[i](h, context, projection, rotary)


def epilogue(model: nn.Module, h, temb, grid: tuple[int, int, int], patch) -> torch.Tensor:
    """The output norm and projection of tokens `(B, N, D)` on the token `grid`, unpatchified
    (`patch`: the model's `(pt, ph, pw)`) to `(B, C, F, H, W)`."""
    if temb.ndim == 3:  # one timestep per token
        shift, scale = (model.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (model.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    h = (model.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
    h = model.proj_out(h)  # (B, N, pt*ph*pw*C)
    (T, Y, X), (pt, ph, pw) = grid, patch
    h = h.reshape(h.shape[0], T, Y, X, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return h.flatten(6, 7).flatten(4, 5).flatten(2, 3)  # (B, C, F, H, W)


@dataclass
class Carry:
    """What the blocks and the epilogue read besides the tokens."""

    temb: torch.Tensor  # (B, [N,] D) the time embedding, read by the epilogue
    projection: torch.Tensor  # (B, [N,] 6, D) the blocks' modulation
    context: torch.Tensor  # (B, L, D) the embedded text (and image)
    rotary: tuple  # rotary tables, shared by every row


class WanCut(ForwardCut):
    """One pass of a Wan expert over some rows, cut at its blocks (for the sampler loop).

    Under sequence parallel (`sp`: the expert carries diffusers' context-parallel hooks, see
    `WanVideoPipeline.parallelize`) the hooks on the modules split as in the model's forward: the
    rotary tables at `rope`, the tokens entering block 0, the gather after `proj_out`. The one
    split made at the model's own forward, per-token timesteps (`expand_timesteps`), the cut
    makes itself in `prologue`, so the modulation and the epilogue's time embedding are this
    rank's tokens'."""

    def __init__(self, model, patch, inputs: tuple, adapters: list, router, sp=None):
        self.model, self.patch = model, patch
        self.x, self.timestep, self.context, self.image = inputs
        self.adapters, self.router, self.sp = adapters, router, sp

    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    def prologue(self):
        timestep = self.timestep
        if timestep.ndim == 2:  # (B, N) one per token: (B, n), this rank's
            timestep = self.local(timestep)
        h, temb, projection, context, rotary = prologue(
            self.model, self.x, timestep, self.context, self.image
        )
        return h, Carry(temb, projection, context, rotary)  # (B, N, D)

    def block(self, i, h, c: Carry):
        return block(self.model, i, h, c.context, c.projection, c.rotary)  # (B, N, D)

    def rows(self, c: Carry, index):
        return replace(c, projection=c.projection[index], context=c.context[index])

    def epilogue(self, h, c: Carry):
        _, _, F, H, W = self.x.shape
        pt, ph, pw = self.patch
        return epilogue(self.model, h, c.temb, (F // pt, H // ph, W // pw), self.patch)
