"""Stream a module's blocks from host RAM to the device, each copy hidden under earlier compute.

`stream_module(module, blocks, device)` turns any module whose heavy part is an ordered list of
blocks into one that runs with only a few blocks on the device at a time:

- every streamed block keeps its parameters and buffers in one contiguous host buffer
  (`HostBlockStore`, in host_store.py), page-locked at its exact size when the device is CUDA;
- the device holds a ring of `prefetch` flat slot buffers sized to the largest streamed block;
  before a block runs its tensors are re-pointed (`tensor.data = view`) at the slot holding its
  copy, so every Parameter keeps its identity, stays a leaf and keeps `requires_grad`;
- copies run on a dedicated copy stream, ordered against the compute stream by events only;
- with `gpu_budget_bytes`, as many blocks as fit stay resident (no streaming); parameters and
  buffers outside the blocks are always resident.

The streamer knows only "an ordered list of blocks with tensors", never the model's math: forward
pre-hooks load a block (and prefetch the next ones in the current order), forward hooks release it.
On `device="cpu"` the same logic runs with synchronous memcpy, so all of it is tested without a GPU;
the CUDA protocol of events is tested on a simulated device (`stream_module(ordering=...)`) whose
copies land as late as the recorded waits allow.

Training (backward through streamed blocks). Hooks release a block when its forward returns, and a
released block's tensors point back at the host store, so backward through a graph built by a hooked
forward would read host tensors (an error on CUDA). The fine-tuning loop instead drives blocks
explicitly, recomputing each block in reverse order::

    with torch.no_grad():                       # forward: keep only each block's input
        inputs = []
        for blk in blocks: inputs.append(h); h = blk(h)
    ...                                         # head, loss, grad_h = dloss/dh
    with handle.manual(order="reverse"):        # hooks off; prefetch runs n-1, n-2, ...
        for i in reversed(range(len(blocks))):
            handle.load(i)                      # block i usable on the compute stream
            x = inputs[i].requires_grad_()
            blocks[i](x).backward(grad_h)       # block params are leaves: .grad fills on the device
            grad_h = x.grad
            ...                                 # read / move / clear p.grad of block i here
            handle.release(i)                   # slot may be refilled once this work is done

Caution: do not `.to()` / `.cuda()` a streamed module, and do not write into block tensors except
through `handle.host_tensors(i)` or `handle.load_weights(...)`. One thread drives a handle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...kernels.delta_reference import DeltaBuffer
from ..placement import Placement
from .disk_store import DEFAULT_RING_DEPTH, DiskBlockStore, make_disk_stores
from .fp8_matmul import fp8_linear_forward, fp8_matmul_shape_ok, fp8_matmul_unavailable
from .host_store import (
    BoundTensor,
    HostBlockStore,
    SafetensorsFile,
    TensorEntry,
    collect_tensors,
    fill_views,
    move_into,
    pack,
    repoint,
)
from .ordering import Ordering, make_ordering
from .variants import TensorsDelta, add_delta, flat_delta, pinned
from .weight_formats import EncodedBlockStore, SharedPayload, fp8_quantizable, make_store

__all__ = ["ResidencyPlan", "StreamHandle", "plan_residency", "stream_module"]


# ----------------------------------------------------------------------------------------------
# Residency plan


@dataclasses.dataclass(frozen=True)
class ResidencyPlan:
    """Which blocks stay on the device and how big the streaming ring is."""

    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    num_slots: int
    slot_bytes: int
    resident_block_bytes: int
    device_weight_bytes: int  # non-block + resident blocks + slots: the streamer's device footprint


def _spread(k: int, n: int) -> list[int]:
    """k of range(n), evenly spaced from 0: each streamed block then has resident compute before it
    to hide its copy under."""
    return sorted({j * n // k for j in range(k)}) if k else []


def plan_residency(
    block_bytes: Sequence[int],
    *,
    prefetch: int = 2,
    gpu_budget_bytes: int | None = None,
    non_block_bytes: int = 0,
    activation_reserve_bytes: int = 0,
) -> ResidencyPlan:
    """Choose resident blocks: the most that fit `gpu_budget_bytes` beside the slots, the non-block
    tensors and the activation reserve (`None`: stream every block).

    `block_bytes[i]` is block i's flat size (`layout_nbytes`); resident blocks are charged the same,
    as they live in one flat device buffer each. The ring has min(prefetch, #streamed) slots of the
    largest streamed block. Resident blocks are spread evenly, so copies hide under their compute.
    `prefetch=1` is one slot: each copy waits for the previous block's compute and nothing
    overlaps, the least device memory; 2 or more copy ahead while a block computes.
    """
    n = len(block_bytes)
    if prefetch < 1:
        raise ValueError(f"prefetch={prefetch}: need >= 1 slot")

    def plan(resident: list[int]) -> ResidencyPlan:
        chosen = set(resident)
        streamed = [i for i in range(n) if i not in chosen]
        slots = min(prefetch, len(streamed))
        slot_bytes = max((block_bytes[i] for i in streamed), default=0)
        res_bytes = sum(block_bytes[i] for i in resident)
        total = non_block_bytes + res_bytes + slots * slot_bytes
        return ResidencyPlan(tuple(resident), tuple(streamed), slots, slot_bytes, res_bytes, total)

    if gpu_budget_bytes is None:
        return plan([])
    for k in range(n, -1, -1):
        candidate = plan(_spread(k, n))
        if candidate.device_weight_bytes + activation_reserve_bytes <= gpu_budget_bytes:
            return candidate
    floor = plan([])
    raise ValueError(
        f"gpu_budget_bytes={gpu_budget_bytes} is below the minimum "
        f"{floor.device_weight_bytes + activation_reserve_bytes}: non-block {non_block_bytes} + "
        f"activation reserve {activation_reserve_bytes} + {floor.num_slots} slots x largest block "
        f"{floor.slot_bytes}"
    )


# ----------------------------------------------------------------------------------------------
# The streamer


@dataclasses.dataclass
class _Block:
    """One block as the streamer sees it: its tensors, layout, and where its bytes are."""

    index: int
    name: str  # qualified name inside the streamed module
    module: nn.Module
    tensors: list[BoundTensor]
    entries: tuple[TensorEntry, ...]
    nbytes: int  # flat layout size
    resident: bool = False
    store: HostBlockStore | EncodedBlockStore | DiskBlockStore | None = None  # streamed blocks
    device_flat: torch.Tensor | None = None  # resident blocks: their own flat device buffer
    slot_views: list[tuple[torch.Tensor, ...]] = dataclasses.field(default_factory=list)
    slot: int | None = None  # slot holding (or receiving) a copy of this block
    loaded: bool = False  # tensors point at the device copy and compute may use them
    open_span: _Span | None = None
    missing: set[int] = dataclasses.field(default_factory=set)  # entries never filled (meta)
    # fp8_matmul (fp8_matmul.py): entries whose Linear multiplies by the payload's fp8 operand
    matmul: frozenset[int] = frozenset()
    variant: str | None = None  # resident blocks: the weight variant their device copy holds


@dataclasses.dataclass
class _Slot:
    """One device buffer of the ring and the events that order its reuse."""

    buffer: torch.Tensor  # (slot_bytes,) uint8 on the device
    ready: Any  # recorded on the copy stream after the latest copy into this slot
    free: Any  # recorded on the compute stream after the latest work that read this slot
    block: int | None = None
    last_use: int = 0
    # Coded weight formats: the payload lands here and is decoded into `buffer` at load.
    staging: torch.Tensor | None = None
    undecoded: bool = False  # `buffer` does not yet hold the decoded copy of `block`
    operands: dict = dataclasses.field(default_factory=dict)  # fp8_matmul: views of `staging`
    variant: str | None = None  # the weight variant `buffer` holds (variants.py; None: the base)


@dataclasses.dataclass
class _Variant:
    """One weight variant as the streamer applies it: the deltas of each block it changes, as
    (byte offset, bytes, delta) in the block's flat buffer, and those outside the blocks."""

    blocks: dict[int, list[tuple[int, int, DeltaBuffer]]]
    non_block: TensorsDelta
    on_disk: bool = False  # its deltas are a memory map of their file: no host RAM of its own


@dataclasses.dataclass
class _Span:
    """One timed block copy or block compute (stamps: events on CUDA, seconds on CPU)."""

    kind: str  # "copy" or "compute"
    block: int
    slot: int | None
    forward: int
    start: Any
    end: Any = None
    nbytes: int = 0


def _covered(intervals: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Total length of `intervals` during which at least one `busy` interval is running."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(busy):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    total, j = 0.0, 0
    for a, b in sorted(intervals):  # one sweep: both lists sorted by start
        while j < len(merged) and merged[j][1] <= a:
            j += 1
        k = j
        while k < len(merged) and merged[k][0] < b:
            total += min(b, merged[k][1]) - max(a, merged[k][0])
            k += 1
    return total


class StreamHandle:
    """Control of one streamed module: stats, traces, explicit loads for training, and `remove()`.

    Block indices are positions in the `blocks` passed to `stream_module`.
    """

    def __init__(self, module, blocks, device, plan, pinned, prefetch, timing, non_block, ordering):
        self.ordering: Ordering = ordering  # the copy stream and events this handle orders with
        self.module = module
        self.device = device
        self.plan = plan
        self.prefetch_depth = prefetch
        self.host_pinned = pinned
        self.timing = timing
        self.weights = "raw"  # the host stores' format (weight_formats.py); set by stream_module
        self.host_tier = "ram"  # where streamed blocks' bytes live: "ram" or "disk" (disk_store.py)
        # fp8_matmul.py: "off", "on", or "dequantize: <why the lever fell back>"
        self.fp8_matmul = "off"
        self._fp8_linears: list[nn.Linear] = []  # whose forward stream_module replaced
        self._blocks: list[_Block] = blocks
        self._non_block: list[BoundTensor] = non_block
        self._non_block_missing = {k for k, t in enumerate(non_block) if t.device.type == "meta"}
        self._non_block_bytes = sum(b.tensor.numel() * b.tensor.element_size() for b in non_block)
        self._slots: list[_Slot] = []
        self._hooks: list[Any] = []
        self._hooks_on = True
        self._tick = 0
        self._closed = False
        # Weight variants (variants.py) by name; `variant` is the one the blocks compute with
        # (None: the base).
        self._variants: dict[str, _Variant] = {}
        self.variant: str | None = None
        self._non_block_variant: str | None = None  # the one the tensors outside blocks hold
        # A variant's block deltas coded again as one per block: one decode as a block loads.
        # On the CPU, where a decode has a cost per call (the torch reference's much, the C++
        # decoder's some); on a GPU a kernel per tensor costs little, and coding a model again
        # at registration a lot.
        self.deltas_per_block = device.type == "cpu"
        self.set_order("forward")
        self.reset_stats()

    # -- explicit control ----------------------------------------------------------------------

    def set_order(self, order: str | Sequence[int], cyclic: bool = False) -> None:
        """Set the order in which blocks run next: "forward", "reverse" or a list of block indices.

        After block i is loaded, the next `prefetch - 1` streamed blocks after i in this order are
        copied ahead. With `cyclic`, the order wraps (the end of one forward prefetches the start of
        the next: hides the first copy of every denoising step, at the price of `prefetch - 1`
        extra block copies after the last step, which `h2d_bytes` counts).
        """
        n = len(self._blocks)
        if order == "forward":
            order = list(range(n))
        elif order == "reverse":
            order = list(range(n - 1, -1, -1))
        order = [int(i) for i in order]
        if len(set(order)) != len(order) or any(not 0 <= i < n for i in order):
            raise ValueError(f"order must list distinct block indices in [0, {n}), got {order}")
        self._order, self._cyclic = order, cyclic
        streamed_ahead = max(self.plan.num_slots - 1, 0)
        self._ahead: dict[int, tuple[int, ...]] = {}
        for pos, i in enumerate(order):
            rest = order[pos + 1 :] + (order[:pos] if cyclic else [])
            self._ahead[i] = tuple(j for j in rest if not self._blocks[j].resident)[:streamed_ahead]

    @contextlib.contextmanager
    def ordered(self, order: str | Sequence[int]) -> Iterator[StreamHandle]:
        """Within this context blocks run in `order` (hooks on), then the order before applies:
        e.g. `ordered([0])` around a step cache's look at block 0 alone, so the streamer copies no
        block ahead that the step may not run."""
        saved = (self._order, self._cyclic)
        self.set_order(order)
        try:
            yield self
        finally:
            self.set_order(*saved)

    @contextlib.contextmanager
    def manual(self, order: str | Sequence[int] | None = None) -> Iterator[StreamHandle]:
        """Within this context the hooks do nothing: the caller loads and releases blocks itself
        (e.g. recompute + backward in reverse order). `order`, if given, applies meanwhile."""
        saved = (self._order, self._cyclic, self._hooks_on)
        if order is not None:
            self.set_order(order)
        self._hooks_on = False
        try:
            yield self
        finally:
            self._hooks_on = saved[2]
            self.set_order(saved[0], saved[1])

    def load(self, i: int) -> None:
        """Make block i usable by work queued next on the current (compute) stream.

        Copies block i into a slot unless a slot already holds it, prefetches the next blocks of
        the current order, makes the compute stream wait for block i's copy and points its tensors
        at the slot. No-op for resident blocks (apart from prefetch) and for a loaded block.
        Raises if every slot is held by a loaded block (release one first).
        """
        self._check_open()
        block = self._blocks[i]
        if block.loaded:
            return
        if block.missing:
            raise RuntimeError(f"block {i} ({block.name}) was never filled: call load_weights")
        if not block.resident:
            slot = self._place(i, protect={i, *self._ahead.get(i, ())})
            if slot is None:
                slot = self._place(i, protect={i})
            if slot is None:
                raise RuntimeError(
                    f"cannot load block {i}: all {len(self._slots)} slots hold loaded blocks; "
                    "release one first"
                )
        self._prefetch_ahead(i)
        if not block.resident:
            s = self._slots[slot]
            # The compute stream must not read the slot before block i's bytes have landed; without
            # this wait the block computes with the previous occupant's (or uninitialised) weights.
            self.ordering.compute_wait(s.ready)
            if s.undecoded:
                # On the compute stream, after the wait above (it reads the landed payload) and
                # before the block's kernels (they read what it writes): the next block's copy
                # runs meanwhile. The staging buffer is refilled only after this slot's release.
                start = self.ordering.stamp(False) if self.timing else None
                s.operands = block.store.decode(
                    s.staging, s.buffer[: block.nbytes], matmul=block.matmul
                )
                s.undecoded = False
                if self.timing:
                    end = self.ordering.stamp(False)
                    self._spans.append(_Span("decode", i, slot, self._forwards, start, end))
            s.variant = self._vary(block, s.buffer, s.variant, base=self._base_bytes(block))
            for bound, view in zip(block.tensors, block.slot_views[slot]):
                bound.tensor.data = view
            # fp8_matmul: these weights stay in the payload (their slot bytes are not written);
            # their Linears read the operands while the block is loaded.
            for k, operand in s.operands.items():
                block.tensors[k].tensor.fp8_operand = operand
            self._tick += 1
            s.last_use = self._tick
        else:
            block.variant = self._vary(block, block.device_flat, block.variant)
        block.loaded = True
        if self.timing:
            start = self.ordering.stamp(False)
            block.open_span = _Span("compute", i, block.slot, self._forwards, start)

    def release(self, i: int) -> None:
        """Declare block i done for now: its slot may be refilled once the work queued so far on
        the compute stream (forward, or recompute + backward) has finished. Call it after
        `backward()` returns. Its tensors point back at the host store, so stray use is an error on
        CUDA; its params' `.grad` (device tensors) stay readable."""
        self._check_open()
        block = self._blocks[i]
        if not block.loaded:
            return
        block.loaded = False
        if self.timing and block.open_span is not None:
            block.open_span.end = self.ordering.stamp(False)
            self._spans.append(block.open_span)
            block.open_span = None
        if block.resident:
            return
        # The next copy into this slot waits on this event; without it the copy stream could
        # overwrite weights that kernels queued for this block are still reading.
        self.ordering.record_on_compute(self._slots[block.slot].free)
        for bound, view in zip(block.tensors, block.store.views):
            bound.tensor.data = view
        for k in self._slots[block.slot].operands:
            block.tensors[k].tensor.fp8_operand = None

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start copying these streamed blocks into free slots, in order, as far as slots allow;
        the compute stream does not wait for them (that happens in `load`). E.g. the sampler may
        prefetch block 0 after a step, or training the last block before its backward."""
        self._check_open()
        indices = [int(i) for i in indices if not self._blocks[int(i)].resident]
        for k, i in enumerate(indices):
            if self._place(i, protect=set(indices[: k + 1])) is None:
                break

    def host_tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Host views of streamed block i's tensors, by name inside the block, safe to write into
        (e.g. optimizer updates); the next load of block i copies the new values."""
        self._check_open()
        block = self._blocks[i]
        if block.resident:
            raise ValueError(f"block {i} is resident: update its device parameters in place")
        if block.loaded:
            raise RuntimeError(f"block {i} is loaded: release it before writing its host copy")
        self.ordering.drain_copies()  # a queued DMA may still read this store (see drain_copies)
        self._forget_copy(block)
        return block.store.tensors()

    def load_weights(
        self, source: Mapping[str, torch.Tensor] | str | os.PathLike, strict: bool = True
    ) -> None:
        """Fill the streamed module's tensors from a state-dict-like mapping or a .safetensors path.

        Keys are names as in `module.state_dict()`. Streamed blocks are filled straight into their
        host stores, block by block, one tensor at a time (a lazy mapping or a file is never fully
        materialised); resident tensors are copied to the device. With `strict`, every persistent
        tensor must be present and every key must name a tensor of the module.
        """
        self._check_open()
        if not isinstance(source, Mapping):
            source = SafetensorsFile(source)
        keys = set(source)
        groups = [(t, t.names) for t in self._non_block]
        groups += [(t, self._qualified(b, t.names)) for b in self._blocks for t in b.tensors]
        known = {n for _, names in groups for n in names}
        missing = [names[0] for t, names in groups if t.persistent and not keys.intersection(names)]
        unexpected = [k for k in keys if k not in known]
        if strict and (missing or unexpected):
            raise KeyError(f"load_weights: missing {missing[:8]}, unexpected {unexpected[:8]}")
        loaded = [b.index for b in self._blocks if b.loaded]
        if loaded:
            raise RuntimeError(f"blocks {loaded} are loaded: release them before load_weights")
        if self._variants:  # their deltas are differences from the weights loaded so far
            raise RuntimeError("remove the weight variants before load_weights")
        self.ordering.drain_copies()  # host stores are about to change under queued DMAs
        for b in self._blocks:
            prefix = f"{b.name}." if b.name else ""
            if b.resident:
                views = tuple(e.view(b.device_flat) for e in b.entries)
                filled = fill_views(b.entries, views, source, prefix)
            else:
                filled = b.store.fill(source, prefix)
                self._forget_copy(b)
            b.missing -= filled
        self._size_staging()  # coded payloads may have changed size (copies drained above)
        for k, t in enumerate(self._non_block):
            key = next((n for n in t.names if n in source), None)
            if key is not None:
                src = source[key]
                if src.shape != t.tensor.shape:
                    shape = tuple(t.tensor.shape)
                    raise ValueError(f"{key!r}: checkpoint shape {tuple(src.shape)} != {shape}")
                t.tensor.data.copy_(src)
                self._non_block_missing.discard(k)

    def host_buffers(self) -> list[torch.Tensor]:
        """The streamed blocks' raw host buffers, in block order (flat uint8, packed layout), for
        handing to `stream_module(host_buffers=...)` in another process."""
        self._check_open()
        if self.weights != "raw" or any(b.store is None for b in self._blocks):
            raise ValueError("host buffers are raw stores of streamed blocks: no resident blocks")
        return [b.store.buffer for b in self._blocks]

    def share_blocks(self) -> list[torch.Tensor | SharedPayload]:
        """Every block's host copy moved into shared memory (in place: this handle keeps using
        it), in block order, for `stream_module(host_buffers=...)` in processes this one spawns:
        a raw store's buffer, a resident block's flat buffer (the handle must be on the CPU) or
        a coded store's `SharedPayload`. ValueError on the disk tier (the blocks are in files)."""
        self._check_open()
        if self.host_tier == "disk":
            raise ValueError(
                "the disk tier keeps the blocks in the model's files: nothing to share"
            )
        if any(b.resident for b in self._blocks) and self.device.type != "cpu":
            raise ValueError("resident blocks are shared from a handle on the CPU")
        shared = []
        for b in self._blocks:
            if b.resident:
                shared.append(b.device_flat.share_memory_())  # moved in place: views follow
            elif b.store.encoded:
                shared.append(b.store.share())
            else:
                shared.append(b.store.buffer.share_memory_())
        return shared

    def non_block_tensors(self) -> dict[str, torch.Tensor]:
        """The streamed module's tensors outside its blocks, by every name they go by."""
        return {n: t.tensor for t in self._non_block for n in t.names}

    # -- weight variants (variants.py) ---------------------------------------------------------

    def add_variant(
        self, name: str, deltas: Mapping[str, DeltaBuffer], on_disk: bool = False
    ) -> None:
        """Register weight variant `name`: a coded delta for each tensor it changes, by name as
        in `module.state_dict()`. Its deltas stay in host memory (page-locked for a GPU) and
        are applied to a block as it loads (`select_variant`). `on_disk`: the deltas are a
        memory map of their file and stay so (pageable, read from disk as blocks load)."""
        self._check_open()
        if name in self._variants:
            raise ValueError(f"variant {name!r} is registered already")
        if self.weights == "fp8":
            # A delta is exact over the base's own words, not over their fp8 rounding (and with
            # fp8_matmul the linears would not even read the slot the delta is added to).
            raise ValueError(
                "weight variants need the base's weights raw or lossless, not weights='fp8'"
            )
        where: dict[str, tuple[int | None, int]] = {}
        for k, t in enumerate(self._non_block):
            where.update({n: (None, k) for n in t.names})
        for b in self._blocks:
            for k, e in enumerate(b.entries):
                where.update({n: (b.index, k) for n in self._qualified(b, e.names)})
        unknown = sorted(set(deltas) - set(where))
        if unknown:
            raise KeyError(f"variant {name!r} changes tensors the module lacks: {unknown[:4]}")
        blocks, by_block, outside = {}, {}, {}
        for key, delta in deltas.items():
            i, k = where[key]
            if i is None:
                size = self._non_block[k].tensor.numel() * self._non_block[k].tensor.element_size()
            else:
                size = self._blocks[i].entries[k].nbytes
            if delta.num_words * 2 != size:
                raise ValueError(
                    f"variant {name!r}: {key} has {size} bytes, its delta codes {delta.num_words * 2}"
                )
            if i is None:
                outside[k] = delta
            else:
                by_block.setdefault(i, []).append((self._blocks[i].entries[k], delta))
        for i, parts in by_block.items():
            if self.deltas_per_block and not on_disk:
                nbytes = self._blocks[i].nbytes
                blocks[i] = [(0, nbytes, flat_delta(nbytes, parts))]
            else:
                keep = (lambda d: d) if on_disk else (lambda d: pinned(d, self.device))
                blocks[i] = [(e.offset, e.nbytes, keep(d)) for e, d in parts]
        ks = sorted(outside)
        non_block = TensorsDelta(
            [self._non_block[k].tensor.data for k in ks], [outside[k] for k in ks], on_disk
        )
        self._variants[name] = _Variant(blocks, non_block, on_disk)

    def held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's tensors as held now, by every name they go by, on the host (copied
        from the device, decoded or read from disk as needed): one at a time."""
        self._check_open()
        # `.cpu()` of a device tensor waits for the work queued on it: the caller reads the
        # bytes on the host now (to hash them), and must see those the queued work leaves.
        for t in self._non_block:
            yield from ((n, t.tensor.detach().cpu()) for n in t.names)
        for b in self._blocks:
            # The store's own buffer, or decoded / read from disk into host memory.
            flat = b.device_flat.cpu() if b.resident else b.store.read()
            for e in b.entries:
                view = e.view(flat)
                yield from ((n, view) for n in self._qualified(b, e.names))

    def variant_nbytes(self, name: str) -> int:
        """Host bytes variant `name` holds (its blocks' deltas and the one outside them)."""
        variant = self._variants[name]
        if variant.on_disk:
            return 0
        blocks = sum(d.nbytes for parts in variant.blocks.values() for _, _, d in parts)
        return blocks + variant.non_block.nbytes

    def remove_variant(self, name: str) -> None:
        """Unregister variant `name`; what holds it now gets the base's bytes back."""
        self._check_open()
        if name not in self._variants:
            return
        loaded = [b.index for b in self._blocks if b.loaded]
        if loaded:
            raise RuntimeError(f"blocks {loaded} are loaded: release them before remove_variant")
        if name in (self.variant, self._non_block_variant):
            self.select_variant(None)
        for b in self._blocks:
            if b.resident and b.variant == name:
                b.variant = self._vary(b, b.device_flat, name, None)
            elif b.slot is not None and self._slots[b.slot].variant == name:
                self._forget_copy(b)  # copied again, as the base, when next loaded
        del self._variants[name]

    def select_variant(self, name: str | None, blocks_only: bool = False) -> None:
        """Compute with variant `name` (None: the base) from now on: the tensors outside the
        blocks change now (queued on the compute stream), each block when it loads next. With
        `blocks_only` the tensors outside the blocks stay as they are (a pass that runs only
        blocks, between passes over the same rows' prologue and epilogue)."""
        self._check_open()
        if name is not None and name not in self._variants:
            raise KeyError(f"no variant {name!r} is registered")
        self.variant = name
        if blocks_only or name == self._non_block_variant:
            return
        for old, sign in ((self._non_block_variant, -1), (name, 1)):
            if old is not None:
                self._h2d_bytes += self._variants[old].non_block.apply(sign)
        self._non_block_variant = name

    def _vary(
        self,
        block: _Block,
        flat: torch.Tensor,
        held: str | None,
        target: str | None = ...,
        base: torch.Tensor | None = None,
    ) -> str | None:
        """Turn block `block`'s bytes in `flat` (its slot or resident buffer) from variant `held`
        into `target` (default: the selected one), on the compute stream; returns `target`.
        `base`: the block's base bytes, copied back rather than `held`'s delta taken off (one
        decode less: `_base_bytes`)."""
        target = self.variant if target is ... else target
        if held == target:
            return held
        undone = self._variants.get(held) if held is not None else None
        if base is not None and undone is not None and undone.blocks.get(block.index):
            # Bitwise what subtracting the delta gives (the arithmetic is exact mod 2**16). A copy
            # within host memory: not counted in h2d_bytes, nothing crosses a bus.
            flat[: block.nbytes].copy_(base)
            held = None
        for name, sign in ((held, -1), (target, 1)):
            variant = self._variants.get(name) if name is not None else None
            for offset, nbytes, delta in variant.blocks.get(block.index, ()) if variant else ():
                self._h2d_bytes += add_delta(flat[offset : offset + nbytes], delta, sign)
        return target

    def _base_bytes(self, block: _Block) -> torch.Tensor | None:
        """Block `block`'s base bytes in host memory, when copying them back into its slot costs
        less than taking a variant's delta off: on the CPU, from a raw store in RAM (a memcpy
        against a decode; a mixed batch switches each block's slot between fine-tunes, and on
        the CPU the decodes are most of what that costs). None elsewhere: on a GPU the copy
        would cross the bus again, and a coded or disk store would be read again."""
        store = block.store
        if self.device.type != "cpu" or not isinstance(store, HostBlockStore):
            return None
        return store.payload

    @staticmethod
    def _qualified(block: _Block, names: Sequence[str]) -> list[str]:
        return [f"{block.name}.{n}" if block.name else n for n in names]

    # -- stats and traces ------------------------------------------------------------------------

    @property
    def h2d_bytes(self) -> int:
        """Bytes copied to the device since `reset_stats` (a counter: reading it never syncs)."""
        return self._h2d_bytes

    def reset_stats(self) -> None:
        """Zero the counters and drop timing records (these grow with blocks x forwards)."""
        self._h2d_bytes = 0
        self._copies = 0
        self._forwards = 0
        self._spans: list[_Span] = []
        self._origin = self.ordering.stamp(False) if self.timing else None

    def stats(self) -> dict[str, Any]:
        """The streamer's accounting. Timing figures (when `timing=True`) read CUDA events, which
        waits for the work recorded so far to finish."""
        p = self.plan
        out: dict[str, Any] = {
            "device": str(self.device),
            "host_pinned": self.host_pinned,
            "num_blocks": len(self._blocks),
            "resident_blocks": len(p.resident),
            "streamed_blocks": len(p.streamed),
            "resident_block_indices": list(p.resident),
            "prefetch": self.prefetch_depth,
            "num_slots": p.num_slots,
            "slot_bytes": p.slot_bytes,
            "non_block_bytes": self._non_block_bytes,
            "resident_block_bytes": p.resident_block_bytes,
            "streamed_block_bytes": sum(self._blocks[i].nbytes for i in p.streamed),
            "weights": self.weights,
            "host_tier": self.host_tier,
            # Host RAM the streamed blocks hold: their stores, or on the disk tier the ring.
            "host_store_bytes": self._host_store_bytes(),
            "staging_bytes": sum(s.staging.numel() for s in self._slots if s.staging is not None),
            # Everything is allocated up front, so the peak is the steady-state footprint.
            "peak_device_weight_bytes": self._non_block_bytes
            + p.resident_block_bytes
            + p.num_slots * p.slot_bytes,
            "h2d_bytes": self._h2d_bytes,
            "copies": self._copies,
            "forwards": self._forwards,
        }
        if self.fp8_matmul != "off":
            out["fp8_matmul"] = self.fp8_matmul
            out["fp8_matmul_linears"] = len(self._fp8_linears)
        # Bytes one pass's decodes write into the slots (coded formats; fp8_matmul leaves its
        # weights out), against `h2d_bytes` those copies moved.
        out["slot_decode_bytes_per_pass"] = sum(
            b.nbytes - sum(b.entries[k].nbytes for k in b.matmul)
            for b in (self._blocks[i] for i in p.streamed)
            if b.store is not None and b.store.encoded
        )
        if self.timing:
            out.update(self._timing_stats())
        return out

    def _host_store_bytes(self) -> int:
        stores = [self._blocks[i].store for i in self.plan.streamed]
        if self.host_tier == "disk":
            rings = {id(s.ring): s.ring.ring_nbytes for s in stores}
            return sum(rings.values()) + sum(s.ram_nbytes for s in stores)
        return sum(s.payload_nbytes for s in stores)

    def _intervals(self) -> list[tuple[_Span, float, float]]:
        seconds = self.ordering.seconds
        origin = self._origin
        return [(s, seconds(origin, s.start), seconds(origin, s.end)) for s in self._spans]

    def _timing_stats(self) -> dict[str, Any]:
        n = len(self._blocks)
        copy_s, compute_s = [0.0] * n, [0.0] * n
        copies, busy, copied_bytes, decode_s = [], [], 0, 0.0
        for span, a, b in self._intervals():
            if span.kind == "decode":  # coded weight formats: compute-stream work too
                decode_s += b - a
                busy.append((a, b))
            elif span.kind == "copy":
                copy_s[span.block] += b - a
                copies.append((a, b))
                copied_bytes += span.nbytes
            else:
                compute_s[span.block] += b - a
                busy.append((a, b))
        total_copy = sum(copy_s)
        # Fraction of copy time during which the compute stream was busy (a block's kernels or a
        # coded block's decode): 1.0 means fully hidden.
        hidden = _covered(copies, busy)
        return {
            "copy_s": copy_s,
            "compute_s": compute_s,
            "copy_s_total": total_copy,
            "compute_s_total": sum(compute_s),
            "decode_s_total": decode_s,
            "h2d_gbps": copied_bytes / total_copy / 1e9 if total_copy > 0 else None,
            "copy_hidden_fraction": hidden / total_copy if total_copy > 0 else None,
        }

    def trace_events(self, label: str = "", track: int = 0) -> list[dict[str, Any]]:
        """Chrome trace events: one "X" event per block copy (copy stream) and per block compute
        (compute stream), times in microseconds since `reset_stats`, plus thread-name metadata.
        `label` names the module and `track` offsets the thread ids, so the traces of several
        streamed modules share one file."""
        if not self.timing:
            raise RuntimeError("trace_events needs stream_module(..., timing=True)")
        pid, tids = os.getpid(), {"compute": track + 1, "copy": track + 2}
        prefix = f"{label}: " if label else ""
        events: list[dict[str, Any]] = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "tid": 0,
                "args": {"name": f"megaslide streamer ({self.device})"},
            },
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": tids["compute"],
                "args": {"name": f"{prefix}compute stream"},
            },
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": tids["copy"],
                "args": {"name": f"{prefix}copy stream (host to device)"},
            },
        ]
        for span, a, b in self._intervals():
            args = {"block": span.block, "slot": span.slot, "forward": span.forward}
            if span.kind == "copy":
                args["bytes"] = span.nbytes
            events.append(
                {
                    "name": f"{span.kind} block {span.block}",
                    "cat": span.kind,
                    "ph": "X",
                    "ts": a * 1e6,
                    "dur": (b - a) * 1e6,
                    "pid": pid,
                    "tid": tids["copy" if span.kind == "copy" else "compute"],
                    "args": args,
                }
            )
        return events

    def write_trace(self, path: str | os.PathLike) -> None:
        """Write `{"traceEvents": [...]}`, which Perfetto and chrome://tracing open."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.trace_events(), "displayTimeUnit": "ms"}, f)

    # -- teardown --------------------------------------------------------------------------------

    def remove(self) -> None:
        """Undo streaming: hooks removed, every tensor back on its original device as an ordinary
        tensor with the same values (bitwise) and strides (meta-built tensors come back on CPU)."""
        self._check_open()
        for name in list(self._variants):  # the module goes back to the base's values
            self.remove_variant(name)
        self.ordering.synchronize()  # see _CudaOrdering.synchronize
        for hook in self._hooks:
            hook.remove()
        for linear in self._fp8_linears:
            del linear.forward  # the class's own again
            linear.weight.fp8_operand = None
        home = lambda d: torch.device("cpu") if d.type == "meta" else d  # noqa: E731
        for block in self._blocks:
            if block.store is None:
                views = tuple(e.view(block.device_flat) for e in block.entries)
            else:  # the store's own buffer, or decoded / read from disk into host memory
                flat = block.store.read()
                views = tuple(e.view(flat) for e in block.entries)
            for bound, entry, view in zip(block.tensors, block.entries, views):
                own = torch.empty_strided(
                    entry.shape, entry.stride, dtype=entry.dtype, device=home(bound.device)
                )
                own.copy_(view)
                bound.tensor.data = own
            if block.store is not None:
                block.store.close()
            block.store = block.device_flat = None
            block.slot_views = []
        for bound in self._non_block:
            bound.tensor.data = bound.tensor.data.to(home(bound.device))
        self._slots = []
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this StreamHandle was removed")

    # -- slots -----------------------------------------------------------------------------------

    def _place(self, i: int, protect: set[int]) -> int | None:
        """Slot holding block i, copying it into the least recently used free slot if needed; None
        if every slot is loaded or protected."""
        block = self._blocks[i]
        if block.slot is not None:
            return block.slot

        def evictable(s: _Slot) -> bool:
            return s.block is None or (s.block not in protect and not self._blocks[s.block].loaded)

        candidates = [k for k, s in enumerate(self._slots) if evictable(s)]
        if not candidates:
            return None
        # Empty slots first, then the least recently used one.
        k = min(
            candidates, key=lambda k: (self._slots[k].block is not None, self._slots[k].last_use)
        )
        slot = self._slots[k]
        if slot.block is not None:
            self._blocks[slot.block].slot = None
        store = block.store
        if store.encoded and (slot.staging is None or slot.staging.numel() < store.payload_nbytes):
            raise RuntimeError(f"block {i}'s payload outgrew the staging buffers (a bug)")
        # The copy stream must not overwrite the slot before the compute stream is done with the
        # block that last used it (its release event); without this wait kernels still queued for
        # that block would read the new block's weights (diffusers#12673: garbage output).
        self.ordering.copy_wait(slot.free)
        # The host bytes to send: the store's own, or (disk tier) a ring buffer the reader has
        # filled, which waits here if the reader is behind.
        payload = store.payload
        span = (
            _Span("copy", i, k, self._forwards, self.ordering.stamp(True)) if self.timing else None
        )
        if store.encoded:
            self.ordering.copy(slot.staging[: store.payload_nbytes], payload)
            slot.undecoded = True
        else:
            self.ordering.copy(slot.buffer[: block.nbytes], payload)
            slot.undecoded = False
        slot.variant = None  # the base's bytes: load() puts the selected variant on
        # Recorded after the copy so load() can make compute wait for exactly this copy.
        self.ordering.record_on_copy(slot.ready)
        store.after_copy(self.ordering)  # disk tier: the ring buffer is reused after this copy
        if span is not None:
            span.end, span.nbytes = self.ordering.stamp(True), store.payload_nbytes
            self._spans.append(span)
        slot.block, block.slot = i, k
        self._tick += 1
        slot.last_use = self._tick
        self._h2d_bytes += store.payload_nbytes
        self._copies += 1
        return k

    def _size_staging(self) -> None:
        """Give every slot a staging buffer for the largest coded payload (coded stores know their
        size only once filled, so this runs after every fill). Callers have drained the copy
        stream, so no copy still writes a buffer this replaces; decodes that read one are on the
        compute stream, in whose order the allocator reuses freed memory."""
        largest = max(
            (
                b.store.payload_nbytes
                for b in self._blocks
                if b.store is not None and b.store.encoded
            ),
            default=0,
        )
        for slot in self._slots:
            if largest == 0 or (slot.staging is not None and slot.staging.numel() >= largest):
                continue
            slot.staging = self.ordering.device_buffer(largest)
            # Fresh memory from the compute stream's allocator: the first copy into it waits on
            # `free`, which must therefore also cover compute work queued before the allocation
            # (the memory's previous owner); without it the copy may land under that work.
            self.ordering.record_on_compute(slot.free)

    def _prefetch_ahead(self, i: int) -> None:
        ahead = self._ahead.get(i, ())
        for j in ahead:
            if self._place(j, protect={i, *ahead}) is None:
                break

    def _forget_copy(self, block: _Block) -> None:
        """The host copy changed: a slot's copy of this block is stale."""
        if block.slot is not None:
            self._slots[block.slot].block = None
            block.slot = None

    # -- hooks -----------------------------------------------------------------------------------

    def _install(self) -> None:
        def on_module(_module, _args):
            if self._non_block_missing:
                raise RuntimeError("non-block tensors were never loaded: call load_weights")
            if self._hooks_on:
                self._forwards += 1

        self._hooks.append(self.module.register_forward_pre_hook(on_module))
        for block in self._blocks:
            i = block.index

            def pre(_module, _args, i=i):
                if self._hooks_on:
                    self.load(i)

            def post(_module, _args, _output, i=i):
                if self._hooks_on:
                    self.release(i)

            self._hooks.append(block.module.register_forward_pre_hook(pre))
            # always_call: a forward that raises still releases its block, so its slot is reusable.
            self._hooks.append(block.module.register_forward_hook(post, always_call=True))


