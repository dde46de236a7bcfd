"""The optimizer's disk tier: state in files through a bounded ring, bitwise the RAM tier.

Streamed must equal resident: every state format, several blocks, several steps, blocks stepped
in the ring's order and against it (each block then read on demand); checkpoints (`state_dict`)
are exact, and a crash after write-behind but before the next checkpoint loses nothing the last
checkpoint holds.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaslide.engine.training.finetune_spec import OptimizerSpec
from megaslide.engine.training.optim import CPUAdamW
from megaslide.engine.training.optim_disk import StateLayout
from megaslide.engine.training.state_format import MASTERS, MOMENTS, StateFormat

FORMATS = ["fp32"] + [
    f"{m}/{v}" for m in MASTERS for v in MOMENTS if (m, v) != ("fp32", "fp32") and m != "bf16"
]
SHAPES = {
    0: {"attn.w": (64, 48), "attn.b": (48,)},
    1: {"mlp.w1": (33, 17), "emb": (1000,)},
    2: {"out.w": (40, 40), "norm.scale": (300,)},
    3: {"x.w": (20, 10)},
}


def make_params(state: str):
    g = torch.Generator().manual_seed(0)
    bf16 = StateFormat.parse(state).master_is_compute_copy
    dtype = torch.bfloat16 if bf16 else torch.float32
    return {
        b: {n: torch.randn(s, generator=g).bfloat16().to(dtype) for n, s in named.items()}
        for b, named in SHAPES.items()
    }


def make_grads(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return {
        b: {n: torch.randn(s, generator=g) for n, s in named.items()} for b, named in SHAPES.items()
    }


def make_opt(params, state, tier, tmp_path, **kw):
    disk = dict(state_tier="disk", state_dir=tmp_path / "state") if tier == "disk" else {}
    return CPUAdamW(params, lr=1e-2, weight_decay=0.1, state=state, seed=3, threads=2, **disk, **kw)


def train(opt, params, steps, order, first=0):
    for t in range(first, first + steps):
        grads = make_grads(t)
        for b in order:
            opt.step_block(b, grads[b])


def same(a, b) -> bool:
    return all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


@pytest.mark.parametrize("state", FORMATS)
@pytest.mark.parametrize("order", ["backward", "forward"])
def test_disk_tier_is_bitwise_the_ram_tier(state, order, tmp_path):
    steps = [3, 2, 1, 0] if order == "backward" else [0, 1, 2, 3]
    ram_p, disk_p = make_params(state), make_params(state)
    with (
        make_opt(ram_p, state, "ram", tmp_path) as ram,
        make_opt(disk_p, state, "disk", tmp_path, ring_depth=2) as disk,
    ):
        train(ram, ram_p, 3, steps)
        train(disk, disk_p, 3, steps)
        assert same(ram_p, disk_p)
        ram_sd, disk_sd = ram.state_dict(), disk.state_dict()
        for key in ("m", "v", "codes", "absmax", "lo"):
            if key in ram_sd:
                assert same(ram_sd[key], disk_sd[key]), key
        assert ram_sd["step"] == disk_sd["step"]
        if StateFormat.parse(state).master == "bf16-split":
            assert same(
                {b: ram.master_values(b) for b in SHAPES},
                {b: disk.master_values(b) for b in SHAPES},
            )
        # The ring holds 2 buffers of the largest block's state, not the model's state.
        assert disk.ring_nbytes == 2 * max(
            StateLayout(disk._state_shapes(disk_p[b])).nbytes for b in SHAPES
        )


def test_ring_bytes_and_traffic(tmp_path):
    params = make_params("bf16-sr/8bit")
    with make_opt(params, "bf16-sr/8bit", "disk", tmp_path, ring_depth=3) as opt:
        train(opt, params, 2, [3, 2, 1, 0])
        ring = opt._disk
        ring.flush()
        # Every block read and written once per step (the first step reads the zeros too).
        assert ring.bytes_written == 2 * ring.file_nbytes
        assert ring.bytes_read >= 2 * ring.file_nbytes - ring.ring_nbytes
        assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
            f"block-{k}.{s}" for k in range(4) for s in ("absmax", "codes")
        ]


@pytest.mark.parametrize("state", ["fp32", "bf16-split/8bit", "bf16-sr/8bit"])
def test_resume_after_a_crash_is_bitwise_the_uninterrupted_run(state, tmp_path):
    """Checkpoint after 2 steps, write 1 more step's state behind (the files change), then die
    without closing: a new optimizer loading the checkpoint continues as if nothing happened,
    and checkpoints load across tiers."""
    order = [3, 2, 1, 0]
    ref_p = make_params(state)
    with make_opt(ref_p, state, "ram", tmp_path / "ref") as ref:
        train(ref, ref_p, 4, order)

    params = make_params(state)
    opt = make_opt(params, state, "disk", tmp_path / "a")
    train(opt, params, 2, order)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # the checkpoint: a copy of the files' bytes
    saved_params = {b: {n: t.clone() for n, t in named.items()} for b, named in params.items()}
    train(opt, params, 1, order, first=2)
    opt._disk.flush()  # the write-behind has reached the files: they are past the checkpoint
    opt._pool.shutdown(wait=True)  # "crash": no close(), no final checkpoint

    for tier in ("disk", "ram"):
        params = {b: {n: t.clone() for n, t in named.items()} for b, named in saved_params.items()}
        with make_opt(params, state, tier, tmp_path / "b") as resumed:
            buf.seek(0)
            resumed.load_state_dict(torch.load(buf, weights_only=True))
            train(resumed, params, 2, order, first=2)
            assert same(params, ref_p), tier


def test_from_spec_and_checks(tmp_path):
    params = make_params("fp32")
    spec = OptimizerSpec(state_tier="disk", state_dir=str(tmp_path / "s"))
    with CPUAdamW.from_spec(params, spec, threads=1) as opt:
        assert opt.state_tier == "disk" and opt.ring_nbytes > 0
    with pytest.raises(ValueError, match="state_dir"):
        CPUAdamW(params, state_tier="disk")
    with pytest.raises(ValueError, match="state_tier"):
        OptimizerSpec(state_tier="ssd")


@pytest.mark.parametrize("state", ["fp32", "bf16-sr/8bit"])
def test_clipping_and_accumulation_on_the_disk_tier(state, tmp_path):
    """Clipped and accumulated steps: every block accumulates, then all are stepped in the
    forward order (against the ring's), bitwise the RAM tier."""
    kw = dict(max_grad_norm=0.5, accumulation_steps=2)
    ram_p, disk_p = make_params(state), make_params(state)
    with (
        make_opt(ram_p, state, "ram", tmp_path, **kw) as ram,
        make_opt(disk_p, state, "disk", tmp_path, **kw) as disk,
    ):
        for t in range(2):
            for opt in (ram, disk):
                for micro in range(2):
                    grads = make_grads(10 * t + micro)
                    for b in [3, 2, 1, 0]:
                        opt.accumulate(b, grads[b])
                for b in [0, 1, 2, 3]:
                    opt.step_block(b)
        assert same(ram_p, disk_p)
        assert ram.last_grad_norm == disk.last_grad_norm


CHILD = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from megaslide.engine.atomic import atomic_write
from test_optim_disk import make_opt, make_params, train
from pathlib import Path
state, tmp = {state!r}, Path({tmp!r})
params = make_params(state)
opt = make_opt(params, state, "disk", tmp)
train(opt, params, 2, [3, 2, 1, 0])
atomic_write(tmp / "optimizer.pt", lambda p: torch.save(opt.state_dict(), p))
atomic_write(tmp / "params.pt", lambda p: torch.save(params, p))
writes, real = [0], os.pwritev
def dying(*args):  # the third write-behind of step 3: killed in the middle of it
    writes[0] += 1
    if writes[0] == 3:
        real(args[0], [bytes(len(args[1][0]) // 2)], args[2])
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args)
os.pwritev = dying
train(opt, params, 1, [3, 2, 1, 0], first=2)
"""


@pytest.mark.slow  # starts a process
def test_kill_9_during_write_behind_loses_nothing_the_checkpoint_holds(tmp_path):
    state, order = "bf16-split/8bit", [3, 2, 1, 0]
    code = CHILD.format(tests=str(Path(__file__).parent), state=state, tmp=str(tmp_path))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    ref_p = make_params(state)
    with make_opt(ref_p, state, "ram", tmp_path / "ref") as ref:
        train(ref, ref_p, 4, order)
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    with make_opt(params, state, "disk", tmp_path) as resumed:  # the killed run's directory
        resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
        train(resumed, params, 2, order, first=2)
    assert same(params, ref_p)
