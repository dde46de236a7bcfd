"""A simulated device for the streaming protocol: streams as queues, events as vector clocks, and a
race detector that checks every interleaving the recorded waits allow.

`SimulatedDevice().ordering()` implements `megaslide.engine.streaming.ordering.Ordering` on CPU tensors, so
the real streamer and the training step's gradient drain run on it unchanged
(`stream_module(..., ordering=...)`, `open_pipeline(..., ordering=...)`). Two things are
simulated, separately, and both are kept small enough to be checked by eye:

Ordering (the oracle). Actors are the compute stream, each copy stream and each host thread, and
every actor keeps a vector clock. Work on one actor happens in issue order. A stream operation
happens after everything its host thread did before issuing it. Recording an event stores the
stream's clock in it; a stream that waits on it, or a host thread that waits on it, joins that
clock. A wait on an event never recorded orders nothing (on CUDA it returns at once), so it
is reported as a race: the engine creates events only to record them before any wait, and a wait
that finds one unrecorded means a record went missing. `drain_copies` joins the copy
stream into the host, `synchronize` every stream. A task submitted to a worker thread happens
after the submit, and `result()` joins the task back (`executor`). Nothing else orders anything:
a copy may land arbitrarily late unless something waited on it, a kernel may run arbitrarily late
unless something synchronised with it.

Each buffer (device slot, host store, pinned gradient buffer, device gradient), keyed by its
storage, keeps its last write and the latest read of each actor. Two accesses of which one writes
and neither happens before the other can run in either order, or overlap, in some schedule the
waits allow: that is a race, reported with the buffer, the block, the operation number and the
`context` (say, the denoising step). Checking happens-before this way covers every interleaving of
the issued program at once (the vector-clock race detectors FastTrack and ThreadSanitizer work
so). Slots also carry a version and the block whose bytes they hold: a compute of block i must
find block i there, unchanged from its load to its release. Frees are seen through the storage's
finalizer: freeing device memory orders its reuse after the compute stream (the caching
allocator's rule) and after the copy streams `keep_alive` named; host memory is freed by the
host thread that drops it.

Data (the witness). Copies move bytes for real, at moments the scheduler picks at random
(`reseed`): a queued copy lands when a wait needs it (a compute or a host thread waiting on its
event: compute runs eagerly, when Python calls it, so it reads the slot at issue) or earlier,
at random. A missing wait therefore lets a compute read a slot whose copy has not landed (device
buffers start as NaN bytes), and outputs differ from the resident run in most seeds. Copies hold
only weak references: a copy whose source was freed first lands NaNs.

What the engine does to memory outside the ordering calls is declared by the harness below
(`watch_handle`, `watch_training`): which slot a block computes with between `load` and
`release`, which host buffers the optimizer reads and writes, which gradients the backward wrote.

Deleting a call site: `deleted` holds `(method, caller qualname)` pairs, e.g.
`("copy_wait", "StreamHandle._place")`; such a call does nothing (a test of the engine's waits
deletes each in turn). `calls` counts every call site seen.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

COMPUTE = "compute"
Clock = dict[str, int]  # actor -> how many of its operations happen before (a vector clock)


def _join(into: Clock, other: Clock) -> None:
    for actor, tick in other.items():
        if tick > into.get(actor, 0):
            into[actor] = tick


@dataclasses.dataclass
class Access:
    """One read or write of a buffer: by `actor` at its tick `tick` (the epoch), described."""

    actor: str
    tick: int
    what: str
    where: str  # "op #N, <context>"

    def before(self, clock: Clock) -> bool:
        """Does this access happen before whatever holds `clock`?"""
        return clock.get(self.actor, 0) >= self.tick


@dataclasses.dataclass
class Buffer:
    """What the detector knows of one allocation (one storage)."""

    name: str
    device: bool  # device memory: freed in the compute stream's order
    slot: bool = False  # one of the streamer's slots
    write: Access | None = None
    reads: dict[str, Access] = dataclasses.field(default_factory=dict)  # latest read per actor
    version: int = 0
    block: int | None = None  # host store: its block; slot: the block whose copy it holds
    guards: set[str] = dataclasses.field(default_factory=set)  # copy streams of keep_alive


@dataclasses.dataclass
class Event:
    clock: Clock | None = None  # None: never recorded


@dataclasses.dataclass
class _Ref:
    """A tensor by weak reference to its storage, rebuilt on demand (None once freed)."""

    storage: weakref.ref
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> _Ref:
        return cls(
            weakref.ref(t.untyped_storage()), t.dtype, t.storage_offset(), t.shape, t.stride()
        )

    def get(self) -> torch.Tensor | None:
        storage = self.storage()
        if storage is None:
            return None
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclasses.dataclass
class _Queued:
    """A copy (or a keep-alive hold) on a copy stream's queue, not yet landed."""

    tick: int  # the stream's own clock component at issue
    clock: Clock  # what it must wait for
    dst: _Ref | None = None
    src: _Ref | None = None
    hold: Any = None  # keep_alive: the storage, kept until the queue gets here