def _resolve_pinning(device: torch.device, host_pinned: bool | None) -> bool:
    """Pin host stores iff copies go to a CUDA device (unless told otherwise): page-locked memory is
    what lets the copy engine DMA asynchronously; pageable copies stage through the driver."""
    if host_pinned is None:
        return device.type == "cuda"
    if host_pinned and not torch.cuda.is_available():
        raise ValueError("host_pinned=True needs CUDA (cudaHostRegister)")
    return host_pinned


def stream_module(
    module: nn.Module,
    blocks: Sequence[nn.Module] | nn.ModuleList,
    device: str | torch.device | Placement,
    gpu_budget_bytes: int | None = None,
    prefetch: int = 2,
    timing: bool = False,
    host_pinned: bool | None = None,
    activation_reserve_bytes: int = 0,
    ordering: Ordering | None = None,
    weights: str = "raw",
    host_buffers: Sequence[torch.Tensor | SharedPayload] | None = None,
    host_tier: str = "ram",
    ring_depth: int = DEFAULT_RING_DEPTH,
    disk_io: str = "buffered",
    fp8_matmul: bool = False,
) -> StreamHandle:
    """Stream `blocks` (submodules of `module`, in the order they run) from host RAM to `device`.

    `device` is a device, or a whole `Placement` (placement.py) in place of it and of
    `gpu_budget_bytes`, `prefetch`, `timing`, `weights`, `host_tier`, `disk_io` and `fp8_matmul`
    (with `weights="fp8"`, streamed Linears multiply by the stored fp8 weights: fp8_matmul.py).
    After this call `module(...)` runs as usual. Tensors outside the blocks move to `device`.
    With `gpu_budget_bytes`, the most blocks that fit beside the `prefetch` slots, the non-block
    tensors and `activation_reserve_bytes` stay resident (see `plan_residency`); `None` streams all.
    A block called several times in one forward is correct: each call loads it (a copy only if its
    slot was reused meanwhile). Tensors may be on the meta device: fill them with `load_weights`.
    `ordering` replaces the device's own streams and events (`make_ordering(device)`): tests run
    the streamer on a simulated device this way; the module never knows. `weights` is the host
    store's format (`weight_formats.py`: "raw", "lossless", "fp8"): coded payloads cross the bus
    and are decoded in the slot, on the compute stream, when their block loads. `host_tier="disk"`
    keeps streamed blocks in the model's files instead of host RAM: `load_weights` then records
    where each tensor lies (a `SafetensorsFile` or path), and a reader thread reads the next blocks
    into a ring of `ring_depth` host buffers (disk_store.py; `disk_io`: "buffered" through the page
    cache or "direct", O_DIRECT where the filesystem takes it); raw weights only. `host_buffers`
    (RAM tier) are the blocks' host copies, one per block already holding its weights (shared
    memory another process filled, `StreamHandle.share_blocks`): a flat uint8 buffer for a
    block kept raw or resident, a `SharedPayload` for a block streamed in a coded `weights`
    format. They are used as they are, so several processes stream from one copy; their blocks
    count as filled. The residency plan must keep the blocks the other process kept (the same
    budget and prefetch) where the format makes them differ.
    """
    loose = dict(
        gpu_budget_bytes=gpu_budget_bytes,
        prefetch=prefetch,
        timing=timing,
        weights=weights,
        host_tier=host_tier,
        disk_io=disk_io,
        fp8_matmul=fp8_matmul,
    )
    placement = _stream_placement(device, loose)
    device = _resolve_device(placement.device)
    if activation_reserve_bytes < 0:
        raise ValueError(f"activation_reserve_bytes={activation_reserve_bytes} must be >= 0")
    blocks = list(blocks)
    if host_buffers is not None:
        _check_host_buffers(host_buffers, blocks, placement)
    names = _block_names(module, blocks)
    per_block, non_block = _block_tensors(module, blocks)
    layouts = [pack(ts) for ts in per_block]
    plan = plan_residency(
        [nb for _, nb in layouts],
        prefetch=placement.prefetch,
        gpu_budget_bytes=placement.gpu_budget_bytes,
        non_block_bytes=sum(t.tensor.numel() * t.tensor.element_size() for t in non_block),
        activation_reserve_bytes=activation_reserve_bytes,
    )
    pinned = _resolve_pinning(device, host_pinned)
    if ordering is None:
        ordering = make_ordering(device)
    disk_stores = (
        make_disk_stores(per_block, plan.streamed, pinned, ring_depth, placement.disk_io)
        if placement.host_tier == "disk"
        else None
    )
    records = []
    for i, (b, tensors, (entries, nbytes)) in enumerate(zip(blocks, per_block, layouts)):
        rec = _Block(i, names[id(b)], b, tensors, entries, nbytes, resident=i in plan.resident)
        buffer = host_buffers[i] if host_buffers is not None else None
        _place_block(rec, placement, device, pinned, buffer, disk_stores)
        records.append(rec)
    _move_to(non_block, device)
    handle = StreamHandle(
        module,
        records,
        device,
        plan,
        pinned,
        placement.prefetch,
        placement.timing,
        non_block,
        ordering,
    )
    handle.placement = placement
    handle.weights = placement.weights
    handle.host_tier = placement.host_tier
    if placement.fp8_matmul:
        _use_fp8_matmul(handle, device)
    _open_slots(handle, plan, ordering)
    handle._install()
    return handle


