"""fp8 slot decode: every fp8 linear weight of a streamed block dequantized in one launch (Triton).

Semantics: for each weight `i` of a block, `out_i[r, c] = (q_i[r, c] as float32) * 2**e_i[r]`,
cast to the slot's dtype, where `q_i` is float8_e4m3fn `(rows, cols)` and `e_i` one int8
exponent per row (`engine/streaming/weight_formats.fp8_quantize`). That is `fp8_dequantize`'s
arithmetic, the reference: a product by a power of two is exact in fp32 and the cast rounds to
nearest even on both sides, so the kernel's output is bitwise the reference's
(`tests/test_fp8_decode.py`, under the interpreter; NaN, which no quantized weight holds, only
by position: its payload differs).

Why one launch: the unfused decode runs five PyTorch ops per weight (upcast, exp2, multiply,
cast, copy), about fifty small launches per Wan block, each a pass over the weight in its own
dtype; this reads each fp8 byte once and writes each output element once. The weights of one
block all come out of one payload, so the launch takes the payload's lowest part as its base
pointer and a table of tiles, one row per `ROWS` rows of a weight:

    (q byte offset, exponent byte offset, output element offset, rows in the tile, cols)

offsets relative to the base (bytes) and to the typed output. The table depends only on the
block's layout, and a model's blocks share one, so it is built once per layout and device
(`DecodeTable`) and kept.

The kernel decodes the e4m3fn bits with integer arithmetic (sign, 4-bit exponent with bias 7,
3-bit mantissa; subnormals as `m * 2**-9`; 0x7F/0xFF as NaN) and builds the scale's fp32 bits
directly (`(e + 127) << 23`; exponents are within [-126, 127] by construction), so neither an
fp8 dtype nor `exp2` (approximate on a GPU) is needed and the interpreter runs the same code.

Caution: `out` must not overlap the payload. Exponent and q bytes are read through one pointer
whatever the base part's dtype (uint8 or int8): both are masked to their low 8 bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from .triton_import import TRITON_IMPORT_ERROR, interpreting, tl, triton

ROWS = 16  # weight rows per program
COLS = 256  # columns per inner step
FIELDS = 5  # int64s per tile of the table
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _fp8_rows_kernel(BASE, TABLE, OUT, ROWS: tl.constexpr, COLS: tl.constexpr):
    tile = TABLE + tl.program_id(0).to(tl.int64) * 5
    q_off = tl.load(tile)
    e_off = tl.load(tile + 1)
    o_off = tl.load(tile + 2)
    rows = tl.load(tile + 3)
    cols = tl.load(tile + 4)
    r = tl.arange(0, ROWS)
    live = r < rows
    e = tl.load(BASE + e_off + r, mask=live, other=0).to(tl.int32) & 0xFF
    e = tl.where(e > 127, e - 256, e)  # the int8 exponent
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    row_q = q_off + r.to(tl.int64) * cols
    row_o = o_off + r.to(tl.int64) * cols
    for c0 in range(0, cols, COLS):
        c = c0 + tl.arange(0, COLS)
        keep = live[:, None] & (c < cols)[None, :]
        bits = tl.load(BASE + row_q[:, None] + c[None, :], mask=keep, other=0).to(tl.int32) & 0xFF
        sign = (bits >> 7) << 31
        exp = (bits >> 3) & 0xF
        man = bits & 0x7
        normal = ((exp + 120) << 23) | (man << 20)  # (1 + m/8) * 2**(exp - 7)
        value = tl.where(
            exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True)
        )
        value = (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        nan = (sign | 0x7FC00000).to(tl.float32, bitcast=True)  # a quiet NaN of the same sign
        value = tl.where((bits & 0x7F) == 0x7F, nan, value)
        out = value * scale[:, None]
        tl.store(OUT + row_o[:, None] + c[None, :], out.to(OUT.dtype.element_ty), mask=keep)


class DecodeTable:
    """A block layout's tiles (`FIELDS` int64s each) on one device, for `fp8_rows_decode`.

    `weights`: per weight `(q byte offset, exponent byte offset, output element offset, rows,
    cols)`, offsets relative to the payload's base part and the typed output."""

    def __init__(self, weights: Sequence[tuple[int, int, int, int, int]], device: torch.device):
        tiles = []
        for q_off, e_off, o_off, rows, cols in weights:
            for r0 in range(0, rows, ROWS):
                n = min(ROWS, rows - r0)
                tiles.append((q_off + r0 * cols, e_off + r0, o_off + r0 * cols, n, cols))
        self.tiles = len(tiles)
        # A copy from pageable memory (it waits for the host): once per layout and device, at
        # the first decode of a model's first block, never per step.
        self.table = torch.tensor(tiles, dtype=torch.int64, device=device).reshape(-1)


_TABLES: dict[tuple, DecodeTable] = {}


def decode_table(weights: tuple[tuple[int, int, int, int, int], ...], device) -> DecodeTable:
    """The kept `DecodeTable` of a layout on `device` (built on first use)."""
    key = (weights, str(device))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = DecodeTable(weights, torch.device(device))
    return table


def fp8_decode_available(device: torch.device) -> bool:
    """Whether `fp8_rows_decode` runs on `device`: Triton on CUDA, or the interpreter."""
    return TRITON_IMPORT_ERROR is None and (device.type == "cuda" or interpreting())


def fp8_rows_decode(
    weights: Sequence[tuple[Tensor, Tensor, int]], out: Tensor, dtype: torch.dtype
) -> None:
    """Dequantize each `(q, exponent, output element offset)` of `weights` into `out` (a flat
    uint8 slot viewed as `dtype`) in one launch, queued on the current stream. `q`: e4m3fn
    `(rows, cols)` or its bytes; `exponent`: int8 `(rows,)`; all views of one payload on `out`'s
    device (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    if not weights:
        return
    if not fp8_decode_available(out.device):
        raise RuntimeError(
            "fp8_rows_decode needs Triton and CUDA tensors (or TRITON_INTERPRET=1 on the CPU)"
            + (f": {TRITON_IMPORT_ERROR}" if TRITON_IMPORT_ERROR is not None else "")
        )
    if dtype not in OUT_DTYPES:
        raise ValueError(f"fp8 decodes into {', '.join(map(str, OUT_DTYPES))}, not {dtype}")
    parts = [t for q, e, _ in weights for t in (q, e)]
    if any(t.device != out.device or t.element_size() != 1 for t in parts):
        raise ValueError("fp8 weights and exponents: 1-byte tensors on the output's device")
    base = min(parts, key=Tensor.data_ptr)
    at = base.data_ptr()
    layout = tuple(
        (q.data_ptr() - at, e.data_ptr() - at, offset, q.shape[0], q.numel() // q.shape[0])
        for q, e, offset in weights
    )
    table = decode_table(layout, out.device)
    typed = out[: out.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
    # Launched on the output's device, whichever is current (a rank's, a second GPU's).
    guard = torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext()
    with guard:
        _fp8_rows_kernel[(table.tiles,)](base, table.table, typed, ROWS=ROWS, COLS=COLS)
