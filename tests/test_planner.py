"""The planner's accounting: each figure follows from the config and the machine."""

from dataclasses import replace
from pathlib import Path

import pytest

from megaslide.engine.loader import open_pipeline
from megaslide.engine.native.family import count_parameters
from megaslide.engine.planner import Machine, Workload, format_plan, plan
from megaslide.engine.sources import describe, resolve_source


def preset(name: str):
    return describe(resolve_source(preset=name))


def test_inference_streams_every_block_by_default_and_time_is_bounded_by_the_slower_side():
    info = preset("megaslide-105b")
    config = info.config
    p = plan(info, Machine(), Workload())
    counts = count_parameters(config)
    assert p["streamed_blocks"] == config.depth and p["resident_blocks"] == 0
    assert p["device"]["slots"] == 2 * counts["per_block"] * 2
    assert p["host"]["compute_dtype_weights"] == 2 * counts["total"]
    assert p["bytes_per_step"]["h2d"] == config.depth * counts["per_block"] * 2
    slow_link = plan(info, Machine(h2d_gbps=1.0), Workload())
    assert slow_link["time_s"]["bound"] == "transfer"


def test_budget_makes_blocks_resident_and_reduces_traffic():
    info = preset("small")
    depth = info.config.depth
    block = count_parameters(info.config)["per_block"] * 2
    everything = plan(info, Machine(), Workload())
    budget = everything["device"]["non_block_weights"] + 2 * block + 3 * block
    p = plan(info, Machine(), Workload(gpu_budget=budget))
    assert p["resident_blocks"] == 3 and p["streamed_blocks"] == depth - 3
    assert p["device"]["weights"] <= budget
    assert p["bytes_per_step"]["h2d"] == (depth - 3) * block


def test_verdict_names_the_broken_constraint():
    p = plan(preset("megaslide-105b"), Machine(host_mem=1e12), Workload(mode="finetune"))
    assert not p["fits"] and "host memory" in p["problems"][0]
    with pytest.raises(ValueError, match="mode"):
        plan(preset("tiny"), Machine(), Workload(mode="train"))


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_predicted_device_weights_match_the_streamers_accounting(name):
    pipe = open_pipeline(resolve_source(preset=name), offload="stream")
    text_bytes = sum(p.numel() * 4 for p in pipe.text_encoder.parameters())
    # The text encoder is resident too.
    measured = pipe.handles["dit"].stats()["peak_device_weight_bytes"] + text_bytes
    pipe.close()
    predicted = plan(preset(name), Machine(), Workload(dtype_bytes=4))["device"]["weights"]
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


