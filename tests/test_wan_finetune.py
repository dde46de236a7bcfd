"""Full fine-tuning of Wan models: block-wise streamed training equals torch's AdamW, the data is
encoded once, a killed run resumes bitwise, the export is a diffusers pipeline, the server runs
a job and serves its model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_model, open_pipeline
from megaslide.engine.native.world import write_dataset
from megaslide.engine.parallel.data_parallel import finetune_on_devices
from megaslide.engine.request import VideoRequest
from megaslide.engine.sampling.flow import sample_training_times
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.streaming.host_store import SafetensorsFile
from megaslide.engine.training.blockwise import BlockwiseStep, StepConfig, master_state_dicts
from megaslide.engine.training.experts import ExpertSteps
from megaslide.engine.training.finetune import open_trainer
from megaslide.engine.training.finetune_spec import (
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    RuntimeSpec,
    ScheduleSpec,
)
from megaslide.engine.wan.family import WanFamily
from megaslide.engine.wan.training import WanTrainingModel

from mixed_clips import write_mixed_clips
from wan_fixtures import build_tiny_wan

diffusers = pytest.importorskip("diffusers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-ft")
    return {
        "one": build_tiny_wan(root / "one", layers=3),
        "experts": build_tiny_wan(root / "experts", experts=2),
        "world": write_dataset(root / "world", 8, seed=0, frames=9, height=32, width=32),
    }


def config(output, steps=4, save_every=2, expert=None, times="logit-normal") -> FinetuneSpec:
    return FinetuneSpec(
        run=RunSpec(output=str(output), save_every=save_every, expert=expert),
        schedule=ScheduleSpec(steps=steps),
        optimizer=OptimizerSpec(lr=1e-3),
        clips=ClipSpec(batch_size=2, time_sampling=times),
        runtime=RuntimeSpec(offload="stream"),
    )


def test_streamed_training_matches_torch_adamw():
    """Three steps of the block-wise step (blocks streamed, CPU AdamW) against whole-model
    autograd and torch.optim.AdamW on the same transformer, times and noise."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_wan(Path(tmp) / "wan", layers=3)
        info = describe(resolve_source(path))
        reference = diffusers.WanTransformer3DModel.from_pretrained(path / "transformer").train()
        parts, handles = open_model(
            info, dtype=torch.float32, offload="stream", only={"transformer"}
        )
    model = WanTrainingModel("transformer", parts["transformer"].train(), info.config, (0.0, 1.0))
    lr, wd, steps = 3e-4, 0.01, 3
    step = BlockwiseStep(
        model,
        "cpu",
        StepConfig(OptimizerSpec(lr=lr, weight_decay=wd), offload="stream"),
        handles["transformer"],
    )
    g = torch.Generator().manual_seed(0)
    x0, emb = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 512, 32, generator=g)

    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": wd},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    ours, theirs = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(steps):
        step.micro_step(x0, emb, ours)
        t = sample_training_times(2, theirs)
        noise = torch.randn(x0.shape, generator=theirs)
        x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
        v = reference(
            hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=emb, return_dict=False
        )[0]
        loss = torch.nn.functional.mse_loss(v, noise - x0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained = master_state_dicts(step)["transformer"]
    step.close()
    expected = reference.state_dict()
    assert trained.keys() == expected.keys()
    worst = max(
        ((trained[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-30)).item()
        for k in expected
    )
    assert worst <= 1e-6, worst


def test_loss_falls_export_is_diffusers_and_generates_alike(wan, tmp_path):
    with open_trainer(
        wan["one"], wan["world"], config(tmp_path / "run", steps=25, save_every=100)
    ) as t:
        losses = [t.train_step()["loss"] for _ in range(25)]
        cache = sorted(p.name for p in (tmp_path / "run" / "cache").iterdir())
        t.save_checkpoint()
        path = t.export()
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
    assert "manifest.json" in cache and "text.safetensors" in cache
    # A complete diffusers pipeline: the trained transformer, the rest linked from the base.
    reference = diffusers.WanPipeline.from_pretrained(path)
    reference.set_progress_bar_config(disable=True)
    base_vae = wan["one"] / "vae" / "diffusion_pytorch_model.safetensors"
    assert os.path.samefile(path / "vae" / "diffusion_pytorch_model.safetensors", base_vae)
    frames = reference(
        prompt="a red circle moving left",
        negative_prompt="",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=3,
        guidance_scale=4.0,
        generator=torch.Generator().manual_seed(2),
        output_type="np",
    ).frames[0]
    expected = np.round(frames * 255).astype(np.uint8)
    ours = open_pipeline(path).generate(
        VideoRequest(
            "a red circle moving left", height=32, width=32, frames=9, steps=3, guidance=4.0, seed=2
        )
    )
    assert np.abs(ours.astype(int) - expected.astype(int)).max() <= 1
    # A second run on the same data and model reuses the encoded data.
    before = (tmp_path / "run" / "cache" / "manifest.json").stat().st_mtime_ns
    with open_trainer(
        wan["one"], wan["world"], config(tmp_path / "run", steps=30), resume=True
    ) as t:
        assert t.step == 25
    assert (tmp_path / "run" / "cache" / "manifest.json").stat().st_mtime_ns == before


@pytest.fixture(scope="module")
def encoded(wan, tmp_path_factory):
    """The tiny two-expert Wan's encoded dataset, made once: each run below starts with a copy
    (the same data and model: the run reuses it)."""
    run = tmp_path_factory.mktemp("encoded")
    with open_trainer(wan["experts"], wan["world"], config(run, steps=1)):
        pass
    return run / "cache"


def base_weights(model: Path) -> dict[str, torch.Tensor]:
    """`{"<component>.<tensor>": tensor}` of both experts as a model directory holds them."""
    out = {}
    for name in ("transformer", "transformer_2"):
        weights = SafetensorsFile(model / name / "diffusion_pytorch_model.safetensors")
        out |= {f"{name}.{k}": weights[k] for k in weights}
    return out


def trained_weights(t) -> dict[str, torch.Tensor]:
    states = t.blockwise.state_dicts(values=True)
    return {f"{m}.{k}": v.clone() for m, sd in states.items() for k, v in sd.items()}


def moved(before: dict, after: dict, component: str) -> bool:
    return any(
        not torch.equal(before[k], after[k]) for k in before if k.startswith(component + ".")
    )


def test_both_experts_train_only_on_their_own_times(wan, encoded, tmp_path):
    """Both experts by default; times that all lie above the boundary ("prior": [0.99, 1)) move
    the high-noise expert only, and the metrics name each expert's loss."""
    shutil.copytree(encoded, tmp_path / "a" / "cache")
    with open_trainer(wan["experts"], wan["world"], config(tmp_path / "a", times="prior")) as t:
        assert set(t.blockwise.steps) == {"high", "low"}
        metrics = [t.train_step() for _ in range(2)]
        after = trained_weights(t)
    before = base_weights(wan["experts"])
    assert moved(before, after, "transformer")
    assert not moved(before, after, "transformer_2")
    assert all(m["loss_low"] is None and m["loss_high"] == m["loss"] for m in metrics)


def test_each_expert_trains_its_rows_as_alone(wan):
    """A batch with rows of both experts: each expert's step equals a one-expert step on its
    rows with their draws, bitwise (the split sends each row, time and noise to its owner)."""
    info = describe(resolve_source(wan["experts"]))
    family = WanFamily()

    def steps(expert):
        parts, handles = open_model(
            info, dtype=torch.float32, offload="stream", only={"transformer", "transformer_2"}
        )
        models = family.training_models(info, parts, expert)
        config = StepConfig(OptimizerSpec(lr=1e-3), offload="stream")
        return {
            k: BlockwiseStep(m, "cpu", config, handles[m.blocks_owner]) for k, m in models.items()
        }

    g = torch.Generator().manual_seed(0)
    x0, emb = torch.randn(6, 4, 3, 4, 4, generator=g), torch.randn(6, 512, 32, generator=g)
    both = ExpertSteps(steps("both"), "uniform")
    out = both.micro_step(x0, emb, torch.Generator().manual_seed(5))
    draws = torch.Generator().manual_seed(5)
    t = sample_training_times(6, draws, "uniform")
    noise = torch.randn(x0.shape, generator=draws)
    for label, owned in (("high", t >= 0.9), ("low", t < 0.9)):
        rows = owned.nonzero()[:, 0]
        assert len(rows) > 0  # the draws give each expert rows
        (alone,) = steps(label).values()
        got = alone.micro_step(x0[rows], emb[rows], None, drawn=(t[rows], noise[rows]))
        assert got["loss"] == out[f"loss_{label}"]
        ours, theirs = both.steps[label].state_dicts(), alone.state_dicts()
        assert all(torch.equal(ours[m][k], theirs[m][k]) for m in theirs for k in theirs[m])
        alone.close()
    both.close()


def test_command_line_trains_both_experts_and_writes_each_ones_stats(wan, encoded, tmp_path):
    from megaslide.cli.main import main

    out = tmp_path / "run"
    shutil.copytree(encoded, out / "cache")
    args = ["finetune", "--model", str(wan["experts"]), "--data", str(wan["world"])]
    args += ["--output", str(out), "--steps", "1", "--batch-size", "2", "--offload", "stream"]
    args += ["--time-sampling", "uniform", "--no-progress", "--stats", str(tmp_path / "s.json")]
    assert main([*args, "--trace", str(tmp_path / "trace.json")]) == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    assert set(stats) == {"high", "low"}
    assert (tmp_path / "trace-high.json").is_file() and (tmp_path / "trace-low.json").is_file()
    metrics = json.loads((out / "metrics.jsonl").read_text())
    assert {"loss_high", "loss_low"} <= set(metrics)


def test_one_transformer_refuses_both_experts(wan):
    info = describe(resolve_source(wan["one"]))
    with pytest.raises(ValueError, match="one transformer: expert 'both' does not apply"):
        WanFamily().training_components(info, "both")


def test_both_experts_resume_exactly_and_export_a_two_expert_pipeline(wan, encoded, tmp_path):
    """Uniform times over a tiny two-expert Wan, two micro-batches a step, clipped: rows of both
    experts come up, in one micro-batch of a step or both. A run abandoned after step 3 and
    resumed from its step-2 checkpoint ends with the uninterrupted run's weights, bitwise; the
    export holds both trained experts, loads in diffusers' WanPipeline and samples in ours; its
    delta covers both."""

    def run(output, steps=3):
        resume = output.exists()
        if not resume:
            shutil.copytree(encoded, output / "cache")
        spec = config(output, steps=steps, times="uniform")
        spec = spec.replace(optimizer={"grad_accum": 2, "max_grad_norm": 1.0})
        return open_trainer(wan["experts"], wan["world"], spec, resume=resume)

    with run(tmp_path / "a") as t:
        metrics = [t.train_step() for _ in range(3)]
        uninterrupted = trained_weights(t)
        path = t.export()
    assert any(m["loss_high"] is not None for m in metrics)
    assert any(m["loss_low"] is not None for m in metrics)
    before = base_weights(wan["experts"])
    assert moved(before, uninterrupted, "transformer")
    assert moved(before, uninterrupted, "transformer_2")
    t = run(tmp_path / "b")
    for _ in range(3):
        t.train_step()
    t.loader.close()
    high = config(tmp_path / "b", steps=3, expert="high")
    with pytest.raises(ValueError, match="trained expert both, the run asks for high"):
        open_trainer(wan["experts"], wan["world"], high, resume=True)
    with run(tmp_path / "b") as resumed:
        assert resumed.step == 2
        resumed.run()
        after = trained_weights(resumed)
    assert after.keys() == uninterrupted.keys()
    assert all(torch.equal(after[k], uninterrupted[k]) for k in after)

    exported = base_weights(path)
    assert all(torch.equal(exported[k], uninterrupted[k]) for k in exported)
    delta = json.loads((path / "delta" / "bfloat16" / "delta.json").read_text())
    assert set(delta["changed"]) == {"transformer", "transformer_2"}
    # diffusers' WanPipeline loads both trained experts (tests/test_wan.py: it samples as ours).
    reference = diffusers.WanPipeline.from_pretrained(path)
    for name in ("transformer", "transformer_2"):
        state = getattr(reference, name).state_dict()
        assert all(torch.equal(state[k], uninterrupted[f"{name}.{k}"]) for k in state)
    frames = open_pipeline(path).generate(
        VideoRequest("a red circle", height=32, width=32, frames=9, steps=3, seed=2)
    )
    assert frames.shape == (9, 32, 32, 3)


@pytest.mark.slow  # tens of seconds: the developer loop leaves it out
def test_two_experts_train_one_at_a_time(wan, tmp_path):
    with pytest.raises(ValueError, match="must be one of"):
        open_trainer(wan["experts"], wan["world"], config(tmp_path / "a", expert="middle"))
    with open_trainer(wan["experts"], wan["world"], config(tmp_path / "b", expert="low")) as t:
        assert set(t.blockwise.model.modules) == {"transformer_2"}
        assert t.blockwise.model.time_range == (0.0, 0.9)
        t.run()
        path = t.export()
    base, trained = wan["experts"], path
    same = (base / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert (trained / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == same
    assert describe(resolve_source(trained)).config.experts == ("transformer", "transformer_2")


@pytest.mark.slow
def test_data_parallel_on_two_processes_equals_one(wan, tmp_path):
    """A Wan fine-tune split over two gloo processes (each half of every batch, one AdamW over one
    fp32 master) ends where one process does, to the bound tests/test_data_parallel.py derives:
    a ten-thousandth of how far training moved the weights."""
    runs = {}
    for name, devices in (("one", None), ("split", ["cpu", "cpu"])):
        spec = config(tmp_path / name, steps=2, save_every=100)
        spec = spec.replace(runtime={"devices": devices})
        if devices is None:
            with open_trainer(wan["one"], wan["world"], spec) as t:
                t.run()
                model = t.export()
        else:
            model = Path(finetune_on_devices(wan["one"], wan["world"], spec)["model"])
        runs[name] = SafetensorsFile(model / "transformer" / "diffusion_pytorch_model.safetensors")
    initial = SafetensorsFile(wan["one"] / "transformer" / "diffusion_pytorch_model.safetensors")
    one, split = runs["one"], runs["split"]
    assert set(one) == set(split) == set(initial)
    moved = sum((one[k].double() - initial[k].double()).square().sum() for k in one).sqrt()
    apart = sum((split[k].double() - one[k].double()).square().sum() for k in one).sqrt()
    assert moved > 0 and apart / moved < 1e-4, (apart, moved)


def run_cli(*args: str) -> subprocess.Popen:
    code = "import sys; from megaslide.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-P", "-c", code, *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_kill_9_and_resume_equal_an_uninterrupted_run(wan, tmp_path):
    args = [
        "finetune",
        "--model",
        str(wan["one"]),
        "--data",
        str(wan["world"]),
        "--steps",
        "6",
        "--save-every",
        "2",
        "--batch-size",
        "2",
        "--lr",
        "1e-3",
        "--offload",
        "stream",
        "--no-progress",
    ]
    whole = run_cli(*args, "--output", str(tmp_path / "whole"))
    killed = run_cli(*args, "--output", str(tmp_path / "killed"))
    checkpoint = tmp_path / "killed" / "checkpoints" / "step-000004"
    deadline = time.monotonic() + 240
    while not checkpoint.exists() and killed.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    resumed = run_cli(*args, "--output", str(tmp_path / "killed"), "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    name = "transformer/diffusion_pytorch_model.safetensors"
    a = (tmp_path / "whole" / "model" / name).read_bytes()
    b = (tmp_path / "killed" / "model" / name).read_bytes()
    assert a == b
    metrics = [
        json.loads(line)
        for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow  # tens of seconds: the developer loop leaves it out
def test_a_bf16_master_trains_resumes_and_exports(wan, tmp_path):
    """bf16-sr/8bit on Wan: the modules diffusers keeps in fp32 are bf16 masters too; a resumed
    run ends with the uninterrupted run's weights; the export is fp32 and serves."""

    def run(output, steps=3):
        spec = config(output, steps=steps).replace(optimizer={"state": "bf16-sr/8bit"})
        return open_trainer(wan["one"], wan["world"], spec, resume=output.exists())

    def values(t):
        states = master_state_dicts(t.blockwise, values=True)
        return {f"{m}.{k}": v.clone() for m, sd in states.items() for k, v in sd.items()}

    with run(tmp_path / "a") as t:
        trained = [p for m in t.blockwise.model.modules.values() for p in m.parameters()]
        assert {p.dtype for p in trained if p.requires_grad} == {torch.bfloat16}
        t.run()
        uninterrupted = values(t)
        path = t.export()
    t = run(tmp_path / "b", steps=4)
    for _ in range(3):
        t.train_step()
    t.loader.close()
    # The same state format as the checkpoint's, so that the experts are what differs.
    high = config(tmp_path / "b", steps=3, expert="high")
    high = high.replace(optimizer={"state": "bf16-sr/8bit"})
    with pytest.raises(ValueError, match="trained expert both, the run asks for high"):
        open_trainer(wan["experts"], wan["world"], high, resume=True)
    with run(tmp_path / "b") as resumed:
        assert resumed.step == 2
        resumed.run()
        after = values(resumed)
    assert after.keys() == uninterrupted.keys()
    assert all(torch.equal(after[k], uninterrupted[k]) for k in after)
    exported = SafetensorsFile(path / "transformer" / "diffusion_pytorch_model.safetensors")
    assert {exported[k].dtype for k in exported} == {torch.float32}
    frames = open_pipeline(path).generate(
        VideoRequest("a red circle", height=32, width=32, frames=9, steps=2, seed=0)
    )
    assert frames.shape == (9, 32, 32, 3)


def test_clips_of_two_sizes_and_lengths_train_in_buckets(wan, tmp_path):
    """Wan's latents in aspect and length buckets: each clip encoded at its own shape (16-pixel
    multiples, 4k + 1 frames), each batch one bucket's latents."""
    torch.set_num_threads(1)
    data = write_mixed_clips(tmp_path / "data", [(32, 32, 5), (48, 32, 9)] * 2)
    spec = config(tmp_path / "run", steps=2).replace(clips={"token_budget": 18})
    with open_trainer(wan["one"], data, spec) as t:
        assert {str(b) for b in t.plan.buckets} == {"32x32x5", "48x32x9"}
        shapes = set()
        for _ in range(2):
            batch = next(t.loader)
            shapes.add(tuple(batch.video.shape[2:]))
            t.blockwise.micro_step(
                t.data.x0(batch), t.data.condition(batch, [False] * 2), t.generator
            )
    # A latent frame per 4 pixel frames (and the first), a latent pixel per 8.
    assert shapes == {(2, 4, 4), (3, 4, 6)}