class SimulatedDevice:
    """Streams, events and a happens-before race detector over CPU tensors; see the module doc."""

    def __init__(self, seed: int = 0):
        self._lock = threading.RLock()
        self.clocks: dict[str, Clock] = {COMPUTE: {}}
        self.queues: dict[str, collections.deque[_Queued]] = {}
        self.buffers: dict[int, Buffer] = {}  # by storage data_ptr
        self.races: list[str] = []
        self.deleted: set[tuple[str, str]] = set()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.context = ""
        self.ops = 0
        self.landed: collections.Counter[str] = collections.Counter()  # copies by why they landed
        self._freed: list[tuple[Buffer, Clock, str]] = []
        self._using: dict[tuple[int, int], int] = {}  # (slot, block) -> slot version at load
        self._copy_streams = 0
        self.reseed(seed)

    # -- scheduling ------------------------------------------------------------------------------

    def reseed(self, seed: int) -> None:
        """A new random landing schedule: every fourth seed lands copies only when a wait needs
        them (as late as allowed); the others land each queued copy early with a random chance."""
        self.rng = random.Random(seed)
        self.eagerness = 0.0 if seed % 4 == 0 else self.rng.random()

    def finish(self) -> None:
        """Land every queued copy (no actor learns of it: it orders nothing)."""
        with self._lock:
            for stream, queue in self.queues.items():
                while queue:
                    self._land(stream, "at the end")
            self._process_frees()

    def check(self) -> None:
        """Fail with the races found so far."""
        if self.races:
            shown = "\n  ".join(self.races[:5])
            raise AssertionError(f"{len(self.races)} race(s), first ones:\n  {shown}")

    def _enter(self) -> None:
        """Every entry point: settle frees, then let queued copies land at random."""
        self._process_frees()
        streams = list(self.queues)
        self.rng.shuffle(streams)
        for stream in streams:
            queue = self.queues[stream]
            while queue and self.rng.random() < self.eagerness:
                self._land(stream, "early")

    def _land(self, stream: str, why: str) -> None:
        """Land the head of a copy stream's queue, after what it waits for on other streams."""
        op = self.queues[stream][0]
        self._land_through({s: t for s, t in op.clock.items() if s != stream})
        self.queues[stream].popleft()
        if op.dst is not None:
            self.landed[why] += 1
            dst, src = op.dst.get(), op.src.get()
            if dst is not None:
                if src is None:  # read memory that was freed (and may be in use again)
                    dst.view(torch.uint8).fill_(0xFF)
                else:
                    dst.copy_(src)

    def _land_through(self, clock: Clock) -> None:
        """Land every queued copy that happens before `clock`."""
        for stream, queue in self.queues.items():
            while queue and queue[0].tick <= clock.get(stream, 0):
                self._land(stream, "waited for")

    # -- clocks and accesses ---------------------------------------------------------------------

    def _host(self) -> str:
        actor = f"host {threading.current_thread().name}"
        self.clocks.setdefault(actor, {})
        return actor

    def _tick(self, actor: str) -> Clock:
        clock = self.clocks[actor]
        clock[actor] = clock.get(actor, 0) + 1
        return clock

    def _issue(self, stream: str) -> Clock:
        """A stream operation issued by the calling host thread: it happens after that thread's
        past, and is the stream's next operation."""
        _join(self.clocks[stream], self.clocks[self._host()])
        return self._tick(stream)

    def _access(self, actor: str, what: str) -> Access:
        self.ops += 1
        where = f"op #{self.ops}" + (f", {self.context}" if self.context else "")
        return Access(actor, self.clocks[actor][actor], what, where)

    def _race(self, message: str) -> None:
        self.races.append(message)

    def _buffer(self, t: torch.Tensor, name: str | None = None, device: bool = False) -> Buffer:
        storage = t.untyped_storage()
        if not storage.nbytes():  # nothing to race on (and no address of its own)
            return Buffer(name or "an empty tensor", device)
        key = storage.data_ptr()
        buffer = self.buffers.get(key)
        if buffer is None:
            shape = "x".join(map(str, t.shape)) or "scalar"
            buffer = Buffer(name or f"{'device' if device else 'host'} tensor {shape}", device)
            self.buffers[key] = buffer
            fin = weakref.finalize(storage, self._on_free, key, buffer)
            fin.atexit = False
        elif name is not None:
            buffer.name = name
        return buffer

    def _read(self, buffer: Buffer, access: Access, clock: Clock) -> None:
        w = buffer.write
        if w is not None and not w.before(clock):
            self._race(
                f"{access.what} ({access.where}) reads {buffer.name} before {w.what} "
                f"({w.where}) is known to have finished"
            )
        buffer.reads[access.actor] = access

    def _write(self, buffer: Buffer, access: Access, clock: Clock) -> None:
        self._check_done(buffer, clock, f"{access.what} ({access.where}) overwrites")
        buffer.write, buffer.reads = access, {}
        buffer.version += 1

    def _check_done(self, buffer: Buffer, clock: Clock, doing: str) -> None:
        """Every access to `buffer` must happen before `clock`."""
        w = buffer.write
        if w is not None and not w.before(clock):
            self._race(f"{doing} {buffer.name} while {w.what} ({w.where}) may still write it")
        for r in buffer.reads.values():
            if not r.before(clock):
                self._race(f"{doing} {buffer.name} while {r.what} ({r.where}) may still read it")

    def _on_free(self, key: int, buffer: Buffer) -> None:
        """Storage finalizer: note when and by whom the memory was freed (checked at the next
        entry point; a finalizer may run in the middle of the detector's own bookkeeping)."""
        with self._lock:
            host = self._host()
            clock = dict(self.clocks[host])
            if buffer.device:  # the caching allocator reuses it in the compute stream's order
                _join(clock, self.clocks[COMPUTE])
                for stream in buffer.guards:
                    _join(clock, self.clocks[stream])
            self._freed.append((buffer, clock, host))
            if self.buffers.get(key) is buffer:
                del self.buffers[key]

    def _process_frees(self) -> None:
        while self._freed:
            buffer, clock, host = self._freed.pop(0)
            self.ops += 1
            self._check_done(buffer, clock, f"freeing (by {host}, op #{self.ops})")

    # -- the engine's orderings ------------------------------------------------------------------

    def ordering(self) -> SimOrdering:
        """An ordering with a copy stream of its own (`megaslide.engine.streaming.ordering.Ordering`)."""
        with self._lock:
            name = f"copy stream {self._copy_streams}"
            self._copy_streams += 1
            self.clocks[name] = {}
            self.queues[name] = collections.deque()
            return SimOrdering(self, name)

    # -- what the engine does outside the ordering calls (declared by the harness) ---------------

    def name(self, t: torch.Tensor, name: str, block: int | None = None, device=False) -> None:
        """Name `t`'s allocation in reports; say whether it is device memory, and which block's
        bytes it holds (a host store)."""
        with self._lock:
            buffer = self._buffer(t, name)
            buffer.block, buffer.device = block, device

    def compute_begins(self, t: torch.Tensor, block: int) -> None:
        """Block `block` starts computing with its slot, the allocation `t` lives in."""
        with self._lock:
            self._enter()
            buffer = self.buffers.get(t.untyped_storage().data_ptr())
            if buffer is None or not buffer.slot:
                return  # a resident block: never copied
            clock = self._issue(COMPUTE)
            access = self._access(COMPUTE, f"compute of block {block}")
            w = buffer.write
            if w is not None and not w.before(clock):
                self._race(
                    f"{access.what} ({access.where}) reads {buffer.name} before {w.what} "
                    f"({w.where}) is known to have landed"
                )
            if buffer.block != block:
                self._race(
                    f"{access.what} ({access.where}) reads {buffer.name}, which holds "
                    f"block {buffer.block}"
                )
            self._using[(id(buffer), block)] = buffer.version

    def compute_ends(self, t: torch.Tensor, block: int) -> None:
        """Block `block`'s work with its slot is all queued (its last read happens here)."""
        with self._lock:
            self._enter()
            buffer = self.buffers.get(t.untyped_storage().data_ptr())
            if buffer is None or not buffer.slot:
                return
            self._issue(COMPUTE)
            access = self._access(COMPUTE, f"compute of block {block}")
            if self._using.pop((id(buffer), block), None) != buffer.version:
                self._race(
                    f"{buffer.name} changed ({buffer.write.what}, {buffer.write.where}) while "
                    f"{access.what} was using it ({access.where})"
                )
            buffer.reads[COMPUTE] = access  # its write was checked when the use began

    def compute_writes(
        self, tensors: Iterable[torch.Tensor], what: str, block: int | None = None
    ) -> None:
        """Kernels queued on the compute stream so far wrote these device tensors (with `block`:
        its bytes, as a weight format's decode writes a slot)."""
        with self._lock:
            self._enter()
            clock = self._issue(COMPUTE)
            for t in tensors:
                buffer = self._buffer(t, device=True)
                self._write(buffer, self._access(COMPUTE, what), clock)
                if block is not None:
                    buffer.block = block

    def host_reads(self, tensors: Iterable[torch.Tensor], what: str) -> None:
        with self._lock:
            self._enter()
            host = self._host()
            clock = self._tick(host)
            for buffer in self._distinct(tensors):
                self._read(buffer, self._access(host, what), clock)

    def host_writes(self, tensors: Iterable[torch.Tensor], what: str) -> None:
        with self._lock:
            self._enter()
            host = self._host()
            clock = self._tick(host)
            for buffer in self._distinct(tensors):
                self._write(buffer, self._access(host, what), clock)

    def _distinct(self, tensors: Iterable[torch.Tensor]) -> list[Buffer]:
        seen: dict[int, Buffer] = {}
        for t in tensors:
            if t.untyped_storage().nbytes():
                buffer = self._buffer(t)
                seen.setdefault(id(buffer), buffer)
        return list(seen.values())

    # -- host threads ----------------------------------------------------------------------------

    def executor(self, inner) -> _Executor:
        """Wrap a `concurrent.futures` executor: a task happens after its submit, and `result()`
        makes the caller happen after the task."""
        return _Executor(self, inner)

    def _snapshot(self) -> Clock:
        with self._lock:
            host = self._host()
            return dict(self._tick(host))

    def _adopt(self, clock: Clock) -> None:
        with self._lock:
            _join(self.clocks[self._host()], clock)


