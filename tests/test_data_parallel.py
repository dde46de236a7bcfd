"""Fine-tuning on several CPU processes (gloo): data parallel must equal one process.

Not bitwise: one process's loss is the mean over every row of the batch in one reduction, where
each rank takes the mean over its rows and rank 0 the mean of the ranks' gradients, so gradients
agree to fp32 rounding, and AdamW, whose step m / sqrt(v) is about lr wherever a gradient is tiny,
carries a rounding flip there into the weights at full step size. Measured against how far
training moved the weights (||split - one|| / ||one - initial|| over every tensor), after 3 steps
here: 3e-6 on 2 ranks; one process with 1 thread instead of 2 (the same maths, GEMMs reduced in
another order) is 7e-7 from itself. The bound, 1e-4, leaves 30x; a rank's share lost, or trained
on stale weights, is of the order of 1 (1.02 with rank 1's gradients dropped).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from megaslide.engine.atomic import TMP_SUFFIX
from megaslide.engine.native.world import write_dataset
from megaslide.engine.parallel.data_parallel import finetune_on_devices
from megaslide.engine.parallel.ranks import RankFailed
from megaslide.engine.sources import resolve_source
from megaslide.engine.streaming.host_store import SafetensorsFile
from megaslide.engine.training.finetune import list_checkpoints, open_trainer
from megaslide.engine.training.finetune_spec import (
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    RuntimeSpec,
    ScheduleSpec,
)

from mixed_clips import write_mixed_clips

TIMEOUT_S = 120  # a hang fails the test instead of the suite
TINY = resolve_source(preset="tiny")
STEPS = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_dataset(
        tmp_path_factory.mktemp("world") / "data", 12, seed=0, frames=4, height=16, width=16
    )


def spec(output, devices=None, **sections) -> FinetuneSpec:
    base = FinetuneSpec(
        run=RunSpec(output=str(output), save_every=2),
        schedule=ScheduleSpec(steps=STEPS),
        optimizer=OptimizerSpec(lr=2e-3, weight_decay=0.01),
        clips=ClipSpec(frames=4, height=16, width=16, batch_size=4),
        runtime=RuntimeSpec(offload="stream", devices=devices),
    )
    return base.replace(**sections)


def one_process(world, output, **sections) -> dict:
    with open_trainer(TINY, world, spec(output, **sections)) as t:
        t.export(Path(output) / "initial")
        t.run()
        t.save_checkpoint()
        t.export()
    return exported(output)


def exported(output, name="model") -> dict[str, torch.Tensor]:
    """Every tensor of the run's export, by file and name."""
    found = {}
    for path in sorted(Path(output, name).rglob("*.safetensors")):
        f = SafetensorsFile(path)
        found |= {f"{path.name}:{k}": f[k].clone() for k in f}
    return found


def norm(tensors) -> float:
    return sum(t.double().square().sum() for t in tensors).sqrt().item()


def off_by(ours: dict, ref: dict, initial: dict) -> float:
    """How far `ours` is from `ref`, as a fraction of how far training moved `ref`."""
    assert ours.keys() == ref.keys() == initial.keys() and ref
    return norm(ours[k] - ref[k] for k in ref) / norm(ref[k] - initial[k] for k in ref)