def _resolve_device(name: str) -> torch.device:
    """`name` as a device; plain "cuda" as the current CUDA device (its slots need an index)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _move_to(tensors: list[BoundTensor], device: torch.device) -> None:
    """The tensors outside the blocks, moved to `device` for good (left empty if on meta)."""
    for bound in tensors:
        t = bound.tensor
        repoint(t, torch.empty_like(t, device=device) if t.is_meta else t.detach().to(device))


def _stream_placement(device: str | torch.device | Placement, loose: dict) -> Placement:
    """The placement `stream_module` streams by: the one given, or one of its loose keywords
    (which must then be left at their defaults), checked by the placement's rules."""
    if isinstance(device, Placement):
        changed = sorted(k for k, v in loose.items() if v != _LOOSE_DEFAULTS[k])
        if changed:
            raise TypeError(f"give a placement or its fields, not both: {changed}")
        placement = device
        if not placement.streams:
            raise ValueError("stream_module streams: the placement needs offload='stream'")
    else:
        placement = Placement(device=str(device), offload="stream", **loose)
    placement.validate()
    if placement.host_tier not in ("ram", "disk"):  # "auto" is the loader's to resolve
        raise ValueError(f"host_tier must be ram or disk, got {placement.host_tier!r}")
    if placement.devices is not None or placement.device is None:
        raise ValueError("stream_module streams to one device: name it (placement.on(device))")
    return placement


