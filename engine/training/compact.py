"""Codecs of CPUAdamW's compact state formats (state_format.py): torch ops on CPU scratch.

Each function works in place on buffers the caller owns (optim.py keeps one set per worker,
small enough to stay in cache), so a chunk is decoded to fp32, updated by torch's fused AdamW
and encoded back without allocating. Bit patterns are handled as int32 views of fp32 values.

Master halves (``bf16-split``). An fp32 value x with bit pattern X = 2**16 * T + L (T the top
16 bits, L the low 16 read as unsigned) is stored as

    hi = T + (L >= 2**15)      # x rounded to bf16, half away from zero: (X + 2**15) >> 16
    lo = L as signed int16     # L - 2**16 when L >= 2**15, else L

and since X = 2**16 * hi + lo in both cases, `join_halves` restores x bit for bit. Adding 2**15
to a pattern adds to the magnitude (sign and magnitude are separate fields), so the rounding is
the same for negative x; a carry into the exponent is the correct rounding too.

Stochastic rounding (``bf16-sr``): (X + r) >> 16 with r uniform in [0, 2**16) rounds the
magnitude up with probability L / 2**16, so E[result] = x. r is the low 16 bits of murmur3's
32-bit finalizer applied to (element index * golden ratio + key), a key per (seed, step, block,
tensor): no generator state, the same bits for a resumed run, any thread split.

8-bit moments. The scratch holds m in row 0 and v in row 1, shape (2, n), n a multiple of
QUANT_BLOCK = 256; row 1 is coded as w = sqrt(v), so both rows span the dynamic range of the
gradient rather than v spanning its square. Each block of 256 is divided by its absmax a, and
y = x / a in [-1, 1] gets a float-like code, computed from y's bits (round to nearest on the
mantissa, then rebias the exponent):

    m (signed):   sign bit + k in [0, 127]; k = 0 is 0, else y = 2**(e - 127) * (1 + f / 8)
                  with (e, f) = divmod(k + 889, 8): 3 mantissa bits, |y| from 2**-16 to 1
    w (unsigned): k in [0, 255], y = 2**(e - 127) * (1 + f / 16) with (e, f) = divmod(k + 1777,
                  16): 4 mantissa bits, from 2**-16 to 1, no zero (a tiny w rounds up to the
                  smallest code: a larger sqrt(v) only shortens the step)

w is rounded stochastically (same hash, its own stream). Rounded to nearest, v gets stuck: once
the per-step change of v / absmax (about (1 - beta2) / t early in training) is below half a code
step, every step rounds back to the same code, and v keeps its first few samples' weights; on a
drifting test problem that biased the steps by about 7%, stochastic rounding by < 0.1%. m moves
by (1 - beta1) of itself per step and is rounded to nearest.

Relative error: at most 2**-4 on m and 2**-5 on w rounded to nearest, 2**-4 on w rounded
stochastically (so about 2**-3 on v) for |y| >= 2**-16;
below that m is flushed to 0 (error < 1.25 * 2**-16 * a) and w raised to 2**-16 * 1.0625 * a.
This is the idea of Dettmers et al.'s dynamic code (an exponent for range, a few bits of
fraction for precision) in a form that needs no table search: quantizing is a few integer ops.
A block of zeros has a = 0 and decodes to zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .state_format import QUANT_BLOCK

# Per-row constants of the 8-bit code, rows (m, w), as (2, 1) int32 tensors that broadcast.
_SHIFT = (20, 19)  # keep 3 (m) or 4 (w) mantissa bits
_ROUND = (1 << 19, 1 << 18)  # half of the last kept mantissa unit
_BIAS = (889, 1777)  # (bits >> shift) - bias = k, so that k_max decodes to exactly 1.0
_KMASK = (127, 255)  # the magnitude field of a code
_SIGN = (128, 0)  # the sign bit of a code (w has none)
_NOZERO = (0, 1)  # ORed into min(k, 1): the factor that zeroes code 0 of m, not of w


def _rows(values: tuple[int, int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int32).view(2, 1)


_GOLDEN = -1640531535  # 0x9E3779B1 as int32
_FMIX1 = -2048144789  # 0x85EBCA6B
_FMIX2 = -1028477387  # 0xC2B2AE35


@dataclass
class Scratch:
    """One worker's buffers for chunks of up to `numel` elements (numel % QUANT_BLOCK == 0)."""

    numel: int

    def __post_init__(self) -> None:
        n = self.numel
        self.p = torch.empty(n, dtype=torch.float32)  # decoded master
        self.mv = torch.empty(2, n, dtype=torch.float32)  # decoded m, v
        self.i = torch.empty(2, n, dtype=torch.int32)
        self.j = torch.empty(2, n, dtype=torch.int32)
        self.nonzero = torch.empty(2, n, dtype=torch.int32)
        self.codes = torch.empty(2, n, dtype=torch.uint8)
        self.absmax = torch.empty(2, n // QUANT_BLOCK, dtype=torch.float32)
        self.noise = torch.empty(n, dtype=torch.int32)  # stochastic rounding bits
        self.tmp = torch.empty(n, dtype=torch.int32)
        self.inv = torch.empty(2, n // QUANT_BLOCK, dtype=torch.float32)
        # arange * golden ratio (mod 2**32): the first step of the hash, shared by all chunks
        self.golden = torch.arange(n, dtype=torch.int32).mul_(_GOLDEN)
        self.shift, self.round, self.bias = _rows(_SHIFT), _rows(_ROUND), _rows(_BIAS)
        self.kmask, self.sign, self.nozero = _rows(_KMASK), _rows(_SIGN), _rows(_NOZERO)


# ---------------------------------------------------------------------- master halves


def split_halves(x: Tensor, hi: Tensor, lo: Tensor, tmp: Tensor) -> None:
    """Write fp32 `x` as `hi` (x rounded to bf16, any 16-bit dtype) and `lo` (int16);
    `tmp` is int32 scratch of x's size."""
    bits = x.view(torch.int32)
    torch.add(bits, 1 << 15, out=tmp).bitwise_right_shift_(16)
    hi.view(torch.int16).copy_(tmp)  # in int16 range: an arithmetic shift of an int32 by 16
    lo.copy_(bits)  # int32 -> int16 keeps the low 16 bits


def join_halves(hi: Tensor, lo: Tensor, out: Tensor) -> None:
    """fp32 `out` = the value `split_halves` cut into `hi` and `lo`, bit for bit."""
    bits = out.view(torch.int32)
    bits.copy_(hi.view(torch.int16)).bitwise_left_shift_(16).add_(lo)


def stochastic_round(x: Tensor, hi: Tensor, noise: Tensor) -> None:
    """Write fp32 `x` stochastically rounded to bf16 into `hi`, given `noise` (int32, x's size,
    from `sr_noise`; overwritten)."""
    noise.add_(x.view(torch.int32)).bitwise_right_shift_(16)
    hi.view(torch.int16).copy_(noise)


def sr_fill(noise: Tensor, golden: Tensor, start: int, key: int) -> None:
    """First step of the hash of elements start, start+1, ... under `key` into `noise`."""
    base = (start * 0x9E3779B1 + key) & 0xFFFFFFFF
    torch.add(golden[: noise.numel()], _as_int32(base), out=noise)


def sr_finish(noise: Tensor, tmp: Tensor, bits: int = 16) -> None:
    """murmur3's fmix32 on every element, keeping the low `bits` bits: uniform in [0, 2**bits).

    torch's right shift of int32 is arithmetic; the low 16 bits that are kept do not depend on
    that (each shift is by >= 13 and the multiplies only carry upwards), so this is fmix32's
    low half up to a fixed difference in which high bits feed the last xor-shift."""
    tmp = tmp[: noise.numel()]
    for shift, mult in ((16, _FMIX1), (13, _FMIX2), (16, None)):
        noise.bitwise_xor_(torch.bitwise_right_shift(noise, shift, out=tmp))
        if mult is not None:
            noise.mul_(mult)
    noise.bitwise_and_((1 << bits) - 1)


def sr_key(seed: int, step: int, block: int, tensor: int, stream: int = 0) -> int:
    """A 32-bit key per (seed, step, block index, tensor index, stream: MASTER_STREAM or
    MOMENT_STREAM): splitmix64 rounds."""
    z = 0
    for part in (seed, step, block, tensor, stream):
        z = (z + (part & 0xFFFFFFFFFFFFFFFF) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
    return z & 0xFFFFFFFF


MASTER_STREAM, MOMENT_STREAM = 0, 1
W_NOISE_BITS = _SHIFT[1]  # the w row's stochastic rounding: noise below its last kept bit


def _as_int32(u: int) -> int:
    return u - (1 << 32) if u >= 1 << 31 else u


# ---------------------------------------------------------------------- 8-bit moments


def dequantize_8bit(codes: Tensor, absmax: Tensor, out: Tensor, s: Scratch) -> None:
    """(2, n) uint8 codes and (2, n / 256) absmax -> m (row 0) and v (row 1) in fp32 `out`."""
    n = codes.shape[1]
    i, j, nz = s.i[:, :n], s.j[:, :n], s.nonzero[:, :n]
    i.copy_(codes)
    torch.bitwise_and(i, s.sign, out=j).bitwise_left_shift_(24)  # the fp32 sign bit
    i.bitwise_and_(s.kmask)
    # 0 for m's code 0, else 1 (integer ops: a bool mask would cost a slow dtype promotion)
    torch.clamp(i, max=1, out=nz).bitwise_or_(s.nozero)
    i.add_(s.bias).bitwise_left_shift_(s.shift).mul_(nz).bitwise_or_(j)
    torch.mul(
        i.view(torch.float32).view(2, -1, QUANT_BLOCK),
        absmax.unsqueeze(-1),
        out=out.view(2, -1, QUANT_BLOCK),
    )
    out[1].square_()


def quantize_8bit(
    mv: Tensor, codes: Tensor, absmax: Tensor, s: Scratch, noise: Tensor | None = None
) -> None:
    """m (row 0) and v (row 1) of fp32 `mv` -> `codes` and `absmax`; `mv` is overwritten.

    m is rounded to the nearest code. w = sqrt(v) is rounded stochastically when `noise` is
    given (int32, uniform in [0, 2**W_NOISE_BITS), one per element of a row), else to nearest.
    """
    n = mv.shape[1]
    i, j = s.i[:, :n], s.j[:, :n]
    mv[1].sqrt_()
    blocks = mv.view(2, -1, QUANT_BLOCK)
    torch.abs(mv, out=i.view(torch.float32))
    torch.amax(i.view(torch.float32).view(2, -1, QUANT_BLOCK), dim=-1, out=absmax)
    inv = s.inv[:, : absmax.shape[1]]
    torch.reciprocal(absmax, out=inv).nan_to_num_(posinf=0.0)  # a block of zeros stays zeros
    blocks.mul_(inv.unsqueeze(-1))
    bits = mv.view(torch.int32)
    torch.bitwise_right_shift(bits, 24, out=j).bitwise_and_(s.sign)  # the code's sign bit
    torch.bitwise_and(bits, 0x7FFFFFFF, out=i)
    if noise is None:
        i.add_(s.round)
    else:
        i[0].add_(_ROUND[0])
        i[1].add_(noise)
    i.bitwise_right_shift_(s.shift).sub_(s.bias).clamp_(min=0).bitwise_or_(j)
    codes.copy_(i)


def quantize(mv: Tensor, key: int | None = None) -> tuple[Tensor, Tensor]:
    """Allocating form of `quantize_8bit` for (2, n) fp32 m and v, n a multiple of 256:
    (codes, absmax), w rounded stochastically under `key` if given. `mv` is left unchanged."""
    n = mv.shape[1]
    s = Scratch(n)
    codes = torch.empty(mv.shape, dtype=torch.uint8)
    absmax = torch.empty(2, n // QUANT_BLOCK)
    noise = None
    if key is not None:
        noise = torch.empty(n, dtype=torch.int32)
        sr_fill(noise, s.golden, 0, key)
        sr_finish(noise, torch.empty(n, dtype=torch.int32), W_NOISE_BITS)
    quantize_8bit(mv.clone(), codes, absmax, s, noise)
    return codes, absmax


def dequantize(codes: Tensor, absmax: Tensor) -> Tensor:
    """Allocating form of `dequantize_8bit`: fp32 (2, n) m and v."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    dequantize_8bit(codes, absmax, out, Scratch(codes.shape[1]))
    return out