def metrics(output) -> list[dict]:
    return [json.loads(line) for line in Path(output, "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory):
    """One process on the whole batch: the weights and metrics every split must reproduce."""
    output = tmp_path_factory.mktemp("one")
    return one_process(world, output), metrics(output), exported(output, "initial")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.slow
def test_data_parallel_equals_one_process(ranks, world, reference, tmp_path):
    weights, steps, initial = reference
    started, seen = [], []
    result = finetune_on_devices(
        TINY,
        world,
        spec(tmp_path, ("cpu",) * ranks),
        on_start=lambda step, total: started.append((step, total)),
        progress=seen.append,
        timeout_s=TIMEOUT_S,
        threads=1,
    )
    assert started == [(0, STEPS)] and [m["step"] for m in seen] == list(range(1, STEPS + 1))
    assert result["step"] == STEPS and result["model"] == str(tmp_path / "model")
    # fp32 reduction order only (module docstring).
    assert off_by(exported(tmp_path), weights, initial) <= 1e-4
    # Rank 0 reports the whole batch: its loss and gradient norm are one process's (AdamW hardly
    # sees a gradient summed but not averaged over the ranks; the norm does).
    written = metrics(tmp_path)
    for key in ("loss", "grad_norm", "lr"):
        assert [m[key] for m in written] == pytest.approx([m[key] for m in steps], rel=1e-5)
    # Written once: the checkpoints of one process, nothing half-written.
    assert [c["step"] for c in list_checkpoints(tmp_path)] == [2, 3]
    assert not list(tmp_path.rglob(f"*{TMP_SUFFIX}"))


@pytest.mark.slow
def test_rank_killed_mid_run_fails_the_run_and_leaves_whole_checkpoints(world, tmp_path):
    pids: list[int] = []

    def kill_rank_1(m):
        if m["step"] == 1:
            os.kill(pids[1], signal.SIGKILL)

    run = spec(tmp_path, ("cpu", "cpu"), schedule={"steps": 50}, run={"save_every": 1})
    with pytest.raises(RankFailed, match=r"rank 1 \(cpu\) failed: killed by SIGKILL") as failed:
        finetune_on_devices(
            TINY, world, run, on_spawn=pids.extend, progress=kill_rank_1, timeout_s=TIMEOUT_S
        )
    assert failed.value.rank == 1
    for pid in pids:  # the launcher stopped rank 0 too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    done = list_checkpoints(tmp_path)
    assert done and done[-1]["step"] < 50
    assert not list(tmp_path.rglob(f"*{TMP_SUFFIX}"))  # no half-written checkpoint or export
    for c in done:  # each one whole: it opens for training again
        assert (Path(c["path"]) / "optimizer.pt").is_file()


@pytest.mark.slow
def test_checkpoints_carry_a_run_between_one_device_and_several(world, reference, tmp_path):
    """A split run writes one process's checkpoints and resumes from them: steps 1, 2 and 3 on
    one process, two, and one again end where one process alone does."""
    weights, steps, initial = reference
    with open_trainer(TINY, world, spec(tmp_path, schedule={"until": 1})) as t:
        t.run()
        t.save_checkpoint()
    split = spec(tmp_path, ("cpu", "cpu"), schedule={"until": 2})
    started = []
    finetune_on_devices(
        TINY, world, split, resume=True, on_start=lambda *a: started.append(a), timeout_s=TIMEOUT_S
    )
    assert started == [(1, STEPS)]
    assert [c["step"] for c in list_checkpoints(tmp_path)] == [1, 2]
    with open_trainer(TINY, world, spec(tmp_path), resume=True) as t:
        assert t.step == 2
        t.run()
        t.export()
    assert off_by(exported(tmp_path), weights, initial) <= 1e-4
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3]
    assert [m["loss"] for m in metrics(tmp_path)] == pytest.approx(
        [m["loss"] for m in steps], rel=1e-5
    )


def test_runs_that_cannot_split_are_refused_before_anything_starts(world, tmp_path):
    for devices, sections, message in [
        (("cpu", "cpu", "cpu"), {}, "clips.batch_size must be a multiple of the 3"),
        (
            ("cpu", "cpu"),
            {"runtime": {"offload": "none"}},
            "runtime: devices streams every rank from one shared host copy: needs offload='stream'",
        ),
        (("cpu",), {}, "two or more"),
        (("cpu", "cuda:0"), {}, "all cpu, or all cuda"),
    ]:
        with pytest.raises(ValueError, match=message):
            finetune_on_devices(TINY, world, spec(tmp_path, devices, **sections))
    with pytest.raises(ValueError, match="finetune_on_devices"):
        open_trainer(TINY, world, spec(tmp_path, ("cpu", "cpu")))
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_bad_dataset_fails_the_run_with_its_error(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metadata.jsonl").write_text('{"file": "missing.mp4", "text": "a clip"}\n')
    with pytest.raises(
        RankFailed, match=r"(?s)rank 0 \(cpu\) failed: .*DatasetError.*missing\.mp4"
    ):
        finetune_on_devices(TINY, bad, spec(tmp_path / "out", ("cpu", "cpu")), timeout_s=TIMEOUT_S)


@pytest.mark.slow
def test_cli_finetune_on_two_cpu_processes(world, reference, tmp_path, capsys):
    from megaslide.cli.main import main

    weights, _, initial = reference
    flags = ["finetune", "--preset", "tiny", "--data", str(world), "--frames", "4"]
    flags += ["--size", "16x16", "--batch-size", "4", "--steps", str(STEPS), "--lr", "2e-3"]
    flags += ["--weight-decay", "0.01", "--save-every", "2", "--no-progress"]
    assert main([*flags, "--output", str(tmp_path), "--devices", "cpu,cpu"]) == 0
    assert "(2 devices)" in capsys.readouterr().err
    assert off_by(exported(tmp_path), weights, initial) <= 1e-4
    for extra, message in [
        (["--devices", "cpu"], "two or more"),
        (
            ["--devices", "cpu,cpu", "--offload", "none"],
            "runtime: devices streams every rank from one shared host copy: needs offload='stream'",
        ),
        (["--devices", "cpu,cpu", "--stats", "s.json"], "neither --stats nor --trace"),
        (["--devices", "cpu,cpu", "--batch-size", "3"], "multiple of the 2"),
    ]:
        assert main([*flags, "--output", str(tmp_path / "x"), *extra]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("state", ["bf16-split/8bit", "bf16-sr/8bit"])
@pytest.mark.slow
def test_data_parallel_trains_a_bf16_master(state, world, tmp_path):
    """Rank 0 updates the one bf16 master in shared memory (its low halves and 8-bit moments in
    its optimizer), every rank streams from it; a checkpoint resumes it on one process."""
    optimizer = {"lr": 2e-3, "weight_decay": 0.01, "state": state}
    one = tmp_path / "one"
    one_process(world, one, optimizer=optimizer)
    split = spec(tmp_path / "two", ("cpu", "cpu"), optimizer=optimizer, schedule={"until": 2})
    finetune_on_devices(TINY, world, split, timeout_s=TIMEOUT_S, threads=1)
    assert [c["step"] for c in list_checkpoints(tmp_path / "two")] == [2]
    with open_trainer(TINY, world, spec(tmp_path / "two", optimizer=optimizer), resume=True) as t:
        t.run()
        t.export()
    ours, ref, initial = exported(tmp_path / "two"), exported(one), exported(one, "initial")
    assert {t.dtype for t in ours.values()} == {torch.float32}  # the masters' fp32 values
    # bf16 compute and its rounding of the weights carry the reduction order further than fp32
    # does: measured 0.014 (bf16-split/8bit) and 0.020 (bf16-sr/8bit) here; a lost share is of
    # the order of 1 (module docstring).
    assert off_by(ours, ref, initial) <= 0.1
    written, steps = metrics(tmp_path / "two"), metrics(one)
    assert [m["loss"] for m in written] == pytest.approx([m["loss"] for m in steps], rel=1e-2)


@pytest.mark.slow
def test_clips_in_buckets_split_as_one_process_trains_them(tmp_path):
    """Every rank plans and orders the buckets alike: each step all take the same bucket, and the
    run ends where one process does."""
    data = write_mixed_clips(tmp_path / "data", [(16, 16, 4), (24, 16, 6)] * 3)
    # Buckets with a size asked for: its clip (16x16x4) only sets the budget and the frames.
    mixed = {"clips": {"batch_size": 2, "buckets": True}}
    one = tmp_path / "one"
    reference = one_process(data, one, **mixed)
    plans = []
    finetune_on_devices(
        TINY,
        data,
        spec(tmp_path / "split", ("cpu", "cpu"), **mixed),
        on_plan=plans.append,
        timeout_s=TIMEOUT_S,
        threads=1,
    )
    assert len(plans) == 1 and plans[0][0].startswith("2 bucket(s) of at most 64 tokens")
    initial = exported(one, "initial")
    assert off_by(exported(tmp_path / "split"), reference, initial) <= 1e-4
