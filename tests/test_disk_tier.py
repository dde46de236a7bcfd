"""The disk tier: streamed blocks read from the model's files each step through a bounded ring.

Streamed output must be bitwise that of RAM streaming (our DiT in fp32, where the bf16 file is
cast on read, and in bf16, where the file's bytes land in the ring as they are; a tiny two-expert
Wan with a streamed text encoder). Host RAM for block weights must be bounded by the ring: the
ring's bytes are a few blocks, and a child process's peak RSS grows by far less than the blocks'
bytes. Errors name the file or tensor. `auto` picks disk when RAM is short.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from megaslide.engine import VideoRequest, open_pipeline
from megaslide.engine.native.checkpoint import save_model
from megaslide.engine.native.config import DiTConfig
from megaslide.engine.planner import Machine, Workload, format_plan, plan
from megaslide.engine.sources import describe, packaged_models, resolve_source
from megaslide.engine.streaming.disk_store import DiskTierError
from megaslide.engine.streaming.host_store import read_safetensors_header
from megaslide.engine.streaming.streamer import stream_module

ROOT = Path(__file__).resolve().parents[1]
REQUEST = VideoRequest("a red circle moving left on a black background", seed=3, steps=2)


@pytest.fixture(scope="module")
def ram_frames():
    """Frames of RAM streaming by dtype, and the fp32 streamer's stats."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        pipe = open_pipeline(dtype=dtype, offload="stream")
        out[dtype] = pipe.generate(REQUEST)
        out[dtype + "_stats"] = pipe.stats()["dit"]
    return out


@pytest.mark.parametrize(
    "dtype, io", [("float32", "buffered"), ("bfloat16", "buffered"), ("bfloat16", "direct")]
)
def test_disk_tier_is_bitwise_ram_streaming(ram_frames, dtype, io):
    """fp32: the bf16 file is cast on read; bf16: the file's bytes land in the ring as they are
    (or, with O_DIRECT, are copied there from an aligned buffer). Two steps: the second reads
    every block again, through the same ring."""
    pipe = open_pipeline(dtype=dtype, offload="stream", host_tier="disk", disk_io=io)
    assert np.array_equal(pipe.generate(REQUEST), ram_frames[dtype])
    stats = pipe.stats()["dit"]
    assert stats["host_tier"] == "disk" and stats["streamed_blocks"] > 0
    assert stats["h2d_bytes"] >= 2 * stats["streamed_block_bytes"]
    # The reader thread ends with the handle.
    thread = pipe.handles["dit"]._blocks[0].store.ring._core.thread
    assert thread is not None and thread.is_alive()
    pipe.close()
    assert not thread.is_alive()


def test_disk_tier_with_resident_blocks_is_bitwise(ram_frames):
    stats = ram_frames["float32_stats"]
    budget = stats["non_block_bytes"] + 3 * stats["slot_bytes"]  # one resident, the rest streamed
    pipe = open_pipeline(offload="stream", host_tier="disk", gpu_budget_bytes=budget)
    stats = pipe.stats()["dit"]
    assert stats["resident_blocks"] > 0 and stats["streamed_blocks"] > 0
    assert np.array_equal(pipe.generate(REQUEST), ram_frames["float32"])


def test_tiny_wan_on_the_disk_tier_is_bitwise(tmp_path):
    pytest.importorskip("diffusers")
    from wan_fixtures import build_tiny_wan, request

    model = build_tiny_wan(tmp_path / "experts", experts=2)
    ref = open_pipeline(model, dtype="bfloat16", offload="stream").generate(request(seed=1))
    pipe = open_pipeline(model, dtype="bfloat16", offload="stream", host_tier="disk")
    assert set(pipe.stats()) == {"text_encoder", "transformer", "transformer_2"}
    assert all(s["host_tier"] == "disk" for s in pipe.stats().values())
    assert np.array_equal(pipe.generate(request(seed=1)), ref)


def many_blocks(path: Path) -> Path:
    """A model directory whose blocks are most of its bytes: 32 blocks of width 256 (fp32,
    4.2 MB each), the tiny preset's text encoder."""
    from megaslide.engine.native.dit import VideoDiT

    tiny = open_pipeline(resolve_source(preset="tiny"))
    torch.manual_seed(0)
    dit = VideoDiT(DiTConfig(dim=256, depth=32, heads=4, ffn_dim=1024))
    # Saved in bf16 (half the file to write), opened in fp32: reads go through the cast path.
    return save_model(path, dit, tiny.text_encoder, tiny.info.sampling, dtype=torch.bfloat16)


