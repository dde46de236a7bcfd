"""3D Deformable Slide Attention: geometry, window indices, PyTorch reference and dense oracle.

The operator's exact semantics are documented in `kernels/dsa.py`. This file holds what both
backends share and what tests compare against:

- `dsa_geometry` validates `grid`, `tile` and `window` and returns a frozen `DSAGeometry`.
- `window_tiles` computes, for every query tile, the `wt*wy*wx` key tiles it attends to. The Triton
  kernels read exactly this tensor, so the two backends cannot disagree about a window;
  `invert_windows` turns it into the key->query lists of the Triton dK/dV pass.
- `dsa_attention_reference` is the readable PyTorch implementation and the fast CPU path: it
  gathers the key and value tiles of each query tile and calls SDPA on them, so it never forms an
  N x N matrix and trains through ordinary autograd.
- `dsa_dense_oracle` builds the full N x N mask from the written rules with plain Python loops
  (independently of `window_tiles`) and runs masked dense attention. It is for tests only.

Nothing here imports Triton, so it works wherever torch does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Triple = tuple[int, int, int]

# Gathered key/value tiles are built for a chunk of query tiles at a time; this caps one gathered
# tensor at about this many bytes so memory stays O(N) with a small constant and chunks stay
# cache-friendly. Measured on a 2-core CPU at 4k-32k tokens: 1-4 MiB chunks are within noise of
# each other, 8 MiB is 10-30% slower and gathering everything at once about 2x slower (the gathered
# copies fall out of cache between the gather and SDPA).
_GATHER_CHUNK_BYTES = 2 * 2**20


@dataclass(frozen=True)
class DSAGeometry:
    """Token grid, tile shape and window (in tiles) of one 3D-DSA call, already validated."""

    grid: Triple  # (T, Y, X) tokens
    tile: Triple  # (tt, ty, tx) tokens per tile
    window: Triple  # (wt, wy, wx) tiles, each odd

    @property
    def tiles(self) -> Triple:
        """Tile counts (nT, nY, nX)."""
        return tuple(g // t for g, t in zip(self.grid, self.tile))  # type: ignore[return-value]

    @property
    def num_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def num_tiles(self) -> int:
        return math.prod(self.tiles)

    @property
    def tile_tokens(self) -> int:
        return math.prod(self.tile)

    @property
    def window_tiles(self) -> int:
        return math.prod(self.window)


def _triple(name: str, value) -> Triple:
    try:
        out = tuple(int(x) for x in value)
    except TypeError:
        raise ValueError(f"{name} must be three integers (t, y, x), got {value!r}") from None
    if len(out) != 3 or any(x != y for x, y in zip(out, value)):
        raise ValueError(f"{name} must be three integers (t, y, x), got {value!r}")
    return out  # type: ignore[return-value]


def dsa_geometry(grid, tile, window) -> DSAGeometry:
    """Validate `grid`, `tile` and `window` and return them as a `DSAGeometry`."""
    grid, tile, window = _triple("grid", grid), _triple("tile", tile), _triple("window", window)
    for axis, g, t, w in zip("tyx", grid, tile, window):
        if g < 1 or t < 1:
            raise ValueError(f"grid and tile must be positive, got grid={grid}, tile={tile}")
        if g % t:
            raise ValueError(f"tile {tile} must divide grid {grid}: axis {axis} has {g} % {t} != 0")
        if w < 1 or w % 2 == 0:
            raise ValueError(
                f"window {window} must be odd and positive on every axis (axis {axis})"
            )
        if w > g // t:
            raise ValueError(
                f"window {window} is larger than the tile count {g // t} on axis {axis} "
                f"(grid {grid}, tile {tile}); windows shift inward, they cannot exceed the grid"
            )
    return DSAGeometry(grid, tile, window)


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, motion: Tensor | None, geom: DSAGeometry, scale: float | None
) -> float:
    """Raise ValueError with a clear message on any inconsistency; return the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, heads, N, D), got shape {tuple(t.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, N, _ = q.shape
    if N != geom.num_tokens:
        raise ValueError(
            f"sequence length {N} does not match grid {geom.grid} "
            f"({geom.num_tokens} tokens in (t, y, x) row-major order)"
        )
    if motion is not None:
        want = (B, "1 or " + str(H), *geom.tiles, 2)
        if (
            motion.dim() != 6
            or motion.shape[0] != B
            or motion.shape[1] not in (1, H)
            or tuple(motion.shape[2:]) != (*geom.tiles, 2)
        ):
            raise ValueError(
                f"motion must be (B, heads or 1, nT, nY, nX, 2) = {want}, got {tuple(motion.shape)}"
            )
        if not motion.is_floating_point():
            raise ValueError(f"motion must be a floating-point tensor, got {motion.dtype}")
        if motion.device != q.device:
            raise ValueError(f"motion is on {motion.device} but q is on {q.device}")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def window_tiles(
    geom: DSAGeometry, motion: Tensor | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """Key tiles attended by each query tile: int64 `(Bm, Hm, nT*nY*nX, wt*wy*wx)`.

    `Bm, Hm` are `motion.shape[:2]`, or `(1, 1)` without motion (windows then do not depend on
    batch or head). Query and key tiles are numbered `(a*nY + b)*nX + c` (row-major over tiles);
    each row lists its key tiles in (key time tile, y, x) row-major order, all distinct.

    For query tile (a, b, c): `s = clamp(a - wt//2, 0, nT - wt)`; for each key time tile
    `a'` in `[s, s + wt)` the spatial centre is `(b + r((a'-a)*vy), c + r((a'-a)*vx))` with
    `r(x) = floor(x + 0.5)`, and the start on each spatial axis is `clamp(centre - w//2, 0, n - w)`.
    The products and the rounding are done in float64, so the result depends only on the
    motion values, not on the device. NaN velocities count as 0; speeds beyond n tiles per time
    tile (infinite included) act as n, which already pins every shifted window to the border.
    """
    nT, nY, nX = geom.tiles
    wt, wy, wx = geom.window
    if device is None:
        device = motion.device if motion is not None else "cpu"
    a = torch.arange(nT, device=device)
    start_t = (a - wt // 2).clamp(0, nT - wt)  # (nT,)
    key_t = start_t[:, None] + torch.arange(wt, device=device)  # (nT, wt): a'
    dt = (key_t - a[:, None]).to(torch.float64)  # (nT, wt): a' - a

    b = torch.arange(nY, device=device)
    c = torch.arange(nX, device=device)
    if motion is None:
        centre_y = b.view(1, 1, 1, nY, 1, 1).expand(1, 1, nT, nY, nX, wt)
        centre_x = c.view(1, 1, 1, 1, nX, 1).expand(1, 1, nT, nY, nX, wt)
    else:
        vel = torch.nan_to_num(motion.detach().to(torch.float64), nan=0.0)
        # A speed of n tiles per time tile already pins every shifted window to a border, so
        # clamping to +-n changes nothing and keeps inf * 0 (the query's own frame) from being NaN.
        vy = vel[..., 0].clamp(-nY, nY)[..., None]  # (Bm, Hm, nT, nY, nX, 1)
        vx = vel[..., 1].clamp(-nX, nX)[..., None]
        dt = dt.view(1, 1, nT, 1, 1, wt)
        centre_y = b.view(1, 1, 1, nY, 1, 1) + torch.floor(dt * vy + 0.5).to(torch.int64)
        centre_x = c.view(1, 1, 1, 1, nX, 1) + torch.floor(dt * vx + 0.5).to(torch.int64)
    start_y = (centre_y - wy // 2).clamp(0, nY - wy)
    start_x = (centre_x - wx // 2).clamp(0, nX - wx)

    key_y = start_y[..., None] + torch.arange(wy, device=device)  # (..., wt, wy)
    key_x = start_x[..., None] + torch.arange(wx, device=device)  # (..., wt, wx)
    key_t = key_t.view(1, 1, nT, 1, 1, wt, 1, 1)
    # (Bm, Hm, nT, nY, nX, wt, wy, wx) flat key-tile indices
    flat = (key_t * nY + key_y[..., :, None]) * nX + key_x[..., None, :]
    Bm, Hm = flat.shape[:2]
    return flat.reshape(Bm, Hm, nT * nY * nX, wt * wy * wx)


def invert_windows(win: Tensor, num_tiles: int) -> tuple[Tensor, Tensor]:
    """Key-tile -> query-tile lists of `window_tiles`, in CSR form, for the dK/dV pass.

    `win`: (Bm, Hm, nQ, W) from `window_tiles`. Returns `(offsets, queries)`, int32, of shapes
    (Bm, Hm, nQ + 1) and (Bm, Hm, nQ * W): the query tiles that attend to key tile j are
    `queries[..., offsets[..., j]:offsets[..., j + 1]]`, in increasing order. A stable sort keeps
    that order, so the dK/dV sums run in a fixed order (deterministic, no atomics).
    """
    Bm, Hm, nQ, W = win.shape
    keys = win.reshape(Bm, Hm, nQ * W)
    order = torch.sort(keys, dim=-1, stable=True).indices  # (Bm, Hm, nQ*W)
    queries = torch.div(order, W, rounding_mode="floor")  # query tile of each sorted pair
    counts = torch.zeros(Bm, Hm, num_tiles, dtype=torch.int64, device=win.device)
    counts.scatter_add_(-1, keys, torch.ones_like(keys))  # (Bm, Hm, nQ)
    offsets = torch.nn.functional.pad(counts.cumsum(-1), (1, 0))  # (Bm, Hm, nQ+1)
    return offsets.to(torch.int32), queries.to(torch.int32)


def to_tiles(x: Tensor, geom: DSAGeometry) -> Tensor:
    """Natural (t, y, x) row-major tokens to tile-major: (B, H, N, D) -> (B, H, nTiles, S, D)."""
    B, H, _, D = x.shape
    (T, Y, X), (tt, ty, tx) = geom.grid, geom.tile
    x = x.reshape(B, H, T // tt, tt, Y // ty, ty, X // tx, tx, D)
    x = x.permute(0, 1, 2, 4, 6, 3, 5, 7, 8)  # (B, H, nT, nY, nX, tt, ty, tx, D)
    return x.reshape(B, H, geom.num_tiles, geom.tile_tokens, D)


def from_tiles(x: Tensor, geom: DSAGeometry) -> Tensor:
    """Inverse of `to_tiles`: (B, H, nTiles, S, D) -> (B, H, N, D) in natural order."""
    B, H, _, _, D = x.shape
    (nT, nY, nX), (tt, ty, tx) = geom.tiles, geom.tile
    x = x.reshape(B, H, nT, nY, nX, tt, ty, tx, D)
    x = x.permute(0, 1, 2, 5, 3, 6, 4, 7, 8)  # (B, H, nT, tt, nY, ty, nX, tx, D)
    return x.reshape(B, H, geom.num_tokens, D)


def _tile_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, use_sdpa: bool) -> Tensor:
    """Attention of (B, G, S, D) queries over (B, G, L, D) keys/values, batched over G."""
    if use_sdpa:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    p = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)  # (B, G, S, L)
    return p @ v  # (B, G, S, D)


def dsa_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    grid,
    tile,
    window,
    motion: Tensor | None = None,
    scale: float | None = None,
    use_sdpa: bool | None = None,
) -> Tensor:
    """3D-DSA in plain PyTorch: (B, H, N, D) natural-order inputs -> (B, H, N, D) output.

    Gathers, for a chunk of query tiles at a time, the `wt*wy*wx` key and value tiles of each
    query tile (one `index_select` on a tile-major copy) and runs attention of the tile's `S`
    queries over those `W*S` keys. Memory is O(N * W * S / chunk) beyond the inputs, never N x N.
    Differentiable in q, k, v through ordinary autograd; motion only selects tiles (no gradient).

    `use_sdpa=False` spells out softmax(q k^T * scale) v in the input dtype (what tests use as
    "the same math at low precision"); the default uses SDPA except in float64, where CPU SDPA
    costs about 5 ms per call even for tiny shapes (torch 2.13) and the spelled-out math is exact.
    """
    if use_sdpa is None:
        use_sdpa = q.dtype != torch.float64
    geom = dsa_geometry(grid, tile, window)
    scale = check_inputs(q, k, v, motion, geom, scale)
    B, H, N, D = q.shape
    nQ, S, W = geom.num_tiles, geom.tile_tokens, geom.window_tiles

    win = window_tiles(geom, motion, device=q.device)  # (Bm, Hm, nQ, W)
    # Row of key tile j of batch b, head h in the flattened (B*H*nQ, S, D) tile-major copy.
    base = (torch.arange(B, device=q.device)[:, None] * H + torch.arange(H, device=q.device)) * nQ
    rows = win.expand(B, H, nQ, W) + base[:, :, None, None]  # (B, H, nQ, W)

    q_t = to_tiles(q, geom)  # (B, H, nQ, S, D)
    k_t = to_tiles(k, geom).reshape(B * H * nQ, S, D)
    v_t = to_tiles(v, geom).reshape(B * H * nQ, S, D)

    per_tile_bytes = B * H * W * S * D * q.element_size()
    chunk = max(1, _GATHER_CHUNK_BYTES // per_tile_bytes)
    # Without autograd every chunk gathers into the same two buffers. Fresh multi-MB tensors per
    # chunk cost page faults and are retained by glibc's heap: measured at 32k tokens, peak RSS
    # growth 779 -> 233 MB, and 4k tokens 126 -> 112 ms.
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    k_buf = v_buf = None
    if not tracked:
        k_buf = k_t.new_empty(B * H * min(chunk, nQ) * W, S, D)
        v_buf = torch.empty_like(k_buf)
    outs = []
    for i in range(0, nQ, chunk):
        j = min(i + chunk, nQ)
        idx = rows[:, :, i:j].reshape(-1)  # (B*H*c*W,)
        if tracked:
            k_g, v_g = k_t.index_select(0, idx), v_t.index_select(0, idx)
        else:
            k_g = torch.index_select(k_t, 0, idx, out=k_buf[: idx.numel()])
            v_g = torch.index_select(v_t, 0, idx, out=v_buf[: idx.numel()])
        k_g = k_g.view(B, H * (j - i), W * S, D)
        v_g = v_g.view(B, H * (j - i), W * S, D)
        q_c = q_t[:, :, i:j].reshape(B, H * (j - i), S, D)
        o_c = _tile_attention(q_c, k_g, v_g, scale, use_sdpa)  # (B, H*c, S, D)
        outs.append(o_c.view(B, H, j - i, S, D))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (B, H, nQ, S, D)
    return from_tiles(out, geom)


def _oracle_window_sets(geom: DSAGeometry, vel: list | None) -> list[set[int]]:
    """Key-tile sets per query tile, straight from the written rules (loops, Python floats)."""
    nT, nY, nX = geom.tiles
    wt, wy, wx = geom.window
    sets = []
    for a in range(nT):
        for b in range(nY):
            for c in range(nX):
                s = min(max(a - wt // 2, 0), nT - wt)
                vy, vx = (0.0, 0.0) if vel is None else vel[a][b][c]
                keys = set()
                for a2 in range(s, s + wt):
                    cy = b + math.floor((a2 - a) * vy + 0.5)
                    cx = c + math.floor((a2 - a) * vx + 0.5)
                    sy = min(max(cy - wy // 2, 0), nY - wy)
                    sx = min(max(cx - wx // 2, 0), nX - wx)
                    for y in range(sy, sy + wy):
                        for x in range(sx, sx + wx):
                            keys.add((a2 * nY + y) * nX + x)
                sets.append(keys)
    return sets


def dsa_dense_mask(geom: DSAGeometry, motion: Tensor | None = None) -> Tensor:
    """Boolean (Bm, Hm, N, N) mask, True where query token n may attend key token m. Tests only."""
    (T, Y, X), (tt, ty, tx) = geom.grid, geom.tile
    _, nY, nX = geom.tiles
    t, y, x = torch.meshgrid(torch.arange(T), torch.arange(Y), torch.arange(X), indexing="ij")
    tile_of = (((t // tt) * nY + y // ty) * nX + x // tx).reshape(-1)  # (N,) tile of each token
    vel_lists = [[None]] if motion is None else motion.detach().double().cpu().tolist()
    masks = []
    for per_batch in vel_lists:
        row = []
        for vel in per_batch:
            allowed = torch.zeros(geom.num_tiles, geom.num_tiles, dtype=torch.bool)
            for qt, keys in enumerate(_oracle_window_sets(geom, vel)):
                allowed[qt, sorted(keys)] = True
            row.append(allowed[tile_of[:, None], tile_of[None, :]])  # (N, N)
        masks.append(torch.stack(row))
    return torch.stack(masks)


def dsa_dense_oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    grid,
    tile,
    window,
    motion: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Masked dense attention with the full N x N mask, in the input dtype. Tests only."""
    geom = dsa_geometry(grid, tile, window)
    scale = check_inputs(q, k, v, motion, geom, scale)
    mask = dsa_dense_mask(geom, motion).to(q.device)  # (Bm, Hm, N, N)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, N, N)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (B, H, N, D)