class SimOrdering:
    """One copy stream of a `SimulatedDevice`, with the `Ordering` interface. Device buffers it
    allocates are the streamer's slots ("slot k"); host buffers the drain's pinned buffers."""

    device_is_host = False

    def __init__(self, sim: SimulatedDevice, stream: str):
        self.sim, self.stream = sim, stream
        self._slots = self._pinned = 0

    def _deleted(self, method: str) -> bool:
        """Count this call site; True when a test deleted it."""
        site = (method, sys._getframe(2).f_code.co_qualname)
        with self.sim._lock:
            self.sim.calls[site] += 1
        return site in self.sim.deleted

    def _recorded(self, event: Event, method: str) -> bool:
        """Is `event` recorded? A wait on one that is not returns at once on CUDA, ordering
        nothing: the record it was meant to follow is missing (call with the lock held)."""
        if event.clock is not None:
            return True
        caller = sys._getframe(2).f_code.co_qualname
        where = f"op #{self.sim.ops}" + (f", {self.sim.context}" if self.sim.context else "")
        self.sim._race(f"{method} in {caller} ({where}) waits on an event never recorded")
        return False

    def sibling(self) -> SimOrdering:
        return self.sim.ordering()

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        sim = self.sim
        with sim._lock:
            sim._enter()
            t = torch.full((nbytes,), 0xFF, dtype=torch.uint8)  # NaN bytes until a copy lands
            buffer = sim._buffer(t, f"slot {self._slots}", device=True)
            buffer.slot = True
            self._slots += 1
            # Allocated in the compute stream's order: its previous owner's kernels queued there
            # count as writes that the first copy into it must wait for.
            clock = sim._issue(COMPUTE)
            sim._write(buffer, sim._access(COMPUTE, f"allocation of {buffer.name}"), clock)
            return t

    def host_buffer(self, numel: int) -> torch.Tensor:
        sim = self.sim
        with sim._lock:
            sim._enter()
            t = torch.full((numel,), float("nan"))
            buffer = sim._buffer(t, f"pinned gradient buffer {self._pinned}")
            self._pinned += 1
            host = sim._host()
            clock = sim._tick(host)
            sim._write(buffer, sim._access(host, f"allocation of {buffer.name}"), clock)
            return t

    def new_event(self) -> Event:
        return Event()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        sim = self.sim
        with sim._lock:
            sim._enter()
            clock = sim._issue(self.stream)
            src_buf = sim._buffer(src)
            dst_buf = sim._buffer(dst, device=not src_buf.device)
            access = sim._access(self.stream, f"copy {src_buf.name} -> {dst_buf.name}")
            sim._read(src_buf, access, clock)
            sim._write(dst_buf, access, clock)
            dst_buf.block = src_buf.block
            queued = _Queued(clock[self.stream], dict(clock), _Ref.of(dst), _Ref.of(src))
            sim.queues[self.stream].append(queued)

    def record_on_copy(self, event: Event) -> None:
        if self._deleted("record_on_copy"):
            return
        with self.sim._lock:
            self.sim._enter()
            event.clock = dict(self.sim._issue(self.stream))

    def record_on_compute(self, event: Event) -> None:
        if self._deleted("record_on_compute"):
            return
        with self.sim._lock:
            self.sim._enter()
            event.clock = dict(self.sim._issue(COMPUTE))

    def compute_wait(self, event: Event) -> None:
        if self._deleted("compute_wait"):
            return
        with self.sim._lock:
            self.sim._enter()
            clock = self.sim._issue(COMPUTE)
            if self._recorded(event, "compute_wait"):
                _join(clock, event.clock)
                # Compute runs eagerly, when Python calls it: what it waits for lands now.
                self.sim._land_through(event.clock)

    def copy_wait(self, event: Event) -> None:
        if self._deleted("copy_wait"):
            return
        with self.sim._lock:
            self.sim._enter()
            clock = self.sim._issue(self.stream)
            if self._recorded(event, "copy_wait"):
                _join(clock, event.clock)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        if self._deleted("keep_alive"):
            return
        sim = self.sim
        with sim._lock:
            sim._enter()
            sim._buffer(tensor).guards.add(self.stream)
            # The allocator keeps the memory until the copy stream gets here: hold it as long.
            clock = sim.clocks[self.stream]
            queued = _Queued(clock.get(self.stream, 0), dict(clock), hold=tensor.untyped_storage())
            sim.queues[self.stream].append(queued)

    def host_wait(self, event: Event) -> None:
        if self._deleted("host_wait"):
            return
        sim = self.sim
        with sim._lock:
            sim._enter()
            if self._recorded(event, "host_wait"):
                _join(sim.clocks[sim._host()], event.clock)
                sim._land_through(event.clock)

    def drain_copies(self) -> None:
        if self._deleted("drain_copies"):
            return
        sim = self.sim
        with sim._lock:
            sim._enter()
            clock = dict(sim.clocks[self.stream])
            _join(sim.clocks[sim._host()], clock)
            sim._land_through(clock)

    def synchronize(self) -> None:
        if self._deleted("synchronize"):
            return
        sim = self.sim
        with sim._lock:
            sim._enter()
            host = sim.clocks[sim._host()]
            for actor, clock in list(sim.clocks.items()):
                if not actor.startswith("host"):
                    _join(host, clock)
            sim._land_through(host)

    def stamp(self, on_copy: bool) -> float:
        return time.perf_counter()

    def seconds(self, origin: float, stamp: float) -> float:
        return stamp - origin


