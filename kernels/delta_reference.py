"""Fine-tune deltas: a fine-tune as an entropy-coded, lossless delta over a shared base.

A full fine-tune moves most weights by a few units in the last place, so the fine-tune's 16-bit
words minus the base's (as integers mod 2**16) are mostly tiny. `delta_encode(base, tuned)`
codes that integer delta; `delta_apply(buffer, words, sign)` adds it into a buffer holding the
base's words in place (base + delta = tuned, bitwise), and `sign=-1` subtracts it again
(integer arithmetic mod 2**16 is exactly reversible), so one device slot can switch between
fine-tunes of one base without ever holding a second copy.

The format (what `delta_encode` writes, `delta_apply_reference` and the Triton kernel in
`delta.py` read). Both tensors are viewed as flat 16-bit words (any dtype whose byte size is
even: bf16, fp16, fp32 ...); word i's delta is `d = (tuned[i] - base[i]) mod 2**16` read as
int16. Each word gets one byte symbol:

- `d + BIAS` for `d` in `[-BIAS, BIAS]` (symbols 0 .. 2 * BIAS = 254; symbol `BIAS` is an
  untouched word);
- `ESCAPE` (255) otherwise: the word's delta goes to `escape_value` (int16).

The symbols are coded with the lane-parallel canonical Huffman code of `lane_code.py` (the
layout DFloat uses) with codes of at most `MAX_CODE_BITS` = 12 bits: `table` (4096 int16),
`lane_offsets` (int32), `stream` (uint8, with `STREAM_PAD` zero bytes). Escaped deltas are kept
in lane order (lane by lane, step by step within a lane) and `escape_offsets` (int32, one per
lane) says where each lane's first one is: a lane that decodes an escape takes the next value of
its own, so an escape costs two bytes and its symbol's code, and needs no word index (the
offsets cost 4 bytes per lane of 256 words).

Why this symbol map: a Huffman code's size does not depend on which byte names which delta, so
any other one-to-one map of the same deltas (zigzag, sign-magnitude) codes to exactly the same
bytes; only the window of deltas a symbol can carry matters, and one byte carries at most 255
of them besides the escape. Escapes are words near zero, where an update of a given size spans
many more units in the last place, and sign flips (benchmarks/delta_codec.py counts them); the
low words of fp32 weights, whose deltas are close to uniform, are nearly all escapes.

The sparse form. When storing each changed word's index (`escape_index`, int32, ascending) and
delta (`escape_value`, in word order) is smaller than the coded stream (an untouched tensor, a
few changed rows, a tiny tensor), the encoder writes no code at all: `table`, `lane_offsets`,
`stream` and `escape_offsets` are empty, and the deltas are applied by one index op. An untouched
tensor costs nothing but its word count. In the coded form `escape_index` is empty.

Caution:
- Lossless means bitwise: NaN payloads, infinities and signed zeros of either side round-trip;
  the arithmetic is on the words, never on the values.
- `delta_apply` modifies `words` in place and must be given the exact words the delta was coded
  against (the base for sign=1, the fine-tune for sign=-1); other words are shifted by the same
  delta without any error.
- Fewer than 2**31 words per buffer (int32 lane offsets and escape indices; checked).
- Made for bf16. Measured on 1M Gaussian weights moved by 1% of their RMS: 0.31x the tensor's
  bytes in bf16, 0.52x in fp16 (three more mantissa bits: deltas 8x as many units, 7% escapes),
  0.72x in fp32 (the low words change at random: half the words escape, at about 17 bits each).
  A delta can cost more than its tensor (random words: up to about 1.1x); a caller that cares
  compares `nbytes` with the tensor's bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .lane_code import (
    LANES,
    STREAM_PAD,
    SYMBOLS,
    check_operands,
    code_lengths,
    decode_lane_steps,
    encode_lanes,
    in_word_order,
    lane_position,
    num_lanes,
    stream_nbytes,
)

BIAS = 127  # symbols 0 .. 2 * BIAS carry the deltas -BIAS .. BIAS
ESCAPE = 255  # the word's delta is in escape_value
SPARSE_NBYTES = 6  # a changed word in the sparse form: its int32 index and int16 delta
# Longest code. Deltas spread over all 256 symbols, and limiting codes by halving counts
# (`lane_code.code_lengths`) costs more bits the tighter the limit: measured on 4M bf16 words of
# Adam-like updates of 0.3% / 1% / 3% of the RMS, 10 bits (DFloat's) cost 0.35 / 0.21 / 0.14 bits
# a word over the symbols' entropy, 12 bits 0.08 / 0.06 / 0.03, for an 8 KiB table instead of 2.
MAX_CODE_BITS = 12
PARTS = ("table", "lane_offsets", "stream", "escape_offsets", "escape_index", "escape_value")


@dataclasses.dataclass(frozen=True)
class DeltaBuffer:
    """One coded delta: the decode table, lane offsets and stream, and the escaped deltas."""

    num_words: int
    table: torch.Tensor  # (2**MAX_CODE_BITS,) int16: symbol | length << 8; (0,) when sparse
    lane_offsets: torch.Tensor  # (num_lanes,) int32; (0,) when sparse
    stream: torch.Tensor  # (stream bytes + STREAM_PAD,) uint8; (0,) when sparse
    escape_offsets: torch.Tensor  # (num_lanes,) int32, each lane's first escape; (0,) when sparse
    escape_index: torch.Tensor  # (num_escapes,) int32, ascending, when sparse; (0,) when coded
    escape_value: torch.Tensor  # (num_escapes,) int16: lane order when coded, word order if sparse

    @property
    def coded(self) -> bool:
        """False in the sparse form: no stream, every non-zero delta an escape."""
        return self.lane_offsets.numel() > 0

    @property
    def num_escapes(self) -> int:
        return self.escape_value.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of the six parts together: what the delta costs in RAM or on the bus."""
        return sum(t.numel() * t.element_size() for t in self.parts())

    def parts(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in PARTS)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DeltaBuffer:
        """The same delta with its parts on `device`."""
        moved = {name: t.to(device, non_blocking=non_blocking) for name, t in self._named()}
        return dataclasses.replace(self, **moved)

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Named tensors for a safetensors file: `{prefix}num_words` (int64 scalar) and
        `{prefix}<part>` for the six parts."""
        tensors = {f"{prefix}{name}": t for name, t in self._named()}
        tensors[f"{prefix}num_words"] = torch.tensor(self.num_words, dtype=torch.int64)
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str = "") -> DeltaBuffer:
        """The delta `to_tensors(prefix)` wrote, from those tensors (or a dict holding them)."""
        names = ("num_words", *PARTS)
        missing = [f"{prefix}{name}" for name in names if f"{prefix}{name}" not in tensors]
        if missing:
            raise KeyError(f"not a stored delta: missing {missing}")
        parts = {name: tensors[f"{prefix}{name}"] for name in PARTS}
        return cls(num_words=int(tensors[f"{prefix}num_words"]), **parts)

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, getattr(self, name)) for name in PARTS]


def _words(t: torch.Tensor, name: str) -> np.ndarray:
    """A tensor's bytes as a flat uint16 array (a view when it is contiguous)."""
    if t.device.type != "cpu":
        raise ValueError(f"delta_encode runs on the CPU, got {name} on {t.device}")
    flat = t.detach().reshape(-1).contiguous().view(torch.uint8)
    if flat.numel() % 2:
        raise ValueError(
            f"deltas are over 16-bit words: {name} has {flat.numel()} bytes, an odd number"
        )
    return flat.numpy().view(np.uint16)