def test_sequence_parallel_splits_compute_and_counts_the_all_to_all():
    info = preset("wan-14b")
    config = info.config
    one = plan(info, Machine(), Workload())
    two = plan(info, Machine(), Workload(devices=2))
    n, rows, D, b = one["tokens"], one["batch_rows"], config.dim, 2
    # Per block each device sends half of its q, k, v and output (4 x rows x N/2 x D values), and
    # once a step half of the gathered hidden states' worth.
    sent = config.depth * 4 * rows * (n // 2) * D * b // 2 + rows * (n // 2) * D * b
    assert two["bytes_per_step"]["all_to_all"] == sent and one["bytes_per_step"]["all_to_all"] == 0
    comm = two["time_s"]["communication"]
    assert comm == pytest.approx(sent / (Machine().link_gbps * 1e9))
    assert two["time_s"]["compute"] == pytest.approx(one["time_s"]["compute"] / 2 + comm)
    # Each device still streams every block, all from the one host copy (not one per device).
    assert two["bytes_per_step"]["h2d"] == one["bytes_per_step"]["h2d"]
    assert two["host"]["total"] == one["host"]["total"]
    assert two["fits"]
    three = plan(info, Machine(), Workload(devices=3))
    assert not three["fits"] and "heads (40) to be a multiple of 3" in three["problems"][0]


def test_data_parallel_finetuning_splits_the_batch_over_one_host_master():
    info = preset("small")
    one = plan(info, Machine(), Workload(mode="finetune", batch=4))
    two = plan(info, Machine(), Workload(mode="finetune", batch=4, devices=2))
    # Each device runs half of the rows; the master and AdamW's moments are one, in host RAM.
    assert two["batch_rows"] == one["batch_rows"] // 2 == 2
    assert two["device"]["activations"] == one["device"]["activations"] // 2
    assert two["host"]["total"] == one["host"]["total"]
    # Each block's fp32 gradients are reduced onto rank 0: half of them sent per device.
    sent = info.config.depth * one["per_block_parameters"] * 4 // 2
    assert two["bytes_per_step"]["gradient_reduce"] == sent
    assert one["bytes_per_step"]["gradient_reduce"] == 0
    comm = two["time_s"]["communication"]
    assert comm == pytest.approx(sent / (Machine().link_gbps * 1e9))
    assert two["time_s"]["compute"] == pytest.approx(one["time_s"]["compute"] / 2 + comm)
    assert two["fits"]
    odd = plan(info, Machine(), Workload(mode="finetune", batch=3, devices=2))
    assert not odd["fits"] and "batch 3 does not split over 2 devices" in odd["problems"][0]


def test_streaming_levers_on_several_devices_count_one_host_copy_and_each_devices_budget():
    info = preset("wan-14b")
    # A coded format: one coded copy for the host, each device its slots and staging.
    for weights in ("lossless", "fp8"):
        one = plan(info, Machine(), Workload(weights=weights))
        two = plan(info, Machine(), Workload(weights=weights, devices=2))
        assert two["host"] == one["host"] and two["device"]["weights"] == one["device"]["weights"]
        assert two["fits"]
    # A budget is each device's: the same blocks resident on each, the rest streamed by each.
    one = plan(info, Machine(), Workload(gpu_budget=20e9))
    two = plan(info, Machine(), Workload(gpu_budget=20e9, devices=2))
    assert 0 < two["resident_blocks"] == one["resident_blocks"] < two["blocks"]
    assert two["device"]["weights"] == one["device"]["weights"]
    assert two["bytes_per_step"]["h2d"] == one["bytes_per_step"]["h2d"]
    # Coded and a budget: the shared copy keeps the resident blocks raw (each rank copies them
    # to its device as they are), where one device keeps them on the device alone.
    one = plan(info, Machine(), Workload(gpu_budget=20e9, weights="fp8"))
    two = plan(info, Machine(), Workload(gpu_budget=20e9, weights="fp8", devices=2))
    raw = one["experts"] * one["resident_blocks"] * one["per_block_parameters"] * 2
    host = "compute_dtype_weights"
    assert two["host"][host] - one["host"][host] == raw
    assert two["host"]["coded_block_weights"] < one["host"]["coded_block_weights"]
    # The disk tier: each rank reads into rings of its own; the blocks come off the disk once.
    one = plan(info, Machine(), Workload(host_tier="disk"))
    two = plan(info, Machine(), Workload(host_tier="disk", devices=2))
    assert two["host_tier"] == "disk" and two["host"]["disk_ring"] == 2 * one["host"]["disk_ring"]
    assert two["bytes_per_step"]["disk"] == one["bytes_per_step"]["disk"] > 0
    assert "GB of blocks streamed from the files (a ring each" in format_plan(two)
    # "auto" counts one copy for the host, as the launcher resolves it: the same choice.
    small = Machine(host_mem=one["host"]["total"] * 1.1)
    for devices in (1, 2):
        assert plan(info, small, Workload(host_tier="auto", devices=devices))["host_tier"] == "disk"


def test_fp8_matmuls_decode_only_the_non_matmul_weights_and_run_the_matmuls_at_fp8s_rate():
    info = preset("wan-14b")
    machine = Machine()
    plain = plan(info, machine, Workload(weights="fp8"))
    direct = plan(info, machine, Workload(weights="fp8", fp8_matmul=True))
    block, depth = plain["per_block_parameters"], plain["blocks"]
    matmuls = block - 6 * 5120  # the modulation table is the one non-matmul weight of size
    # What crosses the bus and what the device holds are the same; the decode shrinks to the
    # blocks' other parameters, and the matmul FLOPs run at twice the rate.
    assert direct["bytes_per_step"]["h2d"] == plain["bytes_per_step"]["h2d"]
    assert direct["device"] == plain["device"]
    assert plain["time_s"]["decode"] == pytest.approx(depth * block * 2 / 200e9)
    other = depth * (block - matmuls) * 2 / 200e9
    assert direct["time_s"]["decode"] == pytest.approx(other, rel=0.05)
    saved = plain["time_s"]["compute"] - direct["time_s"]["compute"]
    assert saved > plain["time_s"]["decode"] - direct["time_s"]["decode"]
    assert "fp8 matmuls" in format_plan(direct)
    # The placement's rule: fp8 matmuls multiply by fp8 weights.
    with pytest.raises(ValueError, match="needs weights='fp8'"):
        plan(info, machine, Workload(fp8_matmul=True))


@pytest.mark.parametrize("state", ["fp32", "bf16-split/fp32", "bf16-sr/8bit"])
def test_optimizer_disk_tier_swaps_the_state_for_a_ring_and_counts_its_traffic(state):
    info, machine = preset("megaslide-105b"), Machine(gpu_mem=80e9, host_mem=512e9)
    ram = plan(info, machine, Workload(mode="finetune", optimizer_state=state))
    disk = plan(
        info,
        machine,
        Workload(mode="finetune", optimizer_state=state, optimizer_state_tier="disk"),
    )
    per_param = disk["optimizer_state"]["disk_bytes_per_param"]
    trainable = disk["trainable_parameters"]
    moved = ram["host"]["total"] - disk["host"]["total"]
    ring = disk["host"]["optimizer_state_ring"]
    assert "adam_moments" not in disk["host"] and 0 < ring < 0.1 * per_param * trainable
    assert moved == pytest.approx(per_param * trainable - ring, rel=1e-6)
    # Read and written once a step, at the disk's bandwidth; named when it bounds the step.
    assert disk["bytes_per_step"]["optimizer_disk"] == pytest.approx(2 * per_param * trainable)
    t = disk["time_s"]
    assert t["optimizer_disk"] == pytest.approx(2 * per_param * trainable / 3e9)
    slow = plan(
        info,
        Machine(disk_gbps=0.5),
        Workload(mode="finetune", optimizer_state=state, optimizer_state_tier="disk"),
    )
    assert slow["time_s"]["bound"] == "optimizer_disk"
    assert "it bounds the step" in format_plan(slow)
    assert "optimizer_disk" not in ram["time_s"] and ram["bytes_per_step"]["optimizer_disk"] == 0


# Bytes one update moves per parameter, counted from the kernels' reads and writes
# (state_format.py, "Traffic"): master and moments read and written back, the fp32 gradient read.
UPDATE_BYTES = {
    "fp32": 28.0,
    "fp32/8bit": 16.0625,
    "bf16-split/fp32": 28.0,
    "bf16-split/8bit": 16.0625,
    "bf16-sr/fp32": 24.0,
    "bf16-sr/8bit": 12.0625,
}


@pytest.mark.parametrize("state", sorted(UPDATE_BYTES))
def test_optimizer_time_is_the_formats_bytes_through_host_memory(state):
    info = preset("megaslide-105b")
    # Threads enough that the 8-bit codecs keep up with memory: the bytes bound every format.
    machine = Machine(gpu_mem=80e9, host_mem=512e9, host_gbps=100.0, cpu_threads=1000)
    p = plan(info, machine, Workload(mode="finetune", optimizer_state=state))
    trainable, update = p["trainable_parameters"], p["optimizer_state"]
    assert update["update_bytes_per_param"] == UPDATE_BYTES[state]
    assert p["time_s"]["optimizer"] == pytest.approx(UPDATE_BYTES[state] * trainable / 100e9)
    assert update["update_memory_s"] == p["time_s"]["optimizer"]
    assert update["update_bound"] == "memory"
    assert (update["update_compute_s"] is not None) == state.endswith("/8bit")
    assert f"optimizer update: {UPDATE_BYTES[state]:.2f} B per trained parameter" in format_plan(p)


def test_compact_formats_plan_less_optimizer_time_than_fp32():
    info, machine = preset("megaslide-105b"), Machine(gpu_mem=80e9, host_mem=512e9)
    seconds = {
        state: plan(info, machine, Workload(mode="finetune", optimizer_state=state))["time_s"][
            "optimizer"
        ]
        for state in UPDATE_BYTES
    }
    assert seconds["bf16-sr/8bit"] < seconds["bf16-sr/fp32"] < seconds["fp32"]
    assert seconds["bf16-split/8bit"] < seconds["bf16-split/fp32"] == seconds["fp32"]
    # Not one figure for every format (the planner once charged 30 B/param to each).
    assert len(set(seconds.values())) == 4


def test_eight_bit_update_on_few_threads_is_bound_by_the_codecs():
    info = preset("megaslide-105b")
    few = Machine(gpu_mem=80e9, host_mem=512e9, cpu_threads=2)
    p = plan(info, few, Workload(mode="finetune", optimizer_state="bf16-sr/8bit"))
    trainable, update = p["trainable_parameters"], p["optimizer_state"]
    codecs = trainable / (2 * 1.1e9)
    assert update["update_bound"] == "compute"
    assert update["update_compute_s"] == pytest.approx(codecs)
    assert p["time_s"]["optimizer"] == pytest.approx(codecs)
    assert codecs > update["update_memory_s"] == pytest.approx(12.0625 * trainable / 200e9)
    assert "codecs" in format_plan(p) and "compute-bound" in format_plan(p)
    # Twice the threads, half the codecs' time; fp32 moments have no codecs to wait for.
    more = plan(
        info, replace(few, cpu_threads=4), Workload(mode="finetune", optimizer_state="bf16-sr/8bit")
    )
    assert more["time_s"]["optimizer"] == pytest.approx(codecs / 2)
    fp32 = plan(info, few, Workload(mode="finetune", optimizer_state="bf16-sr/fp32"))
    assert fp32["optimizer_state"]["update_bound"] == "memory"
    assert fp32["time_s"]["optimizer"] == pytest.approx(24 * trainable / 200e9)
    with pytest.raises(ValueError, match="cpu_threads"):
        plan(info, replace(few, cpu_threads=0), Workload(mode="finetune"))


def test_fine_tunes_kept_as_deltas_cost_their_delta_bytes_in_host_ram():
    from megaslide.engine.planner import DELTA_RATIO

    info = describe(resolve_source(preset="wan-14b"))
    alone = plan(info, Machine(), Workload(frames=81, height=480, width=832))
    ten = plan(info, Machine(), Workload(frames=81, height=480, width=832, fine_tunes=10))
    added = ten["host"]["total"] - alone["host"]["total"]
    assert added == ten["host"]["fine_tune_deltas"] > 0
    # Ten fine-tunes in about three copies' worth of a denoiser, not ten more models.
    blocks = ten["host"]["compute_dtype_weights"]
    assert 10 * DELTA_RATIO * 0.8 * blocks < added < 10 * DELTA_RATIO * blocks
    with pytest.raises(ValueError, match="fine_tunes must be at least 0"):
        plan(info, Machine(), Workload(fine_tunes=-1))


def test_fine_tuning_both_experts_holds_both_and_steps_those_its_rows_span(tmp_path):
    """A two-expert Wan (Wan2.2-A14B's shapes) trains both experts unless one is named: twice the
    masters and moments in host RAM; a step of one row runs one expert, of several both."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "wan_shapes.py"
    spec = importlib.util.spec_from_file_location("wan_shapes", path)
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    info = describe(resolve_source(shapes.write("wan2.2-t2v-a14b", tmp_path / "a14b")))
    machine = Machine(host_mem=1.5e12)
    one, both, both4 = (
        plan(info, machine, Workload(mode="finetune", batch=batch, expert=expert))
        for expert, batch in (("high", 1), (None, 1), ("both", 4))
    )
    assert one["experts_trained"] == 1 and both["experts_trained"] == 2
    assert both["trainable_parameters"] == 2 * one["trainable_parameters"]
    for part in ("master", "adam_moments"):
        assert both["host"][part] == 2 * one["host"][part]
    assert both["device"]["slots"] > one["device"]["slots"]
    assert both["bytes_per_step"]["h2d"] == one["bytes_per_step"]["h2d"]  # one row: one expert
    assert both4["bytes_per_step"]["h2d"] == 2 * one["bytes_per_step"]["h2d"]
    assert both4["time_s"]["optimizer"] == 2 * one["time_s"]["optimizer"]
    split = plan(info, machine, Workload(mode="finetune", batch=2, devices=2))
    assert any("name one expert" in p for p in split["problems"])
