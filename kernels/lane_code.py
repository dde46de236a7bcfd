"""Lane-parallel canonical Huffman code of byte symbols: what the entropy-coded formats share.

One symbol per word, one canonical Huffman code per buffer with code lengths at most
`max_bits`, a format's choice up to `LONGEST_CODE_BITS` (DFloat's is `MAX_CODE_BITS`). The formats built on it (`dfloat_reference.py`: bf16 exponents,
`delta_reference.py`: fine-tune deltas) decide what a word's symbol is; this module builds the
code, writes the streams and reads them back.

Parallel layout. Words are taken in groups of `LANES * SYMBOLS` (the last group padded with the
most common symbol, decoded and never stored); within group g, lane w owns words
`g*LANES*SYMBOLS + t*LANES + w` for t in `[0, SYMBOLS)`, so at each step t the `LANES` lanes of a
group decode `LANES` consecutive words (coalesced device loads and stores). Each lane's codes form
its own bit stream, starting at a byte boundary, MSB first; the byte offset of every lane's stream
is stored (`lane_offsets`, int32), so every lane decodes on its own with no search. The decode
table `table` has `2**max_bits` int16 entries: indexed by the next `max_bits` bits of
a stream, it gives `symbol | code_length << 8`. The stream is followed by `STREAM_PAD` zero
bytes, so a lane may always read the 3 bytes at its position.

Overhead per word: 4 bytes of lane offset per `SYMBOLS` words (0.125 bits at 256) and under one
byte of stream padding per lane; per buffer a table of `2**(max_bits + 1)` bytes (2 KiB at 10).

Also here: the Triton helpers every decode kernel of this layout uses (where a lane starts, the
table entry of the code at a bit position), and the check of a kernel's 1-D operands.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from .triton_import import tl, triton

MAX_CODE_BITS = 10  # DFloat's longest code; the decode table has 2**MAX_CODE_BITS entries
# Longer codes would not fit: a code and its bit offset (<= 7) must fit the 24-bit window a lane
# reads (<= 17 bits), four codes and an offset the 64-bit word the encoder packs (<= 14).
LONGEST_CODE_BITS = 14
LANES = 32  # lanes per group: consecutive words decoded together
SYMBOLS = 256  # words per lane
STREAM_PAD = 3  # zero bytes after the stream: a lane always reads 3 bytes at its position


def num_lanes(num_words: int) -> int:
    groups = -(-num_words // (LANES * SYMBOLS))
    return groups * LANES


def lane_position(word):
    """Where words (integer indices, numpy or torch) sit in lane order: `lane * SYMBOLS + step`."""
    group, within = word // (LANES * SYMBOLS), word % (LANES * SYMBOLS)
    return (group * LANES + within % LANES) * SYMBOLS + within // LANES


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
        # Heap of (count, node): leaves are the symbols, merged nodes numbered from 256 on (the
        # number breaks ties between equal counts); a symbol's length is its depth in the tree.
        heap = list(zip(counts[seen].tolist(), seen.tolist()))
        heapq.heapify(heap)
        parent = [0] * 512
        node = 256
        while len(heap) > 1:
            c1, n1 = heapq.heappop(heap)
            c2, n2 = heapq.heappop(heap)
            parent[n1] = parent[n2] = node
            heapq.heappush(heap, (c1 + c2, node))
            node += 1
        depth = [0] * node  # the root, node - 1, has depth 0; parents come after children
        for m in range(node - 2, 255, -1):
            depth[m] = depth[parent[m]] + 1
        lengths[seen] = [depth[parent[s]] + 1 for s in seen.tolist()]
        if lengths.max() <= max_bits:
            return lengths
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


def stream_nbytes(counts: np.ndarray, lengths: np.ndarray) -> int:
    """About the bytes `encode_lanes` writes for these symbol counts (lane padding not counted),
    for a coder choosing between this code and another representation."""
    return int(np.dot(np.asarray(counts, dtype=np.int64), lengths)) // 8


def encode_lanes(
    symbols: np.ndarray,
    counts: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
    max_bits: int = MAX_CODE_BITS,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Code `(num_words,)` uint8 symbols: `(code_lengths (256,), table (2**max_bits,) int16,
    lane_offsets (num_lanes,) int32, stream (bytes + STREAM_PAD,) uint8)`. `counts` (the
    symbols' histogram) and `lengths` (`code_lengths(counts, max_bits)`) when the caller has
    them."""
    if max_bits > LONGEST_CODE_BITS:
        raise ValueError(f"max_bits={max_bits}: codes of at most {LONGEST_CODE_BITS} bits")
    num_words = symbols.size
    if counts is None:
        counts = np.bincount(symbols, minlength=256)
    if lengths is None:
        lengths = code_lengths(counts, max_bits)
    lanes = num_lanes(num_words)
    # Padding words get the most common symbol's code (the shortest) and are never stored.
    pad_symbol = int(np.argmax(counts)) if num_words else 0
    padded = np.full(lanes * SYMBOLS, pad_symbol, dtype=np.uint8)
    padded[:num_words] = symbols
    # Word order -> lane order: group g, step t, lane w  ->  lane g*LANES + w, position t.
    padded = padded.reshape(-1, SYMBOLS, LANES).transpose(0, 2, 1).reshape(lanes, SYMBOLS)
    if num_words and lengths[pad_symbol] == 0:
        raise AssertionError("the padding symbol has no code")  # pad_symbol always occurs
    # Codes are packed four at a time (four codes: at most 4 * LONGEST_CODE_BITS = 56 bits, plus
    # a bit offset of at most 7, fit a 64-bit word), so the costly steps below run on a quarter of
    # the words. First two: the lane-order bytes read as little-endian uint16 index a table of
    # every pair's code and length (65536 entries, built from the 256 codes).
    codes = canonical_codes(lengths)
    first_of, second_of = np.arange(65536) & 0xFF, np.arange(65536) >> 8
    pair_length = (lengths[first_of] + lengths[second_of]).astype(np.int16)
    pair_code = (codes[first_of] << lengths[second_of]) | codes[second_of]
    pairs = np.ascontiguousarray(padded).view(
        "<u2"
    )  # (lanes, SYMBOLS // 2): symbol 2i | symbol 2i+1 << 8
    code2 = pair_code.astype(np.uint64)[pairs]
    length2 = pair_length[pairs]
    code = (code2[:, 0::2] << length2[:, 1::2].astype(np.uint64)) | code2[:, 1::2]
    length = length2[:, 0::2] + length2[:, 1::2]  # (lanes, SYMBOLS // 4) bits of each quad
    # Bits within a lane stay below SYMBOLS * LONGEST_CODE_BITS = 3584: int16.
    within = np.cumsum(length, axis=1, dtype=np.int16)
    within -= length  # bit position of each quad inside its lane's stream
    lane_bytes = (within[:, -1].astype(np.int64) + length[:, -1] + 7) // 8
    offsets = np.zeros(lanes, dtype=np.int64)
    np.cumsum(lane_bytes[:-1], out=offsets[1:])
    total = int(lane_bytes.sum())
    if total + STREAM_PAD >= 2**31:
        raise ValueError("a stream of 2**31 bytes or more: lane offsets overflow int32")
    # Each quad fits in the 64-bit window of the 8 bytes from its first byte. Quads never
    # overlap and first bytes never decrease in stream order (lane after lane, quad after quad);
    # a quad has at least 4 bits, so at most two start in one byte. The windows of the first
    # quads in their bytes are stored, the second ones OR-ed in (no index repeats within either
    # set), then the eight bytes of every window OR-ed into the stream: that builds it exactly.
    field = code << (64 - (within & 7) - length).astype(np.uint64)
    first = (offsets[:, None] + (within >> 3)).reshape(-1)
    field = field.reshape(-1)
    windows = np.zeros(total + STREAM_PAD, dtype=np.uint64)
    shares = np.zeros(first.size, dtype=bool)  # a quad starting in its predecessor's byte
    np.equal(first[1:], first[:-1], out=shares[1:])
    if shares.any():
        leads = ~shares
        windows[first[leads]] = field[leads]
        windows[first[shares]] |= field[shares]
    else:
        windows[first] = field
    window_bytes = windows.astype(">u8").view(np.uint8).reshape(-1, 8)  # MSB first
    stream = window_bytes[:, 0].copy()  # each byte: its own window's top byte,
    for j in range(1, 8):  # and byte j of the window j bytes before
        stream[j:] |= window_bytes[:-j, j]
    return lengths, decode_table(lengths, max_bits), offsets.astype(np.int32), stream


