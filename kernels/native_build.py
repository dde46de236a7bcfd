"""Native CPU libraries: a C++ source with a C ABI, built on first use by the system compiler,
cached, and called through ctypes. What the CPU optimizer's fused kernel
(`engine/training/compact_kernel.py`) and the lane code's CPU decoders (`lane_native.py`) share.

Why this way. The sources are plain C++ with no torch headers: the system compiler (``$CXX``,
else ``g++``) builds one in a few seconds, where `torch.utils.cpp_extension.load_inline` spends
~25 s here compiling torch's extension headers for even an empty function. ctypes releases the
GIL for the call, so Python threads run the library in parallel with each other and with torch.

Cache. A library is cached under ``$MEGASLIDE_NATIVE_CACHE`` (default
``~/.cache/megaslide/native``), named by its source's stem and a hash of the source, the flags,
the compiler's version and this CPU's model and feature flags (``-march=native`` compiles for
this CPU: a cache shared by machines with different CPUs never hands one a library built for
another). It is written to a temporary name and renamed, so processes building at once never
see a half-written file.

Switches. Each library has its own ``MEGASLIDE_NATIVE_<NAME>=0`` that turns it off; a missing
compiler or a failed build does too, with the reason in `NativeLibrary.unavailable_reason()`, and
the caller runs its torch path instead. A library's `bind` checks a few results against the
torch path after loading (a stale or foreign file, a miscompile) and refuses it when they
differ.

Caution: a build runs once per process and (directory, compiler), under a lock: the first
caller waits seconds, the others wait for it. A failure is remembered for the process too, and
logged once as a warning.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# -O3 -march=native vectorizes element loops for this machine's ISA; -ffp-contract=off keeps the
# compiler from fusing multiply-adds torch does not fuse; no -ffast-math, so nothing is
# reassociated and results depend on each element's inputs only.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17")
BUILD_TIMEOUT_S = 300

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where built libraries are kept (``$MEGASLIDE_NATIVE_CACHE``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megaslide/native"
    return Path(os.environ.get("MEGASLIDE_NATIVE_CACHE", default))


def compiler() -> str:
    return os.environ.get("CXX", "g++")


@dataclasses.dataclass(eq=False)
class NativeLibrary:
    """One C++ source built into a shared library on first use.

    `bind(path, build_s, lib)` wraps the loaded `ctypes.CDLL` (declaring its functions'
    argument types) and checks it: it returns the wrapper, or a string saying why the library
    may not be used. `switch` names the environment variable whose value "0" turns it off."""

    source: Path
    switch: str
    bind: Callable[[Path, float, ctypes.CDLL], Any]
    flags: tuple[str, ...] = FLAGS

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[tuple[str, str], Any] = {}  # (cache dir, compiler) -> wrapper or reason

    def load(self) -> Any | None:
        """The bound library, built or taken from the cache once per process; None when it is
        turned off or cannot be built (`unavailable_reason` says why)."""
        if os.environ.get(self.switch, "1") == "0":
            return None
        got = self.build(cache_dir(), compiler())
        return None if isinstance(got, str) else got

    def unavailable_reason(self) -> str | None:
        """Why `load` returns None, or None when it returns the library."""
        if os.environ.get(self.switch, "1") == "0":
            return f"turned off by {self.switch}=0"
        got = self.build(cache_dir(), compiler())
        return got if isinstance(got, str) else None

    def build(self, directory: Path, compiler: str) -> Any:
        """The library built with `compiler` into `directory` (or found there) and bound, or the
        reason it could not be; remembered per (directory, compiler) for the life of the
        process."""
        memo = (str(directory), compiler)
        with self._lock:  # one build per process; other threads wait for it
            if memo not in self._loaded:
                got = self._loaded[memo] = self.build_now(Path(directory), compiler)
                if isinstance(got, str):  # said once a process: the torch path runs, slower
                    log.warning("%s is not used: %s", self.source.name, got)
            return self._loaded[memo]

    def build_now(self, directory: Path, compiler: str) -> Any:
        """`build` without the memo: compiles unless `directory` holds this build already."""
        exe = shutil.which(compiler)
        if exe is None:
            return f"no C++ compiler: {compiler!r} not found (set CXX)"
        try:
            version = subprocess.run(
                [exe, "--version"], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{compiler} --version failed: {exc}"
        source = self.source.read_bytes()
        digest = hashlib.sha256()
        for part in (
            source,
            " ".join(self.flags).encode(),
            version.encode(),
            cpu_identity().encode(),
        ):
            digest.update(part)
        path = directory / f"{self.source.stem}-{digest.hexdigest()[:16]}.so"
        build_s = 0.0
        if not path.exists():
            try:
                directory.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
                os.close(fd)
            except OSError as exc:
                return f"cannot write the build cache {directory}: {exc}"
            cmd = [exe, *self.flags, "-shared", "-fPIC", "-o", tmp, str(self.source)]
            t0 = time.perf_counter()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as exc:
                os.unlink(tmp)
                return f"building {self.source.name} failed: {exc}"
            build_s = time.perf_counter() - t0
            if done.returncode != 0:
                os.unlink(tmp)
                return (
                    f"building {self.source.name} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
                )
            os.replace(tmp, path)  # atomic: another process sees no library or a whole one
        try:
            return self.bind(path, build_s, ctypes.CDLL(str(path)))
        except (OSError, AttributeError) as exc:
            return f"loading {path} failed: {exc}"


def cpu_identity() -> str:
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
