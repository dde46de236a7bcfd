"""Ulysses sequence parallelism: one video's tokens split over P ranks, applied to a built model.

Each rank holds a contiguous shard of the token sequence, `N / P` tokens, through every block.
Row-wise work (projections, norms, RoPE, cross-attention to the text, the MLP) runs on the shard.
Self-attention needs every token, so around it an all-to-all swaps sequence sharding for head
sharding (DeepSpeed-Ulysses, Jacobs et al. 2023): each rank then holds all `N` tokens of `h / P`
heads, attends over them with the unchanged attention (dense SDPA or 3D-DSA), and a second
all-to-all swaps back. Per block and rank that moves `4 * B * N * D / P * (P - 1) / P` elements
(q, k, v out and the output back), independent of which attention runs.

3D-DSA fits the same layout: after the swap every rank has every token of its heads, so each query
tile finds its window's keys locally and the kernel runs as it is on `h / P` heads. Its per-tile
velocities come from tile-pooled hidden states; with the shard boundary on a time-tile boundary
each rank pools its own time-tiles for all heads and the same all-to-all hands each rank its
heads' velocities for every tile.

The transform (`parallelize_dit`) re-points a few bound methods of one built `VideoDiT`: its
forward shards the tokens after the prologue and gathers them before the epilogue, and each
self-attention's `attend` and `motion_field` are wrapped with the all-to-alls. Parameter names,
the block list and the streamer's hooks are untouched, so streaming composes with it: each rank
streams the same blocks. A pass cut at its blocks (a first-block step cache, flow.py's `DiTCut`)
shards and gathers in the same places with the same helpers. Every rank runs the sampler on the full latents (the prologue, the
epilogue and the Euler update are replicated, and exactly equal on every rank since the gathered
tokens are), so no rank ever waits for another's sampler state.

Caution: inference only (the collectives here carry no autograd); every rank must call the model
with the same inputs, in the same order, as collectives pair up by call order.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..native.config import DiTConfig


@dataclass(frozen=True)
class SequenceGroup:
    """The ranks one video's tokens are split over: this process's `rank` of `world`."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None  # None: the default group

    @classmethod
    def default(cls) -> SequenceGroup:
        return cls(dist.get_rank(), dist.get_world_size())

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of `n` tokens (`n % world == 0`, see `check_shardable`)."""
        size = n // self.world
        return slice(self.rank * size, (self.rank + 1) * size)


def check_shardable(config: DiTConfig, grid: tuple[int, int, int], world: int) -> None:
    """ValueError naming the problem if a `(T, Y, X)` token grid cannot be split over `world`
    ranks: equal contiguous token shards, equal head groups and, for 3D-DSA, shard boundaries on
    time-tile boundaries (each rank pools the tiles of its own frames)."""
    T, Y, X = grid
    if config.heads % world:
        raise ValueError(
            f"sequence parallel over {world} devices needs the heads ({config.heads}) to be a "
            f"multiple of {world}"
        )
    if (T * Y * X) % world:
        raise ValueError(
            f"sequence parallel over {world} devices needs the token count ({T}x{Y}x{X}) to be "
            f"a multiple of {world}"
        )
    if config.attention == "dsa" and T % (world * config.dsa_tile[0]):
        raise ValueError(
            f"3D-DSA over {world} devices needs the token grid's frames ({T}) to be a multiple "
            f"of {world} x the tile's frames ({config.dsa_tile[0]}): each device pools the "
            "tiles of its own frames"
        )


# ---------------------------------------------------------------------------------------------
# The two all-to-alls


def seq_to_heads(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """`(B, h, n, d)` (this rank's tokens, all heads) -> `(B, h/P, N, d)` (all tokens, this
    rank's heads); head group j goes to rank j, token shards arrive in rank order."""
    P = sp.world
    B, h, n, d = x.shape
    send = x.reshape(B, P, h // P, n, d).transpose(0, 1).contiguous()  # (P, B, h/P, n, d)
    recv = torch.empty_like(send)  # recv[i]: rank i's tokens of my heads
    dist.all_to_all_single(recv, send, group=sp.group)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, h // P, P * n, d)  # (B, h/P, N, d)


def heads_to_seq(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """Inverse of `seq_to_heads`: `(B, h/P, N, d)` -> `(B, h, n, d)`."""
    P = sp.world
    B, hp, N, d = x.shape
    send = x.reshape(B, hp, P, N // P, d).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, h/P, n, d)
    recv = torch.empty_like(send)  # recv[i]: my tokens of rank i's heads
    dist.all_to_all_single(recv, send, group=sp.group)
    return recv.transpose(0, 1).reshape(B, P * hp, N // P, d)  # (B, h, n, d)


def gather_tokens(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """Every rank's shard `(B, n, D)` -> the whole sequence `(B, N, D)` on every rank."""
    parts = [torch.empty_like(x) for _ in range(sp.world)]
    dist.all_gather(parts, x.contiguous(), group=sp.group)
    return torch.cat(parts, dim=1)  # (B, N, D)


# ---------------------------------------------------------------------------------------------
# The transform


def parallelize_dit(dit: nn.Module, sp: SequenceGroup) -> nn.Module:
    """Split `dit`'s (a built `VideoDiT`'s) tokens over the ranks of `sp`, in place; returns it.

    Apply it after the weights are placed (streamed or resident): only bound methods change.
    """
    from ..native.dit import SelfAttention

    config: DiTConfig = dit.config

    def forward(self, x, t, ctx, ctx_mask):
        if torch.is_grad_enabled():
            raise RuntimeError("sequence parallel runs inference only: call under torch.no_grad()")
        h, c = self.prologue(x, t, ctx, ctx_mask)  # (B, N, D), replicated on every rank
        h, local = shard_tokens(config, h, c, sp)  # (B, n, D)
        for block in self.blocks:
            h = block(h, local)  # (B, n, D)
        return self.epilogue(gather_tokens(h, sp), c)  # (B, C, F, H, W)

    dit.forward = types.MethodType(forward, dit)
    for module in dit.modules():
        if isinstance(module, SelfAttention):
            _parallelize_attention(module, sp)
    return dit


def shard_tokens(config: DiTConfig, h: torch.Tensor, c, sp: SequenceGroup):
    """This rank's tokens `(B, n, D)` of the prologue's output `h` `(B, N, D)`, and what its
    blocks read besides (`c`, a `dit.BlockInputs`, with the rotary angles of those tokens);
    ValueError if the token grid does not split (`check_shardable`)."""
    check_shardable(config, c.grid, sp.world)
    part = sp.shard(h.shape[1])
    return h[:, part], dataclasses.replace(c, angles=c.angles[part])  # angles (n, d/2)


def _parallelize_attention(attn: nn.Module, sp: SequenceGroup) -> None:
    attend, motion_field = attn.attend, attn.motion_field  # the bound originals

    def sharded_attend(self, q, k, v, grid, motion=None):
        q, k, v = (seq_to_heads(t, sp) for t in (q, k, v))  # (B, h/P, N, d) x3
        o = attend(q, k, v, grid, motion)  # (B, h/P, N, d): the model's own attention
        return heads_to_seq(o, sp)  # (B, h, n, d)

    def sharded_motion_field(self, x, grid):
        # x holds this rank's frames (T / P of them: `check_shardable`); pool its tiles for all
        # heads, then trade so each rank has its heads' velocities for every tile.
        T, Y, X = grid
        local = motion_field(x, (T // sp.world, Y, X))  # (B, h, nT/P, nY, nX, 2)
        B, h, nt, nY, nX, _ = local.shape
        full = seq_to_heads(local.reshape(B, h, nt * nY * nX, 2), sp)  # (B, h/P, nT*nY*nX, 2)
        return full.reshape(B, h // sp.world, sp.world * nt, nY, nX, 2)

    attn.attend = types.MethodType(sharded_attend, attn)
    attn.motion_field = types.MethodType(sharded_motion_field, attn)
