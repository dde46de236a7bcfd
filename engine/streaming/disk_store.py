"""The disk tier: streamed blocks read from the model's safetensors files, through a bounded ring.

With `host_tier="disk"` a streamed block keeps no copy of its weights in host RAM. Its store
(`DiskBlockStore`) knows where each of its tensors lies in the model's .safetensors files
(`SafetensorsFile.locate`), and one reader thread per streamed module (`DiskRing`) reads the next
blocks, in the blocks' order and cyclically (the end of one denoising step reads ahead the start
of the next), into a ring of `depth` host buffers, each the size of the largest block and
page-locked at that size when copies go to CUDA. The streamer asks a store for its `payload` at
copy time exactly as it does a RAM store's, and tells it when the copy has been queued
(`after_copy`): the ring buffer is refilled only once that copy has finished. Resident host RAM
for block weights is therefore `depth` x the largest block, whatever the model's size.

Reads are `os.preadv` straight into the ring buffer at the tensor's place in the block's flat
layout (one read per tensor, in file order), so the bytes in the slot are the file's: streamed
output is bitwise that of RAM streaming. A tensor whose dtype differs from the model's (a bf16
file opened in fp32) is read into a scratch buffer and cast with the same `copy_` the RAM store's
fill uses. Reads go through the page cache (buffered); a model read twice in a row is served from
it while it fits, and the kernel evicts it when RAM runs short, which is the point of this tier.
Over several devices each rank has its own stores and ring and reads the files itself: buffered,
the ranks reading the same blocks at about the same time share the page cache (one copy for the
host, read from the disk once); direct, each rank reads them from the disk.

Caution: the disk store is read-only (fine-tuning, which writes the host store every step, needs
`host_tier="ram"`), holds the raw format only (not `lossless`/`fp8`), and the files must not
change while the model is open (their extents are read once, when the store is filled).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..placement import DISK_IO
from .host_store import BoundTensor, Extent, TensorEntry, pack, pin_exact, repoint, unpin

DEFAULT_RING_DEPTH = 4  # host buffers per streamed module: the block copied and 3 read ahead
# How blocks are read (placement.DISK_IO): through the page cache ("buffered", the default: a model
# read again soon is served from RAM while it fits) or around it ("direct", O_DIRECT;
# benchmarks/disk_streaming.py measures both on a machine).


class DiskTierError(ValueError):
    """The disk tier cannot serve a tensor: not in a file as stored, a file missing or truncated."""


def _placeholder(entry: TensorEntry) -> torch.Tensor:
    """What a released tensor of a disk block points at: its shape and dtype, no memory (stride
    0), NaN where the dtype has one, so a stray use outside the block's load shows."""
    fill = float("nan") if entry.dtype.is_floating_point else 0
    return torch.full((), fill, dtype=entry.dtype).expand(entry.shape)


def _contiguous(entry: TensorEntry) -> bool:
    expected, ok = 1, True
    for size, stride in zip(reversed(entry.shape), reversed(entry.stride)):
        if size != 1 and stride != expected:
            ok = False
        expected *= size
    return ok


