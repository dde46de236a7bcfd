"""The lane code's CPU decoders in C++ (lane_native.cpp): a fine-tune delta applied in place, and
DFloat's words decoded, bitwise what the torch references compute.

Why. The references (`delta_reference.delta_apply_reference`, `dfloat_reference.
dfloat_decode_reference`) decode all lanes at once with a handful of torch ops per step, 256
steps a buffer: each op a pass over the lanes, 30 to 70M words a second on one core, and a
delta of a streamed block costs tens of milliseconds on the CPU. This library walks the same
stream word by word (lanes of a group side by side, so their table lookups overlap) and adds
each delta into its word as it is decoded: no temporary per step, one pass over the words.
`delta_apply` and `dfloat_decode` use it on CPU tensors when it is available.

Build: `native_build.py` (the system compiler on first use, cached; ctypes releases the GIL for
the call). ``MEGASLIDE_NATIVE_CODEC=0`` turns it off, and a missing compiler or a failed build
does too (`unavailable_reason()` says why): the references run then.

Threads. Groups of `LANES` lanes are independent; a call uses up to `torch.get_num_threads()`
threads, one per `GROUPS_PER_THREAD` groups at least (a thread costs tens of microseconds to
start: small buffers run on the calling thread alone).

Caution:
- Operands are checked as the references check them (`check_delta_apply`, dfloat's `_check`,
  by the callers); the library also checks every stream read and escape count against the
  sizes it is given and raises ValueError on a malformed buffer, but finds that while
  decoding: the words may then be partly written (the references raise before writing).
- The escapes of a coded delta are read through `escape_offsets`, each lane from its own
  run, as the Triton kernel reads them (the reference assigns them in lane order and never
  reads the offsets): offsets that disagree with the stream are an error here.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .delta_reference import DeltaBuffer, delta_apply_reference, delta_encode
from .lane_code import LANES
from .native_build import FLAGS, NativeLibrary

SOURCE = Path(__file__).with_name("lane_native.cpp")
SWITCH = "MEGASLIDE_NATIVE_CODEC"
GROUPS_PER_THREAD = 16  # 131072 words: a thread's start-up is under 1% of its share
ERRORS = {
    1: "a lane reads past the end of the stream",
    2: "the escape values do not match the escapes the stream names (escape_offsets)",
    3: "an escape index is out of range",
}


@dataclass
class LaneNative:
    """The loaded library: `path`, and the seconds its build took (0 when it came cached)."""

    path: Path
    build_s: float
    lib: ctypes.CDLL

    def __post_init__(self) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        f = self.lib.megaslide_delta_apply
        f.argtypes = [ptr, i32, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i32, i32]
        f.restype = i32
        f = self.lib.megaslide_delta_apply_sparse
        f.argtypes = [ptr, ptr, i64, ptr, i64, i32]
        f.restype = i32
        f = self.lib.megaslide_dfloat_decode
        f.argtypes = [ptr, ptr, i32, ptr, i64, ptr, i64, ptr, i64, i32]
        f.restype = i32

    def delta_apply(self, buffer: DeltaBuffer, words: Tensor, sign: int, threads: int) -> Tensor:
        """`words += sign * delta` in place; the operands checked already
        (`check_delta_apply`), all on the CPU. Returns `words`."""
        if not buffer.coded:
            rc = self.lib.megaslide_delta_apply_sparse(
                _ptr(buffer.escape_index),
                _ptr(buffer.escape_value),
                buffer.escape_index.numel(),
                words.data_ptr(),
                words.numel(),
                sign,
            )
        else:
            lanes = buffer.lane_offsets.numel()
            rc = self.lib.megaslide_delta_apply(
                buffer.table.data_ptr(),
                buffer.table.numel().bit_length() - 1,
                buffer.lane_offsets.data_ptr(),
                lanes,
                buffer.stream.data_ptr(),
                buffer.stream.numel(),
                buffer.escape_offsets.data_ptr(),
                _ptr(buffer.escape_value),
                buffer.num_escapes,
                words.data_ptr(),
                words.numel(),
                sign,
                threads_for(lanes, threads),
            )
        if rc != 0:
            raise ValueError(f"malformed delta: {ERRORS.get(rc, rc)}")
        return words

    def dfloat_decode(
        self, sm: Tensor, table: Tensor, lane_offsets: Tensor, stream: Tensor, out: Tensor
    ) -> Tensor:
        """DFloat's words into `out`; the operands checked already, all on the CPU."""
        lanes = lane_offsets.numel()
        if lanes == 0:
            return out
        rc = self.lib.megaslide_dfloat_decode(
            sm.data_ptr(),
            table.data_ptr(),
            table.numel().bit_length() - 1,
            lane_offsets.data_ptr(),
            lanes,
            stream.data_ptr(),
            stream.numel(),
            out.data_ptr(),
            out.numel(),
            threads_for(lanes, torch.get_num_threads()),
        )
        if rc != 0:
            raise ValueError(f"malformed DFloat buffer: {ERRORS.get(rc, rc)}")
        return out


def threads_for(lanes: int, threads: int) -> int:
    """Threads for a buffer of `lanes` lanes: at most `threads`, one per GROUPS_PER_THREAD
    groups at least."""
    return max(1, min(threads, lanes // LANES // GROUPS_PER_THREAD))


def _ptr(t: Tensor) -> int | None:
    return t.data_ptr() if t.numel() else None


def _bind(path: Path, build_s: float, lib: ctypes.CDLL) -> LaneNative | str:
    native = LaneNative(path, build_s, lib)
    # A cheap check that the library decodes what the reference does (a stale or foreign file,
    # a miscompile): a delta with escapes and a partial last group, both signs.
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-(2**15), 2**15, (9000,), dtype=torch.int32, generator=g)
    step = torch.randint(-3, 4, (9000,), dtype=torch.int32, generator=g)
    step[::97] = 4000  # escapes
    base, tuned = base.to(torch.int16), (base + step).to(torch.int16)
    coded = delta_encode(base, tuned)
    if not coded.coded or not coded.num_escapes:
        raise AssertionError("the self-check's delta is not coded with escapes")  # a bug here
    for sign, start in ((1, base), (-1, tuned)):
        want = delta_apply_reference(coded, start.clone(), sign)
        try:
            got = native.delta_apply(coded, start.clone(), sign, 1)
        except ValueError as exc:
            return f"{path} fails on a well-formed delta ({exc}); not used"
        if not torch.equal(got, want):
            return f"{path} does not reproduce delta_apply_reference; not used"
    return native


LIBRARY = NativeLibrary(SOURCE, SWITCH, _bind, flags=(*FLAGS, "-pthread"))


def load() -> LaneNative | None:
    """The library, built or taken from the cache once per process; None when it is turned off
    (``MEGASLIDE_NATIVE_CODEC=0``) or cannot be built (`unavailable_reason` says why)."""
    return LIBRARY.load()


def unavailable_reason() -> str | None:
    """Why `load` returns None, or None when it returns the library."""
    return LIBRARY.unavailable_reason()
