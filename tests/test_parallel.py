"""One video on several CPU processes (gloo): sequence parallel must equal one process.

Bitwise, not within a tolerance: sharding the sequence changes no reduction. Row-wise layers
(projections, norms, RoPE, cross-attention, MLP) compute each token's row alone, attention
computes each head alone and, after the all-to-all, over the same keys in the same order, and the
all-to-alls and the gather only move bytes. Observed bitwise on this machine's CPU kernels;
a CPU GEMM whose blocking depended on the row count would break it, and then the bound would be
one uint8 level.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from megaslide.engine.family import family
from megaslide.engine.loader import open_pipeline, share_weights
from megaslide.engine.parallel.multidevice import RankFailed, generate_on_devices, parse_devices
from megaslide.engine.parallel.ranks import join_group, run_ranks
from megaslide.engine.request import VideoRequest, resolve
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.streaming.host_store import SharedWeights

TIMEOUT_S = 120  # a hang fails the test instead of the suite


def tiny(attention: str = "dense", size: int = 16, **request):
    # 3D-DSA with 2x2-token tiles: 3 tiles a side (its window) from 24 pixels.
    tile = {"dsa_tile": (1, 2, 2)} if attention == "dsa" else {}
    info = describe(resolve_source(preset="tiny"), attention=attention, **tile)
    fields = dict(prompt="a red circle moving left", frames=4, width=size, height=size, steps=2)
    request = VideoRequest(**{**fields, "seed": 3, **request})
    video = resolve(request, info.limits, info.sampling, model=info.name)
    return info, video


@pytest.mark.parametrize(
    "attention, size, world",
    [("dense", 16, 2), ("dsa", 24, 2)],
)
@pytest.mark.slow
def test_sequence_parallel_equals_one_process_bitwise(attention, size, world):
    info, video = tiny(attention, size)
    one = open_pipeline(info, offload="stream").generate(video)
    steps = []
    split = generate_on_devices(
        info,
        video,
        ["cpu"] * world,
        timeout_s=TIMEOUT_S,
        progress=lambda step, total: steps.append((step, total)),
    )
    assert split.dtype == np.uint8 and split.shape == one.shape
    assert np.array_equal(split, one), f"max difference {np.abs(split.astype(int) - one).max()}"
    assert steps == [(1, 2), (2, 2)]


@pytest.mark.slow
def test_wan_sequence_parallel_equals_one_process_bitwise(tmp_path):
    from wan_fixtures import build_tiny_wan

    info = describe(resolve_source(str(build_tiny_wan(tmp_path / "wan"))))
    request = VideoRequest(prompt="a red circle", steps=2, seed=3)
    video = resolve(request, info.limits, info.sampling, model=info.name)
    one = open_pipeline(info, offload="stream").generate(video)
    split = generate_on_devices(info, video, ["cpu", "cpu"], timeout_s=TIMEOUT_S)
    assert np.array_equal(split, one), f"max difference {np.abs(split.astype(int) - one).max()}"
    dsa = describe(info.source, attention="dsa")
    with pytest.raises(ValueError, match="dense attention only"):
        family("wan").check_parallel(dsa, video.frames, video.height, video.width, 2)


@pytest.mark.slow
def test_rank_killed_mid_job_fails_the_job_naming_the_rank():
    info, video = tiny(steps=50)
    pids: list[int] = []

    def kill_rank_1(step, total):
        if step == 1:
            os.kill(pids[1], signal.SIGKILL)

    with pytest.raises(RankFailed, match=r"rank 1 \(cpu\) failed: killed by SIGKILL") as failed:
        generate_on_devices(
            info, video, "cpu,cpu", timeout_s=TIMEOUT_S, on_spawn=pids.extend, progress=kill_rank_1
        )
    assert failed.value.rank == 1
    for pid in pids:  # the launcher stopped the survivor too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _barrier_after_rank_1_dies(link, job) -> None:
    import torch.distributed as dist

    join_group(link)
    if link.rank == 1:
        # Its connections close first, its exit comes a moment later: rank 0's error is seen
        # first, as it may be when a process dies (its sockets close before it is reaped).
        dist.destroy_process_group()
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 raises here: its peer's connection closed


@pytest.mark.slow
def test_a_rank_whose_peer_died_names_the_dead_rank_not_itself():
    # Rank 0 reports an error of its own (the closed connection) as rank 1 dies: the job's
    # failure is rank 1's death.
    with pytest.raises(RankFailed, match=r"rank 1 \(cpu\) failed: killed by SIGKILL"):
        run_ranks(_barrier_after_rank_1_dies, None, ["cpu", "cpu"], timeout_s=TIMEOUT_S)


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_job_with_its_error(monkeypatch):
    from megaslide.engine.parallel import rank_group

    info, video = tiny()
    # Weights the ranks cannot open from: each raises (not hangs) while opening the model.
    monkeypatch.setattr(rank_group, "share_weights", lambda *a, **kw: SharedWeights({}, {}))
    with pytest.raises(RankFailed, match=r"rank \d \(cpu\) failed: ValueError: .*lack component"):
        generate_on_devices(info, video, ["cpu", "cpu"], timeout_s=TIMEOUT_S)


def test_shapes_that_do_not_split_are_refused_before_anything_starts():
    info, video = tiny(size=16, frames=3)  # 3 x 4 x 4 = 48 tokens: not a multiple of 32
    fam = family(info.family)
    with pytest.raises(ValueError, match="heads \\(4\\) to be a multiple of 8"):
        fam.check_parallel(info, video.frames, video.height, video.width, 8)
    info, video = tiny("dsa", 24, frames=3)  # 3 frames: not 2 x the tile's 1
    with pytest.raises(ValueError, match="3D-DSA over 2 devices needs the token grid's frames"):
        generate_on_devices(info, video, ["cpu", "cpu"], timeout_s=TIMEOUT_S)


def test_devices_are_checked():
    assert parse_devices("cpu, cpu") == ["cpu", "cpu"]
    for bad, message in [
        ("cpu", "two or more"),
        ("cpu,cuda:0", "all cpu, or all cuda"),
        ("cuda,cuda", "by index"),
        ("cuda:0,cuda:0", "named twice"),
        ("tpu,tpu", "devices tpu,tpu"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_devices(bad)


def test_shared_weights_are_one_copy_in_shared_memory():
    info, _ = tiny()
    shared = share_weights(info, torch.float32)
    assert len(shared.blocks["dit"]) == info.config.depth
    assert all(b.is_shared() and b.dtype == torch.uint8 for b in shared.blocks["dit"])
    assert all(t.is_shared() for ts in shared.tensors.values() for t in ts.values())
    assert not any(k.startswith("blocks.") for k in shared.tensors["dit"])  # in the buffers only
    # A pipeline opened from them streams from those very buffers: no copy of its own.
    pipe = open_pipeline(info, offload="stream", shared=shared)
    ptrs = {b.data_ptr() for b in pipe.handles["dit"].host_buffers()}
    assert ptrs == {b.data_ptr() for b in shared.blocks["dit"]}
    with pytest.raises(ValueError, match="need offload='stream'"):
        open_pipeline(info, shared=shared)
    one = open_pipeline(info, offload="stream")
    for a, b in zip(pipe.dit.state_dict().values(), one.dit.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_cli_generate_on_two_cpu_processes_writes_the_same_mp4(tmp_path, capsys):
    from megaslide.cli.main import main

    flags = ["a red circle", "--preset", "tiny", "--frames", "4", "--size", "16x16"]
    flags += ["--steps", "2", "--no-progress", "--cache", "first-block:1"]  # a cache: taken
    one, split = tmp_path / "one.mp4", tmp_path / "split.mp4"
    assert main(["generate", *flags, "-o", str(one)]) == 0
    assert main(["generate", *flags, "-o", str(split), "--devices", "cpu,cpu"]) == 0
    assert "2 devices" in capsys.readouterr().err
    assert split.read_bytes() == one.read_bytes()  # the same frames encode to the same file
    for extra, message in [
        (["--devices", "cpu"], "two or more"),
        (["--devices", "cpu,cpu", "--offload", "none"], "--offload stream"),
        (["--devices", "cpu,cpu", "--trace", "t.json"], "--stats has each's"),
    ]:
        assert main(["generate", *flags, "-o", str(tmp_path / "x.mp4"), *extra]) == 2
        assert message in capsys.readouterr().err
