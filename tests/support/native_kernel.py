"""The compact formats' fused kernel in tests: present, or skipped with the reason (a failure
when ``MEGASLIDE_REQUIRE_NATIVE=1``, as on CI, where a missing compiler must not pass unseen)."""

from __future__ import annotations

import os

import pytest

from megaslide.engine.training import compact_kernel

PATHS = ["native", "torch-ops"]  # CPUAdamW.update_path of a compact format


def require_kernel() -> compact_kernel.Kernel:
    kernel = compact_kernel.load()
    if kernel is None:
        reason = f"the fused kernel is unavailable: {compact_kernel.unavailable_reason()}"
        if os.environ.get("MEGASLIDE_REQUIRE_NATIVE") == "1":
            pytest.fail(reason + " (MEGASLIDE_REQUIRE_NATIVE=1)")
        pytest.skip(reason)
    return kernel


def use_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the optimizers built from now on run `path` (CPUAdamW reads the switch when built)."""
    if path == "native":
        require_kernel()
    else:
        monkeypatch.setenv("MEGASLIDE_NATIVE_OPTIM", "0")
