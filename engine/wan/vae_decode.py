"""Wan's VAE decode, latent frame by latent frame, its frames handed out as each chunk exists.

`AutoencoderKLWan.decode` already decodes one latent frame at a time, carrying a causal cache
(the last two input frames of every causal convolution) from one to the next; it concatenates
the chunks, clamps the whole video, and only then returns. `decode_chunks` makes the same calls
in the same order on the same tensors, but yields each latent frame's pixels (1 frame for the
first latent frame, 4 for each later one with Wan's VAEs) as soon as they are decoded, clamped
as diffusers clamps them. A caller that encodes or postprocesses chunk by chunk never holds the
float video concatenated, nor the postprocessing's copies of it, and its chunks are bitwise `vae.decode(z).sample[:, :, t0:t1]`: the decoder
calls are diffusers' own, and what follows them (the tiles' blending, `unpatchify`, the clamp)
is elementwise or a copy, the same value for an element whatever the length of the video.

Tiling (`vae.enable_tiling()`, what the Wan family turns on above 256 pixels a side) decodes
each spatial tile through all its frames before the next tile, with one cache alive; the chunk of
a latent frame then needs every tile's output of that frame. Two orders (`decode_chunks`'s
`order`), both bitwise diffusers' (the blend is diffusers' `blend_v` / `blend_h`, in diffusers'
order, on the chunk's tiles):

- "tiles" (the default) decodes as diffusers does and keeps every tile's 3-channel output of the
  clip (12 bytes a pixel and frame, times the tiles' overlap: 1.66 at 480x832), the last tile
  decoded a latent frame at a time as its chunks are taken. Its memory is diffusers' without the
  copies diffusers makes of the whole video after the tiles (the concatenations, the clamp, the
  postprocessing's intermediates): each chunk is blended, clamped and turned to uint8 alone.
  Caution: on a CPU with glibc's default malloc settings the process's measured peak is no lower
  than diffusers' (its heap keeps what the chunks free: docs/benchmarks.md, "Wan VAE decode").
- "frames" gives every tile its own cache and advances all tiles a latent frame together, so each
  chunk comes out as soon as it exists (an encoder overlaps the whole decode). Caution: the
  caches of all tiles are alive together, 9.5 KB a pixel for Wan2.1's decoder (measured: the last
  two input frames of its 30-odd causal convolutions), times the overlap: 6.3 GB at 480x832 and
  14 GB at 720x1280, whatever the frame count, against "tiles"' 0.6 GB (one 256-pixel tile's
  cache) plus 8 MB (480p) or 18 MB (720p) a frame. Below about 780 frames "tiles" holds less.

`fuse_chains` rewrites the decoder's elementwise chains in place, bitwise:

- the RMS norm `F.normalize(x) * scale * gamma + bias` becomes one division into a new tensor
  and in-place multiplications; `+ bias` is skipped when the bias is the float 0.0 (Wan's VAEs
  have no bias): `x + 0.0` equals `x` except that it turns -0.0 into +0.0, and no later operation
  of the decoder tells the two zeros apart (no division by a value, no sign test), so every
  frame is bitwise the same;
- the SiLU after each norm runs in place on the norm's fresh output (the same kernel);
- a residual block's `x + h` adds in place into its second convolution's fresh, contiguous
  output (TensorIterator gives `x + h` the layout of its first operand here, so the next
  convolution sees the same memory layout either way).

What stays as diffusers computes it, and why: the norm's reduction (`linalg.vector_norm` over the
channels, in its own summation order: any other order moves the frames by a few ulps, see
`norm="sum"`), the multiplications by `scale` and `gamma` as two roundings (one by their product
rounds differently), SiLU's `x / (1 + exp(-x))` (a compiler's `x * sigmoid(x)` rounds
differently), the causal convolutions' zero padding (a padded copy; padding inside the
convolution may pick another algorithm), the attention block's residual (its output is a permuted
view: an in-place add would change the layout the next convolution sees) and Wan2.2's
`avg_shortcut` add (same reason). A Triton kernel for CUDA is not built: its norm would have to
reproduce `vector_norm`'s CUDA reduction tree and `expf` bit for bit, which cannot be argued
without a GPU to test on.

`norm="sum"` keeps the Wan family's faster norm (the batched mode's, `sqrt(sum(x * x))`: a few
ulps from `F.normalize`, frames within one uint8 level of diffusers') with the same in-place
chain; `norm="exact"` is diffusers' reduction, bitwise.

Postprocessing to uint8 (`frames`) follows WanEncoders' (diffusers' `VideoProcessor`'s
denormalisation): `(x / 2 + 0.5).clamp(0, 1) * 255`, rounded; the second clamp is left out, for
on a value already clamped to [-1, 1], `x / 2 + 0.5` is in [0, 1] exactly (halving is exact,
and adding 0.5 rounds monotonically to 0 or 1 at the ends), NaN staying NaN either way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("exact", "sum")
ORDERS = ("tiles", "frames")  # how a tiled decode walks its tiles and frames: decode_chunks


# ---------------------------------------------------------------------- fused chains


def _rms_norm(self, x: torch.Tensor, *, norm: str) -> torch.Tensor:
    """`WanRMS_norm.forward` for a float32 `(B, C, ...)` input, its chain in place on one new
    tensor. Other dtypes or layouts run diffusers' own forward."""
    if not self.channel_first or x.dtype != torch.float32:
        return type(self).forward(self, x)
    if norm == "exact":  # F.normalize's: the same reduction, the same clamp, the same division
        denom = x.norm(2, 1, keepdim=True).clamp_min(1e-12)  # (B, 1, ...)
    else:
        denom = (x * x).sum(dim=1, keepdim=True).sqrt().clamp_min(1e-12)  # (B, 1, ...)
    y = torch.div(x, denom)  # the one new tensor: (B, C, ...)
    y.mul_(self.scale)
    y.mul_(self.gamma)
    if isinstance(self.bias, torch.Tensor) or self.bias != 0.0:  # 0.0: see the module docstring
        y.add_(self.bias)
    return y