PEAK_RSS = textwrap.dedent(
    """
    import json, sys
    from megaslide.engine import VideoRequest, open_pipeline
    from megaslide.engine.sources import resolve_source

    def rss():  # resident set now, and its peak, in bytes
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024

    # Imports, torch's meta kernels and a first pass's workspaces are not the cost of the tier.
    warm = open_pipeline(resolve_source(preset="tiny"), offload="stream")
    warm.generate(VideoRequest("warm", seed=0, steps=1, frames=4, width=32, height=32))
    warm.close()
    before, _ = rss()
    pipe = open_pipeline(sys.argv[1], offload="stream", host_tier=sys.argv[2])
    pipe.generate(VideoRequest("a ball", seed=0, steps=1, frames=4, width=32, height=32))
    stats = pipe.stats()["dit"]
    print(json.dumps({"growth": rss()[1] - before, **stats}))
    """
)


def peak_rss(path: Path, tier: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-P", "-c", PEAK_RSS, str(path), tier],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(done.stdout)


@pytest.mark.slow
def test_host_ram_for_blocks_is_bounded_by_the_ring(tmp_path):
    """Streaming 32 blocks (135 MB) from disk holds a ring of 4 blocks (17 MB): peak RSS grows by
    the ring, the two slots of the CPU "device", activations and the non-block weights (0.34x the
    blocks' bytes, measured 2026-12-05), where the RAM tier holds every block (1.20x)."""
    model = many_blocks(tmp_path / "m")
    r = peak_rss(model, "disk")
    blocks = r["streamed_block_bytes"]
    assert blocks > 130e6 and r["streamed_blocks"] == 32
    assert r["host_tier"] == "disk"
    assert r["host_store_bytes"] == 4 * r["slot_bytes"]  # the ring: 4 buffers of the largest block
    assert r["growth"] < 0.5 * blocks, {k: r[k] for k in ("growth", "host_store_bytes")}


def test_a_missing_or_truncated_file_is_named(tmp_path):
    src = packaged_models()["megaslide-tiny"]
    model = tmp_path / "m"
    model.mkdir()
    for f in src.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    weights = model / "model.safetensors"
    pipe = open_pipeline(model, offload="stream", host_tier="disk")
    # Cut the file inside its last block tensor (the tensors after it are loaded already).
    extents = read_safetensors_header(str(weights))
    last = max((e for k, e in extents.items() if k.startswith("blocks.")), key=lambda e: e.offset)
    with open(weights, "r+b") as f:
        f.truncate(last.offset + last.nbytes // 2)
    with pytest.raises(DiskTierError, match="model.safetensors is truncated"):
        pipe.generate(REQUEST)
    weights.unlink()
    with pytest.raises(DiskTierError, match="model.safetensors: the model file is gone"):
        pipe.generate(REQUEST)


def test_a_shape_mismatch_names_the_tensor(tmp_path):
    from safetensors.torch import save_file

    from megaslide.engine.loader import open_model
    from megaslide.engine.streaming.host_store import SafetensorsFile

    info = describe(resolve_source())
    parts, handles = open_model(info, offload="stream", host_tier="disk")
    handle = handles["dit"]
    state = {
        k: v.clone() for k, v in SafetensorsFile(info.source.path / "model.safetensors").items()
    }
    state["blocks.1.mlp.0.weight"] = torch.zeros(3, 3)
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(DiskTierError, match=r"'blocks\.1\.mlp\.0\.weight': checkpoint shape"):
        handle.load_weights(tmp_path / "bad.safetensors")
    # A source that is no file (a converted tensor, a state dict) cannot be read from disk.
    with pytest.raises(DiskTierError, match="converted on load"):
        handle.load_weights(state, strict=False)


def test_what_the_disk_tier_refuses():
    with pytest.raises(ValueError, match="a preset's random weights have none"):
        open_pipeline(resolve_source(preset="tiny"), offload="stream", host_tier="disk")
    with pytest.raises(ValueError, match="needs offload='stream'"):
        open_pipeline(host_tier="disk")
    with pytest.raises(ValueError, match="weights='raw'"):
        open_pipeline(offload="stream", host_tier="disk", weights="lossless")
    pipe = open_pipeline(offload="stream", host_tier="disk")
    with pytest.raises(ValueError, match="fine-tuning needs host_tier='ram'"):
        pipe.handles["dit"].host_tensors(0)
    info = describe(resolve_source())
    with pytest.raises(ValueError, match="needs host_tier='ram'"):
        plan(info, Machine(), Workload(mode="finetune", host_tier="disk"))
    with pytest.raises(ValueError, match="host_tier must be"):
        stream_module(pipe.dit, pipe.dit.blocks, "cpu", host_tier="nvme")


def test_auto_picks_disk_when_ram_is_short(monkeypatch):
    import megaslide.engine.planner as planner

    # The tier's choice alone (1 MB would fit no tier: the refusal is test_host_memory.py's).
    monkeypatch.setenv(planner.HOST_MEMORY_CHECK_ENV, "off")
    monkeypatch.setattr(planner, "available_ram_bytes", lambda: 1_000_000)  # 1 MB free
    pipe = open_pipeline(offload="stream", host_tier="auto")
    assert pipe.stats()["dit"]["host_tier"] == "disk"
    monkeypatch.setattr(planner, "available_ram_bytes", lambda: 1 << 40)
    pipe = open_pipeline(offload="stream", host_tier="auto")
    assert pipe.stats()["dit"]["host_tier"] == "ram"
    # A preset has no files: auto stays in RAM however short it is.
    monkeypatch.setattr(planner, "available_ram_bytes", lambda: 1_000_000)
    pipe = open_pipeline(resolve_source(preset="tiny"), offload="stream", host_tier="auto")
    assert pipe.stats()["dit"]["host_tier"] == "ram"


def test_the_plan_reports_the_disk_bound_step():
    info = describe(resolve_source(preset="wan-14b"))
    ram = plan(info, Machine(host_mem=256e9), Workload(host_tier="auto"))
    assert ram["host_tier"] == "ram" and "disk" not in ram["time_s"]
    short = plan(info, Machine(host_mem=32e9, disk_gbps=2.0), Workload(host_tier="auto"))
    assert short["host_tier"] == "disk"
    assert short["host"]["total"] < 0.5 * ram["host"]["total"]
    assert short["bytes_per_step"]["disk"] == short["bytes_per_step"]["h2d"]
    assert short["time_s"]["disk"] == pytest.approx(short["bytes_per_step"]["disk"] / 2e9)
    assert short["time_s"]["step"] == max(
        short["time_s"][k] for k in ("compute", "transfer", "disk")
    )
    assert "host tier disk (auto: the RAM tier does not fit)" in format_plan(short)


def test_cli_host_tier(capsys, tmp_path):
    from megaslide.cli.main import main

    assert main(["plan", "--preset", "wan-14b", "--host-mem", "32GB", "--disk-gbps", "2"]) == 0
    out = capsys.readouterr().out
    assert "host tier disk" in out and "at 2 GB/s" in out
    code = main(["generate", "x", "--host-tier", "disk", "--output", str(tmp_path / "a.mp4")])
    assert code == 2
    assert "--host-tier disk" in capsys.readouterr().err


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.GELU()) for _ in range(6)
        )

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _ring_on_sim(tmp_path, deleted=(), seeds=6):
    """A six-block stack streamed from disk through a two-buffer ring on a simulated device, run
    under `seeds` landing schedules with the `deleted` ordering call sites: the device and whether
    each run matched the resident stack."""
    from safetensors.torch import save_file

    from simulated_device import SimulatedDevice, watch_ring

    torch.manual_seed(0)
    ref = _Stack()
    save_file(ref.state_dict(), tmp_path / "stack.safetensors")
    with torch.device("meta"):
        model = _Stack()
    sim = SimulatedDevice()
    sim.deleted = set(deleted)
    handle = stream_module(
        model, model.blocks, "cpu", ordering=sim.ordering(), host_tier="disk", ring_depth=2
    )
    handle.load_weights(tmp_path / "stack.safetensors")
    watch_ring(sim, handle._blocks[0].store)
    equal = []
    for seed in range(seeds):
        sim.reseed(seed)
        x = torch.randn(3, 40)
        equal.append(torch.equal(model(x), ref(x)))
    handle.remove()
    sim.finish()
    return sim, equal


