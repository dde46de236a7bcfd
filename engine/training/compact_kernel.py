"""The fused CPU kernel of CPUAdamW's compact state formats (compact_kernel.cpp), built on first use.

The torch-ops path (compact.py, optim.py) decodes a chunk into fp32 scratch, runs torch's fused
AdamW and encodes it back: about fifty torch ops per chunk, each a pass over memory. The kernel
does the same per element in one pass (decode, AdamW, encode, with the same codes and the same
random bits), so a compact format runs at the speed of the fp32 format or faster
(benchmarks/optimizer.py).

Build. compact_kernel.cpp is plain C++ with a C ABI and no torch headers: the system compiler
(``$CXX``, else ``g++``) builds it in a few seconds, where `torch.utils.cpp_extension.load_inline`
spends ~25 s here compiling torch's extension headers for even an empty function; ctypes calls
it and releases the GIL for the call, so the optimizer's worker threads run it in parallel. Flags:
``-O3 -march=native`` vectorizes the element loops for this machine's ISA; ``-ffp-contract=off``
keeps the compiler from fusing multiply-adds that torch's kernel does not fuse; no
``-ffast-math``, so nothing is reassociated and results depend on each element's inputs only.
The library is cached under ``$MEGASLIDE_NATIVE_CACHE`` (default
``~/.cache/megaslide/native``), named by a hash of the source, the flags, the compiler's
version and this CPU's model and feature flags (a cache shared by machines with different CPUs
never hands one a library built for another); it is written to a temporary name and renamed,
so processes building at once do not see a half-written file.

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
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from . import compact

SOURCE = Path(__file__).with_name("compact_kernel.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17")
BUILD_TIMEOUT_S = 300

MASTER_KINDS = {"fp32": 0, "bf16-split": 1, "bf16-sr": 2, "bf16": 3}

_lock = threading.Lock()
_loaded: dict[tuple[str, str], Kernel | str] = {}  # (cache dir, compiler) -> kernel or reason


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


def load() -> Kernel | None:
    """The kernel, built or taken from the cache once per process; None when it is turned off
    (``MEGASLIDE_NATIVE_OPTIM=0``) or cannot be built (`unavailable_reason` says why)."""
    if os.environ.get("MEGASLIDE_NATIVE_OPTIM", "1") == "0":
        return None
    got = build(cache_dir(), os.environ.get("CXX", "g++"))
    return got if isinstance(got, Kernel) else None


def unavailable_reason() -> str | None:
    """Why `load` returns None, or None when it returns the kernel."""
    if os.environ.get("MEGASLIDE_NATIVE_OPTIM", "1") == "0":
        return "turned off by MEGASLIDE_NATIVE_OPTIM=0"
    got = build(cache_dir(), os.environ.get("CXX", "g++"))
    return got if isinstance(got, str) else None


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megaslide/native"
    return Path(os.environ.get("MEGASLIDE_NATIVE_CACHE", default))


def build(directory: Path, compiler: str) -> Kernel | str:
    """The kernel built with `compiler` into `directory` (or found there), or the reason it
    could not be; remembered per (directory, compiler) for the life of the process."""
    memo = (str(directory), compiler)
    with _lock:  # one build per process; the optimizer's threads wait for it
        if memo not in _loaded:
            _loaded[memo] = _build(Path(directory), compiler)
        return _loaded[memo]


def _build(directory: Path, compiler: str) -> Kernel | str:
    exe = shutil.which(compiler)
    if exe is None:
        return f"no C++ compiler: {compiler!r} not found (set CXX)"
    try:
        version = subprocess.run(
            [exe, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{compiler} --version failed: {exc}"
    source = SOURCE.read_bytes()
    digest = hashlib.sha256()
    for part in (source, " ".join(FLAGS).encode(), version.encode(), _cpu_identity().encode()):
        digest.update(part)
    path = directory / f"compact_kernel-{digest.hexdigest()[:16]}.so"
    build_s = 0.0
    if not path.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
            os.close(fd)
        except OSError as exc:
            return f"cannot write the build cache {directory}: {exc}"
        cmd = [exe, *FLAGS, "-shared", "-fPIC", "-o", tmp, str(SOURCE)]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            os.unlink(tmp)
            return f"building {SOURCE.name} failed: {exc}"
        build_s = time.perf_counter() - t0
        if done.returncode != 0:
            os.unlink(tmp)
            return f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
        os.replace(tmp, path)  # atomic: another process sees no library or a whole one
    try:
        kernel = Kernel(path, build_s, ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as exc:
        return f"loading {path} failed: {exc}"
    # A cheap check that the library computes what compact.py does (a stale or foreign file, a
    # miscompile): the random bits of a few elements, bit for bit.
    if not torch.equal(
        kernel.hash_bits(512, 3 << 30, 12345), compact.hash_bits(512, 3 << 30, 12345)
    ):
        return f"{path} does not reproduce compact.hash_bits; not used"
    return kernel


def _cpu_identity() -> str:
    """This CPU's model and feature flags: what -march=native compiles for."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [
        line
        for line in info.splitlines()
        if line.startswith(("model name", "flags", "Features", "CPU part"))
    ]
    return "\n".join(sorted(set(keep)))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
