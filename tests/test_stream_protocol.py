"""The streaming protocol on a simulated device: the real streamer, sampler and training step, on
hundreds of random interleavings per scenario, race-free and bitwise equal to the resident run;
and every wait or record in the ordering code, deleted alone, caught.

The scenarios are benchmarks/stream_protocol.py's, which runs them on CUDA with real streams.
`python -m tests.test_stream_protocol` prints which scenarios catch each deletion (the table in
docs/streaming.md).
"""

import json
from pathlib import Path

import pytest
import torch

import stream_protocol
from simulated_device import SimulatedDevice, call_sites, watch_handle, watch_training
from stream_protocol import SCENARIOS, Probe, identical, reference, run, write_model

ROOT = Path(__file__).resolve().parent.parent
CLIP = (2, 8, 8)  # frames, height, width: 4 tokens a frame
ROUNDS = 200  # random interleavings per scenario


class SimProbe(Probe):
    """Runs a scenario on a simulated device: a new landing schedule every round, the work under
    way named in every report."""

    def __init__(self, sim: SimulatedDevice):
        self.sim = sim

    def ordering(self):
        return self.sim.ordering()

    def opened(self, handle, blocks):
        watch_handle(self.sim, handle, blocks)

    def training(self, step):
        watch_training(self.sim, step)

    def round(self, r):
        self.sim.reseed(r)

    def at(self, where):
        self.sim.context = where


@pytest.fixture(autouse=True)
def _one_thread(_deterministic_threads):
    # The micro model's ops are tiny: a second intra-op thread only adds hand-offs, which cost
    # milliseconds each when other work shares the cores. Resident and streamed runs share it.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("protocol") / "model")


def simulate(name, model, rounds, deleted=()):
    sim = SimulatedDevice()
    sim.deleted = set(deleted)
    outputs = run(name, model, "cpu", torch.float32, SimProbe(sim), rounds, CLIP)
    sim.finish()
    return sim, outputs


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_is_race_free_and_bitwise_resident_on_every_interleaving(name, model):
    resident = reference(name, model, "cpu", torch.float32, CLIP)[0]
    sim, outputs = simulate(name, model, ROUNDS)
    sim.check()
    differ = [r for r, out in enumerate(outputs) if not identical(out, resident)]
    assert not differ, f"rounds {differ[:10]} differ from the resident run"
    # The rounds interleaved differently: copies landed early in some, only when waited for in
    # others.
    assert len(outputs) == ROUNDS and sim.landed["early"] and sim.landed["waited for"]


# ------------------------------------------------------------------------------------------------
# Every wait and record of the ordering code, and the scenario that proves it needed

# (method, calling function) -> scenario whose run catches the deletion of that call. `result` is
# a host-side join of the optimizer thread's tasks (see simulated_device.executor).
WAITS = {
    ("compute_wait", "StreamHandle.load"): "prefetch2",
    ("record_on_copy", "StreamHandle._place"): "prefetch2",
    ("copy_wait", "StreamHandle._place"): "prefetch1",
    ("record_on_compute", "StreamHandle.release"): "prefetch1",
    ("record_on_compute", "_open_slots"): "prefetch2",
    ("record_on_compute", "StreamHandle._size_staging"): "lossless",
    ("drain_copies", "StreamHandle.host_tensors"): "training",
    ("drain_copies", "StreamHandle.load_weights"): "reload",
    ("synchronize", "StreamHandle.remove"): "remove",
    ("record_on_compute", "_GradientDrain.send"): "training",
    ("copy_wait", "_GradientDrain.send"): "training",
    ("keep_alive", "_GradientDrain.send"): "training",
    ("record_on_copy", "_GradientDrain.send"): "training",
    ("host_wait", "_GradientDrain.wait"): "training",
    ("result", "_GradientDrain.send"): "training",
    ("result", "BlockwiseStep._finish_step"): "training",
}
ORDERING_CALLS = {
    "compute_wait",
    "copy_wait",
    "record_on_copy",
    "record_on_compute",
    "keep_alive",
    "host_wait",
    "drain_copies",
    "synchronize",
}


def test_the_table_lists_every_wait_in_the_ordering_code():
    sites = call_sites(ROOT / "engine/streaming/streamer.py", ORDERING_CALLS)
    sites |= call_sites(ROOT / "engine/training/blockwise.py", ORDERING_CALLS | {"result"})
    assert sites == set(WAITS)


@pytest.mark.parametrize("site", WAITS, ids=lambda s: f"{s[0]}@{s[1]}")
def test_deleting_a_wait_is_caught(site, model):
    sim, _ = simulate(WAITS[site], model, rounds=2, deleted={site})
    assert sim.calls[site] > 0, f"{site} never ran in {WAITS[site]}: the deletion proves nothing"
    assert sim.races, f"deleting {site} went unnoticed in {WAITS[site]}"


def test_races_name_the_block_the_slot_and_the_step(model):
    sim, outputs = simulate(
        "prefetch2", model, rounds=1, deleted={("compute_wait", "StreamHandle.load")}
    )
    first = sim.races[0]
    assert "compute of block 0" in first and "reads slot 0" in first
    assert "round 0, denoising step 0" in first
    assert not torch.isfinite(outputs[0]).all()  # the data moved: it read the slot's NaN bytes


def test_the_cuda_checks_script_runs_on_the_cpu(model, capsys):
    code = stream_protocol.main(["--device", "cpu", "--rounds", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"]
    assert set(report["scenarios"]) == set(SCENARIOS)
    assert all(s["float32"]["bitwise"] for s in report["scenarios"].values())


def mutation_matrix(model, rounds=2) -> dict:
    """For each wait: the scenarios that catch its deletion, and those whose outputs then differ
    from the resident run in some round."""
    matrix = {}
    for site in WAITS:
        caught, wrong = [], []
        for name in SCENARIOS:
            resident = reference(name, model, "cpu", torch.float32, CLIP)[0]
            sim, outputs = simulate(name, model, rounds, deleted={site})
            if sim.races:
                caught.append(name)
            if any(not identical(out, resident) for out in outputs):
                wrong.append(name)
        matrix[site] = {"caught_by": caught, "outputs_differ": wrong}
    return matrix


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        result = mutation_matrix(write_model(Path(tmp) / "model"), rounds=8)
    for (method, caller), row in result.items():
        print(
            f"{method}@{caller}: caught by {row['caught_by']}; outputs differ in {row['outputs_differ']}"
        )
