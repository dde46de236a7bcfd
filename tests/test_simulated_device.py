"""The simulated device's race detector on hand-made schedules: each correct schedule passes, and
the same schedule with one wait missing (or in the wrong place) is caught, naming what raced."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from simulated_device import SimulatedDevice


class Ring:
    """Two host stores (blocks 0 and 1) and a slot on a simulated device, used the way the
    streamer uses them; each step can leave out its wait."""

    def __init__(self, seed=0):
        self.sim = SimulatedDevice(seed)
        self.ord = self.sim.ordering()
        self.stores = [torch.full((8,), float(i + 1)) for i in range(2)]
        for i, store in enumerate(self.stores):
            self.sim.name(store, f"host store of block {i}", block=i)
        self.slot = self.ord.device_buffer(32).view(torch.float32)
        self.ready, self.free = self.ord.new_event(), self.ord.new_event()
        self.ord.record_on_compute(self.free)  # after the allocation

    def copy(self, block, wait_free=True, record_ready=True):
        if wait_free:
            self.ord.copy_wait(self.free)
        self.ord.copy(self.slot, self.stores[block])
        if record_ready:
            self.ord.record_on_copy(self.ready)

    def compute(self, block, wait_ready=True, record_free=True):
        """Returns what the compute read: the slot's contents when Python ran it."""
        if wait_ready:
            self.ord.compute_wait(self.ready)
        self.sim.compute_begins(self.slot, block)
        seen = self.slot.clone()
        self.sim.compute_ends(self.slot, block)
        if record_free:
            self.ord.record_on_compute(self.free)
        return seen

    def races(self):
        return "\n".join(self.sim.races)


def test_the_streamers_protocol_has_no_race_and_reads_the_right_bytes():
    for seed in range(8):
        ring = Ring(seed)
        for block in (0, 1, 0):
            ring.copy(block)
            assert torch.equal(ring.compute(block), ring.stores[block])
        assert ring.sim.races == []


def test_compute_that_does_not_wait_for_its_copy():
    ring = Ring(seed=0)  # seed 0 lands copies only when a wait needs them
    ring.copy(0)
    seen = ring.compute(0, wait_ready=False)
    assert "compute of block 0 (op #" in ring.races()
    assert "reads slot 0 before copy host store of block 0 -> slot 0" in ring.races()
    assert seen.isnan().all()  # the copy had not landed: the compute read the slot's NaN bytes


def test_copy_that_does_not_record_its_ready_event():
    ring = Ring()
    ring.copy(0)
    ring.compute(0)
    ring.copy(1, record_ready=False)  # ready still marks block 0's copy
    ring.compute(1)
    assert "reads slot 0 before copy host store of block 1 -> slot 0" in ring.races()


def test_copy_that_overwrites_a_slot_still_being_read():
    ring = Ring()
    ring.copy(0)
    ring.compute(0)
    ring.copy(1, wait_free=False)
    assert "copy host store of block 1 -> slot 0" in ring.races()
    assert "overwrites slot 0 while compute of block 0" in ring.races()
    assert "may still read it" in ring.races()


def test_free_recorded_before_the_compute_is_queued():
    ring = Ring()
    ring.copy(0)
    ring.ord.compute_wait(ring.ready)
    ring.ord.record_on_compute(ring.free)  # too early: block 0's kernels come after it
    ring.sim.compute_begins(ring.slot, 0)
    ring.sim.compute_ends(ring.slot, 0)
    ring.copy(1)
    assert "overwrites slot 0 while compute of block 0" in ring.races()


def test_first_copy_into_a_new_slot_waits_for_its_allocation():
    ring = Ring()
    fresh = ring.ord.device_buffer(32).view(torch.float32)
    ring.ord.copy(fresh, ring.stores[0])  # no event recorded after the allocation is waited on
    assert "overwrites slot 1 while allocation of slot 1" in ring.races()


def test_wait_on_an_event_never_recorded_orders_nothing():
    ring = Ring()
    ring.ready = ring.ord.new_event()
    ring.copy(0, record_ready=False)
    ring.compute(0)
    assert "before copy host store of block 0 -> slot 0" in ring.races()
    # On CUDA such a wait returns at once: the missing record is reported at the wait itself.
    assert "compute_wait in Ring.compute (op #" in ring.races()
    assert "waits on an event never recorded" in ring.races()


def test_host_wait_on_an_event_never_recorded_is_reported_even_without_a_race():
    """A host thread that waits for a copy's event before reusing its source: with the record
    missing the wait orders nothing, whatever the buffers it guards are declared to be."""
    sim = SimulatedDevice()
    ord_ = sim.ordering()
    event = ord_.new_event()
    ord_.host_wait(event)
    assert sim.races and "host_wait in " in sim.races[0]
    assert "waits on an event never recorded" in sim.races[0]
    recorded = ord_.new_event()
    ord_.record_on_copy(recorded)
    ord_.host_wait(recorded)
    assert len(sim.races) == 1


def test_compute_that_finds_another_blocks_bytes():
    ring = Ring()
    ring.copy(0)
    ring.compute(1)
    assert "compute of block 1" in ring.races() and "reads slot 0, which holds block 0" in (
        ring.races()
    )