_LOOSE_DEFAULTS = {
    "gpu_budget_bytes": None,
    "prefetch": 2,
    "timing": False,
    "weights": "raw",
    "host_tier": "ram",
    "disk_io": "buffered",
    "fp8_matmul": False,
}


def _check_host_buffers(
    host_buffers: Sequence[torch.Tensor | SharedPayload],
    blocks: list[nn.Module],
    placement: Placement,
) -> None:
    if len(host_buffers) != len(blocks):
        raise ValueError(f"{len(host_buffers)} host buffers for {len(blocks)} blocks")
    if placement.host_tier != "ram":
        raise ValueError("host_buffers are the blocks' stores in RAM: host_tier='ram'")


def _block_names(module: nn.Module, blocks: list[nn.Module]) -> dict[int, str]:
    """Each submodule's qualified name by id; ValueError unless `blocks` are distinct, non-nested
    submodules of `module`."""
    if not blocks:
        raise ValueError("blocks is empty: nothing to stream")
    names: dict[int, str] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        names.setdefault(id(m), name)
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module) or id(b) not in names:
            raise ValueError(f"blocks[{i}] ({type(b).__name__}) is not a submodule of the module")
        if b is module:
            raise ValueError(f"blocks[{i}] is the module itself: pass its repeated submodules")
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("a block appears twice in blocks: list each block once")
    block_ids = {id(b) for b in blocks}
    for i, b in enumerate(blocks):
        if any(id(m) in block_ids for m in b.modules() if m is not b):
            raise ValueError(f"blocks[{i}] contains another block: blocks must not nest")
    return names