def _residual_block(self, x, feat_cache=None, feat_idx=[0]) -> torch.Tensor:  # noqa: B006 - diffusers' signature
    """`WanResidualBlock.forward` with its SiLUs and its residual add in place."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import CACHE_T

    h = self.conv_shortcut(x)
    x = self.norm1(x)  # a new tensor: the SiLU may overwrite it
    x = F.silu(x, inplace=True)
    x = _causal_conv(self.conv1, x, feat_cache, feat_idx, CACHE_T)
    x = self.norm2(x)
    x = F.silu(x, inplace=True)
    x = self.dropout(x)
    x = _causal_conv(self.conv2, x, feat_cache, feat_idx, CACHE_T)
    if not x.is_contiguous():  # never for a convolution's output; the layout argument needs it
        return x + h
    return x.add_(h)  # (B, C, T, H, W): the convolution's fresh output


def _causal_conv(conv, x, feat_cache, feat_idx, cache_t: int) -> torch.Tensor:
    """A causal convolution with diffusers' cache bookkeeping (WanResidualBlock's, verbatim)."""
    if feat_cache is None:
        return conv(x)
    idx = feat_idx[0]
    cache_x = x[:, :, -cache_t:, :, :].clone()
    if cache_x.shape[2] < 2 and feat_cache[idx] is not None:
        last = feat_cache[idx][:, :, -1, :, :].unsqueeze(2).to(cache_x.device)
        cache_x = torch.cat([last, cache_x], dim=2)
    x = conv(x, feat_cache[idx])
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return x


def fuse_chains(vae: nn.Module, *, norm: str = "exact") -> None:
    """Rewrite `vae`'s RMS norms, residual blocks and the SiLUs after its norms in place (see the
    module docstring); `norm` is "exact" (diffusers' reduction: bitwise) or "sum" (the Wan
    family's faster one). Training is not supported: the chains overwrite their inputs."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanDecoder3d,
        WanEncoder3d,
        WanResidualBlock,
        WanRMS_norm,
    )

    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    for module in vae.modules():
        if isinstance(module, WanRMS_norm):
            module.forward = functools.partial(_rms_norm, module, norm=norm)
        elif isinstance(module, WanResidualBlock) and isinstance(module.nonlinearity, nn.SiLU):
            module.forward = _residual_block.__get__(module)  # (Wan's VAEs: SiLU everywhere)
        elif isinstance(module, WanDecoder3d | WanEncoder3d):
            # The head's SiLU follows `norm_out` (a new tensor): it may run in place.
            if isinstance(module.nonlinearity, nn.SiLU):
                module.nonlinearity.inplace = True


