"""fp8 matmuls: a streamed block's linear layers multiply by their stored fp8 weights directly.

With `--weights fp8` a streamed block's linear weights cross the bus as float8_e4m3fn bytes and
a scale per output row (weight_formats.py) and are dequantized into the device slot before the
block runs. With `Placement(fp8_matmul=True)` the slot decode leaves those weights out, and each
such `nn.Linear` computes

    y = _scaled_mm(quant(x), q.t(), scale_a=s_x, scale_b=s_w) + bias

on the payload's device copy instead: `q` the stored fp8 weight `(out, in)` (a view of the
staging buffer the payload landed in), `s_w` its scales `(1, out)` in fp32, and `quant(x)` the
activation quantized on the fly to float8_e4m3fn with one fp32 scale per token (row-wise:
`s_x = amax(|x_row|) / 448`, `(M, 1)`). Row-wise on both sides is the one scale layout that
keeps the weight's per-row scale exact; `torch._scaled_mm` takes it on the CPU and on CUDA
(rowwise needs sm89+/sm90 there and a bf16 output, so on CUDA the product is taken in bf16 and
cast to the input's dtype). `fp8_linear_reference` is the same math in fp64 on the same
quantized operands: the tests hold `fp8_linear` to it.

The streamer relays what the store's decode hands back (`Fp8Operand`, by entry) to the weight
Parameter (`weight.fp8_operand`, set while its block is loaded, None otherwise); the Linear's
forward (`fp8_linear_forward`, installed per streamed Linear) uses it when set and `F.linear`
otherwise, so resident blocks, the dequantizing fallback and every other tensor are untouched.
Forward hooks on the Linear (LoRA rows add on its output) run as before.

Which weights: those the fp8 codec quantized itself (power-of-two row scales) and e4m3fn weights
a checkpoint stores with its float scale (per tensor: broadcast to every row), of Linears whose
weight is not shared with another module; on CUDA only those with both dimensions multiples of
16 (what `_scaled_mm` needs there: every linear of a real Wan; the CPU takes any shape, so the
tiny test models' 24-wide layers run it too). An e5m2 weight a checkpoint stores is dequantized
as without the lever.

Caution: activation quantization is a second rounding the dequantizing path does not have
(relative error up to 2**-4 per element of x, before accumulation): frames differ from plain fp8
by it (measured in benchmarks/fp8_matmul.py). A slot's bytes for a skipped weight are left as
they were: anything other than the Linear's forward that reads that weight reads garbage. Weight
variants (merged fine-tunes, which add deltas to the slot's decoded weights) are refused with
the lever on. Where `_scaled_mm` is missing or refuses (an older GPU), the lever falls back to
the dequantizing decode and `stats()["fp8_matmul"]` says why.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MATMUL_MULTIPLE = 16  # `_scaled_mm` on CUDA: both weight dimensions multiples of this


@dataclasses.dataclass(frozen=True)
class Fp8Operand:
    """A linear weight as `_scaled_mm` takes it: e4m3fn values and fp32 scales per output row."""

    q: torch.Tensor  # float8_e4m3fn (out, in), row-major
    scale: torch.Tensor  # float32 (out,)


def fp8_matmul_shape_ok(shape: tuple[int, ...], device: torch.device) -> bool:
    """A weight `(out, in)` whose matmul `_scaled_mm` takes on `device`: on CUDA both
    dimensions multiples of 16, on the CPU any."""
    if len(shape) != 2 or min(shape) <= 0:
        return False
    return device.type == "cpu" or all(n % MATMUL_MULTIPLE == 0 for n in shape)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): `x` `(M, K)` as float8_e4m3fn with one fp32 scale per row, `x ~ q * scale`;
    each row's largest magnitude lands on 448. An all-zero row gets scale 1."""
    x32 = x.float()
    amax = x32.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_linear(x: torch.Tensor, w: Fp8Operand, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ (w.q * w.scale).T + bias` with `x` quantized per token: `_scaled_mm` on fp8 operands,
    the output in `x`'s dtype (taken in bf16 on CUDA, where row-wise scales need it)."""
    lead = x.shape[:-1]
    xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]))  # (M, K) fp8, (M, 1) fp32
    out_dtype = x.dtype if x.device.type == "cpu" else torch.bfloat16
    y = torch._scaled_mm(  # (M, N)
        xq, w.q.t(), scale_a=sx, scale_b=w.scale.view(1, -1), out_dtype=out_dtype
    )
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, -1)


def fp8_linear_reference(
    x: torch.Tensor, w: Fp8Operand, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`fp8_linear`'s math in fp64 on the same quantized operands (the oracle), in fp64."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_rows(x2)
    a = xq.double() * sx.double()
    b = w.q.double() * w.scale.double()[:, None]
    y = a @ b.t()
    if bias is not None:
        y = y + bias.double()
    return y.view(*x.shape[:-1], -1)


@functools.cache
def fp8_matmul_unavailable(device: str) -> str | None:
    """Why `fp8_linear` cannot run on `device` (None: it can), found by running a tiny one."""
    dev = torch.device(device)
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        if (major, minor) < (8, 9):
            return f"fp8 matmuls need compute capability 8.9+, this GPU has {major}.{minor}"
    elif dev.type != "cpu":
        return f"fp8 matmuls are checked on CPU and CUDA, not {dev.type}"
    n = MATMUL_MULTIPLE
    w = Fp8Operand(torch.ones(n, n, device=dev).to(torch.float8_e4m3fn), torch.ones(n, device=dev))
    try:
        y = fp8_linear(torch.ones(2, n, device=dev, dtype=torch.bfloat16), w)
    except (RuntimeError, NotImplementedError) as e:  # a build or a card without the kernel
        return f"torch._scaled_mm refused row-wise scales here: {str(e).splitlines()[0]}"
    # A sync, once per device (cached): the probe's product must be read to be checked.
    if not bool((y.float() == n).all()):
        return "torch._scaled_mm gave a wrong product here"
    return None


def fp8_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An `nn.Linear`'s forward that multiplies by its weight's fp8 operand while one is set
    (`weight.fp8_operand`, see the module docstring), else the plain `F.linear`."""
    w = getattr(self.weight, "fp8_operand", None)
    if w is None:
        return F.linear(x, self.weight, self.bias)
    return fp8_linear(x, w, self.bias)
