"""Native libraries in tests (the compact formats' fused kernel, the lane code's decoders):
present, or skipped with the reason (a failure when ``MEGASLIDE_REQUIRE_NATIVE=1``, as on CI,
where a missing compiler must not pass unseen)."""

from __future__ import annotations

import os

import pytest

from megaslide.engine.training import compact_kernel
from megaslide.kernels import lane_native

PATHS = ["native", "torch-ops"]  # CPUAdamW.update_path of a compact format


def require_kernel() -> compact_kernel.Kernel:
    return require(compact_kernel.LIBRARY, "the fused kernel")


def require_lane_native() -> lane_native.LaneNative:
    return require(lane_native.LIBRARY, "the native lane-code decoder")


def require(library, what: str):
    """`library` loaded, or the test skipped (failed under MEGASLIDE_REQUIRE_NATIVE=1)."""
    loaded = library.load()
    if loaded is None:
        reason = f"{what} is unavailable: {library.unavailable_reason()}"
        if os.environ.get("MEGASLIDE_REQUIRE_NATIVE") == "1":
            pytest.fail(reason + " (MEGASLIDE_REQUIRE_NATIVE=1)")
        pytest.skip(reason)
    return loaded


def use_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the optimizers built from now on run `path` (CPUAdamW reads the switch when built)."""
    if path == "native":
        require_kernel()
    else:
        monkeypatch.setenv("MEGASLIDE_NATIVE_OPTIM", "0")