def _block_tensors(
    module: nn.Module, blocks: list[nn.Module]
) -> tuple[list[list[BoundTensor]], list[BoundTensor]]:
    """(each block's tensors, the tensors outside every block); ValueError for a tensor two of
    them share, or a non-persistent buffer not set yet."""
    per_block = [collect_tensors(b) for b in blocks]
    owner: dict[int, int] = {}
    for i, tensors in enumerate(per_block):
        for t in tensors:
            if id(t.tensor) in owner:
                first = owner[id(t.tensor)]
                raise ValueError(f"{t.names[0]!r} is shared by blocks {first} and {i}")
            owner[id(t.tensor)] = i
    # Tensors reachable without entering a block; one also reachable through a block (tied weights,
    # a shared submodule) would be used while its block is not loaded, so it is refused.
    non_block = collect_tensors(module, stop=frozenset(id(b) for b in blocks))
    for t in non_block:
        if id(t.tensor) in owner:
            raise ValueError(
                f"{t.names[0]!r} is shared between block {owner[id(t.tensor)]} and the rest of the "
                "module: untie it or make the sharing module a block"
            )
    for t in non_block + [t for ts in per_block for t in ts]:
        if t.tensor.is_meta and not t.persistent:
            raise ValueError(f"non-persistent buffer {t.names[0]!r} is on meta: set it first")
    return per_block, non_block


