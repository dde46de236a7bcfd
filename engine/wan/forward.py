"""`WanTransformer3DModel.forward` cut in three, once, for sampling and training alike.

`prologue` is everything before the blocks (rotary tables, patch embedding, the condition
embedder, Wan2.1-I2V's image tokens before the text), `epilogue` everything after (the output
norm and projection, unpatchified); between them each block is the model's own, called as its
forward calls it. Run in a row, they are the model's forward op for op. The first-block step
cache cuts its passes here (`WanCut`), and block-wise fine-tuning runs the blocks one at a time
between them (training.py).

A VACE or Animate transformer's pass is cut the same way, what its forward adds between the
blocks carried from the prologue: VACE's hints (`vace_hints`: its VACE blocks, which run before
any block, on the control latents), each added times its scale after its block (`vace_layers`);
Animate's pose tokens (added in the prologue) and motion vectors (`motion`), which the face
adapter after every `inject_face_latents_blocks`-th block reads. A first-block cache's reused
step then runs the VACE blocks and block 0 (and its face adapter), not the blocks after.

Caution: diffusers' VACE forward runs its blocks on the patch embedding's strided view, the
other forwards on a contiguous copy; `prologue` does as the model's forward does, since a
matmul over a strided view need not round as one over a copy.
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


def prologue(model: nn.Module, x, timestep, context, image=None, pose=None):
    """Tokens `(B, N, D)`, the time embedding, the blocks' modulation `(B, [N,] 6, D)`, the
    embedded text (after Wan2.1-I2V's embedded image features) and the rotary tables. `timestep`
    is `(B,)`, or `(B, N)` one per token (Wan2.2-TI2V's `expand_timesteps`); `pose`: Animate's
    pose latents `(B, C, F' - 1, H', W')`, whose tokens add to those after the first frame's."""
    rotary = model.rope(x)
    h = model.patch_embedding(x)  # (B, D, F', H'', W'')
    if pose is not None:
        h[:, :, 1:] = h[:, :, 1:] + model.pose_patch_embedding(pose)
    h = h.flatten(2).transpose(1, 2)  # (B, N, D)
    if not hasattr(model, "vace_blocks"):  # VACE's forward keeps the strided view (Caution)
        h = h.contiguous()
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


def vace_hints(model: nn.Module, h, context, projection, rotary, control, scale) -> list:
    """A VACE transformer's hints, as its forward makes them before the blocks: its VACE blocks
    run in turn on the control latents `(B, C', F', H', W')` (their tokens padded with zeros to
    the clip's, `h` `(B, N, D)`), each giving a hint `(B, N, D)`; `scale` is `(layers,)` or
    `(layers, B, 1, 1)`, one per row. A `(hint, scale)` pair per entry of `vace_layers`."""
    c = model.vace_patch_embedding(control).flatten(2).transpose(1, 2)  # (B, N', D)
    pad = c.new_zeros(c.shape[0], h.shape[1] - c.shape[1], c.shape[2])
    c = torch.cat([c, pad], dim=1)  # (B, N, D)
    hints = []
    for vace_block, s in zip(model.vace_blocks, torch.unbind(scale)):
        hint, c = vace_block(h, context, c, projection, rotary)  # (B, N, D) each
        hints.append((hint, s))
    return hints


def motion(model: nn.Module, face: torch.Tensor) -> torch.Tensor:
    """An Animate transformer's motion vectors of face frames `(B, 3, L, S, S)`, as its forward
    makes them (the motion encoder in batches of `motion_encoder_batch_size` frames, then the
    face encoder), with the zero vector of the first latent frame before them."""
    B, C, L, S, _ = face.shape
    frames = face.permute(0, 2, 1, 3, 4).reshape(-1, C, S, S)  # (B L, 3, S, S)
    size = model.config.motion_encoder_batch_size
    vectors = torch.cat([model.motion_encoder(f) for f in torch.split(frames, size)])
    vectors = model.face_encoder(vectors.view(B, L, -1))  # (B, L', heads, D')
    return torch.cat([torch.zeros_like(vectors[:, :1]), vectors], dim=1)


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
    hints: list | None = None  # VACE: (hint (B, N, D), scale () or (B, 1, 1)) per vace layer
    motion: torch.Tensor | None = None  # Animate: the face adapters' motion vectors


class WanCut(ForwardCut):
    """One pass of a Wan expert over some rows, cut at its blocks (for the sampler loop).

    Under sequence parallel (`sp`: the expert carries diffusers' context-parallel hooks, see
    `WanVideoPipeline.parallelize`) the hooks on the modules split as in the model's forward: the
    rotary tables at `rope`, the tokens entering block 0, the gather after `proj_out`. The one
    split made at the model's own forward, per-token timesteps (`expand_timesteps`), the cut
    makes itself in `prologue`, so the modulation and the epilogue's time embedding are this
    rank's tokens'.

    A VACE transformer's hints under sequence parallel are this rank's tokens': the plan splits
    the VACE blocks' token inputs where they enter VACE block 0 (`WanVideoPipeline.parallelize`),
    which the prologue runs as the forward does.

    `extra`: a VACE or Animate transformer's own inputs, in the names its forward takes
    (`control_hidden_states` and `control_hidden_states_scale`; `pose_hidden_states` and
    `face_pixel_values`)."""

    def __init__(self, model, patch, inputs: tuple, adapters: list, router, sp=None, extra=None):
        self.model, self.patch = model, patch
        self.x, self.timestep, self.context, self.image = inputs
        self.adapters, self.router, self.sp = adapters, router, sp
        self.extra = extra or {}
        layers = getattr(model.config, "vace_layers", None) or ()
        self.hint_of = {i: j for j, i in enumerate(sorted(layers))}  # block -> its hint

    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    def prologue(self):
        timestep = self.timestep
        if timestep.ndim == 2:  # (B, N) one per token: (B, n), this rank's
            timestep = self.local(timestep)
        extra = self.extra
        h, temb, projection, context, rotary = prologue(
            self.model, self.x, timestep, self.context, self.image, extra.get("pose_hidden_states")
        )
        c = Carry(temb, projection, context, rotary)
        if "control_hidden_states" in extra:
            control, scale = extra["control_hidden_states"], extra["control_hidden_states_scale"]
            c.hints = vace_hints(self.model, h, context, projection, rotary, control, scale)
        if "face_pixel_values" in extra:
            c.motion = motion(self.model, extra["face_pixel_values"])
        return h, c  # (B, N, D)

    def block(self, i, h, c: Carry):
        h = block(self.model, i, h, c.context, c.projection, c.rotary)  # (B, N, D)
        if c.hints is not None and i in self.hint_of:
            hint, scale = c.hints[self.hint_of[i]]
            h = h + hint * scale
        if c.motion is not None and i % self.model.config.inject_face_latents_blocks == 0:
            adapter = self.model.face_adapter[i // self.model.config.inject_face_latents_blocks]
            h = adapter(h, c.motion) + h
        return h

    def rows(self, c: Carry, index):
        hints = c.hints and [(h[index], s[index] if s.ndim else s) for h, s in c.hints]
        return replace(
            c,
            projection=c.projection[index],
            context=c.context[index],
            hints=hints,
            motion=None if c.motion is None else c.motion[index],
        )

    def epilogue(self, h, c: Carry):
        _, _, F, H, W = self.x.shape
        pt, ph, pw = self.patch
        return epilogue(self.model, h, c.temb, (F // pt, H // ph, W // pw), self.patch)
