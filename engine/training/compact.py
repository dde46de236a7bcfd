"""Codecs of CPUAdamW's compact state formats (state_format.py): torch ops on CPU scratch.

Each function works in place on buffers the caller owns (optim.py keeps one set per worker),
so a chunk is decoded to fp32, updated by torch's fused AdamW and encoded back without
allocating. Bit patterns are handled as int32 views of fp32 values. Integer constants are passed
as int32 tensors, not Python numbers: torch's CPU shift and mask kernels are several times
slower with a Python scalar operand.

Master halves (``bf16-split``). An fp32 value x with bit pattern X = 2**16 * T + L (T the top
16 bits, L the low 16 read as unsigned) is stored as

    hi = T + (L >= 2**15)      # x rounded to bf16, half away from zero: (X + 2**15) >> 16
    lo = L as signed int16     # L - 2**16 when L >= 2**15, else L

and since X = 2**16 * hi + lo in both cases, `join_halves` restores x bit for bit. Adding 2**15
to a pattern adds to the magnitude (sign and magnitude are separate fields), so the rounding is
the same for negative x; a carry into the exponent is the correct rounding too.

Stochastic rounding (``bf16-sr``): (X + r) >> 16 with r uniform in [0, 2**16) rounds the
magnitude up with probability L / 2**16, so E[result] = x (Gupta et al. 2015). r comes from
`hash_bits`: murmur3's 32-bit finalizer (fmix32) applied to (element index * golden ratio + key), a key
per (seed, step, block, tensor): no generator state, the same bits for a resumed run and for any
thread split. Its low 16 bits round the master, its high 16 bits the 8-bit v below.

8-bit moments. The scratch holds m in row 0 and v in row 1, shape (2, n), n a multiple of
QUANT_BLOCK = 256. Each block of 256 is divided by its absmax a, and y = x / a gets a
float-like code with 3 mantissa bits, computed from y's bits (add half a unit or, for v, random
bits below the kept mantissa; shift; rebias the exponent):

    m (signed, y in [-1, 1]): sign bit + k in [0, 127]; k = 0 is 0, else
        |y| = 2**(e - 127) * (1 + f / 8) with (e, f) = divmod(k + 889, 8): 2**-16 .. 1
    v (unsigned, y in [0, 1]): k in [0, 255],
        y = 2**(e - 127) * (1 + f / 8) with (e, f) = divmod(k + 761, 8): 2**-32 .. 1, no zero

v gets 5 exponent bits to m's 4 because it is a square: its range is m's squared, and 3
mantissa bits on v are 4 on sqrt(v), the quantity the update divides by. A tiny v rounds up to
the smallest code, never to 0 (a larger v only shortens the step); a zero m stays exactly 0, so
a weight without gradient does not move.

Rounding. m is rounded to nearest: it moves by (1 - beta1) of itself per step, more than a code
step. v is rounded stochastically: rounded to nearest it gets stuck, because once its change
per step relative to the block's absmax (about (1 - beta2) / t early in training) is below half
a code step, every step rounds back to the same code; on a drifting test problem that biased the
steps by about 7%, stochastic rounding by < 0.1%.

Relative error: at most 2**-4 on m (nearest); on v 2**-4 rounded to nearest, 2**-3 (one code
step) stochastically, so 2**-4 on sqrt(v); for |y| >= 2**-16 (m) or 2**-32 (v). Below, m is
flushed to 0 (error <= 1.25 * 2**-16 * a) and v raised to 1.125 * 2**-32 * a. This is the idea
of Dettmers et al.'s dynamic code (an exponent for range, a few bits of fraction for precision)
in a form that needs no table search. A block of zeros has a = 0 and decodes to zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .state_format import QUANT_BLOCK


def _i32(*values: int) -> Tensor:
    """int32 constant: 0-dim for one value, (2, 1) per row (m, v) for two."""
    t = torch.tensor(values if len(values) > 1 else values[0], dtype=torch.int32)
    return t.view(2, 1) if len(values) > 1 else t


_SHIFT = 20  # 23 mantissa bits - 3 kept
_HALF = 1 << (_SHIFT - 1)  # half a kept unit: round to nearest
_BIAS = (889, 761)  # (bits >> 20) - bias = k; k = 127 (m), 255 (v) decodes to exactly 1.0
_KMASK = (127, 255)  # the magnitude field of a code
_SIGN = (128, 0)  # the sign bit of a code (v has none)
_NOZERO = (0, 1)  # ORed into min(k, 1): the factor that zeroes code 0 of m, not of v
_GOLDEN = -1640531535  # 0x9E3779B1 as int32
_FMIX = (-2048144789, -1028477387)  # 0x85EBCA6B, 0xC2B2AE35


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
        self.k = torch.empty(2, n, dtype=torch.int32)
        self.absmax = torch.empty(2, n // QUANT_BLOCK, dtype=torch.float32)
        self.inv = torch.empty(2, n // QUANT_BLOCK, dtype=torch.float32)
        self.bits = torch.empty(n, dtype=torch.int32)  # hash_bits output
        self.tmp = torch.empty(n, dtype=torch.int32)
        # arange * golden ratio (mod 2**32): the first step of the hash, shared by all chunks
        self.golden = torch.arange(n, dtype=torch.int32).mul_(_GOLDEN)
        self.c = {
            "k4": _i32(4),
            "k13": _i32(13),
            "k16": _i32(16),
            "k20": _i32(_SHIFT),
            "k24": _i32(24),
            "half": _i32(_HALF),
            "low16": _i32(0xFFFF),
            "low19": _i32(0x7FFFF),
            "mag": _i32(0x7FFFFFFF),
            "bias": _i32(*_BIAS),
            "kmask": _i32(*_KMASK),
            "sign": _i32(*_SIGN),
            "nozero": _i32(*_NOZERO),
        }


# ---------------------------------------------------------------------- master halves


def split_halves(x: Tensor, hi: Tensor, lo: Tensor, tmp: Tensor, s: Scratch) -> None:
    """Write fp32 `x` as `hi` (x rounded to bf16) and `lo` (int16); `tmp`: int32 like x."""
    bits = x.view(torch.int32)
    torch.add(bits, 1 << 15, out=tmp).bitwise_right_shift_(s.c["k16"])
    hi.view(torch.int16).copy_(tmp)  # in int16 range: an arithmetic shift of an int32 by 16
    lo.copy_(bits)  # int32 -> int16 keeps the low 16 bits


def join_halves(hi: Tensor, lo: Tensor, out: Tensor, s: Scratch) -> None:
    """fp32 `out` = the value `split_halves` cut into `hi` and `lo`, bit for bit."""
    bits = out.view(torch.int32)
    bits.copy_(hi.view(torch.int16)).bitwise_left_shift_(s.c["k16"]).add_(lo)


def stochastic_round(x: Tensor, hi: Tensor, rand: Tensor, tmp: Tensor, s: Scratch) -> None:
    """Write fp32 `x` stochastically rounded to bf16 into `hi`, given `rand` (int32 from
    `hash_bits`, x's size: its low 16 bits are used); `tmp`: int32 like x."""
    torch.bitwise_and(rand, s.c["low16"], out=tmp).add_(x.view(torch.int32))
    hi.view(torch.int16).copy_(tmp.bitwise_right_shift_(s.c["k16"]))


def hash_start(out: Tensor, s: Scratch, start: int, key: int) -> None:
    """First step of the hash of elements start, start+1, ... under `key`, into int32 `out`."""
    base = (start * 0x9E3779B1 + key) & 0xFFFFFFFF
    torch.add(s.golden[: out.numel()], base - (1 << 32) if base >= 1 << 31 else base, out=out)


def hash_finish(bits: Tensor, tmp: Tensor, s: Scratch) -> None:
    """murmur3's fmix32 on every element of `bits` (in place): 32 uniform bits. fmix32 shifts
    logically; torch's int32 shift is arithmetic, so each shift is followed by a mask."""
    tmp = tmp[: bits.numel()]
    c = s.c
    for shift, mask, mult in (("k16", "low16", _FMIX[0]), ("k13", "low19", _FMIX[1])):
        torch.bitwise_right_shift(bits, c[shift], out=tmp).bitwise_and_(c[mask])
        bits.bitwise_xor_(tmp).mul_(mult)
    bits.bitwise_xor_(torch.bitwise_right_shift(bits, c["k16"], out=tmp).bitwise_and_(c["low16"]))


def sr_key(seed: int, step: int, block: int, tensor: int) -> int:
    """A 32-bit key per (seed, step, block index, tensor index): splitmix64 rounds."""
    z = 0
    for part in (seed, step, block, tensor):
        z = (z + (part & 0xFFFFFFFFFFFFFFFF) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
    return z & 0xFFFFFFFF


# ---------------------------------------------------------------------- 8-bit moments


def dequantize_8bit(codes: Tensor, absmax: Tensor, out: Tensor, s: Scratch) -> None:
    """(2, n) uint8 codes and (2, n / 256) absmax -> m (row 0) and v (row 1) in fp32 `out`."""
    s.i[:, : codes.shape[1]].copy_(codes)
    decode_8bit(absmax, out, s)


def decode_8bit(absmax: Tensor, out: Tensor, s: Scratch) -> None:
    """`dequantize_8bit` of the codes already widened into ``s.i[:, :n]`` (n = out.shape[1]):
    a caller with codes in several pieces copies each straight in, with no uint8 staging."""
    n, c = out.shape[1], s.c
    i, j, nz = s.i[:, :n], s.j[:, :n], s.k[:, :n]
    torch.bitwise_and(i, c["sign"], out=j).bitwise_left_shift_(c["k24"])  # the fp32 sign bit
    i.bitwise_and_(c["kmask"])
    # 0 for m's code 0, else 1 (integer ops: a bool mask would cost a slow dtype promotion)
    torch.clamp(i, max=1, out=nz).bitwise_or_(c["nozero"])
    i.add_(c["bias"]).bitwise_left_shift_(c["k20"]).mul_(nz).bitwise_or_(j)
    torch.mul(
        i.view(torch.float32).view(2, -1, QUANT_BLOCK),
        absmax.unsqueeze(-1),
        out=out.view(2, -1, QUANT_BLOCK),
    )


def quantize_8bit(
    mv: Tensor, codes: Tensor, absmax: Tensor, s: Scratch, rand: Tensor | None = None
) -> None:
    """m (row 0) and v (row 1) of fp32 `mv` -> `codes` and `absmax`; `mv` is overwritten.

    m is rounded to nearest; v stochastically when `rand` (int32 from `hash_bits`, one per
    element of a row: its high 16 bits are used) is given, else to nearest too."""
    encode_8bit(mv, absmax, s, rand)
    codes.copy_(s.i[:, : mv.shape[1]])


def encode_8bit(mv: Tensor, absmax: Tensor, s: Scratch, rand: Tensor | None = None) -> None:
    """`quantize_8bit` leaving the codes as int32 in ``s.i[:, :n]``, for the caller to narrow
    into its pieces of uint8 storage."""
    n, c = mv.shape[1], s.c
    i, j = s.i[:, :n], s.j[:, :n]
    scaled = i.view(torch.float32)
    torch.abs(mv, out=scaled)
    torch.amax(scaled.view(2, -1, QUANT_BLOCK), dim=-1, out=absmax)
    inv = s.inv[:, : absmax.shape[1]]
    torch.reciprocal(absmax, out=inv).nan_to_num_(posinf=0.0)  # a block of zeros stays zeros
    mv.view(2, -1, QUANT_BLOCK).mul_(inv.unsqueeze(-1))
    bits = mv.view(torch.int32)
    torch.bitwise_right_shift(bits, c["k24"], out=j).bitwise_and_(c["sign"])  # code's sign bit
    torch.bitwise_and(bits, c["mag"], out=i)
    if rand is None:
        i.add_(c["half"])
    else:  # 16 random bits at the top of the 20 dropped: at most 2**-16 of a step of bias
        i[0].add_(c["half"])
        tmp = s.tmp[:n]
        torch.bitwise_right_shift(rand, c["k16"], out=tmp).bitwise_and_(c["low16"])
        i[1].add_(tmp.bitwise_left_shift_(c["k4"]))
    i.bitwise_right_shift_(c["k20"]).sub_(c["bias"]).clamp_(min=0).bitwise_or_(j)


# ---------------------------------------------------------------------- allocating forms


def hash_bits(n: int, start: int, key: int) -> Tensor:
    """The int32 random bits of elements start .. start+n-1 under `key`."""
    s = Scratch(_round_up(n, QUANT_BLOCK))
    out = torch.empty(n, dtype=torch.int32)
    hash_start(out, s, start, key)
    hash_finish(out, s.tmp, s)
    return out


def quantize(mv: Tensor, key: int | None = None) -> tuple[Tensor, Tensor]:
    """Allocating form of `quantize_8bit` for (2, n) fp32 m and v, n a multiple of 256:
    (codes, absmax), v rounded stochastically under `key` if given. `mv` is left unchanged."""
    n = mv.shape[1]
    codes = torch.empty(mv.shape, dtype=torch.uint8)
    absmax = torch.empty(2, n // QUANT_BLOCK)
    rand = None if key is None else hash_bits(n, 0, key)
    quantize_8bit(mv.clone(), codes, absmax, Scratch(n), rand)
    return codes, absmax


def dequantize(codes: Tensor, absmax: Tensor) -> Tensor:
    """Allocating form of `dequantize_8bit`: fp32 (2, n) m and v."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    dequantize_8bit(codes, absmax, out, Scratch(codes.shape[1]))
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