class DiskBlockStore:
    """One streamed block whose weights stay in the model's files; its `payload` is a ring buffer
    the reader thread filled from them."""

    encoded = False  # the payload is the block's flat layout itself

    def __init__(self, entries: Sequence[TensorEntry], nbytes: int, ring: DiskRing):
        self.entries = tuple(entries)
        self.nbytes = nbytes
        self.ring = ring
        self.index = ring.register(self)
        # entry index -> where its bytes are read from (filled by `fill`)
        self.extents: dict[int, Extent] = {}
        # entry index -> its bytes, for the few tensors a block computed for itself (rotary
        # tables, non-persistent buffers): they are in no file and are small.
        self.inline: dict[int, torch.Tensor] = {}
        self.views = tuple(_placeholder(e) for e in self.entries)

    @classmethod
    def adopt(cls, tensors: Sequence[BoundTensor], ring: DiskRing) -> DiskBlockStore:
        """A store for `tensors` (a block's, from `collect_tensors`), pointing them at
        placeholders; tensors already real (not meta) are kept inline until a file has them."""
        store = cls(*pack(tensors), ring)
        for k, (bound, entry) in enumerate(zip(tensors, store.entries)):
            if not bound.tensor.is_meta:
                own = torch.empty(entry.nbytes, dtype=torch.uint8)
                own.view(entry.dtype).as_strided(entry.shape, entry.stride).copy_(
                    bound.tensor.detach()
                )
                store.inline[k] = own
        for bound, view in zip(tensors, store.views):
            repoint(bound.tensor, view)
        return store

    @property
    def payload(self) -> torch.Tensor:
        """The block's flat bytes in a ring buffer (waits for the reader if it is behind). Valid
        until `after_copy` has been called and the copy it reports has finished."""
        return self.ring.acquire(self.index)[: self.nbytes]

    @property
    def payload_nbytes(self) -> int:
        return self.nbytes

    @property
    def ram_nbytes(self) -> int:
        """Host RAM this store holds by itself (the inline tensors; the ring is shared)."""
        return sum(t.numel() for t in self.inline.values())

    def after_copy(self, ordering) -> None:
        """The copy from `payload` has been queued on `ordering`'s copy stream."""
        self.ring.release(self.index, ordering)

    def fill(self, source: Mapping[str, torch.Tensor], prefix: str = "") -> set[int]:
        """Record where each tensor named `prefix + name` lies in `source`'s files (nothing is
        read now). DiskTierError when `source` cannot say (a converted tensor) or the shape is
        not the model's, naming the tensor."""
        locate = getattr(source, "locate", None)
        filled = set()
        for k, entry in enumerate(self.entries):
            key = next((prefix + n for n in entry.names if prefix + n in source), None)
            if key is None:
                continue
            extent = locate(key) if locate is not None else None
            if extent is None:
                raise DiskTierError(
                    f"{key!r}: the disk tier reads tensors as stored in .safetensors files, and "
                    "this one is converted on load (use host_tier='ram')"
                )
            if extent.shape != entry.shape:
                raise DiskTierError(
                    f"{key!r}: checkpoint shape {extent.shape} != {entry.shape} ({extent.path})"
                )
            self.extents[k] = extent
            self.inline.pop(k, None)
            filled.add(k)
        if filled:
            self.ring.forget(self.index)  # a buffer may hold this block's bytes from before
        return filled

    def read_into(self, out: torch.Tensor, direct: bool = False) -> None:
        """Read the block's flat layout into `out` (uint8, at least `nbytes`), in file order.

        `direct`: read with O_DIRECT (no page cache) into an aligned scratch buffer, then copy
        each tensor into place; buffered reads go straight into place."""
        for k, t in self.inline.items():
            entry = self.entries[k]
            out[entry.offset : entry.offset + entry.nbytes].copy_(t)
        extents = sorted(self.extents.items(), key=lambda kv: (kv[1].path, kv[1].offset))
        if direct:
            self._read_direct(extents, out)
            return
        for k, extent in extents:
            entry = self.entries[k]
            if extent.dtype == entry.dtype and _contiguous(entry):
                _pread(extent, out[entry.offset : entry.offset + entry.nbytes])
                continue
            else:
                src = torch.empty(extent.nbytes, dtype=torch.uint8)
                _pread(extent, src)
            if extent.dtype == entry.dtype and _contiguous(entry):
                out[entry.offset : entry.offset + entry.nbytes].copy_(src)
            else:  # another dtype or a strided layout: cast/scatter as the RAM store's fill does
                entry.view(out).copy_(src.view(extent.dtype).view(extent.shape))

    def _place(self, k: int, src: torch.Tensor, out: torch.Tensor) -> None:
        """Entry k's bytes `src` (as stored in the file) into its place in `out`."""
        entry, extent = self.entries[k], self.extents[k]
        if extent.dtype == entry.dtype and _contiguous(entry):
            out[entry.offset : entry.offset + entry.nbytes].copy_(src)
        else:  # another dtype or a strided layout: cast/scatter as the RAM store's fill does
            entry.view(out).copy_(src.view(extent.dtype).view(extent.shape))

    def _read_direct(self, extents: list[tuple[int, Extent]], out: torch.Tensor) -> None:
        """O_DIRECT: a block's tensors lie together in a safetensors file (sorted by name), so
        each run of nearby extents is one large aligned read into a scratch buffer, then each
        tensor is copied to its place."""
        runs: list[list[tuple[int, Extent]]] = []
        for k, e in extents:
            last = runs[-1][-1][1] if runs else None
            if (
                last is not None
                and last.path == e.path
                and e.offset - (last.offset + last.nbytes) <= DIRECT_GAP
            ):
                runs[-1].append((k, e))
            else:
                runs.append([(k, e)])
        spans = [_span_of(run) for run in runs]
        scratch = _aligned_empty(max((_direct_span(x)[1] for x in spans), default=0))
        for run, span in zip(runs, spans):
            data = _pread_direct(span, scratch)
            for k, e in run:
                self._place(k, data[e.offset - span.offset :][: e.nbytes], out)

    def read(self) -> torch.Tensor:
        """The block's flat buffer, read now into fresh host memory (uint8, `(nbytes,)`)."""
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        self.read_into(out)
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        raise ValueError(
            "the block's weights are on disk (host_tier='disk') and cannot be written in place: "
            "fine-tuning needs host_tier='ram'"
        )

    def close(self) -> None:
        self.ring.close()


