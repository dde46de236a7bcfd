"""The placement spec: every combination rule once, and every front end built from it."""

import pytest
import torch

from megaslide.cli.args import in_flag_words
from megaslide.engine.loader import open_pipeline
from megaslide.engine.parallel.ranks import ranks_placement
from megaslide.engine.placement import RULES, Placement, PlacementError
from megaslide.engine.planner import Machine, Workload, plan
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.streaming.streamer import stream_module
from megaslide.engine.training.finetune_spec import ClipSpec, FinetuneSpec, RunSpec, RuntimeSpec
from megaslide.server.settings import Settings

STREAM = Placement(offload="stream")
TWO = Placement(devices=("cpu", "cpu"), offload="stream")


@pytest.mark.parametrize(
    "placement, mode, reason",
    [
        (Placement(offload="disk"), "infer", "offload must be one of none, stream"),
        (Placement(weights="zip"), "infer", "weights must be one of raw, lossless, fp8"),
        (Placement(host_tier="nvme"), "infer", "host_tier must be one of ram, disk, auto"),
        (Placement(disk_io="mmap"), "infer", "disk_io must be one of buffered, direct"),
        (STREAM, "train", "mode must be one of infer, finetune"),
        (STREAM.replace(prefetch=0), "infer", "prefetch must be at least 1"),
        (STREAM.replace(gpu_budget_bytes=-1), "infer", "gpu_budget_bytes must be >= 0"),
        (Placement(gpu_budget_bytes=1), "infer", "gpu_budget_bytes needs offload='stream'"),
        (Placement(weights="fp8"), "infer", "streamed host store: needs offload='stream'"),
        (Placement(host_tier="disk"), "infer", "on disk: needs offload='stream'"),
        (STREAM.replace(host_tier="disk", weights="lossless"), "infer", "(weights='raw')"),
        (STREAM.replace(weights="fp8"), "finetune", "it needs weights='raw'"),
        (STREAM.replace(host_tier="disk"), "finetune", "it needs host_tier='ram'"),
        (STREAM.replace(gpu_budget_bytes=0), "finetune", "host store: no gpu_budget_bytes yet"),
        (TWO.replace(devices=("cpu",)), "infer", "devices must name two or more"),
        (TWO.replace(device="cuda"), "infer", "leave out device"),
        (TWO.replace(offload="none"), "infer", "one shared host copy: needs offload='stream'"),
        (TWO.replace(host_tier="disk", weights="fp8"), "infer", "(weights='raw')"),
        (TWO.replace(timing=True), "finetune", "fine-tuning on several devices keeps no streamer"),
        (Placement(compile=True), "finetune", "fine-tuning runs its blocks eagerly"),
        (TWO.replace(compile=True), "infer", "compile is checked on one device"),
        (STREAM.replace(fp8_matmul=True), "infer", "fp8_matmul multiplies by the streamed"),
        (
            STREAM.replace(weights="fp8", fp8_matmul=True, compile=True),
            "infer",
            "fp8_matmul is checked eagerly",
        ),
    ],
)
def test_each_rule_refuses_with_its_reason(placement, mode, reason):
    with pytest.raises(PlacementError) as refused:
        placement.validate(mode)
    assert reason in str(refused.value)


def test_what_runs_passes_and_every_rule_is_reachable():
    for placement in (
        Placement(),
        Placement(device="cuda", timing=True),  # timing without streaming records nothing
        STREAM.replace(gpu_budget_bytes=0, weights="lossless", prefetch=1),
        STREAM.replace(host_tier="disk", disk_io="direct"),
        STREAM.replace(host_tier="auto", weights="fp8"),
        TWO,
        TWO.replace(host_tier="auto"),
        # Every streaming lever runs on several devices as on one.
        TWO.replace(gpu_budget_bytes=10, weights="lossless", timing=True),
        TWO.replace(weights="fp8", host_tier="auto"),
        TWO.replace(host_tier="disk", disk_io="direct", gpu_budget_bytes=0),
        Placement(compile=True),
        STREAM.replace(compile=True, weights="lossless", gpu_budget_bytes=0),
        STREAM.replace(weights="fp8", fp8_matmul=True, gpu_budget_bytes=0),
        TWO.replace(weights="fp8", fp8_matmul=True),
    ):
        assert placement.validate() is placement
    assert STREAM.validate("finetune") and TWO.validate("finetune")
    assert len(RULES) == 17  # each case above names one: a new rule gets a case


def test_the_planner_accounts_for_what_only_todays_code_lacks():
    lacking = TWO.replace(timing=True)
    assert lacking.problems("finetune") and not lacking.problems("finetune", lasting_only=True)
    info = describe(resolve_source(preset="small"))
    p = plan(info, Machine(), Workload.of(lacking, mode="finetune", batch=2))
    assert p["devices"] == 2 and p["mode"] == "finetune"
    with pytest.raises(PlacementError, match="disk tier streams the files' bytes"):
        plan(info, Machine(), Workload.of(STREAM.replace(host_tier="disk", weights="fp8")))
    runs = TWO.replace(weights="fp8", gpu_budget_bytes=10**9, timing=True)
    assert ranks_placement(runs) == runs  # sampling on several devices runs every lever
    assert Workload.of(runs).placement == runs.replace(
        devices=("device:0", "device:1"), timing=False
    )


