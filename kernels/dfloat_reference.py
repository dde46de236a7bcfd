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

Parallel layout. Words are taken in groups of `LANES * SYMBOLS` (the last group zero-padded);
within group g, lane w owns words `g*LANES*SYMBOLS + t*LANES + w` for t in `[0, SYMBOLS)`, so
at each step t the `LANES` lanes of a group decode `LANES` consecutive words (coalesced stores).
Each lane's codes form its own bit stream, starting at a byte boundary, MSB first; the byte
offset of every lane's stream is stored (`lane_offsets`, int32), so every lane decodes on its
own with no search. The decode table `table` has `2**MAX_CODE_BITS` int16 entries: indexed by the
next `MAX_CODE_BITS` bits of a stream, it gives `symbol | code_length << 8`. The stream is
followed by 3 zero bytes, so a lane may always read the 3 bytes at its position.

Overhead per word: 4 bytes of lane offset per `SYMBOLS` words (0.125 bits at 256) and under one
byte of stream padding per lane; per buffer a 2 KiB table.

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
import heapq

import numpy as np
import torch

MAX_CODE_BITS = 10  # longest code; the decode table has 2**MAX_CODE_BITS entries
LANES = 32  # lanes per group: consecutive words decoded together
SYMBOLS = 256  # words per lane
STREAM_PAD = 3  # zero bytes after the stream: a lane always reads 3 bytes at its position


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