def _pread(extent: Extent, out: torch.Tensor) -> None:
    """Read `extent`'s bytes into `out` (uint8, contiguous, `extent.nbytes` long)."""
    if extent.nbytes == 0:
        return
    view = memoryview(out.numpy()).cast("B")
    try:
        fd = os.open(extent.path, os.O_RDONLY)
    except FileNotFoundError:
        raise DiskTierError(
            f"{extent.path}: the model file is gone (needed by the disk tier)"
        ) from None
    try:
        done = 0
        while done < extent.nbytes:
            n = os.preadv(fd, [view[done:]], extent.offset + done)  # releases the GIL
            if n == 0:
                raise DiskTierError(
                    f"{extent.path} is truncated: {extent.nbytes - done} bytes missing at offset "
                    f"{extent.offset + done}"
                )
            done += n
    finally:
        os.close(fd)


# O_DIRECT needs file offsets, lengths and buffer addresses aligned to the device's logical block
# size; 4096 covers every current drive (512-byte ones included).
DIRECT_ALIGN = 4096


DIRECT_GAP = 1 << 20  # extents closer than this in a file are read together (the gap is wasted)


def _span_of(run: list[tuple[int, Extent]]) -> Extent:
    """One extent covering a run of extents of one file, sorted by offset."""
    first = run[0][1]
    end = max(e.offset + e.nbytes for _, e in run)
    return Extent(first.path, first.offset, end - first.offset, torch.uint8, (end - first.offset,))