def _place_block(
    rec: _Block,
    placement: Placement,
    device: torch.device,
    pinned: bool,
    buffer: torch.Tensor | None,
    disk_stores: dict[int, DiskBlockStore] | None,
) -> None:
    """Give block `rec` its storage: a flat device buffer when resident, else its host store (in
    `placement.weights`' format, on disk with the disk tier, or the shared `buffer` given)."""
    rec.missing = {k for k, t in enumerate(rec.tensors) if t.tensor.is_meta}
    if buffer is not None:  # it holds the block's weights already (shared memory)
        _check_shared_block(rec, placement, buffer)
        rec.missing = set()
        if rec.resident:
            rec.device_flat = buffer.to(device, copy=True)
            for bound, entry in zip(rec.tensors, rec.entries):
                repoint(bound.tensor, entry.view(rec.device_flat))
        elif isinstance(buffer, SharedPayload):
            rec.store = EncodedBlockStore.attach(rec.tensors, buffer, pinned)
        else:
            rec.store = HostBlockStore.attach(rec.tensors, buffer, pinned)
    elif rec.resident:  # one flat device buffer per resident block, exactly as planned
        rec.device_flat = torch.empty(rec.nbytes, dtype=torch.uint8, device=device)
        move_into(rec.tensors, [e.view(rec.device_flat) for e in rec.entries])
    elif disk_stores is not None:  # nothing read yet: load_weights locates the tensors
        rec.store = disk_stores[rec.index]
    else:  # block by block, so the host holds at most one block twice at a time
        rec.store = make_store(rec.tensors, pinned, placement.weights)