def decode_lanes_reference(
    table: torch.Tensor, lane_offsets: torch.Tensor, stream: torch.Tensor, num_words: int
) -> torch.Tensor:
    """The `(num_words,)` uint8 symbols of a coded buffer, in word order, on the parts' device
    (the longest code: log2 of the table's size). One step per word of a lane, all lanes at once
    (vectorised torch)."""
    symbols = decode_lane_steps(table, lane_offsets, stream, num_words)
    return in_word_order(symbols, num_words)


def in_word_order(steps: torch.Tensor, num_words: int) -> torch.Tensor:
    """`(SYMBOLS, lanes)` values, one per step of each lane, in word order `(num_words,)`:
    (step, group, lane) -> (group, step, lane), padding dropped. (`steps.t()` is lane order.)"""
    return steps.reshape(SYMBOLS, -1, LANES).transpose(0, 1).reshape(-1)[:num_words]


def decode_lane_steps(
    table: torch.Tensor, lane_offsets: torch.Tensor, stream: torch.Tensor, num_words: int
) -> torch.Tensor:
    """The symbols of a coded buffer as `(SYMBOLS, lanes)` uint8: step t of every lane."""
    lanes = lane_offsets.numel()
    if lanes != num_lanes(num_words):
        raise ValueError(f"{lanes} lane offsets do not describe {num_words} words")
    # The 24-bit window starting at every byte, built once: one gather per step instead of three.
    data = stream.to(torch.int32)
    windows = (data[:-2] << 16) | (data[1:-1] << 8) | data[2:]  # (stream bytes - 2,)
    symbol_of = (table.to(torch.int32) & 0xFF).to(torch.uint8)  # per table entry
    length_of = table.to(torch.int32) >> 8
    position = lane_offsets.to(torch.int64) * 8  # (lanes,) bit position in the stream
    symbols = torch.empty(SYMBOLS, lanes, dtype=torch.uint8, device=stream.device)
    max_bits = table.numel().bit_length() - 1
    mask = (1 << max_bits) - 1
    for t in range(SYMBOLS):
        window = windows.index_select(0, position >> 3)  # index_select: the fast CPU gather
        index = (window >> (24 - max_bits - (position & 7))) & mask
        symbols[t] = symbol_of.index_select(0, index)
        position += length_of.index_select(0, index)
    return symbols