class _Executor:
    """A `concurrent.futures` executor whose tasks and results carry happens-before edges."""

    def __init__(self, sim: SimulatedDevice, inner):
        self.sim, self.inner = sim, inner
        self.finished: list[Clock] = []  # the end of every task, for shutdown(wait=True)

    def submit(self, fn: Callable, *args, **kwargs) -> _Future:
        parent = self.sim._snapshot()
        done: list[Clock] = []

        def task():
            self.sim._adopt(parent)
            try:
                return fn(*args, **kwargs)
            finally:
                done.append(self.sim._snapshot())
                self.finished.append(done[0])

        return _Future(self.sim, self.inner.submit(task), done)

    def shutdown(self, wait: bool = True, **kwargs) -> None:
        self.inner.shutdown(wait=wait, **kwargs)
        if wait:  # every task has finished: the caller happens after all of them
            for clock in self.finished:
                self.sim._adopt(clock)


class _Future:
    def __init__(self, sim: SimulatedDevice, inner, done: list[Clock]):
        self.sim, self.inner, self.done = sim, inner, done

    def result(self, timeout: float | None = None):
        value = self.inner.result(timeout)  # outside the lock: the task may need it
        site = ("result", sys._getframe(1).f_code.co_qualname)
        with self.sim._lock:
            self.sim.calls[site] += 1
        if site not in self.sim.deleted:
            self.sim._adopt(self.done[0])
        return value