def test_fields_travel_as_keywords_or_whole():
    fields, rest = Placement.split({"device": "cpu", "offload": "stream", "attention": "dsa"})
    assert fields == {"device": "cpu", "offload": "stream"} and rest == {"attention": "dsa"}
    made = Placement.of(None, {"device": torch.device("cpu"), "devices": ["cpu", "cpu"]})
    assert made.device == "cpu" and made.devices == ("cpu", "cpu")
    with pytest.raises(TypeError, match="not both"):
        Placement.of(STREAM, {"prefetch": 3})
    # One rank of several: its "auto" is the tier its shared copy was made for (loader.py).
    rank = TWO.replace(host_tier="auto", weights="lossless").on("cpu")
    assert rank == STREAM.replace(device="cpu", host_tier="auto", weights="lossless")
    assert rank.validate() and Placement(host_tier="auto").on("cpu").host_tier == "auto"


def test_a_pipeline_opened_by_placement_is_the_one_opened_by_keywords():
    info = describe(resolve_source(preset="tiny"))
    whole = open_pipeline(info, STREAM.replace(prefetch=3, timing=True))
    loose = open_pipeline(info, offload="stream", prefetch=3, timing=True)
    assert whole.handles["dit"].placement == loose.handles["dit"].placement
    assert whole.handles["dit"].placement == STREAM.replace(device="cpu", prefetch=3, timing=True)
    for a, b in zip(whole.dit.state_dict().values(), loose.dit.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="not both"):
        open_pipeline(info, STREAM, prefetch=3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="not both"):
        stream_module(model, list(model), STREAM.replace(device="cpu"), prefetch=1)
    handle = stream_module(model, list(model), STREAM.replace(device="cpu", prefetch=1))
    assert handle.placement.prefetch == 1 and len(handle._slots) == 1


def test_settings_and_fine_tunes_are_built_from_the_spec(tmp_path):
    s = Settings(data_dir=tmp_path, offload="stream", weights="lossless", gpu_budget=10)
    assert s.placement == Placement(
        device="auto", offload="stream", gpu_budget_bytes=10, weights="lossless", host_tier="auto"
    )
    # Several devices stream unless told otherwise; the ranks' device is theirs to name.
    s = Settings(data_dir=tmp_path, devices=["cpu", "cpu"])
    assert s.placement.devices == ("cpu", "cpu") and s.placement.streams
    assert s.placement.device is None
    with pytest.raises(ValueError, match="needs offload='stream'"):
        Settings(data_dir=tmp_path, host_tier="disk")
    assert Settings(data_dir=tmp_path, compile=True).placement.compile
    with pytest.raises(ValueError, match="compile is checked on one device"):
        Settings(data_dir=tmp_path, devices=["cpu", "cpu"], compile=True)
    s = Settings(data_dir=tmp_path, offload="stream", host_tier="disk", disk_io="direct")
    assert s.placement.disk_io == "direct" and s.placement.host_tier == "disk"
    # Adapters given at start run on several devices too (each rank registers them).
    s = Settings(data_dir=tmp_path, devices=["cpu", "cpu"], loras=["a=b.safetensors"])
    assert s.loras == ["a=b.safetensors"] and s.placement.devices == ("cpu", "cpu")
    runtime = RuntimeSpec(devices=("cpu", "cpu"), offload="stream", timing=True)
    assert runtime.placement == TWO.replace(timing=True)
    s = Settings(data_dir=tmp_path, devices=["cpu", "cpu"], weights="fp8", gpu_budget=10)
    assert s.placement == TWO.replace(weights="fp8", gpu_budget_bytes=10, host_tier="auto")
    s = Settings(data_dir=tmp_path, devices=["cpu", "cpu"], host_tier="disk")
    assert s.placement.host_tier == "disk"
    spec = FinetuneSpec(
        run=RunSpec(output="x"),
        clips=ClipSpec(batch_size=2),
        runtime=RuntimeSpec(devices=("cpu", "cpu")),
    )
    with pytest.raises(ValueError, match="runtime: devices streams every rank"):
        spec.validate()


def test_the_cli_names_a_rule_in_its_flags():
    said = in_flag_words(
        "weights='fp8' is a format of the streamed host store: needs offload='stream'"
    )
    assert said == "--weights fp8 is a format of the streamed host store: needs --offload stream"
    assert in_flag_words("gpu_budget_bytes needs offload='stream'").startswith("--gpu-budget needs")
    refused = Placement(offload="stream", fp8_matmul=True).problems()[0]
    assert in_flag_words(refused).startswith("--fp8-matmul multiplies by")
    assert in_flag_words(refused).endswith("needs --weights fp8")
