"""Delta apply: add a coded fine-tune delta into a buffer of base words, on the device (Triton).

Semantics: `delta_apply(buffer, words, sign)` sets `words[i] = words[i] + sign * delta[i]`
(mod 2**16) for every word of `words`, an `(num_words,)` int16 tensor, in place, where `delta`
is what `delta_reference.delta_encode(base, tuned)` coded (format: `delta_reference.py`). With
`words` holding the base's words and `sign=1` the result is bitwise the fine-tune's words; with
the fine-tune's words and `sign=-1`, bitwise the base's. `tests/test_delta_codec.py` checks the
kernel against the reference and the originals.

Design: the kernel decodes the lane-parallel Huffman stream the way the DFloat kernel does
(`dfloat.py`, helpers in `lane_code.py`): one program decodes `BLOCK` lanes, each from its own
stored byte offset, 256 steps each, and at every step the lanes of a group touch consecutive
words (coalesced). A word whose symbol says "no change" is neither loaded nor stored, so an
update that moves few words costs little more than reading the stream. Escaped words (deltas
outside [-BIAS, BIAS], rare in bf16) take their deltas from `escape_value`, each lane from its
own run (`escape_offsets`) with a counter, so no word index is stored and no second pass runs.
A delta in the sparse form (no stream) is one torch index op.

Caution:
- In place: `words` must hold the words the delta was coded against; nothing can check that.
  All parts on the device of `words` (CUDA, or the CPU under TRITON_INTERPRET=1), contiguous.
- The parts must be those `delta_encode` wrote: the launcher checks their dtypes and sizes, but
  that `escape_value` holds every escape the stream names is only known by decoding it.
- Decoding is serial within a lane (256 steps); parallelism is num_words / 256 lanes, plenty for
  the large tensors of a model, not for tiny ones (those are usually in the sparse form).
- Triton is optional at import time; `delta_apply` raises on CUDA tensors without it. On the CPU
  it runs the C++ decoder (`lane_native.py`, built on first use), or the reference where that
  cannot be built or ``MEGASLIDE_NATIVE_CODEC=0`` (unless TRITON_INTERPRET=1 asks for the
  kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .delta_reference import (
    BIAS,
    ESCAPE,
    MAX_CODE_BITS,
    DeltaBuffer,
    apply_sparse,
    check_delta_apply,
    delta_apply_reference,
)
from .lane_code import LANES, SYMBOLS, lane_start, next_code
from .lane_native import load as load_native
from .lane_native import unavailable_reason
from .triton_import import TRITON_IMPORT_ERROR, interpreting, tl, triton


@triton.jit
def _delta_apply_kernel(
    TABLE, OFFSETS, STREAM, ESCAPE_OFFSETS, ESCAPE_VALUES, WORDS,
    num_words, num_lanes, sign,
    LANES: tl.constexpr, SYMBOLS: tl.constexpr, CODE_BITS: tl.constexpr,
    BIAS: tl.constexpr, ESCAPE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    lane, live, first_word, position = lane_start(OFFSETS, num_lanes, LANES, SYMBOLS, BLOCK)
    next_escape = tl.load(ESCAPE_OFFSETS + lane, mask=live, other=0)  # (BLOCK,) int32
    for t in range(SYMBOLS):
        entry = next_code(STREAM, TABLE, position, live, CODE_BITS)  # symbol | length << 8
        symbol = entry & 0xFF
        word = first_word + t * LANES
        real = live & (word < num_words)  # the last group's padding is decoded, never applied
        escaped = real & (symbol == ESCAPE)
        value = tl.load(ESCAPE_VALUES + next_escape, mask=escaped, other=0).to(tl.int32)
        next_escape += escaped.to(tl.int32)
        delta = tl.where(escaped, value, symbol - BIAS)
        keep = real & (delta != 0)  # unchanged words are neither loaded nor stored
        old = tl.load(WORDS + word, mask=keep, other=0).to(tl.int32)
        new = old + sign * delta
        tl.store(WORDS + word, new.to(tl.int16), mask=keep)  # low 16 bits: mod 2**16
        position += (entry >> 8).to(tl.int64)


def delta_apply_triton(
    buffer: DeltaBuffer, words: Tensor, sign: int = 1, block: int = 128
) -> Tensor:
    """`words += sign * delta` in place with the Triton kernel (CUDA tensors, or CPU tensors
    under TRITON_INTERPRET=1); a sparse delta with one index op. Queued on the current stream;
    returns `words`."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(f"the delta kernel needs triton: {TRITON_IMPORT_ERROR}")
    check_delta_apply(buffer, words, sign)
    if words.device.type != "cuda" and not interpreting():
        raise ValueError("delta_apply_triton needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    if not buffer.coded:
        return apply_sparse(buffer, words, sign)
    lanes = buffer.lane_offsets.numel()
    values = buffer.escape_value
    if values.numel() == 0:  # no escapes: never read, but an empty tensor has no address
        values = torch.zeros(1, dtype=torch.int16, device=words.device)
    grid = (triton.cdiv(lanes, block),)
    _delta_apply_kernel[grid](
        buffer.table,
        buffer.lane_offsets,
        buffer.stream,
        buffer.escape_offsets,
        values,
        words,
        words.numel(),
        lanes,
        sign,
        LANES=LANES,
        SYMBOLS=SYMBOLS,
        CODE_BITS=MAX_CODE_BITS,
        BIAS=BIAS,
        ESCAPE=ESCAPE,
        BLOCK=block,
    )
    return words


def delta_apply_native(buffer: DeltaBuffer, words: Tensor, sign: int = 1) -> Tensor:
    """`words += sign * delta` in place with the C++ decoder (`lane_native.py`; CPU tensors,
    up to `torch.get_num_threads()` threads); RuntimeError when it is unavailable. Returns
    `words`."""
    native = load_native()
    if native is None:
        raise RuntimeError(f"the native delta decoder is unavailable: {unavailable_reason()}")
    return _apply_native(native, buffer, words, sign)


def _apply_native(native, buffer: DeltaBuffer, words: Tensor, sign: int) -> Tensor:
    check_delta_apply(buffer, words, sign)
    if words.device.type != "cpu":
        raise ValueError(f"delta_apply_native needs CPU tensors, got words on {words.device}")
    return native.delta_apply(buffer, words, sign, torch.get_num_threads())


def delta_apply(buffer: DeltaBuffer, words: Tensor, sign: int = 1) -> Tensor:
    """`words += sign * delta` mod 2**16, in place (`words`: contiguous `(num_words,)` int16 on
    the buffer's device): the Triton kernel on CUDA (and on the CPU under TRITON_INTERPRET=1),
    the C++ decoder on the CPU, the reference where that is unavailable. Returns `words`."""
    if words.device.type == "cuda" or interpreting():
        return delta_apply_triton(buffer, words, sign)
    native = load_native() if words.device.type == "cpu" else None
    if native is not None:
        return _apply_native(native, buffer, words, sign)
    return delta_apply_reference(buffer, words, sign)


def delta_apply_(buffer: DeltaBuffer, tensor: Tensor, sign: int = 1) -> Tensor:
    """`delta_apply` on a contiguous tensor of any dtype (a weight in place), through a view of
    its bytes as 16-bit words. Returns `tensor`."""
    if not tensor.is_contiguous():
        raise ValueError("delta_apply_ needs a contiguous tensor: it writes through a view")
    if tensor.numel() * tensor.element_size() % 2:
        raise ValueError(f"deltas are over 16-bit words: {tensor.dtype} {tuple(tensor.shape)}")
    delta_apply(buffer, tensor.reshape(-1).view(torch.uint8).view(torch.int16), sign)
    return tensor