def check_operands(operands: dict[str, tuple[torch.Tensor, torch.dtype]], target: str) -> None:
    """Each named tensor a contiguous 1-D tensor of its dtype on the device of the one named
    `target` (the one a kernel writes), or a ValueError naming it."""
    device = operands[target][0].device
    for name, (t, dtype) in operands.items():
        if t.dtype != dtype or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"{name}: need a contiguous 1-D {dtype} tensor, got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, {target} on {device}: use one device")


@triton.jit
def lane_start(OFFSETS, num_lanes, LANES: tl.constexpr, SYMBOLS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's `BLOCK` lanes: (lane, live mask, word of step 0 (int64), bit position
    (int64))."""
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) lanes of this program
    live = lane < num_lanes
    group = lane // LANES
    first_word = group.to(tl.int64) * (LANES * SYMBOLS) + lane % LANES
    position = tl.load(OFFSETS + lane, mask=live, other=0).to(tl.int64) * 8  # bits
    return lane, live, first_word, position


@triton.jit
def next_code(STREAM, TABLE, position, live, CODE_BITS: tl.constexpr):
    """The table entry (`symbol | length << 8`, int32) of the code at bit `position` of each
    live lane: 3 stream bytes (at most 7 bits of offset plus a code of at most CODE_BITS bits)
    and one table entry (cached: lanes mostly read the same few)."""
    byte = position >> 3
    b0 = tl.load(STREAM + byte, mask=live, other=0).to(tl.int32)
    b1 = tl.load(STREAM + byte + 1, mask=live, other=0).to(tl.int32)
    b2 = tl.load(STREAM + byte + 2, mask=live, other=0).to(tl.int32)
    window = (b0 << 16) | (b1 << 8) | b2  # 24 bits, MSB first
    shift = (24 - CODE_BITS - (position & 7)).to(tl.int32)
    index = (window >> shift) & ((1 << CODE_BITS) - 1)
    return tl.load(TABLE + index, mask=live, other=0).to(tl.int32)