# ------------------------------------------------------------------------------------------------
# The harness: what the engine does to memory outside its ordering calls


def _first_tensor(module: torch.nn.Module) -> torch.Tensor:
    """A tensor of `module` (it lives in the block's slot, host store or resident buffer)."""
    return next(t for t in [*module.parameters(), *module.buffers()] if t.numel())


def watch_handle(sim: SimulatedDevice, handle, blocks) -> None:
    """Declare a streamed module's memory use: each block computes with its slot from `load` to
    `release`, host stores are named by block, `load_weights` writes every store, and the caller
    of `host_tensors(i)` may write block i's store as soon as it returns (its promise)."""
    resident = set(handle.stats()["resident_block_indices"])
    # One tensor of each block: the object stays, what it points at moves (store, slot, store).
    tensors = [_first_tensor(block) for block in blocks]
    streamed = [i for i in range(len(blocks)) if i not in resident]
    stores = {i: handle._blocks[i].store for i in streamed}

    def name_stores() -> None:
        for i in streamed:  # released blocks point at their host stores (or a coded payload)
            store = stores[i]
            sim.name(store.payload if store.encoded else tensors[i], f"host store of block {i}", i)

    name_stores()
    for i, store in stores.items():
        if store.encoded:  # a weight format decodes the landed payload into the slot at load
            _watch_decode(sim, store, i)
    load, release, load_weights = handle.load, handle.release, handle.load_weights
    host_tensors = handle.host_tensors
    in_use: set[int] = set()

    def watched_load(i: int) -> None:
        load(i)
        if i not in in_use:  # load() of a loaded block does nothing
            in_use.add(i)
            sim.compute_begins(tensors[i], i)

    def watched_release(i: int) -> None:
        if i in in_use:  # release() of a released block does nothing
            in_use.discard(i)
            sim.compute_ends(tensors[i], i)
        release(i)

    def watched_load_weights(source, strict: bool = True) -> None:
        load_weights(source, strict)  # refuses to run while a block is loaded
        name_stores()  # a coded store re-encodes into a new payload
        host = [stores[i].payload if stores[i].encoded else tensors[i] for i in streamed]
        sim.host_writes(host, "load_weights")

    def watched_host_tensors(i: int) -> dict[str, torch.Tensor]:
        views = host_tensors(i)
        sim.host_writes(views.values(), f"a write through host_tensors({i})")
        return views

    handle.load, handle.release = watched_load, watched_release
    handle.load_weights, handle.host_tensors = watched_load_weights, watched_host_tensors