def test_ring_reuse_waits_for_the_copy_on_the_simulated_device(tmp_path):
    """Copies land as late as the recorded waits allow (a copy reads its source when it lands):
    a ring buffer refilled before the copy out of it had landed would send the wrong block."""
    sim, equal = _ring_on_sim(tmp_path)
    sim.check()
    assert all(equal), equal


# The ring's ordering calls: the copy out of a buffer records an event, and the reader waits on it
# before refilling the buffer. On CUDA a wait on an event never recorded returns at once.
RING_WAITS = [("record_on_copy", "_RingCore.release"), ("host_wait", "_RingCore.run")]


def test_the_ring_table_lists_every_ordering_call_of_the_disk_tier():
    from simulated_device import call_sites

    methods = {"record_on_copy", "record_on_compute", "compute_wait", "copy_wait", "host_wait"}
    methods |= {"keep_alive", "drain_copies", "synchronize"}
    assert call_sites(ROOT / "engine/streaming/disk_store.py", methods) == set(RING_WAITS)


@pytest.mark.parametrize("site", RING_WAITS, ids=lambda s: f"{s[0]}@{s[1]}")
def test_deleting_a_ring_wait_is_caught(tmp_path, site):
    sim, _ = _ring_on_sim(tmp_path, deleted={site}, seeds=2)
    assert sim.calls[site] > 0, f"{site} never ran: the deletion proves nothing"
    assert sim.races, f"deleting {site} went unnoticed"
