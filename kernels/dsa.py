"""3D Deformable Slide Attention (3D-DSA): Triton forward and backward, and the public entry point.

Semantics (both backends; `tests/test_dsa.py` checks each line):

- `q, k, v`: `(B, heads, N, D)`, `N = T*Y*X` tokens in natural `(t, y, x)` row-major order,
  `grid=(T, Y, X)`. Any strides are accepted as long as the last dimension is contiguous.
- `tile=(tt, ty, tx)` divides the grid (on every axis) into `(nT, nY, nX)` tiles of
  `S = tt*ty*tx` tokens; tiles are numbered `(a*nY + b)*nX + c`.
- `window=(wt, wy, wx)`, in tiles, each odd and no larger than the tile count on its axis.
- `motion` (optional): float `(B, heads or 1, nT, nY, nX, 2)`, a velocity `(vy, vx)` per query
  tile, in tiles per time tile.
- For query tile `(a, b, c)`: time window start `s = clamp(a - wt//2, 0, nT - wt)`. For each key
  time tile `a'` in `[s, s + wt)`: spatial centre `(b + r((a'-a)*vy), c + r((a'-a)*vx))` with
  `r(x) = floor(x + 0.5)` (computed in float64), and on each spatial axis the start
  `clamp(centre - w//2, 0, n - w)`. Every query of the tile attends to all tokens of exactly
  `wt*wy*wx` distinct key tiles: windows shift inward at borders, they never shrink.
- `out = softmax(q k^T * scale) v` over those keys, `scale = 1/sqrt(D)` unless given; output has
  the dtype and shape of `q`, natural token order.
- Without motion this is Sliding Tile Attention; cost is O(N * wt*wy*wx * S * D), linear in N.

The tile-contiguous token permutation happens inside the op, without permuted copies: token s
of tile j sits at natural index `origin[j] + offsets[s]` (two small int32 tables from
`tile_origins`), and the kernels load rows through those indices. Forward: one program per (query
tile, block of BLOCK_M of its tokens, batch*head) walks the tile's key list, the W = wt*wy*wx
key tiles taken as one list of W*S tokens, in blocks of BLOCK_N that may straddle tiles (so odd
tile sizes waste no padding), with an online softmax in base 2 and fp32 accumulation, and stores
the base-2 log-sum-exp. Backward (FlashAttention-2 style, no atomics): `delta = rowsum(dO * O)`;
dQ programs walk the same query->key lists; dK/dV programs walk the inverted key->query lists
(`invert_windows`, CSR), so every gradient row is written by exactly one program.

Caution:
- Motion only selects tiles; rounding has no derivative, so the gradient w.r.t. `motion` is None.
  A motion predictor must learn some other way (see the model's DSA layer).
- The softmax scale stays in fp32 inside the kernels (it is folded with log2(e) into the fp32
  scores, never multiplied into bf16/fp16 q or k).
- fp32 inputs use IEEE fp32 dots, not TF32: fp32 is the accuracy mode, several times slower.
- The Triton backend needs a power-of-two head dim in [16, 256]; the reference takes any D.
- Window and inverted lists are computed with torch on q's device on every call (nQ*W integers,
  a handful of small kernels, no host sync). dK/dV work per key tile grows with the number of
  query tiles that use it, so border tiles and converging motion cost more (imbalance, not error).
- Row offsets inside one (batch, head) are int32: `N * stride(2)` must stay below 2**31 (checked).
- Results are deterministic for a given block configuration; autotuning may pick another
  configuration on another machine, which changes the summation order in the last bits.
- Under `torch.compile` (a model's compiled blocks) the Triton path is a graph break and runs as
  it does eagerly: the launcher's checks, window lists and autotuning are Python Dynamo would
  have to trace (unmeasured on a GPU). The reference is plain torch and compiles with the block.
- Triton is optional at import time (no wheels on macOS): `backend="auto"` then always uses the
  reference, and `backend="triton"` raises.
"""

import torch
from torch import Tensor