def _use_fp8_matmul(handle: StreamHandle, device: torch.device) -> None:
    """fp8_matmul.py: the streamed fp8 blocks' plain Linears multiply by their stored fp8
    weights, or, where `_scaled_mm` cannot run here, the decode dequantizes as without the lever
    and `handle.fp8_matmul` says why."""
    why = fp8_matmul_unavailable(str(device))
    if why is not None:
        handle.fp8_matmul = f"dequantize: {why}"
        return
    handle.fp8_matmul = "on"
    for rec in handle._blocks:
        if rec.resident or not isinstance(rec.store, EncodedBlockStore):
            continue
        entry_of = {id(b.tensor): k for k, b in enumerate(rec.tensors) if len(b.names) == 1}
        chosen = set()
        for linear in rec.module.modules():
            # Subclasses (adapter layers and the like) keep their own forward.
            if type(linear) is not nn.Linear or id(linear.weight) not in entry_of:
                continue
            k = entry_of[id(linear.weight)]
            entry = rec.entries[k]
            if not (fp8_quantizable(entry) and fp8_matmul_shape_ok(entry.shape, device)):
                continue
            chosen.add(k)
            linear.forward = types.MethodType(fp8_linear_forward, linear)
            handle._fp8_linears.append(linear)
        rec.matmul = frozenset(chosen)


