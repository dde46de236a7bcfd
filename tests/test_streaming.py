"""Weight streaming on the CPU path: streamed equals resident bitwise, the accounting is exact, the
event logic is right (on a simulated device whose copies land late) and `remove()` undoes
everything."""

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from megaslide.engine.streaming.host_store import (
    ALIGN_BYTES,
    HostBlockStore,
    collect_tensors,
    layout_nbytes,
    pin_exact,
)
from megaslide.engine.streaming.streamer import plan_residency, stream_module

from simulated_device import SimulatedDevice, watch_handle

# ------------------------------------------------------------------------------------------------
# Two toy modules with different block structures


class NormBlock(nn.Module):
    """Linear + LayerNorm residual block with a buffer."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("scale", torch.rand(d) + 0.5)

    def forward(self, x):
        return x + self.norm(torch.tanh(self.fc(x))) * self.scale  # (B, d)


class Stack(nn.Module):
    """Non-block input and output layers around a stack of NormBlocks."""

    def __init__(self, d=16, n=6):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(NormBlock(d) for _ in range(n))
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)  # (B, d)
        for blk in self.blocks:
            h = blk(h)
        return self.out(h)  # (B, 4)


class CondBlock(nn.Module):
    """A block with a nested MLP (tied under a second name), a transposed float32 weight, a float64
    gate, an int64 buffer and a non-persistent buffer; it takes a condition computed outside it."""

    def __init__(self, d, hidden):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.first = self.mlp[0]  # the same Linear under two names inside the block
        self.proj_t = nn.Parameter(torch.randn(d, d).t())  # non-contiguous storage order
        self.gate = nn.Parameter(torch.randn(d, dtype=torch.float64))
        self.register_buffer("repeats", torch.tensor(2, dtype=torch.int64))
        self.register_buffer("mask", (torch.arange(d) % 3 != 0).float(), persistent=False)

    def forward(self, x, cond):
        h = self.mlp(x * (1 + cond[:, None, :]))  # (B, T, d)
        h = (h @ self.proj_t) * self.mask  # (B, T, d)
        return x + h * self.gate.to(x.dtype) / self.repeats  # (B, T, d)


class CondNet(nn.Module):
    """Blocks of different sizes sharing non-block parameters (a condition embedding); block 1 is
    called twice per forward."""

    schedule = (0, 1, 2, 1, 3)

    def __init__(self, d=12, hiddens=(24, 8, 40, 16)):
        super().__init__()
        self.cond = nn.Linear(3, d)
        self.shared_bias = nn.Parameter(torch.randn(d))
        self.layers = nn.ModuleList(CondBlock(d, h) for h in hiddens)
        self.norm = nn.LayerNorm(d)

    def forward(self, x, c):
        cond = self.cond(c) + self.shared_bias  # (B, d), shared by every block call
        for i in self.schedule:
            x = self.layers[i](x, cond=cond)  # (B, T, d)
        return self.norm(x)


def make(kind):
    torch.manual_seed(0)
    if kind == "stack":
        model = Stack()
        return model, model.blocks, lambda b: (torch.randn(b, 8),)
    model = CondNet()
    return model, model.layers, lambda b: (torch.randn(b, 5, 12), torch.randn(b, 3))


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}


def block_bytes(blocks):
    return [layout_nbytes(b) for b in blocks]


def non_block_bytes(model, blocks):
    inside = {id(p) for b in blocks for p in [*b.parameters(), *b.buffers()]}
    return sum(
        t.numel() * t.element_size()
        for t in [*model.parameters(), *model.buffers()]
        if id(t) not in inside
    )


# ------------------------------------------------------------------------------------------------
# Correctness


@pytest.mark.parametrize("kind", ["stack", "cond"])
@pytest.mark.parametrize("prefetch,budget_blocks", [(1, None), (2, None), (3, None), (2, 2)])
def test_streamed_equals_resident_bitwise(kind, prefetch, budget_blocks):
    model, blocks, inputs = make(kind)
    ref = copy.deepcopy(model)
    budget = None
    if budget_blocks is not None:  # room for the slots plus `budget_blocks` resident blocks
        sizes = block_bytes(blocks)
        budget = non_block_bytes(model, blocks) + (prefetch + budget_blocks) * max(sizes)
    handle = stream_module(model, blocks, "cpu", gpu_budget_bytes=budget, prefetch=prefetch)
    if budget_blocks is not None:
        assert handle.stats()["resident_blocks"] >= budget_blocks
    modes = [torch.no_grad, torch.inference_mode, torch.enable_grad]
    for step, batch in enumerate([1, 3, 2, 3, 1, 4]):
        args = inputs(batch)
        with modes[step % 3]():
            got = model(*args)
        expected = ref(*args)
        assert torch.equal(got, expected), f"forward {step} (batch {batch}) differs"
    assert handle.stats()["forwards"] == 6


def test_block_tensors_live_in_the_host_store_and_keep_identity():
    model, blocks, _ = make("cond")
    params = dict(model.named_parameters())
    handle = stream_module(model, blocks, "cpu")
    assert all(p is params[name] for name, p in model.named_parameters())  # same objects
    for i, blk in enumerate(blocks):
        store = handle._blocks[i].store
        lo, hi = store.buffer.data_ptr(), store.buffer.data_ptr() + store.nbytes
        for t in [*blk.parameters(), *blk.buffers()]:
            assert lo <= t.data_ptr() < hi or t.numel() == 0
            assert (t.data_ptr() - lo) % ALIGN_BYTES == 0
        assert blk.first.weight is blk.mlp[0].weight
        assert blk.proj_t.stride() == (1, 12)  # the stored layout is kept


def test_host_block_store_adopts_repoints_and_fills():
    torch.manual_seed(0)
    block = CondBlock(6, 10)
    before = snapshot(block)
    store = HostBlockStore.adopt(collect_tensors(block))
    assert all(e.offset % ALIGN_BYTES == 0 for e in store.entries)
    assert store.nbytes == layout_nbytes(block)
    for name, value in snapshot(block).items():
        assert torch.equal(value, before[name])
    assert block.mlp[0].weight.data_ptr() == store.tensors()["mlp.0.weight"].data_ptr()
    doubled = {f"blk.{k}": v * 2 for k, v in before.items()}
    filled = store.fill(doubled, prefix="blk.")
    saved = {k for k, e in enumerate(store.entries) if e.names != ("mask",)}  # non-persistent
    assert filled == saved
    assert torch.equal(block.gate, before["gate"] * 2)


# ------------------------------------------------------------------------------------------------
# Accounting


@pytest.mark.parametrize("kind", ["stack", "cond"])
@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_peak_device_bytes_when_everything_streams(kind, prefetch):
    model, blocks, _ = make(kind)
    sizes, fixed = block_bytes(blocks), non_block_bytes(model, blocks)
    stats = stream_module(model, blocks, "cpu", prefetch=prefetch).stats()
    assert stats["streamed_blocks"] == len(blocks) and stats["resident_blocks"] == 0
    assert stats["slot_bytes"] == max(sizes) and stats["num_slots"] == prefetch
    assert stats["peak_device_weight_bytes"] <= fixed + prefetch * max(sizes)
    assert stats["peak_device_weight_bytes"] == fixed + prefetch * max(sizes)


def test_partial_residency_respects_budget_and_counts_blocks():
    model, blocks, inputs = make("stack")
    size, fixed, n = max(block_bytes(blocks)), non_block_bytes(model, blocks), len(blocks)
    cases = [  # (budget, reserve, expected resident)
        (fixed + 2 * size + 3 * size, 0, 3),
        (fixed + 2 * size + 3 * size + size - 1, 0, 3),
        (fixed + 2 * size + 3 * size, size, 2),
        (fixed + n * size, 0, n),  # all resident: no slots needed
        (fixed + 2 * size, 0, 0),
    ]
    for budget, reserve, expected in cases:
        m = copy.deepcopy(model)
        handle = stream_module(
            m, m.blocks, "cpu", gpu_budget_bytes=budget, activation_reserve_bytes=reserve
        )
        s = handle.stats()
        assert s["resident_blocks"] == expected, (budget, reserve)
        assert s["streamed_blocks"] == n - expected
        assert s["peak_device_weight_bytes"] + reserve <= budget
        m(*inputs(2))
        m(*inputs(5))
        assert s["num_slots"] == (0 if expected == n else 2)
        # Resident blocks never cross; each streamed one crosses once per forward.
        assert handle.stats()["h2d_bytes"] == 2 * (n - expected) * size
    assert plan_residency(
        [size] * 6, gpu_budget_bytes=fixed + 5 * size, non_block_bytes=fixed
    ).resident == (0, 2, 4)


@pytest.mark.parametrize("batch", [1, 7])
def test_h2d_bytes_is_forwards_times_streamed_bytes(batch):
    model, blocks, inputs = make("stack")
    handle = stream_module(model, blocks, "cpu")
    streamed = sum(block_bytes(blocks))
    for k in range(1, 4):
        model(*inputs(batch))
        assert handle.stats()["h2d_bytes"] == k * streamed
    handle.reset_stats()
    model(*inputs(batch))
    assert handle.stats()["h2d_bytes"] == streamed


def test_prefetch_across_forwards_and_small_rings_cache():
    model, blocks, inputs = make("stack")
    ref = copy.deepcopy(model)
    handle = stream_module(model, blocks, "cpu", prefetch=3)
    handle.set_order("forward", cyclic=True)
    for _ in range(3):
        model(*inputs(2))
    # Every forward copies each block once; the last one also prefetched blocks 0 and 1.
    assert handle.stats()["copies"] == 3 * len(blocks) + 2

    handle.set_order("forward")
    handle.reset_stats()
    model(*inputs(2))  # blocks 0 and 1 are still in their slots from the cyclic prefetch
    assert handle.stats()["copies"] == len(blocks) - 2
    handle.prefetch([0, 1])  # explicit, e.g. by a sampler between steps
    assert handle.stats()["copies"] == len(blocks)
    args = inputs(3)
    assert torch.equal(model(*args), ref(*args))
    assert handle.stats()["copies"] == 2 * len(blocks) - 2

    torch.manual_seed(0)
    small = Stack(n=2)
    handle = stream_module(small, small.blocks, "cpu", prefetch=2)
    for _ in range(3):
        small(torch.randn(2, 8))
    assert handle.stats()["copies"] == 2  # both blocks stay in the two slots


# ------------------------------------------------------------------------------------------------
# Ordering: the streamer on a simulated device whose copies land late (tests/support/simulated_device.py)


@pytest.mark.parametrize("kind", ["stack", "cond"])
@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_streamer_is_race_free_on_a_simulated_device(kind, prefetch):
    model, blocks, inputs = make(kind)
    ref = copy.deepcopy(model)
    sim = SimulatedDevice()
    handle = stream_module(model, blocks, "cpu", prefetch=prefetch, ordering=sim.ordering())
    watch_handle(sim, handle, blocks)
    for seed in range(8):  # some seeds land copies only when waited for, others at random
        sim.reseed(seed)
        sim.context = f"forward {seed}"
        args = inputs(1 + seed % 3)
        assert torch.equal(model(*args), ref(*args)), seed
    handle.remove()
    sim.finish()
    sim.check()


@pytest.mark.parametrize("kind", ["stack", "cond"])
def test_a_compute_that_does_not_wait_for_its_copy_is_caught(kind):
    model, blocks, inputs = make(kind)
    ref = copy.deepcopy(model)
    sim = SimulatedDevice(seed=0)  # copies land only when something waits for them
    sim.deleted = {("compute_wait", "StreamHandle.load")}
    handle = stream_module(model, blocks, "cpu", ordering=sim.ordering())
    watch_handle(sim, handle, blocks)
    args = inputs(2)
    assert not torch.equal(model(*args), ref(*args))  # it computed with NaN bytes
    assert "compute of block 0" in sim.races[0] and "reads slot 0 before copy" in sim.races[0]


# ------------------------------------------------------------------------------------------------
# Training: backward through streamed blocks, driven by the explicit API


def test_gradients_flow_to_streamed_blocks_with_explicit_reverse_loads():
    model, blocks, inputs = make("stack")
    ref = copy.deepcopy(model)
    (x,) = inputs(4)
    ref(x).square().mean().backward()

    handle = stream_module(model, blocks, "cpu", prefetch=2)
    # Forward: non-block layers with a graph, blocks without one, keeping each block's input.
    h0 = model.inp(x)
    saved = []
    with torch.no_grad():
        h = h0.detach()
        for blk in blocks:
            saved.append(h)
            h = blk(h)
    h.requires_grad_()
    model.out(h).square().mean().backward()
    grad = h.grad
    copies = handle.stats()["copies"]
    # Backward in reverse order: load, recompute with a graph, back-propagate, release.
    with handle.manual(order="reverse"):
        for i in reversed(range(len(blocks))):
            handle.load(i)
            xi = saved[i].requires_grad_()
            blocks[i](xi).backward(grad)
            grad = xi.grad
            assert all(p.is_leaf and p.grad is not None for p in blocks[i].parameters())
            handle.release(i)
    h0.backward(grad)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    # The last two blocks were still in the slots; the others crossed once more, in reverse.
    assert handle.stats()["copies"] - copies == len(blocks) - 2
    # Optimizer-style update written into the host store; the next forward must use it.
    with torch.no_grad():
        for i, blk in enumerate(blocks):
            grads = {name: p.grad for name, p in blk.named_parameters()}
            for name, t in handle.host_tensors(i).items():
                if name in grads:
                    t.sub_(0.1 * grads[name])
            for p in ref.blocks[i].parameters():
                p.sub_(0.1 * p.grad)
    assert torch.equal(model(x), ref(x))


# ------------------------------------------------------------------------------------------------
# Trace, meta loading, remove, errors


def test_trace_json_has_copy_and_compute_tracks(tmp_path):
    model, blocks, inputs = make("cond")
    handle = stream_module(model, blocks, "cpu", timing=True)
    for batch in (1, 2):
        model(*inputs(batch))
    stats = handle.stats()
    assert len(stats["copy_s"]) == len(blocks) and stats["copy_s_total"] > 0
    assert stats["compute_s_total"] > 0 and 0.0 <= stats["copy_hidden_fraction"] <= 1.0
    path = tmp_path / "trace.json"
    handle.write_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert all({"ph", "ts", "dur", "tid", "pid", "name", "args"} <= e.keys() for e in spans)
    assert all(e["dur"] >= 0 for e in spans)
    tids = {e["cat"]: e["tid"] for e in spans}
    assert len(set(tids.values())) == 2
    assert sum(e["cat"] == "compute" for e in spans) == 2 * len(CondNet.schedule)
    assert sum(e["cat"] == "copy" for e in spans) == stats["copies"]
    named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert named == set(tids.values())
    handle.reset_stats()
    assert [e for e in handle.trace_events() if e["ph"] == "X"] == []


@pytest.mark.parametrize("budget_blocks", [None, 2])
def test_meta_built_module_loads_from_safetensors_block_by_block(tmp_path, budget_blocks):
    model, blocks, inputs = make("cond")
    budget = None
    if budget_blocks:
        budget = non_block_bytes(model, blocks) + (2 + budget_blocks) * max(block_bytes(blocks))
    path = tmp_path / "weights.safetensors"
    tensors = {k: v.contiguous() for k, v in snapshot(model).items() if ".first." not in k}
    save_file(tensors, path)  # tied names saved once, as safetensors requires
    with torch.device("meta"):
        empty = CondNet()
    for blk in empty.layers:  # non-persistent buffers are not in checkpoints: set them first
        blk.mask = (torch.arange(12) % 3 != 0).float()
    handle = stream_module(empty, empty.layers, "cpu", gpu_budget_bytes=budget)
    assert handle.stats()["resident_blocks"] >= (budget_blocks or 0)
    with pytest.raises(RuntimeError, match="load_weights"):
        empty(*inputs(1))
    handle.load_weights(path)
    args = inputs(3)
    assert torch.equal(empty(*args), model(*args))
    with pytest.raises(KeyError, match="unexpected"):
        handle.load_weights({"nope": torch.zeros(1)})


@pytest.mark.parametrize("budget_blocks", [None, 2])
def test_remove_restores_the_module_bitwise(budget_blocks):
    model, blocks, inputs = make("cond")
    before, ids = snapshot(model), {n: id(p) for n, p in model.named_parameters()}
    strides = {n: p.stride() for n, p in model.named_parameters()}
    budget = None
    if budget_blocks:
        budget = non_block_bytes(model, blocks) + (2 + budget_blocks) * max(block_bytes(blocks))
    handle = stream_module(model, blocks, "cpu", gpu_budget_bytes=budget)
    model(*inputs(2))
    handle.remove()
    after = snapshot(model)
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    for n, p in model.named_parameters():
        assert id(p) == ids[n] and p.stride() == strides[n] and p.device.type == "cpu"
        assert p._base is None and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    hooks = [m._forward_pre_hooks or m._forward_hooks for m in model.modules()]
    assert not any(hooks)
    with pytest.raises(RuntimeError, match="removed"):
        handle.load(0)


def test_clear_errors_for_bad_arguments():
    model, blocks, _ = make("stack")
    with pytest.raises(ValueError, match="prefetch"):
        stream_module(model, blocks, "cpu", prefetch=0)
    with pytest.raises(ValueError, match="below the minimum"):
        stream_module(model, blocks, "cpu", gpu_budget_bytes=2 * max(block_bytes(blocks)))
    with pytest.raises(ValueError, match="not a submodule"):
        stream_module(model, [NormBlock(16)], "cpu")
    with pytest.raises(ValueError, match="module itself"):
        stream_module(model, [model], "cpu")
    with pytest.raises(ValueError, match="twice"):
        stream_module(model, [blocks[0], blocks[0]], "cpu")
    with pytest.raises(ValueError, match="nest"):
        stream_module(model, [blocks[0], blocks[0].fc], "cpu")
    with pytest.raises(ValueError, match="empty"):
        stream_module(model, [], "cpu")
    with pytest.raises(ValueError, match="activation_reserve"):
        stream_module(model, blocks, "cpu", activation_reserve_bytes=-1)
    with pytest.raises(ValueError, match="not supported"):
        stream_module(model, blocks, "meta")
    tied = Stack(n=2)
    tied.blocks[1].fc.weight = tied.blocks[0].fc.weight
    with pytest.raises(ValueError, match="shared by blocks 0 and 1"):
        stream_module(tied, tied.blocks, "cpu")
    tied = Stack(n=2)
    tied.out.weight = nn.Parameter(torch.randn(4, 16))
    tied.head_alias = tied.blocks[1].norm  # a block's submodule also used outside the blocks
    with pytest.raises(ValueError, match="shared between block 1 and the rest"):
        stream_module(tied, tied.blocks, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="host_pinned"):
            stream_module(model, blocks, "cpu", host_pinned=True)
    # Nothing was modified by the failed calls.
    assert all(p._base is None for p in model.parameters())
    handle = stream_module(model, blocks, "cpu")
    with pytest.raises(ValueError, match="distinct block indices"):
        handle.set_order([0, 0])
    with handle.manual():
        handle.load(0)
        handle.load(1)
        with pytest.raises(RuntimeError, match="release one first"):
            handle.load(2)
        with pytest.raises(RuntimeError, match="release it"):
            handle.host_tensors(0)


def test_a_block_that_raises_still_releases_its_slot():
    model, blocks, inputs = make("cond")
    ref = copy.deepcopy(model)
    handle = stream_module(model, blocks, "cpu")
    x, c = inputs(2)
    with pytest.raises(RuntimeError):
        model(x, torch.randn(3, 3))  # the condition's batch does not match: block 0 raises
    assert not any(b.loaded for b in handle._blocks)
    assert torch.equal(model(x, c), ref(x, c))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_pin_exact_locks_every_byte_of_the_buffer(monkeypatch, dtype):
    """The lock covers the buffer's bytes, not its element count: a gradient ring of fp32 locked
    at a quarter of its size made CUDA refuse async copies into the rest (cudaErrorInvalidValue)."""
    calls = []

    class Runtime:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append((ptr, nbytes))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    buffer = torch.empty(1000, dtype=dtype)
    pin_exact(buffer)
    assert calls == [(buffer.data_ptr(), 1000 * buffer.element_size())]
