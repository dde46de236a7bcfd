"""DFloat: lossless bf16 weight compression (entropy-coded exponents), the format and its reference.

The format (what `dfloat_encode` writes and both decoders read) codes a flat buffer of 16-bit
words, each split the way bf16 lays out its bits, `s eeeeeeee mmmmmmm`:

- `sm`: one byte per word, `s << 7 | mmmmmmm`, stored raw (mantissas of trained weights are
  close to uniform: nothing to gain);
- the 8-bit exponent `eeeeeeee` is coded with one canonical Huffman code per buffer whose code
  lengths are at most `MAX_CODE_BITS` (trained bf16 weights use few distinct exponents: about
  2.6 bits of information in 8, DFloat11, arXiv:2504.11651). Any 16-bit word splits this way, so
  a buffer that also holds fp32 or int tensors or padding still round-trips bitwise; it only
  compresses less.

Parallel layout, code construction and streams: `lane_code.py` (lanes of `SYMBOLS` words in groups
of `LANES`, per-lane byte offsets, a `2**MAX_CODE_BITS`-entry decode table, `STREAM_PAD` zero
bytes after the stream), shared with the fine-tune delta format (`delta_reference.py`).

Caution:
- Lossless means bitwise: decoding reproduces every word, NaN payloads and signed zeros
  included. Compression comes only from the exponents; mantissas and signs stay 8 bits a word.
- Buffers must have an even number of bytes (whole words); a buffer of fewer than 2**31 words
  is required so lane offsets fit int32 (checked).
- The reference decoder walks SYMBOLS steps over all lanes at once (vectorised torch); it is
  what CPU streaming uses and what the Triton kernel (`dfloat.py`) is tested against.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .lane_code import (
    LANES,
    MAX_CODE_BITS,
    STREAM_PAD,
    SYMBOLS,
    canonical_codes,
    code_lengths,
    decode_lanes_reference,
    decode_table,
    encode_lanes,
    num_lanes,
)

# The layout's names stay importable from here, where the format was first defined.
__all__ = [
    "LANES",
    "MAX_CODE_BITS",
    "STREAM_PAD",
    "SYMBOLS",
    "DFloatBuffer",
    "canonical_codes",
    "code_lengths",
    "decode_table",
    "dfloat_decode_buffer",
    "dfloat_decode_reference",
    "dfloat_encode",
    "num_lanes",
    "split_words",
]


@dataclasses.dataclass(frozen=True)
class DFloatBuffer:
    """One coded buffer: raw sign+mantissa bytes, the decode table, lane offsets, the stream."""

    num_words: int
    sm: torch.Tensor  # (num_words,) uint8
    table: torch.Tensor  # (2**MAX_CODE_BITS,) int16: symbol | length << 8
    lane_offsets: torch.Tensor  # (num_lanes,) int32, byte offset of each lane's stream
    stream: torch.Tensor  # (stream bytes + STREAM_PAD,) uint8
    code_lengths: tuple[int, ...]  # (256,), 0 for exponents that never occur

    @property
    def num_lanes(self) -> int:
        return self.lane_offsets.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of all four parts together (what crosses the bus, before alignment)."""
        return sum(t.numel() * t.element_size() for t in self.parts())

    def parts(self) -> tuple[torch.Tensor, ...]:
        return (self.sm, self.table, self.lane_offsets, self.stream)


def split_words(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sm, exponent) bytes of uint16 words: `s<<7 | mantissa` and the 8 bits between."""
    sm = (((words >> 8) & 0x80) | (words & 0x7F)).astype(np.uint8)
    exponent = ((words >> 7) & 0xFF).astype(np.uint8)
    return sm, exponent


def dfloat_encode(buffer: torch.Tensor) -> DFloatBuffer:
    """Code a flat buffer (any dtype, an even number of bytes, on the CPU) as 16-bit words."""
    flat = buffer.detach().reshape(-1).contiguous().view(torch.uint8)
    if flat.device.type != "cpu":
        raise ValueError(f"dfloat_encode runs on the CPU, got a tensor on {flat.device}")
    if flat.numel() % 2:
        raise ValueError(f"dfloat codes 16-bit words: {flat.numel()} bytes is odd")
    num_words = flat.numel() // 2
    if num_words >= 2**31:
        raise ValueError(f"{num_words} words: dfloat buffers must hold fewer than 2**31")
    words = flat.numpy().view(np.uint16)
    sm, exponent = split_words(words)
    lengths, table, offsets, stream = encode_lanes(exponent)
    return DFloatBuffer(
        num_words=num_words,
        sm=torch.from_numpy(sm),
        table=torch.from_numpy(table),
        lane_offsets=torch.from_numpy(offsets),
        stream=torch.from_numpy(stream),
        code_lengths=tuple(int(x) for x in lengths),
    )


def dfloat_decode_reference(
    sm: torch.Tensor,
    table: torch.Tensor,
    lane_offsets: torch.Tensor,
    stream: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Decode into `out`, an `(num_words,)` int16 tensor (any device), from the four parts (on
    `out`'s device). One step per word of a lane, all lanes at once; returns `out`."""
    num_words = out.numel()
    lanes = lane_offsets.numel()
    if sm.numel() != num_words or lanes != num_lanes(num_words):
        raise ValueError(f"parts do not describe {num_words} words ({sm.numel()}, {lanes} lanes)")
    exponent = decode_lanes_reference(table, lane_offsets, stream, num_words)
    s = sm.to(torch.int32)
    words = (
        ((s & 0x80) << 8) | (exponent.to(torch.int32) << 7) | (s & 0x7F)
    )  # (num_words,) in [0, 65536)
    out.copy_(words.to(torch.int16))  # int32 -> int16 keeps the low 16 bits (two's complement)
    return out


def dfloat_decode_buffer(coded: DFloatBuffer) -> torch.Tensor:
    """A coded buffer back as `(2 * num_words,)` uint8 on the CPU (the reference decoder)."""
    out = torch.empty(coded.num_words, dtype=torch.int16)
    dfloat_decode_reference(*coded.parts(), out)
    return out.view(torch.uint8)