def test_slot_overwritten_while_a_block_uses_it():
    ring = Ring()
    ring.copy(0)
    ring.ord.compute_wait(ring.ready)
    ring.sim.compute_begins(ring.slot, 0)
    ring.copy(1)  # waits for the free event of an earlier use, not this one
    ring.sim.compute_ends(ring.slot, 0)
    assert "slot 0 changed (copy host store of block 1 -> slot 0" in ring.races()


def test_host_writes_a_store_a_copy_may_still_read():
    ring = Ring()
    ring.copy(0)
    ring.compute(0)  # the compute waited for the copy, the host did not
    ring.sim.host_writes([ring.stores[0]], "optimizer update of block 0")
    assert "optimizer update of block 0" in ring.races()
    assert "overwrites host store of block 0 while copy host store of block 0" in ring.races()

    ring = Ring()
    ring.copy(0)
    ring.compute(0)
    ring.ord.drain_copies()
    ring.sim.host_writes([ring.stores[0]], "optimizer update of block 0")
    assert ring.sim.races == []


def test_freeing_a_slot_or_a_store_under_a_copy_in_flight():
    ring = Ring()
    ring.copy(0)
    del ring.slot
    ring.sim.finish()  # the copy held the slot only weakly
    assert "freeing" in ring.races() and "slot 0 while copy host store of block 0" in ring.races()

    ring = Ring()
    ring.copy(0)
    ring.ord.synchronize()
    ring.stores[0] = None
    ring.slot = None
    ring.sim.finish()
    assert ring.sim.races == []


class Drain:
    """A device gradient copied to a pinned buffer and read by an optimizer thread."""

    def __init__(self, seed=0):
        self.sim = SimulatedDevice(seed)
        self.ord = self.sim.ordering()
        self.pinned = self.ord.host_buffer(4)
        self.pool = self.sim.executor(ThreadPoolExecutor(max_workers=1))

    def send(self, value, wait_backward=True, keep_alive=True):
        g = torch.full((4,), float(value))
        self.sim.compute_writes([g], "backward")
        if wait_backward:
            done = self.ord.new_event()
            self.ord.record_on_compute(done)
            self.ord.copy_wait(done)
        self.ord.copy(self.pinned, g)
        if keep_alive:
            self.ord.keep_alive(g)
        landed = self.ord.new_event()
        self.ord.record_on_copy(landed)
        return landed

    def read(self, landed, wait=True):
        def task():
            if wait:
                self.ord.host_wait(landed)
            self.sim.host_reads([self.pinned], "optimizer")
            return self.pinned.clone()

        return self.pool.submit(task)

    def races(self):
        return "\n".join(self.sim.races)


def test_the_drains_protocol_has_no_race_and_delivers_the_gradient():
    for seed in range(8):
        drain = Drain(seed)
        for value in (1, 2, 3):
            got = drain.read(drain.send(value)).result()  # joined before the next copy
            assert torch.equal(got, torch.full((4,), float(value)))
        drain.sim.finish()
        assert drain.sim.races == []


def test_copy_that_does_not_wait_for_the_backward():
    drain = Drain()
    drain.read(drain.send(1, wait_backward=False)).result()
    assert "copy device tensor 4 -> pinned gradient buffer 0" in drain.races()
    assert "reads device tensor 4 before backward" in drain.races()


def test_optimizer_that_does_not_wait_for_the_copy():
    drain = Drain(seed=0)
    got = drain.read(drain.send(1), wait=False).result()
    assert "optimizer (op #" in drain.races()
    assert "reads pinned gradient buffer 0 before copy device tensor 4" in drain.races()
    assert got.isnan().all()  # it read the buffer before the copy landed


def test_copy_that_overwrites_a_buffer_the_optimizer_still_reads():
    drain = Drain()
    reader = drain.read(drain.send(1))
    reader.inner.result()  # the task finished, but nothing joined it
    drain.send(2)
    assert "overwrites pinned gradient buffer 0 while optimizer" in drain.races()


def test_gradient_freed_under_its_copy_without_keep_alive():
    drain = Drain(seed=0)
    drain.send(1, keep_alive=False)  # the caller drops g right away
    drain.sim.finish()
    assert "freeing" in drain.races()
    assert "device tensor 4 while copy device tensor 4 -> pinned gradient buffer 0" in (
        drain.races()
    )
    assert drain.pinned.isnan().all()  # the copy read freed memory

    drain = Drain(seed=0)
    drain.send(1)
    drain.sim.finish()
    assert drain.sim.races == [] and torch.equal(drain.pinned, torch.ones(4))


@pytest.mark.parametrize("seed", range(12))
def test_copies_land_in_stream_order_and_never_before_their_waits(seed):
    sim = SimulatedDevice(seed)
    first, second = sim.ordering(), sim.ordering()
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    one, two = torch.ones(4), torch.full((4,), 2.0)
    first.copy(a, one)
    first.copy(a, two)  # lands after the first copy on the same stream
    copied = first.new_event()
    first.record_on_copy(copied)
    second.copy_wait(copied)
    second.copy(b, a)  # reads a only after both copies into it landed
    first.copy(c, one)
    sim.finish()
    assert torch.equal(a, two) and torch.equal(b, two) and torch.equal(c, one)
    assert sim.races == []
