"""The fused CPU kernel of CPUAdamW's compact state formats (compact_kernel.cpp), built on first use.

The torch-ops path (compact.py, optim.py) decodes a chunk into fp32 scratch, runs torch's fused
AdamW and encodes it back: about fifty torch ops per chunk, each a pass over memory. The kernel
does the same per element in one pass (decode, AdamW, encode, with the same codes and the same
random bits), so a compact format runs at the speed of the fp32 format or faster
(benchmarks/optimizer.py).

Build. compact_kernel.cpp is plain C++ with a C ABI and no torch headers, built on first use by
the system compiler and cached (`kernels/native_build.py`: flags, cache, switches), and called
through ctypes, which releases the GIL for the call, so the optimizer's worker threads run it in
parallel. ``-ffp-contract=off`` keeps the compiler from fusing multiply-adds that torch's kernel
does not fuse, and there is no ``-ffast-math``: results depend on each element's inputs only.

Fallback. ``MEGASLIDE_NATIVE_OPTIM=0`` turns the kernel off; a missing compiler or a failed
build does too, with the reason in `unavailable_reason()`. The optimizer then runs the torch-ops
path (`CPUAdamW.update_path` says which one runs).

Caution: the kernel's AdamW arithmetic is that of torch's vectorized loop, which torch runs on all
but the last < 16 elements of each piece of a tensor; torch's scalar tail rounds v differently now
and then, so there the two paths may differ in the last bit of v (and, through it, of the master
and the codes). tests/test_optim_native.py bounds the difference and checks that every other
element is bitwise equal.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...kernels.native_build import NativeLibrary
from . import compact

SOURCE = Path(__file__).with_name("compact_kernel.cpp")

MASTER_KINDS = {"fp32": 0, "bf16-split": 1, "bf16-sr": 2, "bf16": 3}


@dataclass
class Kernel:
    """The loaded library: `path`, and the seconds its build took (0 when it came cached)."""

    path: Path
    build_s: float
    lib: ctypes.CDLL

    def __post_init__(self) -> None:
        f = self.lib.megaslide_adamw_compact
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        f.argtypes = [ctypes.c_int] * 3 + [ptr] * 9 + [ptr, i64, i64, ctypes.c_uint32, ptr]
        f.restype = ctypes.c_int
        self._update = f
        h = self.lib.megaslide_hash_bits
        h.argtypes = [ptr, i64, i64, ctypes.c_uint32]
        h.restype = None

    def update(
        self,
        master: int,
        p: Tensor,
        lo: Tensor | None,
        copy: Tensor | None,
        m: Tensor | None,
        v: Tensor | None,
        codes: Tensor | None,
        absmax: Tensor | None,
        g: Tensor,
        start: int,
        key: int,
        hyper: ctypes.Array,
    ) -> None:
        """One slice of one tensor, elements start .. start + p.numel() - 1 (start a multiple
        of 256): master `p` (fp32 or bf16) and `lo` (bf16-split), `copy` (bf16: an fp32
        master's compute copy, written after the update), fp32 moments `m`, `v` or 8-bit
        `codes` (2, slice padded to 256) and `absmax` (2, padded / 256), gradient `g` (fp32 or
        bf16), all updated in place. Every tensor must be a contiguous row (the caller's views
        are); `hyper` comes from `hyper`."""
        n = p.numel()
        rc = self._update(
            master,
            codes is not None,
            g.dtype == torch.bfloat16,
            p.data_ptr(),
            _ptr(lo),
            _ptr(copy),
            _ptr(m),
            _ptr(v),
            None if codes is None else codes[0].data_ptr(),
            None if codes is None else codes[1].data_ptr(),
            None if absmax is None else absmax[0].data_ptr(),
            None if absmax is None else absmax[1].data_ptr(),
            g.data_ptr(),
            n,
            start,
            key,
            hyper,
        )
        if rc != 0:
            raise ValueError(f"compact kernel: unknown master kind {master}")

    def hash_bits(self, n: int, start: int, key: int) -> Tensor:
        """compact.hash_bits computed by the kernel's own hash (for the tests)."""
        out = torch.empty(n, dtype=torch.int32)
        self.lib.megaslide_hash_bits(out.data_ptr(), n, start, key)
        return out


def hyper(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int, scale
) -> ctypes.Array:
    """The kernel's 8 fp32 constants for one step, computed in double and rounded to fp32 as
    torch's fused kernel does (`scale`: the gradient divisor, a float or None)."""
    bc1 = 1 - beta1 ** float(step)
    bc2 = 1 - beta2 ** float(step)
    values = (
        1 - lr * weight_decay if weight_decay != 0 else 1.0,
        1 - beta1,
        beta2,
        1 - beta2,
        math.sqrt(bc2),
        eps,
        -(lr / bc1),
        1.0 if scale is None else scale,
    )
    return (ctypes.c_float * 8)(*values)


def _bind(path: Path, build_s: float, lib: ctypes.CDLL) -> Kernel | str:
    kernel = Kernel(path, build_s, lib)
    # A cheap check that the library computes what compact.py does (a stale or foreign file, a
    # miscompile): the random bits of a few elements, bit for bit.
    if not torch.equal(
        kernel.hash_bits(512, 3 << 30, 12345), compact.hash_bits(512, 3 << 30, 12345)
    ):
        return f"{path} does not reproduce compact.hash_bits; not used"
    return kernel


LIBRARY = NativeLibrary(SOURCE, "MEGASLIDE_NATIVE_OPTIM", _bind)


def load() -> Kernel | None:
    """The kernel, built or taken from the cache once per process; None when it is turned off
    (``MEGASLIDE_NATIVE_OPTIM=0``) or cannot be built (`unavailable_reason` says why)."""
    return LIBRARY.load()


def unavailable_reason() -> str | None:
    """Why `load` returns None, or None when it returns the kernel."""
    return LIBRARY.unavailable_reason()


def build(directory: Path, compiler: str) -> Kernel | str:
    """The kernel built with `compiler` into `directory` (or found there), or the reason it
    could not be; remembered per (directory, compiler) for the life of the process."""
    return LIBRARY.build(directory, compiler)


def _build(directory: Path, compiler: str) -> Kernel | str:
    """`build` without the memo (the tests' build from scratch)."""
    return LIBRARY.build_now(Path(directory), compiler)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
