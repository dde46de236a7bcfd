"""The planner's accounting: each figure follows from the config and the machine."""

import pytest

from megaslide.engine.dit import PRESETS, count_parameters
from megaslide.engine.planner import Machine, Workload, plan


def test_inference_streams_every_block_by_default_and_time_is_bounded_by_the_slower_side():
    config = PRESETS["megaslide-105b"]
    p = plan(config, Machine(), Workload())
    counts = count_parameters(config)
    assert p["streamed_blocks"] == config.depth and p["resident_blocks"] == 0
    assert p["device"]["slots"] == 2 * counts["per_block"] * 2
    assert p["host"]["compute_dtype_weights"] == 2 * counts["total"]
    assert p["bytes_per_step"]["h2d"] == config.depth * counts["per_block"] * 2
    slow_link = plan(config, Machine(h2d_gbps=1.0), Workload())
    assert slow_link["time_s"]["bound"] == "transfer"


def test_budget_makes_blocks_resident_and_reduces_traffic():
    config = PRESETS["small"]
    block = count_parameters(config)["per_block"] * 2
    everything = plan(config, Machine(), Workload())
    budget = everything["device"]["non_block_weights"] + 2 * block + 3 * block
    p = plan(config, Machine(), Workload(gpu_budget=budget))
    assert p["resident_blocks"] == 3 and p["streamed_blocks"] == config.depth - 3
    assert p["device"]["weights"] <= budget
    assert p["bytes_per_step"]["h2d"] == (config.depth - 3) * block


def test_verdict_names_the_broken_constraint():
    p = plan(PRESETS["megaslide-105b"], Machine(host_mem=1e12), Workload(mode="finetune"))
    assert not p["fits"] and "host memory" in p["problems"][0]
    with pytest.raises(ValueError, match="mode"):
        plan(PRESETS["tiny"], Machine(), Workload(mode="train"))


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_predicted_device_weights_match_the_streamers_accounting(preset):
    from megaslide.engine.pipeline import VideoPipeline
    from megaslide.engine.streaming import stream_module

    pipe = VideoPipeline.from_preset(preset)
    handle = stream_module(pipe.dit, blocks=pipe.dit.blocks, device="cpu")
    text_bytes = sum(p.numel() * 4 for p in pipe.text_encoder.parameters())
    measured = (
        handle.stats()["peak_device_weight_bytes"] + text_bytes
    )  # the text encoder is resident too
    handle.remove()
    predicted = plan(PRESETS[preset], Machine(), Workload(dtype_bytes=4))["device"]["weights"]
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)