def _check_shared_block(
    rec: _Block, placement: Placement, buffer: torch.Tensor | SharedPayload
) -> None:
    """ValueError unless `buffer` is block `rec`'s host copy as this placement keeps it: raw
    bytes for a resident block or the raw format, else a payload in `placement.weights`."""
    coded = isinstance(buffer, SharedPayload)
    want = "raw" if rec.resident else placement.weights
    have = buffer.weights if coded else "raw"
    if have != want:
        kept = "resident" if rec.resident else "streamed"
        raise ValueError(
            f"block {rec.index} ({rec.name}) is shared as {have} weights, and this placement "
            f"keeps it {kept} as {want}: share the weights with the placement the blocks stream "
            "by (the same weights, gpu_budget_bytes and prefetch)"
        )


def _open_slots(handle: StreamHandle, plan: ResidencyPlan, ordering: Ordering) -> None:
    """The ring of device slots the streamed blocks are copied into, and each block's views of
    every slot."""
    for _ in range(plan.num_slots):
        slot = _Slot(
            ordering.device_buffer(plan.slot_bytes), ordering.new_event(), ordering.new_event()
        )
        # The allocator may hand us memory whose previous owner still has kernels queued on the
        # compute stream; the first copy into the slot waits for them through this event.
        ordering.record_on_compute(slot.free)
        handle._slots.append(slot)
    handle._size_staging()  # blocks with real tensors were encoded by make_store
    # Views are built once here, outside any inference_mode a caller may use.
    for rec in handle._blocks:
        if not rec.resident:
            rec.slot_views = [tuple(e.view(s.buffer) for e in rec.entries) for s in handle._slots]
