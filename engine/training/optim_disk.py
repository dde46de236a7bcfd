"""The optimizer's disk tier: each block's optimizer state in a file, through a bounded ring.

With ``state_tier="disk"`` (`OptimizerSpec.state_tier`) the per-tensor state that only the
optimizer reads (m and v, or 8-bit codes and their absmax; a bf16-split master's low halves)
keeps no copy in host RAM between steps. Each block's state is a few files, one per store
(``block-<k>.m``, ``.v``; ``.codes``, ``.absmax``; ``.lo``), each its tensors at 64-byte aligned
offsets; in RAM a block's stores lie one after another (`StateLayout`). One file per store keeps
each file of one dtype, so a mapped file serializes as the RAM tier's tensors do. One I/O
thread (`StateRing`) reads the blocks into a ring of `depth` host buffers, each the size of the
largest block's state, ahead of their update and in the order the trainer steps them (cyclically:
the end of one optimizer step reads ahead the start of the next), and writes each one back once
its update is done (write-behind), before its buffer is reused. The masters stay in RAM: they
are the host store the device streams from. Host RAM for the state is therefore `depth` x the
largest block's state, whatever the model's size (`ring_nbytes`).

The optimizer's update runs on the ring buffer exactly as it runs on RAM state (the same views,
the same kernels), so results are bitwise the RAM tier's. A block asked for out of the expected
order is read on demand (slower, never wrong): the newest bytes of a block are either in a ring
buffer (which is written back before it is reused) or in its file, never both stale.

The files are working state, not a checkpoint: they start at zeros (every format's initial
state) when the optimizer is built, and a checkpoint holds a copy (`CPUAdamW.state_dict` returns
views of the files, mapped, after the ring has written everything back; the checkpoint writer
serializes them atomically as it does RAM state). A process killed mid-step leaves the files
half-written and that is harmless: a resume loads its checkpoint's state into them.

The thread does only `os.preadv`/`os.pwritev` (which release the GIL) and bookkeeping under a
lock; it never runs torch ops. Reads and writes go through the page cache: the kernel writes the
files back when it likes, and evicts their pages when RAM runs short, which is the point.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 64  # byte alignment of every tensor in a block's layout (any dtype's view is aligned)
DEFAULT_STATE_RING_DEPTH = 3  # the block being updated, the next one read, one being written


@dataclass(frozen=True)
class StateEntry:
    key: str  # the optimizer's store: "m", "v", "codes", "absmax", "lo"
    name: str  # the parameter's name in its block
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into the block's layout
    nbytes: int


class StateLayout:
    """Where each of a block's state tensors lies in its flat bytes (and its file)."""

    def __init__(self, shapes: Mapping[str, Mapping[str, tuple[tuple[int, ...], torch.dtype]]]):
        entries, offset = [], 0
        self.stores: dict[str, tuple[int, int]] = {}  # store -> (offset in the block, nbytes)
        for key, named in shapes.items():
            start = offset
            for name, (shape, dtype) in named.items():
                nbytes = _numel(shape) * dtype.itemsize
                entries.append(StateEntry(key, name, dtype, tuple(shape), offset, nbytes))
                offset += -(-nbytes // ALIGN) * ALIGN
            self.stores[key] = (start, offset - start)
        self.entries = tuple(entries)
        self.nbytes = offset

    def views(self, flat: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """The state tensors as views of `flat` (uint8, at least `nbytes`), by store and name."""
        return self.store_views({key: flat[a : a + n] for key, (a, n) in self.stores.items()})

    def store_views(self, flats: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The state tensors as views of one flat uint8 tensor per store (its file's bytes)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for e in self.entries:
            at = e.offset - self.stores[e.key][0]
            out.setdefault(e.key, {})[e.name] = (
                flats[e.key][at : at + e.nbytes].view(e.dtype).view(e.shape)
            )
        return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Slot:
    """One ring buffer and what it holds. States: "free"; "reading" (the thread fills it);
    "ready" (holds `block`'s newest bytes, also in its file); "busy" (being updated);
    "dirty" (updated, not yet written back); "writing"."""

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.block: Hashable | None = None
        self.state = "free"


class StateRing:
    """Blocks' optimizer state in files under `directory`, read ahead into `depth` RAM buffers
    in `order` and written back behind; `acquire` / `release` around each block's update."""

    def __init__(
        self,
        directory: str | os.PathLike,
        layouts: Mapping[Hashable, StateLayout],
        order: Sequence[Hashable],
        depth: int = DEFAULT_STATE_RING_DEPTH,
    ):
        if depth < 2:
            raise ValueError(
                f"the state ring needs depth >= 2 (read ahead while updating), {depth}"
            )
        if sorted(map(str, order)) != sorted(map(str, layouts)) or len(set(order)) != len(order):
            raise ValueError("the ring's order must name every block once")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.layouts = dict(layouts)
        self.paths = {
            bid: {key: self.directory / f"block-{k}.{key}" for key in lay.stores}
            for k, (bid, lay) in enumerate(self.layouts.items())
        }
        for bid, paths in self.paths.items():
            for key, path in paths.items():
                # Fresh zeros (sparse): every format's initial state; a resume loads its checkpoint.
                with open(path, "wb") as f:
                    f.truncate(self.layouts[bid].stores[key][1])
        self.order = list(order)
        self._position = {bid: i for i, bid in enumerate(self.order)}
        self.depth = min(depth, len(self.order)) if self.order else 1
        largest = max((lay.nbytes for lay in self.layouts.values()), default=0)
        self._slots = [_Slot(largest) for _ in range(self.depth)]
        self._fds = {
            (bid, key): os.open(path, os.O_RDWR)
            for bid, paths in self.paths.items()
            for key, path in paths.items()
        }
        self._cursor = 0  # position in `order` of the next block wanted
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self.bytes_read = 0
        self.bytes_written = 0
        self._thread = threading.Thread(target=self._run, name="optim-state-io", daemon=True)
        self._thread.start()

    @property
    def ring_nbytes(self) -> int:
        """Host RAM the ring holds: `depth` buffers of the largest block's state."""
        return sum(s.buffer.numel() for s in self._slots)

    @property
    def file_nbytes(self) -> int:
        return sum(lay.nbytes for lay in self.layouts.values())

    def acquire(self, block_id: Hashable) -> dict[str, dict[str, torch.Tensor]]:
        """The block's state as views of a ring buffer, once read (waits if the reader is
        behind; reads it now if it was not expected). Valid until `release`."""
        with self._cond:
            self._cursor = self._position[block_id]
            self._cond.notify_all()
            while True:
                self._raise_error()
                slot = self._holding(block_id)
                if slot is not None and slot.state == "busy":
                    raise RuntimeError(f"block {block_id!r}: its state is already acquired")
                if slot is not None and slot.state == "ready":
                    slot.state = "busy"
                    return self.layouts[block_id].views(slot.buffer)
                self._cond.wait()

    def release(self, block_id: Hashable) -> None:
        """The block's update is done: write its buffer back (behind, on the I/O thread) and
        read ahead past it."""
        with self._cond:
            slot = self._holding(block_id)
            if slot is None or slot.state != "busy":
                raise RuntimeError(f"block {block_id!r}: its state was not acquired")
            slot.state = "dirty"
            self._cursor = (self._position[block_id] + 1) % len(self.order)
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every updated buffer is in its file."""
        with self._cond:
            while True:
                self._raise_error()
                if not any(s.state in ("busy", "dirty", "writing", "reading") for s in self._slots):
                    return
                self._cond.wait()

    def invalidate(self) -> None:
        """Forget the buffers' contents (after the files were written directly)."""
        with self._cond:
            self.flush()
            for s in self._slots:
                s.state, s.block = "free", None
            self._cond.notify_all()

    def mapped(self, block_id: Hashable) -> dict[str, dict[str, torch.Tensor]]:
        """The block's state as views of its file, mapped shared (writes go to the file). Call
        `flush` first to read the newest bytes, `invalidate` after writing."""
        layout = self.layouts[block_id]
        flats = {}
        for key, (_, nbytes) in layout.stores.items():
            path = str(self.paths[block_id][key])
            flats[key] = (
                torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
        return layout.store_views(flats)

    def close(self) -> None:
        """Write everything back and stop the thread."""
        with self._cond:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                self._cond.notify_all()
        self._thread.join()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    # -- the I/O thread ---------------------------------------------------------------------------

    def _holding(self, block_id: Hashable) -> _Slot | None:
        return next((s for s in self._slots if s.block == block_id and s.state != "free"), None)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the optimizer state's I/O thread failed") from self._error

    def _next_job(self) -> tuple[str, _Slot, Hashable] | None:
        """Under the lock: write back an updated buffer first (it frees a buffer), else read the
        first of the next `depth` blocks in order that no buffer holds, into a buffer holding
        none of them."""
        for s in self._slots:
            if s.state == "dirty":
                return "write", s, s.block
        n = len(self.order)
        wanted = [self.order[(self._cursor + i) % n] for i in range(self.depth)]
        for bid in wanted:
            if self._holding(bid) is not None:
                continue
            free = [s for s in self._slots if s.state == "free"]
            stale = [s for s in self._slots if s.state == "ready" and s.block not in wanted]
            victims = free or stale
            if not victims:
                return None
            return "read", victims[0], bid
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    job = self._next_job()
                    if job is not None:
                        break
                    self._cond.wait()
                kind, slot, bid = job
                if kind == "read":
                    slot.block = bid
                slot.state = "reading" if kind == "read" else "writing"
            layout = self.layouts[bid]
            nbytes = layout.nbytes
            call = os.preadv if kind == "read" else os.pwritev
            try:
                view = memoryview(slot.buffer.numpy()).cast("B")
                for key, (a, n) in layout.stores.items():
                    _transfer(call, self._fds[bid, key], view[a : a + n], self.paths[bid][key])
            except BaseException as e:  # surfaces in the optimizer's next call
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                if kind == "read":
                    self.bytes_read += nbytes
                else:
                    self.bytes_written += nbytes
                slot.state = "ready"
                self._cond.notify_all()


def _transfer(call, fd: int, view: memoryview, path: Path) -> None:
    """All of `view` from/to offset 0 of the file (`os.preadv` or `os.pwritev`; both release
    the GIL)."""
    done = 0
    while done < len(view):
        n = call(fd, [view[done:]], done)
        if n == 0:
            raise OSError(f"{path}: short transfer at offset {done} of {len(view)}")
        done += n
