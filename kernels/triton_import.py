"""Triton, or a stand-in where no Triton wheel exists for the platform, so that the kernels'
modules still import and their PyTorch references still work.

`triton` and `tl` are the real modules when Triton imports; otherwise a stand-in on which the
decorators the kernels use (`jit`, `autotune`, `Config`, `constexpr`) do nothing, and
`TRITON_IMPORT_ERROR` says why a launcher cannot run. `interpreting()` tells whether kernels run
on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # no Triton wheel for this platform; the references still work

    class _TritonMissing:
        """Stands in for `triton` and `triton.language` so that kernels can be defined."""

        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

        @staticmethod
        def autotune(*args, **kwargs):
            return lambda fn: fn

        @staticmethod
        def Config(*args, **kwargs):
            return None

    triton = tl = _TritonMissing  # type: ignore[assignment]
    TRITON_IMPORT_ERROR = exc


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors through numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


__all__ = ["TRITON_IMPORT_ERROR", "interpreting", "tl", "triton"]