# ---------------------------------------------------------------------- chunked decode


class _TileStream:
    """One spatial tile of one group of rows, decoded a latent frame at a time with its own
    causal cache, as `AutoencoderKLWan.tiled_decode` decodes the tile through all frames."""

    def __init__(self, vae, z: torch.Tensor, *, quant_whole: bool):
        self.vae, self.cache = vae, [None] * vae._cached_conv_counts["decoder"]
        # Untiled, diffusers runs `post_quant_conv` on the whole latent once; tiled, on each
        # tile's frame. A 1x1x1 convolution over other shapes may sum in another order: keep each.
        self.quant_whole = quant_whole
        self.z = vae.post_quant_conv(z) if quant_whole else z

    def decode(self, k: int) -> torch.Tensor:
        frame = self.z[:, :, k : k + 1]  # (B, C, 1, h, w)
        if not self.quant_whole:
            frame = self.vae.post_quant_conv(frame)
        return self.vae.decoder(frame, feat_cache=self.cache, feat_idx=[0], first_chunk=(k == 0))


def _group_chunks(vae, z: torch.Tensor, order: str) -> Iterator[torch.Tensor]:
    """`vae._decode(z).sample` (tiled or not, as `vae.use_tiling` and the size decide) a latent
    frame at a time: `(B, 3, f, H, W)` chunks, clamped to [-1, 1]; tiled, in `order`."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    _, _, frames, height, width = z.shape
    patch = vae.config.patch_size
    ratio = vae.spatial_compression_ratio
    min_h = vae.tile_sample_min_height // ratio
    min_w = vae.tile_sample_min_width // ratio
    if not (vae.use_tiling and (width > min_w or height > min_h)):
        stream = _TileStream(vae, z, quant_whole=True)  # one cache: the order does not matter
        for k in range(frames):
            out = stream.decode(k)
            if patch is not None:
                out = unpatchify(out, patch_size=patch)
            yield out.clamp_(-1.0, 1.0)
        return

    # tiled_decode's geometry, verbatim.
    sample_h, sample_w = height * ratio, width * ratio
    stride_h = vae.tile_sample_stride_height // ratio
    stride_w = vae.tile_sample_stride_width // ratio
    sample_stride_h, sample_stride_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    if patch is not None:
        sample_h, sample_w = sample_h // patch, sample_w // patch
        sample_stride_h, sample_stride_w = sample_stride_h // patch, sample_stride_w // patch
        blend_h = vae.tile_sample_min_height // patch - sample_stride_h
        blend_w = vae.tile_sample_min_width // patch - sample_stride_w
    else:
        blend_h = vae.tile_sample_min_height - sample_stride_h
        blend_w = vae.tile_sample_min_width - sample_stride_w
    tiles = [
        [z[:, :, :, i : i + min_h, j : j + min_w] for j in range(0, width, stride_w)]
        for i in range(0, height, stride_h)
    ]
    if order == "frames":  # every tile's cache alive: each chunk as soon as its tiles are decoded
        streams = [[_TileStream(vae, t, quant_whole=False) for t in row] for row in tiles]
        decoded = ([[s.decode(k) for s in row] for row in streams] for k in range(frames))
    else:
        decoded = _tile_major(vae, tiles, frames)
    for rows in decoded:  # (B, c, f, th, tw) each
        result_rows = []
        for i, row in enumerate(rows):
            result_row = []
            for j, tile in enumerate(row):
                # Blending rewrites `tile` in place, which later tiles then blend from: in order.
                if i > 0:
                    tile = vae.blend_v(rows[i - 1][j], tile, blend_h)
                if j > 0:
                    tile = vae.blend_h(row[j - 1], tile, blend_w)
                result_row.append(tile[:, :, :, :sample_stride_h, :sample_stride_w])
            result_rows.append(torch.cat(result_row, dim=-1))
        del rows
        out = torch.cat(result_rows, dim=3)[:, :, :, :sample_h, :sample_w]
        if patch is not None:
            out = unpatchify(out, patch_size=patch)
        yield out.clamp_(-1.0, 1.0)


def _tile_major(vae, tiles: list[list[torch.Tensor]], frames: int):
    """The tiles' decoded chunks, latent frame by latent frame, decoding as diffusers does: each
    tile through all its frames with one cache alive. The last tile is decoded a frame at a
    time as its chunks are taken, so the first chunk is out before the whole clip is decoded."""
    flat = [t for row in tiles for t in row]
    done = []
    for t in flat[:-1]:
        stream = _TileStream(vae, t, quant_whole=False)
        done.append([stream.decode(k) for k in range(frames)])
        del stream  # its cache: one tile's alive at a time
    last = _TileStream(vae, flat[-1], quant_whole=False)
    cols = len(tiles[0])
    for k in range(frames):
        chunk = [d[k] for d in done] + [last.decode(k)]
        for d in done:
            d[k] = None  # the chunk's tiles are freed once it is blended
        yield [chunk[r * cols : (r + 1) * cols] for r in range(len(tiles))]


@torch.no_grad()
def decode_chunks(vae, z: torch.Tensor, *, order: str = "tiles") -> Iterator[torch.Tensor]:
    """Latents `(B, C, F', H', W')` (the VAE's own scale: not normalised) -> pixel chunks
    `(B, 3, f, H, W)` in [-1, 1], one a latent frame, whose concatenation over time is bitwise
    `vae.decode(z).sample` (with `vae.use_slicing`, each row's chunks are decoded alone and
    concatenated over the rows, as diffusers decodes the slices).

    `order` matters when the VAE tiles: "tiles" decodes as diffusers does, one tile through all
    frames at a time, and hands the chunks out as the last tile decodes (memory: one tile's cache
    and every tile's 3-channel output); "frames" advances all tiles a latent frame at a time, so
    every chunk comes out as soon as it exists (memory: every tile's cache, see the module
    docstring; independent of the frame count)."""
    if z.ndim != 5:
        raise ValueError(f"latents must be (B, C, F, H, W), got shape {tuple(z.shape)}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if vae.use_slicing and z.shape[0] > 1:
        groups = [_group_chunks(vae, row, order) for row in z.split(1)]
        for chunks in zip(*groups, strict=True):
            yield torch.cat(chunks)
        return
    yield from _group_chunks(vae, z, order)


def to_frames(chunk: torch.Tensor) -> np.ndarray:
    """A clamped pixel chunk `(B, 3, f, H, W)` (overwritten) -> uint8 `(B, f, H, W, 3)`, as
    WanEncoders has always postprocessed (see the module docstring for the clamp left out)."""
    x = chunk.div_(2).add_(0.5)  # in [0, 1]: `(x / 2 + 0.5).clamp(0, 1)`
    x = x.permute(0, 2, 3, 4, 1).float()  # (B, f, H, W, 3)
    u8 = x.mul_(255).round_().to(torch.uint8)
    # .cpu() copies a device chunk to the host (a sync): the frames' consumer reads host memory.
    return np.ascontiguousarray(u8.cpu().numpy())


def frame_chunks(vae, z: torch.Tensor, *, order: str = "tiles") -> Iterator[np.ndarray]:
    """`decode_chunks` postprocessed: uint8 `(B, f, H, W, 3)` a latent frame at a time."""
    for chunk in decode_chunks(vae, z, order=order):
        yield to_frames(chunk)


__all__ = ["NORMS", "ORDERS", "decode_chunks", "frame_chunks", "fuse_chains", "to_frames"]