def delta_encode(base: torch.Tensor, tuned: torch.Tensor) -> DeltaBuffer:
    """Code `tuned - base` over their 16-bit words. Both tensors on the CPU, of one shape and
    one dtype (any dtype: viewed as words, so the byte size must be even)."""
    if base.shape != tuned.shape or base.dtype != tuned.dtype:
        raise ValueError(
            f"base {base.dtype} {tuple(base.shape)} and tuned {tuned.dtype} "
            f"{tuple(tuned.shape)}: need one shape and one dtype"
        )
    base_words, tuned_words = _words(base, "base"), _words(tuned, "tuned")
    num_words = base_words.size
    if num_words >= 2**31:
        raise ValueError(f"{num_words} words: a delta must hold fewer than 2**31")
    # uint16 arithmetic wraps mod 2**16: delta + BIAS lands in [0, 2 * BIAS] exactly when the
    # delta is in [-BIAS, BIAS], and every other delta maps above it, to ESCAPE by the minimum.
    shifted = np.subtract(tuned_words, base_words)
    shifted += BIAS
    symbols = np.minimum(shifted, ESCAPE).astype(np.uint8)
    counts = np.bincount(symbols, minlength=256)
    changed = num_words - int(counts[BIAS])
    lanes = num_lanes(num_words)
    # The code's fixed costs and at least one bit a word: when the changed words in the sparse
    # form cost no more than that, there is no need to build the code to know the sparse form
    # wins.
    overhead = 2 * (1 << MAX_CODE_BITS) + 8 * lanes + STREAM_PAD + 2 * int(counts[ESCAPE])
    if SPARSE_NBYTES * changed <= overhead + num_words // 8:
        return _sparse(num_words, symbols, shifted)
    lengths = code_lengths(counts, MAX_CODE_BITS)
    if SPARSE_NBYTES * changed <= overhead + stream_nbytes(counts, lengths):
        return _sparse(num_words, symbols, shifted)
    _, table, offsets, stream = encode_lanes(symbols, counts, lengths, MAX_CODE_BITS)
    # Escapes in lane order, and where each lane's first one is.
    escaped = np.flatnonzero(symbols == ESCAPE)  # word order
    position = lane_position(escaped)
    order = np.argsort(position, kind="stable")
    per_lane = np.bincount(position // SYMBOLS, minlength=lanes)
    escape_offsets = np.zeros(lanes, dtype=np.int32)
    np.cumsum(per_lane[:-1], out=escape_offsets[1:])
    return DeltaBuffer(
        num_words=num_words,
        table=torch.from_numpy(table),
        lane_offsets=torch.from_numpy(offsets),
        stream=torch.from_numpy(stream),
        escape_offsets=torch.from_numpy(escape_offsets),
        escape_index=torch.empty(0, dtype=torch.int32),
        escape_value=torch.from_numpy(_deltas(escaped[order], shifted)),
    )


def _sparse(num_words: int, symbols: np.ndarray, shifted: np.ndarray) -> DeltaBuffer:
    """The sparse form: no code, the index and delta of every word with a non-zero delta."""
    changed = np.flatnonzero(symbols != BIAS)
    return DeltaBuffer(
        num_words=num_words,
        table=torch.empty(0, dtype=torch.int16),
        lane_offsets=torch.empty(0, dtype=torch.int32),
        stream=torch.empty(0, dtype=torch.uint8),
        escape_offsets=torch.empty(0, dtype=torch.int32),
        escape_index=torch.from_numpy(changed.astype(np.int32)),
        escape_value=torch.from_numpy(_deltas(changed, shifted)),
    )


def _deltas(index: np.ndarray, shifted: np.ndarray) -> np.ndarray:
    """The int16 deltas of the words at `index`."""
    return (shifted[index] - BIAS).view(np.int16)  # back to the delta, mod 2**16


def check_delta_apply(buffer: DeltaBuffer, words: torch.Tensor, sign: int) -> None:
    """ValueError with a message unless `buffer` can be applied to `words` with `sign`."""
    if sign not in (1, -1) or isinstance(sign, bool):
        raise ValueError(f"sign={sign!r}: need 1 (add the delta) or -1 (subtract it)")
    check_operands(
        {
            "table": (buffer.table, torch.int16),
            "lane_offsets": (buffer.lane_offsets, torch.int32),
            "stream": (buffer.stream, torch.uint8),
            "escape_offsets": (buffer.escape_offsets, torch.int32),
            "escape_index": (buffer.escape_index, torch.int32),
            "escape_value": (buffer.escape_value, torch.int16),
            "words": (words, torch.int16),
        },
        "words",
    )
    n = buffer.num_words
    if words.numel() != n:
        raise ValueError(f"words has {words.numel()} elements, the delta covers {n} words")
    if not buffer.coded:
        if buffer.table.numel() or buffer.stream.numel() or buffer.escape_offsets.numel():
            raise ValueError("a delta with no lane offsets has no table, stream, escape offsets")
        if buffer.escape_index.numel() != buffer.escape_value.numel():
            raise ValueError(
                f"{buffer.escape_index.numel()} escape indices for "
                f"{buffer.escape_value.numel()} values"
            )
        return
    lanes = num_lanes(n)
    for name in ("lane_offsets", "escape_offsets"):
        if getattr(buffer, name).numel() != lanes:
            raise ValueError(f"{getattr(buffer, name).numel()} {name} for {n} words: need {lanes}")
    if buffer.escape_index.numel():
        raise ValueError("a coded delta keeps its escapes in lane order, with no escape_index")
    if buffer.table.numel() != 1 << MAX_CODE_BITS:
        raise ValueError(f"table has {buffer.table.numel()} entries, need {1 << MAX_CODE_BITS}")
    if buffer.stream.numel() < STREAM_PAD:
        raise ValueError("stream is shorter than its padding")


def apply_sparse(buffer: DeltaBuffer, words: torch.Tensor, sign: int) -> torch.Tensor:
    """`words[i] += sign * value` mod 2**16 for the words of a sparse delta, in place (one
    index op, queued on the current stream); returns `words`."""
    if buffer.escape_index.numel():
        index = buffer.escape_index
        moved = words.index_select(0, index).to(torch.int32) + sign * buffer.escape_value
        words.index_put_((index,), moved.to(torch.int16))  # int32 -> int16 keeps the low bits
    return words


def delta_apply_reference(buffer: DeltaBuffer, words: torch.Tensor, sign: int = 1) -> torch.Tensor:
    """`words += sign * delta` mod 2**16, in place: `words` is a contiguous `(num_words,)` int16
    tensor on the buffer's device. All lanes at once (vectorised torch); returns `words`."""
    check_delta_apply(buffer, words, sign)
    if not buffer.coded:
        return apply_sparse(buffer, words, sign)
    steps = decode_lane_steps(buffer.table, buffer.lane_offsets, buffer.stream, buffer.num_words)
    lanes = steps.t()  # (lanes, SYMBOLS): lane order, the escapes' order
    delta = lanes.to(torch.int32) - BIAS
    escaped = lanes == ESCAPE
    lane = torch.arange(lanes.shape[0], device=lanes.device)[:, None]
    step = torch.arange(SYMBOLS, device=lanes.device)[None, :]
    word = (lane // LANES) * (LANES * SYMBOLS) + step * LANES + lane % LANES
    escaped &= word < buffer.num_words  # the last group's padding is decoded, never applied
    if buffer.num_escapes:
        delta[escaped] = buffer.escape_value.to(torch.int32)  # a mask assigns in lane order
    delta = in_word_order(delta.t(), buffer.num_words)
    words.copy_((words.to(torch.int32) + sign * delta).to(torch.int16))  # low 16 bits
    return words
