"""Weight variants: coded deltas added to a module's tensors in place on the device, and taken
off again.

A variant is a set of lossless deltas (`kernels/delta_reference.py`), one per tensor it changes,
keyed by the tensor's name in the module: the 16-bit words of the variant's tensor minus the
base's, mod 2**16. Adding a delta to the base's words gives the variant's, bitwise, and
subtracting it gives the base's back, bitwise, so one copy of a module serves every variant of
it: selecting one takes the previous one off and puts the new one on. Fine-tunes kept as deltas
over their base (`engine/deltas.py`) are served this way.

Two owners apply variants: `StreamHandle` (streamer.py), to each streamed block when it is
loaded into a slot and to the tensors it keeps resident, and `ResidentVariants` here, to a module
whose tensors all live on its device. Both take `add_variant`, `remove_variant` and
`select_variant`; `variant` is the one selected (None: the base).

Caution: a tensor is changed in place. Nothing may read it while a selection runs (the device
work is queued on the current stream, in order with the module's own kernels), and its bytes
must be contiguous with an even size (every floating dtype is).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ...kernels.delta import delta_apply
from ...kernels.delta_reference import PARTS, DeltaBuffer, delta_encode
from .host_store import TensorEntry, collect_tensors


class DeltaError(ValueError):
    """A delta that does not belong to the model it is given to, or cannot be read."""


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (copied to the host first when it is on a device: that
    `.cpu()` waits for the work queued on it, whose result is what is hashed)."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy()).hexdigest()


def words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as 16-bit words `(numel * itemsize / 2,)`: a view, written through."""
    if not t.is_contiguous():
        raise ValueError("a variant changes contiguous tensors only")
    return t.detach().reshape(-1).view(torch.uint8).view(torch.int16)


def add_delta(target: torch.Tensor, delta: DeltaBuffer, sign: int) -> int:
    """Add (`sign` 1) or subtract (-1) `delta` to the words of `target`, in place, on its
    device; returns the bytes of the delta sent to the device (0 when it is on the CPU)."""
    flat = words(target)
    if flat.numel() != delta.num_words:
        raise ValueError(f"a delta of {delta.num_words} words for a tensor of {flat.numel()}")
    if flat.device.type == "cpu":
        delta_apply(delta, flat, sign)
        return 0
    # From pinned host memory, queued on the current stream like the kernel that reads it.
    delta_apply(delta.to(flat.device, non_blocking=True), flat, sign)
    return delta.nbytes


def pinned(delta: DeltaBuffer, device: torch.device) -> DeltaBuffer:
    """`delta` in page-locked host memory when `device` is a GPU (its copies are then
    asynchronous), else as it is."""
    if device.type != "cuda":
        return delta
    return dataclasses.replace(delta, **{n: t.pin_memory() for n, t in zip(PARTS, delta.parts())})


def flat_delta(nbytes: int, parts: Sequence[tuple[TensorEntry, DeltaBuffer]]) -> DeltaBuffer:
    """One delta over a block's whole flat buffer of `nbytes` from its tensors' deltas (each
    with the entry saying where the tensor lies): applied with one decode as the block loads,
    rather than one per tensor. Decodes and codes again: a registration's cost, once."""
    words = torch.zeros(nbytes // 2, dtype=torch.int16)
    for entry, delta in parts:
        delta_apply(delta, words[entry.offset // 2 : (entry.offset + entry.nbytes) // 2], 1)
    return delta_encode(torch.zeros_like(words), words)


class TensorsDelta:
    """One variant's deltas over several separate tensors, coded again as one: a switch decodes
    it once into a scratch buffer on the tensors' device and adds each tensor's part to its
    words (rather than one decode per tensor, most of them small). With `on_disk` the deltas
    stay as given (a memory map of their file: nothing in RAM), one decode each."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], deltas: Sequence[DeltaBuffer], on_disk=False
    ):
        self.tensors = list(tensors)
        self.sizes = [d.num_words for d in deltas]
        for t, size in zip(self.tensors, self.sizes):
            if words(t).numel() != size:
                raise ValueError(f"a delta of {size} words for a tensor of {words(t).numel()}")
        self.separate = list(deltas) if on_disk else None
        if on_disk:
            self.delta = None
            return
        joined = torch.zeros(sum(self.sizes), dtype=torch.int16)
        for part, delta in zip(joined.split(self.sizes), deltas):
            delta_apply(delta, part, 1)
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self.delta = pinned(delta_encode(torch.zeros_like(joined), joined), device)

    def apply(self, sign: int) -> int:
        """Add (`sign` 1) or subtract (-1) the deltas; returns the bytes sent to the device."""
        if not self.tensors:
            return 0
        if self.separate is not None:
            return sum(add_delta(t, d, sign) for t, d in zip(self.tensors, self.separate))
        scratch = torch.zeros(
            self.delta.num_words, dtype=torch.int16, device=self.tensors[0].device
        )
        sent = add_delta(scratch, self.delta, 1)
        for t, part in zip(self.tensors, scratch.split(self.sizes)):
            # int16 arithmetic wraps mod 2**16, as the delta's words do.
            words(t).add_(part) if sign > 0 else words(t).sub_(part)
        return sent

    @property
    def nbytes(self) -> int:
        """Bytes it holds in RAM (none on disk)."""
        return 0 if self.delta is None else self.delta.nbytes


class ResidentVariants:
    """The variants of a module whose tensors all live on its device (a model not streamed)."""

    def __init__(self, module: nn.Module):
        self._tensors = {n: b.tensor for b in collect_tensors(module) for n in b.names}
        self._variants: dict[str, TensorsDelta] = {}
        self.variant: str | None = None
        self.h2d_bytes = 0  # bytes of deltas sent to the device

    def add_variant(
        self, name: str, deltas: Mapping[str, DeltaBuffer], on_disk: bool = False
    ) -> None:
        """Register variant `name`: a delta for each tensor it changes, by name (`on_disk`:
        kept as given, a memory map of its file)."""
        unknown = sorted(set(deltas) - set(self._tensors))
        if unknown:
            raise KeyError(f"variant {name!r} changes tensors the module lacks: {unknown[:4]}")
        if name in self._variants:
            raise ValueError(f"variant {name!r} is registered already")
        keys = sorted(deltas)
        self._variants[name] = TensorsDelta(
            [self._tensors[k].data for k in keys], [deltas[k] for k in keys], on_disk
        )

    def variant_nbytes(self, name: str) -> int:
        """Host bytes variant `name` holds."""
        return self._variants[name].nbytes

    def remove_variant(self, name: str) -> None:
        if self.variant == name:
            self.select_variant(None)
        self._variants.pop(name, None)

    def select_variant(self, name: str | None, blocks_only: bool = False) -> None:
        """Make the module's tensors those of variant `name` (None: the base's); it has no
        blocks of its own, so `blocks_only` is a no-op."""
        if blocks_only or name == self.variant:
            return
        if name is not None and name not in self._variants:
            raise KeyError(f"no variant {name!r} is registered")
        for old, sign in ((self.variant, -1), (name, 1)):
            if old is not None:
                self.h2d_bytes += self._variants[old].apply(sign)
        self.variant = name
