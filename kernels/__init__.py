"""MegaSlide kernels: operators, each Triton kernel beside the PyTorch reference it must match.

3D Deformable Slide Attention: `dsa_attention` is the entry point (the Triton
kernels for CUDA tensors, the reference otherwise), `dsa_triton` and `dsa_attention_reference` are
the two backends, `dsa_geometry`, `window_tiles` and `invert_windows` compute the windows both of
them read, and `dsa_dense_oracle` is the dense masked attention the tests hold them to.

DFloat, lossless bf16 weights: `dfloat_encode` (CPU, numpy) codes a buffer's exponents,
`dfloat_decode` decodes on the device (the Triton kernel on CUDA, C++ or the reference on the
CPU).

Fine-tune deltas, lossless: `delta_encode(base, tuned)` (CPU, numpy) codes a fine-tune's words
minus its base's as a `DeltaBuffer`; `delta_apply(buffer, words, sign)` adds it into the base's
words in place, or subtracts it back (the Triton kernel on CUDA, C++ or the reference on the
CPU). Both formats share the lane-parallel Huffman code of `lane_code.py`; on the CPU both decode
with its C++ decoders (`lane_native.py`, built on first use by `native_build.py`) where a
compiler is available, the references otherwise.

8-bit attention (SageAttention's recipe: smoothed K, int8 QK^T with per-token scales, fp16 PV):
`sage_attention` is the entry point (the Triton kernel for CUDA tensors, the reference
otherwise), `sage_triton` and `sage_attention_reference` the two backends.

A Linear on the CPU through oneDNN, a GELU fused (`cpu_linear`, its reference
`cpu_linear_reference`): a custom op that compiled blocks call for their float32 CPU linears,
whose weights are graph inputs (engine/compiled_blocks.py).

The package needs torch, with Triton optional, and imports nothing from `engine/` or `server/`.
"""

from .cpu_linear import cpu_linear, cpu_linear_reference
from .delta import delta_apply
from .delta_reference import DeltaBuffer, delta_encode
from .dfloat import dfloat_decode
from .dfloat_reference import dfloat_encode
from .dsa import dsa_attention, dsa_triton
from .dsa_reference import (
    DSAGeometry,
    dsa_attention_reference,
    dsa_dense_oracle,
    dsa_geometry,
    invert_windows,
    window_tiles,
)
from .sage import sage_attention, sage_triton
from .sage_reference import sage_attention_reference

__all__ = [
    "cpu_linear",
    "cpu_linear_reference",
    "DSAGeometry",
    "DeltaBuffer",
    "delta_apply",
    "delta_encode",
    "dfloat_decode",
    "dfloat_encode",
    "dsa_attention",
    "dsa_attention_reference",
    "dsa_dense_oracle",
    "dsa_geometry",
    "dsa_triton",
    "invert_windows",
    "sage_attention",
    "sage_attention_reference",
    "sage_triton",
    "window_tiles",
]
