"""A Linear on the CPU through oneDNN, as one opaque operator a compiled graph can call.

    y = cpu_linear(x, weight, bias, activation)   # activation(x @ weight.T + bias)

`x (..., in)`, `weight (out, in)`, `bias (out,)` or None, all float32 CPU tensors (or the same
dtype: oneDNN takes bf16 too); `activation` is "none", "gelu" or "gelu_tanh" (GELU with
the tanh approximation, `nn.GELU(approximate="tanh")`), applied in oneDNN's epilogue, so the
matrix product's output is written once. Returns `(..., out)`, contiguous.

Why: eager `F.linear` in float32 on the CPU calls the BLAS (MKL in PyTorch's builds), and
inductor's own CPU GEMM templates need the weight to be a constant of the graph (`freezing`),
which streamed blocks cannot give: their weights are the graph's inputs, a slot's storage that
changes from block to block (engine/compiled_blocks.py). oneDNN's primitive takes the weight as
an input and reorders it per call, and on the CPUs measured (benchmarks/compile.py) it ran the
small preset's block linears about 1.2x faster than MKL's sgemm at one thread. Inductor cannot
lower oneDNN's `mkldnn._linear_pointwise` with a non-constant weight, hence this custom op: to
the compiler it is an extern call with a fake (shape) implementation.

`cpu_linear_reference` is the same maths in plain PyTorch; the op falls back to it where oneDNN
is not built in (`torch.backends.mkldnn.is_available()`).

Caution: inference only (no autograd formula: a graph that needs gradients keeps `F.linear`);
float32 results differ from `F.linear`'s in the last bits (another summation order), within
fp32's own error (tests/test_compile.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {"none": ("none", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh")}


def cpu_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "none"
) -> torch.Tensor:
    """`activation(F.linear(x, weight, bias))` in plain PyTorch."""
    y = F.linear(x, weight, bias)  # (..., out)
    if activation == "none":
        return y
    return F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


@torch.library.custom_op("megaslide::cpu_linear", mutates_args=())
def _cpu_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    if not torch.backends.mkldnn.is_available():
        return cpu_linear_reference(x, weight, bias, activation).contiguous()
    attr, algorithm = ACTIVATIONS[activation]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)


@_cpu_linear.register_fake
def _(x, weight, bias, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def cpu_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation="none"
) -> torch.Tensor:
    """`activation(x @ weight.T + bias)` through oneDNN; see the module docstring."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(
            f"cpu_linear takes CPU tensors, got x on {x.device}, weight on {weight.device}"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dimension {x.shape[-1]} is not weight's in {weight.shape[1]}")
    return _cpu_linear(x, weight, bias, activation)