from .dsa_reference import (
    DSAGeometry,
    check_inputs,
    dsa_attention_reference,
    dsa_geometry,
    invert_windows,
    window_tiles,
)
from .triton_import import TRITON_IMPORT_ERROR, check_attention_inputs, interpreting, tl, triton

# ---------------------------------------------------------------------------------------------
# Triton helpers and kernels
# ---------------------------------------------------------------------------------------------


# What the kernels share. Each runs on a 2D grid: axis 1 is b * H + h, and axis 0 (except in the
# delta kernel, which reads plain rows) numbers (tile, block of BLOCK tokens of that tile). Tile
# tokens are not contiguous in natural order, so every block is gathered row by row: token s of
# tile t is row ORIGIN[t] + TILE_OFFS[s], and a tile list (a query tile's window, a key tile's
# query tiles) is walked as one token list through the first-token indices of its tiles.


@triton.jit
def _batch_head(H):
    """(b, h, bh) of this program, with bh = b * H + h its axis-1 index.

    b and h are int64, so the (batch, head) base offsets cannot overflow int32.
    """
    bh = tl.program_id(1)
    return (bh // H).to(tl.int64), (bh % H).to(tl.int64), bh


@triton.jit
def _tile_block(BLOCK: tl.constexpr, TILE_TOKENS: tl.constexpr):
    """(tile, start): this program owns within-tile positions [start, start + BLOCK) of `tile`.

    Axis 0 is tile * ceil(TILE_TOKENS / BLOCK) + block; the launchers size the grid so.
    """
    BLOCKS: tl.constexpr = (TILE_TOKENS + BLOCK - 1) // BLOCK
    return tl.program_id(0) // BLOCKS, (tl.program_id(0) % BLOCKS) * BLOCK


@triton.jit
def _tile_rows(ORIGIN, TILE_OFFS, tile, start, BLOCK: tl.constexpr, TILE_TOKENS: tl.constexpr):
    """Rows (int32, natural order) of within-tile positions [start, start + BLOCK) of `tile`.

    Returns (rows, valid); positions past the tile's end are masked and their rows point at the
    tile's first token, so they stay in bounds.
    """
    pos = start + tl.arange(0, BLOCK)
    valid = pos < TILE_TOKENS
    rows = tl.load(ORIGIN + tile) + tl.load(TILE_OFFS + pos, mask=valid, other=0)
    return rows, valid


@triton.jit
def _list_rows(FIRST, TILE_OFFS, start, end, BLOCK: tl.constexpr, TILE_TOKENS: tl.constexpr):
    """Rows (int32, natural order) of positions [start, start + BLOCK) of a tile list.

    FIRST points at the first-token indices of the list's tiles; the list is taken as one list
    of tokens, position j being token j % TILE_TOKENS of list tile j // TILE_TOKENS, so a block
    may straddle tiles. Returns (rows, valid); positions at or past `end` are masked and their
    rows stay in bounds.
    """
    j = start + tl.arange(0, BLOCK)
    valid = j < end
    tile_first = tl.load(FIRST + j // TILE_TOKENS, mask=valid, other=0)
    rows = tile_first + tl.load(TILE_OFFS + j % TILE_TOKENS)
    return rows, valid


@triton.jit
def _load_rows(X, rows, valid, stride_n, offs_d):
    """(BLOCK, HEAD_DIM): rows `rows` of the (N, HEAD_DIM) matrix at X; masked rows read 0."""
    return tl.load(X + rows[:, None] * stride_n + offs_d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _load_rows_t(X, rows, valid, stride_n, offs_d):
    """(HEAD_DIM, BLOCK): the same rows loaded transposed, as the right operand of a dot."""
    return tl.load(X + rows[None, :] * stride_n + offs_d[:, None], mask=valid[None, :], other=0.0)


@triton.jit
def _store_rows(X, rows, valid, stride_n, offs_d, x):
    """Write x (BLOCK, HEAD_DIM) to rows `rows` of the matrix at X, cast to X's element type."""
    tl.store(
        X + rows[:, None] * stride_n + offs_d[None, :],
        x.to(X.dtype.element_ty),
        mask=valid[:, None],
    )


@triton.jit
def _log2_scale(sm_scale):
    """The softmax scale with log2(e) folded in, so that exp2 (the cheap instruction) applies.

    It stays fp32 and multiplies the fp32 dot outputs: scores are never rounded to bf16/fp16
    before the softmax.
    """
    return sm_scale * 1.4426950408889634


@triton.jit
def _dsa_fwd_kernel(
    Q, K, V, O, LSE, ORIGIN, TILE_OFFS, WIN,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_wb, stride_wh,
    H, N,
    sm_scale,
    TILE_TOKENS: tl.constexpr, WIN_TILES: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """O and base-2 LSE for BLOCK_M tokens of one query tile of one (batch, head).

    ORIGIN: (nTiles,) first-token index of each tile. TILE_OFFS: (TILE_TOKENS,) offset of each
    within-tile position from its tile's first token. WIN: (Bm, Hm, nTiles, WIN_TILES) first-token
    indices of each query tile's key tiles (batch/head strides 0 where windows broadcast).
    The tile's keys are walked as one list of WIN_TILES * TILE_TOKENS tokens in BLOCK_N blocks;
    a block may span several small tiles, so odd tile sizes waste no padding.
    """
    KEYS: tl.constexpr = WIN_TILES * TILE_TOKENS
    q_tile, m_start = _tile_block(BLOCK_M, TILE_TOKENS)
    b, h, bh = _batch_head(H)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh
    LSE += bh.to(tl.int64) * N
    win = WIN + b * stride_wb + h * stride_wh + q_tile * WIN_TILES

    offs_d = tl.arange(0, HEAD_DIM)
    rows_m, valid_m = _tile_rows(ORIGIN, TILE_OFFS, q_tile, m_start, BLOCK_M, TILE_TOKENS)
    q = _load_rows(Q, rows_m, valid_m, stride_qn, offs_d)  # (BLOCK_M, HEAD_DIM)
    qk_scale = _log2_scale(sm_scale)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n_start in range(0, KEYS, BLOCK_N):
        rows_n, valid_n = _list_rows(win, TILE_OFFS, n_start, KEYS, BLOCK_N, TILE_TOKENS)
        kT = _load_rows_t(K, rows_n, valid_n, stride_kn, offs_d)  # (HEAD_DIM, BLOCK_N)
        s = tl.dot(q, kT, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if KEYS % BLOCK_N != 0:
            s = tl.where(valid_n[None, :], s, float("-inf"))
        # Every block holds at least one valid key, so m_new is finite from the first block.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(V, rows_n, valid_n, stride_vn, offs_d)  # (BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    _store_rows(O, rows_m, valid_m, stride_on, offs_d, acc)
    tl.store(LSE + rows_m, m_i + tl.math.log2(l_i), mask=valid_m)


@triton.jit
def _dsa_bwd_delta_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_on,
    stride_db, stride_dh, stride_dn,
    H, N,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O) in fp32, the softmax-backward correction term, per token."""
    b, h, bh = _batch_head(H)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # natural order: no tiles needed
    valid = rows < N
    offs_d = tl.arange(0, HEAD_DIM)
    o = _load_rows(O + b * stride_ob + h * stride_oh, rows, valid, stride_on, offs_d)
    do = _load_rows(DO + b * stride_db + h * stride_dh, rows, valid, stride_dn, offs_d)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * N + rows, delta, mask=valid)


@triton.jit
def _dsa_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, ORIGIN, TILE_OFFS, WIN,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    stride_wb, stride_wh,
    H, N,
    sm_scale,
    TILE_TOKENS: tl.constexpr, WIN_TILES: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ for BLOCK_M tokens of one query tile, over the tile's query->key list."""
    KEYS: tl.constexpr = WIN_TILES * TILE_TOKENS
    q_tile, m_start = _tile_block(BLOCK_M, TILE_TOKENS)
    b, h, bh = _batch_head(H)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DQ += b * stride_dqb + h * stride_dqh
    win = WIN + b * stride_wb + h * stride_wh + q_tile * WIN_TILES

    offs_d = tl.arange(0, HEAD_DIM)
    rows_m, valid_m = _tile_rows(ORIGIN, TILE_OFFS, q_tile, m_start, BLOCK_M, TILE_TOKENS)
    q = _load_rows(Q, rows_m, valid_m, stride_qn, offs_d)  # (BLOCK_M, HEAD_DIM)
    do = _load_rows(DO, rows_m, valid_m, stride_don, offs_d)
    lse = tl.load(LSE + bh.to(tl.int64) * N + rows_m, mask=valid_m, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * N + rows_m, mask=valid_m, other=0.0)
    qk_scale = _log2_scale(sm_scale)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n_start in range(0, KEYS, BLOCK_N):
        rows_n, valid_n = _list_rows(win, TILE_OFFS, n_start, KEYS, BLOCK_N, TILE_TOKENS)
        k = _load_rows(K, rows_n, valid_n, stride_kn, offs_d)  # (BLOCK_N, HEAD_DIM)
        vT = _load_rows_t(V, rows_n, valid_n, stride_vn, offs_d)  # (HEAD_DIM, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N): the forward's softmax
        if KEYS % BLOCK_N != 0:
            p = tl.where(valid_n[None, :], p, 0.0)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    dq = dq * sm_scale  # d(scores)/d(q) carries the natural-log scale, applied once in fp32
    _store_rows(DQ, rows_m, valid_m, stride_dqn, offs_d, dq)


@triton.jit
def _dsa_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, ORIGIN, TILE_OFFS, INV_OFF, INV_Q,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_iob, stride_ioh,
    stride_iqb, stride_iqh,
    H, N,
    sm_scale,
    TILE_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dK and dV for BLOCK_N tokens of one key tile, over the tile's key->query list.

    INV_OFF: (Bm, Hm, nTiles + 1) CSR offsets; INV_Q: (Bm, Hm, nTiles * W) first-token indices of
    the query tiles that attend to each key tile. Their tokens are walked as one list in BLOCK_M
    blocks, like the forward walks keys.
    """
    k_tile, n_start = _tile_block(BLOCK_N, TILE_TOKENS)
    b, h, bh = _batch_head(H)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh
    LSE += bh.to(tl.int64) * N
    DELTA += bh.to(tl.int64) * N
    inv_off = INV_OFF + b * stride_iob + h * stride_ioh
    inv_q = INV_Q + b * stride_iqb + h * stride_iqh

    offs_d = tl.arange(0, HEAD_DIM)
    rows_n, valid_n = _tile_rows(ORIGIN, TILE_OFFS, k_tile, n_start, BLOCK_N, TILE_TOKENS)
    k = _load_rows(K, rows_n, valid_n, stride_kn, offs_d)  # (BLOCK_N, HEAD_DIM)
    v = _load_rows(V, rows_n, valid_n, stride_vn, offs_d)
    qk_scale = _log2_scale(sm_scale)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    first = tl.load(inv_off + k_tile) * TILE_TOKENS
    last = tl.load(inv_off + k_tile + 1) * TILE_TOKENS
    for m_start in range(first, last, BLOCK_M):
        rows_m, valid_m = _list_rows(inv_q, TILE_OFFS, m_start, last, BLOCK_M, TILE_TOKENS)
        q = _load_rows(Q, rows_m, valid_m, stride_qn, offs_d)  # (BLOCK_M, HEAD_DIM)
        do = _load_rows(DO, rows_m, valid_m, stride_don, offs_d)
        lse = tl.load(LSE + rows_m, mask=valid_m, other=0.0)
        delta = tl.load(DELTA + rows_m, mask=valid_m, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (BN, BM)
        pT = tl.where(valid_m[None, :], tl.math.exp2(sT - lse[None, :]), 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BN, BM)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    dk = dk * sm_scale
    _store_rows(DK, rows_n, valid_n, stride_dkn, offs_d, dk)
    _store_rows(DV, rows_n, valid_n, stride_dvn, offs_d, dv)


# ---------------------------------------------------------------------------------------------
# Autotune configurations, keyed on (tile tokens, head dim, window tiles) and the input dtype
# ---------------------------------------------------------------------------------------------

_AUTOTUNE_KEY = ["TILE_TOKENS", "HEAD_DIM", "WIN_TILES"]


def _configs(rows):
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
        for m, n, w, st in rows
    ]


# (BLOCK_M, BLOCK_N, warps, stages). Forward and dQ: BLOCK_M query tokens of one tile against
# BLOCK_N keys of its window list. Small-M rows serve small tiles (e.g. 1x4x4 = 16 tokens).
_FWD_CONFIGS = _configs(
    [
        (128, 64, 8, 3),
        (128, 64, 4, 2),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (64, 32, 4, 2),
        (32, 64, 4, 2),
        (16, 64, 4, 2),
        (16, 128, 4, 2),
    ]
)
# dK/dV: BLOCK_N key tokens of one tile against BLOCK_M tokens of its query list; it holds two
# (BLOCK_N, D) fp32 accumulators, so the streamed query block stays small.
_BWD_CONFIGS = _configs(
    [
        (64, 128, 8, 2),
        (32, 128, 8, 2),
        (64, 64, 4, 2),
        (32, 64, 4, 2),
        (64, 32, 4, 2),
        (64, 16, 4, 2),
        (128, 16, 4, 2),
    ]
)


def _pruner(tile_block: str, list_block: str):
    """Config pruning for kernels whose `tile_block` spans one tile and `list_block` a tile list.

    Drops blocks far larger than what they cover (pure padding) and, under the interpreter,
    keeps a single config: timing configs through numpy is meaningless and slow.
    """

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        tile_tokens, head_dim = args["TILE_TOKENS"], args["HEAD_DIM"]
        tile_fit = max(16, triton.next_power_of_2(tile_tokens))
        kept = [c for c in configs if c.kwargs[tile_block] <= tile_fit]
        if head_dim >= 256:  # register pressure: only the smaller blocks fit
            kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
        kept = kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
        if interpreting():
            # Fewest loop trips: the interpreter's cost is per operation, not per element.
            kept = [max(kept, key=lambda c: (c.kwargs[tile_block], c.kwargs[list_block]))]
        return kept

    return {"early_config_prune": prune}


_dsa_fwd = triton.autotune(
    _FWD_CONFIGS,
    key=_AUTOTUNE_KEY,
    prune_configs_by=_pruner("BLOCK_M", "BLOCK_N"),
)(_dsa_fwd_kernel)
_dsa_bwd_dq = triton.autotune(
    _FWD_CONFIGS,
    key=_AUTOTUNE_KEY,
    prune_configs_by=_pruner("BLOCK_M", "BLOCK_N"),
)(_dsa_bwd_dq_kernel)
_dsa_bwd_dkdv = triton.autotune(
    _BWD_CONFIGS,
    key=_AUTOTUNE_KEY[:2],
    prune_configs_by=_pruner("BLOCK_N", "BLOCK_M"),
)(_dsa_bwd_dkdv_kernel)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _check_triton_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise with a clear message when the Triton backend cannot take these tensors."""
    check_attention_inputs(q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[2] * t.stride(2) >= 2**31:
            raise ValueError(
                f"{name} spans {t.shape[2] * t.stride(2)} elements per (batch, head): row offsets "
                "are int32 inside the kernels; make the layout (B, heads, N, D) contiguous"
            )


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def tile_origins(geom: DSAGeometry, device) -> tuple[Tensor, Tensor]:
    """Natural-order token addressing of tiles, int32.

    Returns `(origin, offsets)`: `origin[j]` (nTiles,) is the index of tile j's first token and
    `offsets[s]` (S,) the distance of within-tile position s (row-major over (tt, ty, tx)) from
    it, so token s of tile j is `origin[j] + offsets[s]`. This is the whole tile permutation.
    """
    (_, Y, X), (tt, ty, tx), (nT, nY, nX) = geom.grid, geom.tile, geom.tiles

    def grid_index(nt, ny, nx, st, sy, sx):
        a = torch.arange(nt, device=device).view(nt, 1, 1) * st
        b = torch.arange(ny, device=device).view(1, ny, 1) * sy
        c = torch.arange(nx, device=device).view(1, 1, nx) * sx
        return ((a * Y + b) * X + c).reshape(-1).to(torch.int32)

    return grid_index(nT, nY, nX, tt, ty, tx), grid_index(tt, ty, tx, 1, 1, 1)


def _launch(kernel, blocks, grid_fn, *args, **kwargs):
    """Run the autotuned kernel, or its plain jit function with fixed (BLOCK_M, BLOCK_N)."""
    if blocks is None:
        kernel[grid_fn](*args, **kwargs)
    else:
        meta = {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]}
        kernel.fn[grid_fn(meta)](*args, **kwargs, **meta, num_warps=4)


def _broadcast_strides(t: Tensor) -> tuple[int, int]:
    """(batch, head) strides of a (Bm, Hm, ...) index tensor, 0 where it broadcasts."""
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 is the accuracy mode: IEEE dots, matching torch.matmul's fp32 default on CUDA.
    return "ieee" if dtype == torch.float32 else "tf32"


def _dsa_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    origin: Tensor,
    offsets: Tensor,
    win: Tensor,
    geom: DSAGeometry,
    scale: float,
    blocks: tuple[int, int] | None,
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: returns out (like q) and the base-2 LSE, fp32 (B, H, N).

    origin, offsets: from `tile_origins`; win: (Bm, Hm, nTiles, W) int32 first tokens of each
    query tile's key tiles.
    """
    B, H, N, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    S = geom.tile_tokens
    grid_fn = lambda meta: (triton.cdiv(S, meta["BLOCK_M"]) * geom.num_tiles, B * H)  # noqa: E731
    _launch(
        _dsa_fwd,
        blocks,
        grid_fn,
        q,
        k,
        v,
        out,
        lse,
        origin,
        offsets,
        win,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        *_broadcast_strides(win),
        H,
        N,
        sm_scale=scale,
        WIN_TILES=geom.window_tiles,
        HEAD_DIM=D,
        DOT_PRECISION=_dot_precision(q.dtype),
        TILE_TOKENS=geom.tile_tokens,
    )
    return out, lse


def _dsa_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    origin: Tensor,
    offsets: Tensor,
    win_tiles: Tensor,
    win: Tensor,
    geom: DSAGeometry,
    scale: float,
    blocks: tuple[int, int] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch delta, dQ and dK/dV kernels; gradients have the shapes and dtypes of q, k, v.

    win_tiles: the (Bm, Hm, nTiles, W) key-tile indices, inverted here into key->query lists.
    """
    B, H, N, D = q.shape
    S, nQ = geom.tile_tokens, geom.num_tiles
    do = do.contiguous()  # autograd may hand over an expanded (stride-0) gradient
    delta = torch.empty_like(lse)
    _dsa_bwd_delta_kernel[(triton.cdiv(N, 64), B * H)](
        out,
        do,
        delta,
        *out.stride()[:3],
        *do.stride()[:3],
        H,
        N,
        HEAD_DIM=D,
        BLOCK=64,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    precision = _dot_precision(q.dtype)
    grid_q = lambda meta: (triton.cdiv(S, meta["BLOCK_M"]) * nQ, B * H)  # noqa: E731
    _launch(
        _dsa_bwd_dq,
        blocks,
        grid_q,
        q,
        k,
        v,
        do,
        dq,
        lse,
        delta,
        origin,
        offsets,
        win,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *do.stride()[:3],
        *dq.stride()[:3],
        *_broadcast_strides(win),
        H,
        N,
        sm_scale=scale,
        WIN_TILES=geom.window_tiles,
        HEAD_DIM=D,
        DOT_PRECISION=precision,
        TILE_TOKENS=geom.tile_tokens,
    )
    inv_off, inv_q = invert_windows(win_tiles, nQ)  # (Bm, Hm, nQ+1), (Bm, Hm, nQ*W)
    inv_q = origin[inv_q.long()]  # query tiles -> their first tokens, int32
    grid_k = lambda meta: (triton.cdiv(S, meta["BLOCK_N"]) * nQ, B * H)  # noqa: E731
    _launch(
        _dsa_bwd_dkdv,
        blocks,
        grid_k,
        q,
        k,
        v,
        do,
        dk,
        dv,
        lse,
        delta,
        origin,
        offsets,
        inv_off,
        inv_q,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *do.stride()[:3],
        *dk.stride()[:3],
        *dv.stride()[:3],
        *_broadcast_strides(inv_off),
        *_broadcast_strides(inv_q),
        H,
        N,
        sm_scale=scale,
        HEAD_DIM=D,
        DOT_PRECISION=precision,
        TILE_TOKENS=geom.tile_tokens,
    )
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class DSAFunction(torch.autograd.Function):
    """3D-DSA with Triton forward and backward. Window tensors are integer inputs (no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, win_tiles, geom, scale, blocks):
        origin, offsets = tile_origins(geom, q.device)  # (nTiles,), (S,)
        win = origin[win_tiles]  # (Bm, Hm, nTiles, W) int32 first tokens of the key tiles
        out, lse = _dsa_forward(q, k, v, origin, offsets, win, geom, scale, blocks)
        ctx.save_for_backward(q, k, v, out, lse, origin, offsets, win_tiles, win)
        ctx.geom, ctx.scale, ctx.blocks = geom, scale, blocks
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward kernels have no backward
    def backward(ctx, dout):
        q, k, v, out, lse, origin, offsets, win_tiles, win = ctx.saved_tensors
        dq, dk, dv = _dsa_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            origin,
            offsets,
            win_tiles,
            win,
            ctx.geom,
            ctx.scale,
            ctx.blocks,
        )
        return dq, dk, dv, None, None, None, None


@torch.compiler.disable  # a graph break under torch.compile: see the Caution above
def dsa_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    grid,
    tile,
    window,
    motion: Tensor | None = None,
    scale: float | None = None,
    blocks: tuple[int, int] | None = None,
) -> Tensor:
    """3D-DSA on the Triton kernels. `blocks=(BLOCK_M, BLOCK_N)` skips autotuning (tests)."""
    geom = dsa_geometry(grid, tile, window)
    scale = check_inputs(q, k, v, motion, geom, scale)
    _check_triton_inputs(q, k, v)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    win_tiles = window_tiles(geom, motion, device=q.device)  # (Bm, Hm, nTiles, W) int64
    if q.is_cuda:
        # Triton launches on the current device; without the guard a tensor on cuda:1 would be
        # read by a kernel running on cuda:0.
        with torch.cuda.device(q.device):
            return DSAFunction.apply(q, k, v, win_tiles, geom, scale, blocks)
    return DSAFunction.apply(q, k, v, win_tiles, geom, scale, blocks)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def dsa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    grid,
    tile,
    window,
    motion: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """3D Deformable Slide Attention; semantics in this module's docstring.

    `backend`: "triton", "reference", or "auto" (Triton for CUDA tensors when Triton imports,
    the PyTorch reference otherwise). Gradients flow to q, k, v; motion gets none.
    """
    if backend == "auto":
        backend = "triton" if q.is_cuda and TRITON_IMPORT_ERROR is None else "reference"
    if backend == "triton":
        return dsa_triton(q, k, v, grid=grid, tile=tile, window=window, motion=motion, scale=scale)
    if backend == "reference":
        return dsa_attention_reference(
            q, k, v, grid=grid, tile=tile, window=window, motion=motion, scale=scale
        )
    raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
