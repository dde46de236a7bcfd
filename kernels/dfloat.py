"""DFloat decode: entropy-coded bf16 exponents back to 16-bit words, on the device (Triton).

Semantics: `dfloat_decode(sm, table, lane_offsets, stream, out)` writes into `out`, an
`(num_words,)` int16 tensor, exactly the words `dfloat_reference.dfloat_encode` coded: word i is
`(sm[i] & 0x80) << 8 | exponent[i] << 7 | (sm[i] & 0x7F)`, with `exponent[i]` read from the
Huffman stream (format and layout: `dfloat_reference.py`). The result is bitwise the encoded
buffer; `tests/test_dfloat.py` checks it against the reference decoder and the original.

Why this design (rather than DFloat11's single stream with per-thread bit gaps): every lane has
a stream of its own whose byte offset is stored, so one program decodes `BLOCK` lanes with no
prefix sum and no search, at a cost of 4 bytes per 256 words (0.125 bits a word). Lanes of one
group own interleaved words (lane w takes words w, w + LANES, ...), so at each of the 256 steps
the lanes of a group load `sm` and store words at consecutive addresses. Per step a lane gathers
3 stream bytes (the 24-bit window at its bit position: at most 7 bits of offset plus a code of
at most 10 bits) and one entry of the 2 KiB decode table (cached: every lane reads the same one).

Caution:
- `out` must not overlap the inputs; inputs are read-only. All five tensors on one CUDA device
  (or on the CPU under TRITON_INTERPRET=1), contiguous.
- Decoding is serial within a lane (256 steps); parallelism is the number of lanes, num_words /
  256. Buffers of a few thousand words leave most of a GPU idle: that is fine for a block of a
  streamed model (millions of words), not for tiny tensors.
- Triton is optional at import time; `dfloat_decode` raises on CUDA tensors without it. On the
  CPU it runs the C++ decoder (`lane_native.py`), or the reference where that cannot be built
  or ``MEGASLIDE_NATIVE_CODEC=0`` (unless TRITON_INTERPRET=1 asks for the kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dfloat_reference import dfloat_decode_reference
from .lane_code import (
    LANES,
    MAX_CODE_BITS,
    STREAM_PAD,
    SYMBOLS,
    check_operands,
    lane_start,
    next_code,
    num_lanes,
)
from .lane_native import load as load_native
from .triton_import import TRITON_IMPORT_ERROR, interpreting, tl, triton


@triton.jit
def _dfloat_decode_kernel(
    SM, TABLE, OFFSETS, STREAM, OUT,
    num_words, num_lanes,
    LANES: tl.constexpr, SYMBOLS: tl.constexpr, CODE_BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    _, live, first_word, position = lane_start(OFFSETS, num_lanes, LANES, SYMBOLS, BLOCK)
    for t in range(SYMBOLS):
        entry = next_code(STREAM, TABLE, position, live, CODE_BITS)  # symbol | length << 8
        word = first_word + t * LANES
        keep = live & (word < num_words)  # the last group's padding is decoded, never stored
        sm = tl.load(SM + word, mask=keep, other=0).to(tl.int32)
        bits = ((sm & 0x80) << 8) | ((entry & 0xFF) << 7) | (sm & 0x7F)
        tl.store(OUT + word, bits.to(tl.int16), mask=keep)  # low 16 bits, two's complement
        position += (entry >> 8).to(tl.int64)


def _check(sm: Tensor, table: Tensor, lane_offsets: Tensor, stream: Tensor, out: Tensor) -> None:
    check_operands(
        {
            "sm": (sm, torch.uint8),
            "table": (table, torch.int16),
            "lane_offsets": (lane_offsets, torch.int32),
            "stream": (stream, torch.uint8),
            "out": (out, torch.int16),
        },
        "out",
    )
    n = out.numel()
    if sm.numel() != n:
        raise ValueError(f"sm has {sm.numel()} bytes for {n} words")
    if lane_offsets.numel() != num_lanes(n):
        raise ValueError(f"{lane_offsets.numel()} lane offsets for {n} words: need {num_lanes(n)}")
    if table.numel() != 1 << MAX_CODE_BITS:
        raise ValueError(f"table has {table.numel()} entries, need {1 << MAX_CODE_BITS}")
    if stream.numel() < STREAM_PAD:
        raise ValueError("stream is shorter than its padding")


def dfloat_triton(
    sm: Tensor, table: Tensor, lane_offsets: Tensor, stream: Tensor, out: Tensor, block: int = 128
) -> Tensor:
    """The Triton decode (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); returns `out`."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(f"the dfloat kernel needs triton: {TRITON_IMPORT_ERROR}")
    _check(sm, table, lane_offsets, stream, out)
    if out.device.type != "cuda" and not interpreting():
        raise ValueError("dfloat_triton needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    lanes = lane_offsets.numel()
    if lanes == 0:
        return out
    grid = (triton.cdiv(lanes, block),)
    _dfloat_decode_kernel[grid](
        sm,
        table,
        lane_offsets,
        stream,
        out,
        out.numel(),
        lanes,
        LANES=LANES,
        SYMBOLS=SYMBOLS,
        CODE_BITS=MAX_CODE_BITS,
        BLOCK=block,
    )
    return out


def dfloat_decode(
    sm: Tensor, table: Tensor, lane_offsets: Tensor, stream: Tensor, out: Tensor
) -> Tensor:
    """Decode into `out` (int16, `(num_words,)`): the Triton kernel on CUDA (and on the CPU
    under TRITON_INTERPRET=1), the C++ decoder on the CPU (`lane_native.py`), the reference
    where that is unavailable. Queued on the current stream; returns `out`."""
    if out.device.type == "cuda" or interpreting():
        return dfloat_triton(sm, table, lane_offsets, stream, out)
    _check(sm, table, lane_offsets, stream, out)
    native = load_native() if out.device.type == "cpu" else None
    if native is not None:
        return native.dfloat_decode(sm, table, lane_offsets, stream, out)
    return dfloat_decode_reference(sm, table, lane_offsets, stream, out)