def _watch_decode(sim: SimulatedDevice, store, i: int) -> None:
    """A coded store's decode is compute work: it reads the staging buffer the payload was
    copied into (that copy must have landed and be block i's) and writes block i into the slot."""
    decode = store.decode

    def watched_decode(staging: torch.Tensor, out: torch.Tensor, matmul=frozenset()) -> dict:
        sim.compute_begins(staging, i)
        operands = decode(staging, out, matmul)
        sim.compute_ends(staging, i)
        sim.compute_writes([out], f"decode of block {i}", block=i)
        return operands

    store.decode = watched_decode


def watch_training(sim: SimulatedDevice, step) -> None:
    """Declare a `BlockwiseStep`'s memory use beyond its handle: the backward writes the gradients
    it sends, the optimizer thread reads the drain's buffers and writes the masters, and its
    tasks are ordered by submit and `result()`."""
    step.worker = sim.executor(step.worker)
    opt, drain = step.optimizer, step.drain
    accumulate, step_block, send = opt.accumulate, opt.step_block, drain.send

    def watched_send(grads):
        owners = {
            id(p.grad): f"block {i}'s {name}"
            for i, block in enumerate(step.model.blocks)
            for name, p in block.named_parameters()
            if p.grad is not None
        }
        for name, g in grads.items():
            sim.name(g, f"gradient of {owners.get(id(g), name)}", device=True)
        sim.compute_writes(grads.values(), "backward")
        return send(grads)

    def watched_accumulate(block_id, grads):
        sim.host_reads(grads.values(), f"optimizer of block {block_id}")
        accumulate(block_id, grads)

    def watched_step_block(block_id, grads=None, **kwargs):
        if grads is not None:
            sim.host_reads(grads.values(), f"optimizer of block {block_id}")
        sim.host_writes(step.masters[block_id].values(), f"optimizer update of block {block_id}")
        step_block(block_id, grads, **kwargs)

    drain.send = watched_send
    opt.accumulate, opt.step_block = watched_accumulate, watched_step_block


