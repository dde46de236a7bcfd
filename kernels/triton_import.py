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


def check_attention_inputs(q) -> None:
    """What every attention kernel here needs of `backend='triton'` and its queries `q`
    (..., D): Triton itself, CUDA tensors (or the interpreter), fp16/bf16/fp32 and a power-of-two
    head dim in [16, 256]; raises with a clear message otherwise."""
    import torch

    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(
            "backend='triton' needs the triton package, which failed to import "
            f"({TRITON_IMPORT_ERROR}); use backend='reference'"
        )
    if not q.is_cuda and not interpreting():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {q.device}); use backend='reference' on "
            "CPU, or set TRITON_INTERPRET=1 before importing triton to run the kernels on CPU"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"backend='triton' supports fp16, bf16 and fp32, got {q.dtype}")
    D = q.shape[-1]
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(
            f"backend='triton' needs a power-of-two head dim in [16, 256], got {D}; "
            "backend='reference' takes any head dim"
        )


__all__ = ["TRITON_IMPORT_ERROR", "check_attention_inputs", "interpreting", "tl", "triton"]