def _direct_span(extent: Extent) -> tuple[int, int]:
    """(aligned start, aligned length) of the file range holding `extent`."""
    start = extent.offset // DIRECT_ALIGN * DIRECT_ALIGN
    end = -(-(extent.offset + extent.nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN
    return start, end - start


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """`(nbytes,)` uint8 host memory starting at a multiple of DIRECT_ALIGN."""
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip : skip + nbytes]


def direct_io_supported(path: str) -> bool:
    """Whether `path`'s filesystem takes O_DIRECT reads (tmpfs and some overlays refuse them)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        buf = _aligned_empty(DIRECT_ALIGN)
        os.preadv(fd, [memoryview(buf.numpy())], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _pread_direct(extent: Extent, scratch: torch.Tensor) -> torch.Tensor:
    """`extent`'s bytes read with O_DIRECT into `scratch` (aligned): a view of them there."""
    start, length = _direct_span(extent)
    view = memoryview(scratch.numpy()).cast("B")
    try:
        fd = os.open(extent.path, os.O_RDONLY | os.O_DIRECT)
    except FileNotFoundError:
        raise DiskTierError(
            f"{extent.path}: the model file is gone (needed by the disk tier)"
        ) from None
    need = extent.offset + extent.nbytes - start
    try:
        done = 0
        while done < need:
            n = os.preadv(fd, [view[done:length]], start + done)
            if n == 0:
                raise DiskTierError(
                    f"{extent.path} is truncated: {need - done} bytes missing at offset "
                    f"{start + done}"
                )
            done += n
    finally:
        os.close(fd)
    skip = extent.offset - start
    return scratch[skip : skip + extent.nbytes]


# ----------------------------------------------------------------------------------------------
# The ring


class _Buffer:
    """One ring buffer and what it holds."""

    def __init__(self, data: torch.Tensor):
        self.data = data  # (slot_bytes,) uint8 host memory
        self.block: int | None = None  # the block it holds or receives
        self.state = "free"  # free | reading | ready | copying | done
        self.error: BaseException | None = None
        self.copied: Any = None  # event marking the end of the copy from it (state "done")
        self.ordering: Any = None


class _RingCore:
    """The ring's state and reader thread (kept apart from `DiskRing` so the thread holds no
    reference to it: when the streamed module goes, the ring's finalizer stops the thread)."""

    def __init__(self, depth: int, nbytes: int, pinned: bool, direct: bool):
        self.direct = direct
        self.lock = threading.Condition()
        self.stores: list[DiskBlockStore] = []
        self.buffers: list[_Buffer] = []
        self.pinned: list[tuple[int, int]] = []
        for _ in range(depth):
            data = torch.empty(nbytes, dtype=torch.uint8)  # plain allocation, see pin_exact
            if pinned:
                pin_exact(data)
                self.pinned.append((data.data_ptr(), nbytes))
            self.buffers.append(_Buffer(data))
        self.start = 0  # the window of blocks to hold: start, start + 1, ... (cyclic)
        self.active = False  # nothing is read before the first block is asked for
        self.stopped = False
        self.thread: threading.Thread | None = None

    # -- the window ----------------------------------------------------------------------------

    def window(self) -> list[int]:
        n = len(self.stores)
        return [(self.start + k) % n for k in range(min(len(self.buffers), n))]

    def _holding(self, i: int) -> _Buffer | None:
        return next((b for b in self.buffers if b.block == i and b.state != "free"), None)

    def _next_read(self) -> tuple[_Buffer, int] | None:
        """A block of the window no buffer holds, and a buffer to read it into."""
        if not self.active:
            return None
        wanted = self.window()
        missing = next((i for i in wanted if self._holding(i) is None), None)
        if missing is None:
            return None
        for b in self.buffers:
            if b.state == "free" or (b.state in ("ready", "done") and b.block not in wanted):
                return b, missing
        return None

    def run(self) -> None:
        while True:
            with self.lock:
                while not self.stopped and (job := self._next_read()) is None:
                    self.lock.wait()
                if self.stopped:
                    return
                buf, i = job
                pending, ordering = (
                    (buf.copied, buf.ordering) if buf.state == "done" else (None,) * 2
                )
                buf.block, buf.state, buf.error, buf.copied = i, "reading", None, None
                store = self.stores[i]
            try:
                if pending is not None:
                    # The copy out of this buffer must have finished before it is overwritten;
                    # without this wait a queued DMA would send the next block's bytes.
                    ordering.host_wait(pending)
                store.read_into(buf.data, self.direct)
            except BaseException as e:  # reported to the thread that asks for this block
                buf.error = e
            with self.lock:
                buf.state = "ready"
                self.lock.notify_all()

    # -- the streamer's side -------------------------------------------------------------------

    def acquire(self, i: int) -> torch.Tensor:
        with self.lock:
            if self.thread is None:
                if self.direct:  # O_DIRECT only where every file's filesystem takes it
                    paths = {e.path for s in self.stores for e in s.extents.values()}
                    self.direct = all(direct_io_supported(p) for p in paths)
                self.thread = threading.Thread(
                    target=self.run, name="disk-tier reader", daemon=True
                )
                self.thread.start()
            self.active = True
            held = self._holding(i)
            if held is None or held.state in ("copying", "done"):
                self.start = i  # off the predicted order (or read again): read i first
                if held is not None and held.state == "done":
                    # Already in a buffer from an earlier copy: no need to read it again.
                    held.state = "ready"
                self.lock.notify_all()
            while (held := self._holding(i)) is None or held.state != "ready":
                self.lock.wait()
            if held.error is not None:
                error, held.error, held.state, held.block = held.error, None, "free", None
                raise error
            held.state = "copying"
            return held.data

    def release(self, i: int, ordering) -> None:
        with self.lock:
            held = next(b for b in self.buffers if b.block == i and b.state == "copying")
            held.copied = ordering.new_event()
            ordering.record_on_copy(held.copied)
            held.ordering, held.state = ordering, "done"
            self.start = (i + 1) % len(self.stores)  # read ahead from the next block on
            self.lock.notify_all()

    def forget(self, i: int) -> None:
        """Drop buffered bytes of block i (its tensors were located anew)."""
        with self.lock:
            while (held := self._holding(i)) is not None and held.state in ("reading", "copying"):
                self.lock.wait()
            if held is not None:
                held.state, held.block = "free", None

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        for ptr, nbytes in self.pinned:
            unpin(ptr, nbytes)
        self.pinned = []


class DiskRing:
    """The bounded ring of host buffers and the reader thread shared by one streamed module's
    disk stores (block i of the module is the i-th store registered)."""

    def __init__(
        self,
        nbytes: int,
        depth: int = DEFAULT_RING_DEPTH,
        pinned: bool = False,
        io: str = "buffered",
    ):
        if depth < 2:
            raise ValueError(f"ring depth {depth}: need >= 2 buffers (one copied, one read)")
        if io not in DISK_IO:
            raise ValueError(f"disk io must be one of {', '.join(DISK_IO)}, got {io!r}")
        self.io = io  # "direct" falls back to buffered per file where O_DIRECT is refused
        self.nbytes = nbytes  # per buffer: the largest block
        self.depth = depth
        self._core = _RingCore(depth, nbytes, pinned, io == "direct")
        self._finalizer = weakref.finalize(self, self._core.stop)
        self._finalizer.atexit = False

    @property
    def ring_nbytes(self) -> int:
        """Host bytes the ring holds: the bound on resident block weights."""
        return self.depth * self.nbytes

    def register(self, store: DiskBlockStore) -> int:
        self._core.stores.append(store)
        return len(self._core.stores) - 1

    def acquire(self, i: int) -> torch.Tensor:
        return self._core.acquire(i)

    def release(self, i: int, ordering) -> None:
        self._core.release(i, ordering)

    def forget(self, i: int) -> None:
        self._core.forget(i)

    def close(self) -> None:
        """Stop the reader and unpin the buffers (idempotent)."""
        self._finalizer()


def make_disk_stores(
    per_block: Sequence[Sequence[BoundTensor]],
    streamed: Sequence[int],
    pinned: bool,
    depth: int = DEFAULT_RING_DEPTH,
    io: str = "buffered",
) -> dict[int, DiskBlockStore]:
    """Disk stores for the streamed blocks `streamed` (indices into `per_block`), sharing one ring
    sized to the largest of them."""
    largest = max((pack(per_block[i])[1] for i in streamed), default=0)
    ring = DiskRing(largest, min(depth, max(len(streamed), 2)), pinned, io)
    return {i: DiskBlockStore.adopt(per_block[i], ring) for i in streamed}