def num_lanes(num_words: int) -> int:
    groups = -(-num_words // (LANES * SYMBOLS))
    return groups * LANES


def split_words(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sm, exponent) bytes of uint16 words: `s<<7 | mantissa` and the 8 bits between."""
    sm = (((words >> 8) & 0x80) | (words & 0x7F)).astype(np.uint8)
    exponent = ((words >> 7) & 0xFF).astype(np.uint8)
    return sm, exponent


def code_lengths(counts: np.ndarray, max_bits: int = MAX_CODE_BITS) -> np.ndarray:
    """Huffman code lengths (<= max_bits) for 256 symbol counts; 0 for symbols never seen.

    Lengths come from an ordinary Huffman tree; while the longest exceeds `max_bits` the counts
    are halved (rounding up, so seen symbols stay seen) and the tree rebuilt: rare symbols get
    shorter codes at a small cost to common ones, and all-equal counts end at a balanced tree
    (8 bits for 256 symbols), so this terminates for any `max_bits >= 8`.
    """
    if max_bits < 8:
        raise ValueError(f"max_bits={max_bits}: need >= 8 to code 256 symbols")
    counts = np.asarray(counts, dtype=np.int64).copy()
    seen = np.flatnonzero(counts)
    lengths = np.zeros(256, dtype=np.int64)
    if seen.size == 0:
        return lengths
    if seen.size == 1:
        lengths[seen[0]] = 1  # a one-symbol alphabet still needs one bit per symbol
        return lengths
    while True:
        # Heap of (count, tiebreak, symbols in the subtree); merging adds one bit to each symbol.
        heap = [(int(counts[s]), int(s), [int(s)]) for s in seen]
        heapq.heapify(heap)
        depth = np.zeros(256, dtype=np.int64)
        tiebreak = 256
        while len(heap) > 1:
            c1, _, s1 = heapq.heappop(heap)
            c2, _, s2 = heapq.heappop(heap)
            depth[s1] += 1
            depth[s2] += 1
            heapq.heappush(heap, (c1 + c2, tiebreak, s1 + s2))
            tiebreak += 1
        if depth.max() <= max_bits:
            return depth
        counts[seen] = (counts[seen] + 1) // 2


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical Huffman codes: symbols sorted by (length, symbol) get consecutive codes."""
    codes = np.zeros(256, dtype=np.int64)
    code, prev_len = 0, 0
    for s in sorted(np.flatnonzero(lengths), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - prev_len
        codes[s] = code
        code += 1
        prev_len = int(lengths[s])
    return codes


def decode_table(lengths: np.ndarray, max_bits: int = MAX_CODE_BITS) -> np.ndarray:
    """(2**max_bits,) int16: for every max_bits-bit window, `symbol | length << 8` of the code
    it starts with. Entries no code starts (only when a single symbol is coded) stay 0."""
    codes = canonical_codes(lengths)
    table = np.zeros(1 << max_bits, dtype=np.int16)
    for s in np.flatnonzero(lengths):
        span = max_bits - int(lengths[s])
        start = int(codes[s]) << span
        table[start : start + (1 << span)] = s | (int(lengths[s]) << 8)
    return table


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
    lengths = code_lengths(np.bincount(exponent, minlength=256))
    lanes = num_lanes(num_words)
    # Padding words get the most common exponent's code (the shortest) and are never stored.
    pad_symbol = int(np.argmax(np.bincount(exponent, minlength=256))) if num_words else 0
    symbols = np.full(lanes * SYMBOLS, pad_symbol, dtype=np.uint8)
    symbols[:num_words] = exponent
    # Word order -> lane order: group g, step t, lane w  ->  lane g*LANES + w, position t.
    symbols = symbols.reshape(-1, SYMBOLS, LANES).transpose(0, 2, 1).reshape(lanes, SYMBOLS)
    # Narrow integer types throughout: this loop is the encoder's cost (bits within a lane stay
    # below 256 * MAX_CODE_BITS = 2560, so int16; codes shifted into a 24-bit field, int32).
    length = lengths.astype(np.int16)[symbols]  # (lanes, SYMBOLS) bits of each code
    if num_words and length.min() == 0:
        raise AssertionError("a coded symbol has no code")  # pad_symbol always occurs
    within = np.cumsum(length, axis=1, dtype=np.int16)
    within -= length  # (lanes, SYMBOLS) bit position of each code inside its lane's stream
    lane_bytes = (within[:, -1].astype(np.int64) + length[:, -1] + 7) // 8
    offsets = np.zeros(lanes, dtype=np.int64)
    np.cumsum(lane_bytes[:-1], out=offsets[1:])
    total = int(lane_bytes.sum())
    if total + STREAM_PAD >= 2**31:
        raise ValueError("dfloat stream of 2**31 bytes or more: lane offsets overflow int32")
    # Each code fits in the 24-bit window of the 3 bytes from its first byte (bit offset <= 7,
    # length <= MAX_CODE_BITS <= 17). Codes never overlap, and first bytes never decrease in
    # stream order (lane after lane, code after code), so OR-ing the windows of codes that share
    # a first byte (one reduceat over runs) and then the three bytes of every window into the
    # stream builds it exactly.
    field = canonical_codes(lengths).astype(np.int32)[symbols]
    field <<= 24 - (within & 7) - length
    first = (offsets.astype(np.int32)[:, None] + (within >> 3)).reshape(-1)
    field = field.reshape(-1)
    windows = np.zeros(total + STREAM_PAD, dtype=np.int32)
    if first.size:
        starts = np.flatnonzero(np.concatenate(([True], first[1:] != first[:-1])))
        windows[first[starts]] = np.bitwise_or.reduceat(field, starts)
    stream = (windows >> 16).astype(np.uint8)  # each byte: its own window's top byte,
    stream[1:] |= ((windows[:-1] >> 8) & 0xFF).astype(np.uint8)  # the previous one's middle,
    stream[2:] |= (windows[:-2] & 0xFF).astype(np.uint8)  # and the one before's low byte
    return DFloatBuffer(
        num_words=num_words,
        sm=torch.from_numpy(sm),
        table=torch.from_numpy(decode_table(lengths)),
        lane_offsets=torch.from_numpy(offsets.astype(np.int32)),
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
    # The 24-bit window starting at every byte, built once: one gather per step instead of three.
    data = stream.to(torch.int32)
    windows = (data[:-2] << 16) | (data[1:-1] << 8) | data[2:]  # (stream bytes - 2,)
    symbol_of = (table.to(torch.int32) & 0xFF).to(torch.uint8)  # per table entry
    length_of = table.to(torch.int32) >> 8
    position = lane_offsets.to(torch.int64) * 8  # (lanes,) bit position in the stream
    exponent = torch.empty(SYMBOLS, lanes, dtype=torch.uint8, device=out.device)
    mask = (1 << MAX_CODE_BITS) - 1
    for t in range(SYMBOLS):
        window = windows.index_select(0, position >> 3)  # index_select: the fast CPU gather
        index = (window >> (24 - MAX_CODE_BITS - (position & 7))) & mask
        exponent[t] = symbol_of.index_select(0, index)
        position += length_of.index_select(0, index)
    # (step, group, lane) -> word order (group, step, lane), padding dropped.
    exponent = exponent.view(SYMBOLS, -1, LANES).transpose(0, 1).reshape(-1)[:num_words]
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
