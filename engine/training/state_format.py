"""How CPUAdamW stores its state on the host: the master weights and the moments m and v.

A format is written ``"<master>/<moments>"``; ``"fp32"`` alone means ``"fp32/fp32"``, today's
layout. Plain data, no torch (the fine-tuning spec and the server import it); the codecs are in
compact.py and the update in optim.py.

Masters (bytes per parameter, counting the bf16 compute copy the device reads):

* ``fp32``: an fp32 master, plus the bf16 compute copy `step_block(out=...)` writes: 4 + 2 B.
* ``bf16-split``: the fp32 master cut into two 16-bit halves. The high half is the master rounded
  to bf16 (round half away from zero), so it *is* the compute copy; the low half is the signed
  16-bit remainder, so high + low is the fp32 master exactly: the update is bitwise fp32 AdamW's
  at 4 B and no separate copy. (A compensation term in the sense of Kahan summation, carried to
  its limit: not an approximation of the lost bits but the lost bits themselves.)
* ``bf16-sr``: a bf16 master, the fp32 result of each update stochastically rounded to bf16
  (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision"): rounded up with
  probability equal to the fraction of the gap, so the expected weight is the fp32 one and small
  updates are not lost. The random bits are a hash of (seed, step, block, tensor, element): a
  resumed run draws the same bits as an uninterrupted one. 2 B.
* ``bf16``: a bf16 master rounded to nearest, no compensation. An update smaller than half a
  bf16 ulp (2**-9 of the weight) is lost; kept as the baseline the two above are tested against,
  not for training. 2 B.

Moments:

* ``fp32``: m and v in fp32, 8 B.
* ``8bit``: block-wise dynamic quantization after Dettmers et al. 2021, "8-bit Optimizers via
  Block-wise Quantization" (https://arxiv.org/abs/2110.02861): blocks of 256 elements of one
  tensor, each with its fp32 absmax, values coded relative to it by a float-like 8-bit code
  (compact.py: 3 mantissa bits; m signed, v with the sign bit spent on exponent range; m
  rounded to nearest, v stochastically). 2 B + 2 * 4 / 256 B.

Traffic of one update (`update_bytes`): the fused kernels (torch's for fp32, compact_kernel.cpp
for the rest) read every stored byte of the master and the moments once and write it back once,
and read the fp32 gradient the trainer's pinned buffer holds. Each written line was just read,
so no store misses the cache and costs a second read. Bytes per parameter:

    format            master   m and v   gradient   total
    fp32              4 + 4    8 + 8        4       28
    fp32/8bit         4 + 4    2.03 x 2     4       16.06
    bf16-split/fp32   4 + 4    8 + 8        4       28
    bf16-split/8bit   4 + 4    2.03 x 2     4       16.06
    bf16-sr/fp32      2 + 2    8 + 8        4       24
    bf16-sr/8bit      2 + 2    2.03 x 2     4       12.06

(2.03 x 2: the codes and the block absmax, read and written.) Not counted: the bf16 compute copy
`step_block(out=...)` writes beside an fp32 master (2 B; the trainer casts on the device
instead) and what accumulating micro-batches or clipping adds (`accumulate`'s passes over the
gradient buffer; torch's fp32 kernel also writes the scaled gradient back).
"""

from __future__ import annotations

from dataclasses import dataclass

MASTERS = ("fp32", "bf16-split", "bf16-sr", "bf16")
MOMENTS = ("fp32", "8bit")
QUANT_BLOCK = 256  # elements per absmax scale of the 8-bit moments

_MASTER_BYTES = {"fp32": 4.0, "bf16-split": 4.0, "bf16-sr": 2.0, "bf16": 2.0}
_MOMENT_BYTES = {"fp32": 8.0, "8bit": 2.0 + 2 * 4 / QUANT_BLOCK}
COMPUTE_COPY_BYTES = 2.0  # the bf16 copy an fp32 master needs beside it
GRAD_BYTES = 4.0  # the gradient an update reads: the trainer lands them in fp32 pinned buffers


@dataclass(frozen=True)
class StateFormat:
    """A parsed optimizer state format: `master` in MASTERS, `moments` in MOMENTS."""

    master: str = "fp32"
    moments: str = "fp32"

    @classmethod
    def parse(cls, text: str) -> StateFormat:
        """``"fp32"``, or ``"<master>/<moments>"`` such as ``"bf16-sr/8bit"``; ValueError
        naming the choices otherwise."""
        master, slash, moments = text.partition("/")
        fmt = cls(master, moments if slash else "fp32")
        if fmt.master not in MASTERS or fmt.moments not in MOMENTS:
            raise ValueError(
                f"optimizer state format {text!r}: expected '<master>/<moments>' with master in "
                f"{MASTERS} and moments in {MOMENTS}, e.g. 'bf16-sr/8bit'"
            )
        return fmt

    @property
    def name(self) -> str:
        return "fp32" if self == StateFormat() else f"{self.master}/{self.moments}"

    @property
    def master_is_compute_copy(self) -> bool:
        """True when the master is stored as bf16 weights the device can read as they are."""
        return self.master != "fp32"

    @property
    def compact(self) -> bool:
        """Anything but fp32/fp32: updated through fp32 scratch (optim.py)."""
        return self != StateFormat()

    @property
    def master_bytes(self) -> float:
        """Host bytes per parameter of the master (a bf16-split master's two halves: 4)."""
        return _MASTER_BYTES[self.master]

    @property
    def moment_bytes(self) -> float:
        """Host bytes per parameter of m and v together (8-bit: codes and absmax scales)."""
        return _MOMENT_BYTES[self.moments]

    def update_bytes(self) -> float:
        """Bytes per parameter one update moves through host memory: the master and the
        moments read and written back, the fp32 gradient read (see "Traffic" above)."""
        return 2 * (self.master_bytes + self.moment_bytes) + GRAD_BYTES

    def bytes_per_param(self) -> float:
        """Host bytes per trained parameter: master, m and v, and the bf16 compute copy (an
        fp32 master's separate copy; a bf16 master's own bytes). Gradient buffers are apart
        (optim.grad_buffer_bytes)."""
        copy = 0.0 if self.master_is_compute_copy else COMPUTE_COPY_BYTES
        return _MASTER_BYTES[self.master] + _MOMENT_BYTES[self.moments] + copy


def state_bytes_per_param(state: str) -> float:
    """Host bytes per trained parameter of a state format string (see StateFormat)."""
    return StateFormat.parse(state).bytes_per_param()