def watch_ring(sim: SimulatedDevice, store) -> None:
    """Declare a disk tier's memory use (disk_store.py), given one of its stores: the ring's reader
    thread writes a block's bytes into a ring buffer, and the thread that acquires that block
    happens after the write (the ring's lock and condition hand the buffer over)."""
    core = store.ring._core
    filled: dict[int, Clock] = {}  # ring buffer (its address) -> the reader's clock after filling
    names = {b.data.data_ptr(): f"ring buffer {k}" for k, b in enumerate(core.buffers)}
    acquire = core.acquire

    def watch_read(store) -> None:
        read_into = store.read_into

        def watched_read_into(out: torch.Tensor, direct: bool = False) -> None:
            sim.name(out, names.get(out.data_ptr(), "a ring buffer"), block=store.index)
            sim.host_writes([out], f"disk read of block {store.index}")
            read_into(out, direct)
            filled[out.data_ptr()] = sim._snapshot()

        store.read_into = watched_read_into

    def watched_acquire(i: int) -> torch.Tensor:
        data = acquire(i)
        sim._adopt(filled[data.data_ptr()])
        return data

    for s in core.stores:
        watch_read(s)
    core.acquire = watched_acquire


def call_sites(path: Path, methods: set[str]) -> set[tuple[str, str]]:
    """(method, qualified name of the calling function) for every call of `methods` in `path`."""
    sites = set()

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
            else:
                if (
                    isinstance(child, ast.Call)
                    and isinstance(child.func, ast.Attribute)
                    and child.func.attr in methods
                ):
                    sites.add((child.func.attr, ".".join(scope)))
                visit(child, scope)

    visit(ast.parse(path.read_text()), [])
    return sites
