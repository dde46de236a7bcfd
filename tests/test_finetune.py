"""Adaptation mode: block-wise streamed training equals plain training; resume equals no interruption."""

import copy
import json
import math
from dataclasses import asdict

import pytest
import torch

from megaslide.engine.loader import open_model, open_pipeline
from megaslide.engine.native.checkpoint import save_model
from megaslide.engine.native.config import PRESETS
from megaslide.engine.native.dit import VideoDiT
from megaslide.engine.native.family import DiTTrainingModel
from megaslide.engine.native.text import BuiltinTextEncoder
from megaslide.engine.native.world import write_dataset
from megaslide.engine.placement import Placement
from megaslide.engine.request import VideoRequest
from megaslide.engine.sampling.flow import sample_training_times
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.training.blockwise import BlockwiseStep, StepConfig, master_state_dicts
from megaslide.engine.training.data import DatasetError
from megaslide.engine.training.finetune import learning_rate, open_trainer
from megaslide.engine.training.finetune_spec import (
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    RuntimeSpec,
    ScheduleSpec,
)
from megaslide.engine.training.group import OneProcess

from dit_fixtures import randomise_zero_inits

PROMPTS = ["a red circle moving left", "a blue square"]


def reference_training(dit, text, x0, steps, lr, weight_decay, seed):
    """What a user would write: whole-model autograd and torch.optim.AdamW."""
    params = [p for p in [*dit.parameters(), *text.parameters()] if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        t = sample_training_times(x0.shape[0], g)
        noise = torch.randn(x0.shape, generator=g)
        t_ = t.view(-1, 1, 1, 1, 1)
        v = dit((1 - t_) * x0 + t_ * noise, t, *text.encode(PROMPTS))
        loss = torch.nn.functional.mse_loss(v, noise - x0)
        opt.zero_grad()
        loss.backward()
        opt.step()


def max_relative_difference(ours: dict, ref: dict) -> float:
    """max over tensors of ||ours - ref|| / ||ref||."""
    assert ours.keys() == ref.keys()
    return max(((ours[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item() for k in ref)


@pytest.mark.parametrize(
    "preset, steps, lr",
    [("tiny", 3, 3e-4), pytest.param("small", 2, 3e-5, marks=pytest.mark.slow)],  # small: ~1 min
)
def test_streamed_training_matches_torch_adamw(preset, steps, lr, tmp_path):
    torch.manual_seed(0)
    config = PRESETS[preset]
    dit, text = VideoDiT(config.model), BuiltinTextEncoder(config.model.text)
    randomise_zero_inits(dit)
    x0 = torch.randn(2, 3, 2, 16, 16)
    ref_dit, ref_text = copy.deepcopy(dit), copy.deepcopy(text)
    reference_training(ref_dit, ref_text, x0, steps, lr=lr, weight_decay=0.01, seed=0)

    # The same weights, opened for training as `open_trainer` opens them: fp32, blocks streamed.
    save_model(tmp_path / "m", dit, text, config.sampling)
    info = describe(resolve_source(tmp_path / "m"))
    parts, handles = open_model(info, dtype=torch.float32, offload="stream")
    dit, text = parts["dit"].train(), parts["text_encoder"].train()
    step_config = StepConfig(OptimizerSpec(lr=lr, weight_decay=0.01), offload="stream")
    step = BlockwiseStep(DiTTrainingModel(dit, text), "cpu", step_config, handles["dit"])
    live_grads = []  # blocks holding gradients whenever a block's backward finishes
    for block in dit.blocks:
        block.register_full_backward_hook(
            lambda *_: live_grads.append(
                sum(any(p.grad is not None for p in b.parameters()) for b in dit.blocks)
            )
        )
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        step.micro_step(x0, PROMPTS, g)
    states = master_state_dicts(step)
    dit_sd, text_sd = states["dit"], states["text_encoder"]
    stats = step.handle.stats()
    step.close()

    # fp32 throughout; the block-wise backward sums some gradients in another order, so the weights
    # agree to rounding, not bitwise: the tolerance the adaptation mode promises. The text encoder's
    # gradient arrives as a sum over every block's cross-attention, and its LayerNorm biases sum
    # that over tokens where the terms nearly cancel, so reordering moves them by about 2e-6 of
    # their size after a few steps; losing the last block's contribution moves them by 0.75.
    assert max_relative_difference(dit_sd, ref_dit.state_dict()) <= 1e-6
    assert max_relative_difference(text_sd, ref_text.state_dict()) <= 1e-5
    assert live_grads and max(live_grads) <= 1  # never a gradient for a block not being processed
    block_bytes = stats["slot_bytes"]
    assert stats["peak_device_weight_bytes"] <= stats["non_block_bytes"] + 2 * block_bytes
    # Every block crosses twice per step (forward, then backward in reverse), except the blocks still
    # in their slots when the backward turns around, which are reused.
    n, per_block = len(dit.blocks), stats["streamed_block_bytes"] // len(dit.blocks)
    assert stats["h2d_bytes"] == steps * (2 * n - stats["num_slots"]) * per_block


class HandsOverLate(OneProcess):
    """One process whose blocks' gradients reach the optimizer a block late, as a data-parallel
    rank's do while their reduction runs: the step's other path through its outbox."""

    in_flight = 1


def test_gradients_handed_over_a_block_late_train_the_same_weights(tmp_path):
    config = PRESETS["tiny"]
    dit = VideoDiT(config.model)
    randomise_zero_inits(dit)  # every block then has gradients from the first step
    save_model(tmp_path / "m", dit, BuiltinTextEncoder(config.model.text), config.sampling)
    info = describe(resolve_source(tmp_path / "m"))
    x0 = torch.randn(2, 3, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    optimizer = OptimizerSpec(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, grad_accum=2)
    masters, norms = [], []
    for group in (OneProcess(), HandsOverLate()):
        parts, handles = open_model(info, dtype=torch.float32, offload="stream")
        model = DiTTrainingModel(parts["dit"].train(), parts["text_encoder"].train())
        config = StepConfig(optimizer, offload="stream")
        step = BlockwiseStep(model, "cpu", config, handles["dit"], group)
        g = torch.Generator().manual_seed(0)
        norms.append([step.micro_step(x0, PROMPTS, g)["grad_norm"] for _ in range(4)])
        masters.append({k: v.clone() for k, v in master_state_dicts(step)["dit"].items()})
        step.close()
    assert norms[0] == norms[1]
    assert all(torch.equal(masters[0][k], masters[1][k]) for k in masters[0])


def test_accumulated_micro_batches_average_their_gradients(tmp_path):
    """Two micro-batches alike under `grad_accum=2` are one step on one of them: the optimizer
    sees the mean of the micro-batches' gradients (not that over `grad_accum` again), so
    clipping reads the same norm and the weights come out bitwise the same."""
    config = PRESETS["tiny"]
    dit = VideoDiT(config.model)
    randomise_zero_inits(dit)
    save_model(tmp_path / "m", dit, BuiltinTextEncoder(config.model.text), config.sampling)
    info = describe(resolve_source(tmp_path / "m"))
    x0 = torch.randn(2, 3, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    masters, norms = [], []
    for k in (1, 2):
        optimizer = OptimizerSpec(lr=1e-3, max_grad_norm=1e-3, grad_accum=k)  # always clipped
        parts, handles = open_model(info, dtype=torch.float32, offload="stream")
        model = DiTTrainingModel(parts["dit"].train(), parts["text_encoder"].train())
        step = BlockwiseStep(model, "cpu", StepConfig(optimizer, offload="stream"), handles["dit"])
        for _ in range(k):  # the same times and noise each micro-batch
            step.micro_step(x0, PROMPTS, torch.Generator().manual_seed(0))
        norms.append(step.optimizer.last_grad_norm)
        masters.append({n: v.clone() for n, v in master_state_dicts(step)["dit"].items()})
        step.close()
    assert norms[0] == pytest.approx(norms[1], rel=1e-6) and norms[0] > 1e-3
    assert all(torch.equal(masters[0][n], masters[1][n]) for n in masters[0])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_dataset(
        tmp_path_factory.mktemp("world") / "data", 12, seed=0, frames=4, height=16, width=16
    )


TINY = resolve_source(preset="tiny")


def run(world, output, resume=False, **sections):
    """A fine-tuning run of the tiny preset on `world`; `sections` change the spec's fields, by
    section (`schedule={"steps": 30}`)."""
    spec = FinetuneSpec(
        run=RunSpec(output=str(output), save_every=2),
        schedule=ScheduleSpec(steps=4),
        optimizer=OptimizerSpec(lr=2e-3),
        clips=ClipSpec(frames=4, height=16, width=16, batch_size=2),
        runtime=RuntimeSpec(offload="stream"),
    )
    return open_trainer(TINY, world, spec.replace(**sections), resume=resume)


def final_masters(trainer):
    states = master_state_dicts(trainer.blockwise)
    dit_sd, text_sd = states["dit"], states["text_encoder"]
    return {
        **{f"d.{k}": v.clone() for k, v in dit_sd.items()},
        **{f"t.{k}": v.clone() for k, v in text_sd.items()},
    }


@pytest.mark.slow  # tens of seconds: the developer loop leaves it out
def test_kill_and_resume_equals_uninterrupted(world, tmp_path):
    cosine = {"lr_schedule": "cosine", "warmup_steps": 1}  # the resumed part must follow it too
    schedule = {"schedule": cosine}
    with run(world, tmp_path / "a", **schedule) as t:
        t.run()
        uninterrupted = final_masters(t)
    # The interrupted run dies after step 3: its last checkpoint is step 2, step 3 is lost.
    t = run(world, tmp_path / "b", **schedule)
    for _ in range(3):
        t.train_step()
    t.loader.close()  # no close(): nothing is flushed or saved beyond what the run wrote itself
    with run(world, tmp_path / "b", resume=True, **schedule) as resumed:
        assert resumed.step == 2
        resumed.run()
        after = final_masters(resumed)
    assert after.keys() == uninterrupted.keys()
    assert all(torch.equal(after[k], uninterrupted[k]) for k in after)
    # A run in planned parts (--until) follows the same schedule to the same weights.
    with run(world, tmp_path / "c", schedule={**cosine, "until": 3}) as first:
        first.run()
        assert first.step == 3 and first.total_steps == 4
        first.save_checkpoint()
    with run(world, tmp_path / "c", resume=True, **schedule) as second:
        second.run()
        parts = final_masters(second)
    assert all(torch.equal(parts[k], uninterrupted[k]) for k in parts)
    metrics = [
        json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["lr"] for m in metrics] == pytest.approx([2e-3, 2e-3, 1.5e-3, 0.5e-3])


def test_learning_rate_schedules():
    spec = FinetuneSpec(
        run=RunSpec(output="o"),
        schedule=ScheduleSpec(steps=10, warmup_steps=2),
        optimizer=OptimizerSpec(lr=1.0),
    )
    assert [learning_rate(spec, s, 10) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    cosine = spec.replace(schedule={"lr_schedule": "cosine"})
    lrs = [learning_rate(cosine, s, 10) for s in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 7 / 8))
    )
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    with pytest.raises(ValueError, match="schedule.lr_schedule"):
        spec.replace(schedule={"lr_schedule": "step"}).validate()
    with pytest.raises(ValueError, match="optimizer.lr must be positive"):
        spec.replace(optimizer={"lr": 0.0}).validate()
    with pytest.raises(ValueError, match="at most one of schedule.steps and schedule.epochs"):
        spec.replace(schedule={"epochs": 1.0}).validate()


# A spec as `asdict` wrote it into a checkpoint's state.pt (and JSON reads it back) before the
# runtime section held a placement: device, offload, devices and timing flat.
OLD_SPEC = {
    "run": {"output": "runs/a", "seed": 3, "save_every": 50, "attention": None, "expert": None},
    "schedule": {"steps": 8, "epochs": None, "lr_schedule": "cosine", "warmup_steps": 1},
    "optimizer": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
    "clips": {"frames": 17, "height": 32, "width": 32, "batch_size": 2},
    "runtime": {
        "device": "cpu",
        "offload": "stream",
        "devices": ["cpu", "cpu"],
        "timing": False,
        "cache_mb": 512,
    },
}


def test_old_specs_load_and_the_runtime_is_one_placement():
    spec = FinetuneSpec.from_dict(json.loads(json.dumps(OLD_SPEC)))
    two = Placement(devices=("cpu", "cpu"), offload="stream")
    assert spec.runtime == RuntimeSpec(two, cache_mb=512)
    assert spec.optimizer.betas == (0.9, 0.95) and spec.schedule.until is None
    # What a spec writes now reads back whole, through JSON too.
    assert FinetuneSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.to_dict()["runtime"] == {"placement": asdict(two), "cache_mb": 512}
    # The flat keywords still build and change it, meaning what they meant.
    assert RuntimeSpec(offload="stream", devices=("cpu", "cpu"), cache_mb=512) == spec.runtime
    one = spec.replace(runtime={"devices": None, "device": "cuda:1", "timing": True})
    assert one.runtime.placement == Placement(device="cuda:1", offload="stream", timing=True)
    assert RuntimeSpec().placement == Placement(device="cpu") and RuntimeSpec().device == "cpu"
    with pytest.raises(TypeError, match="no field 'prefetch'"):
        RuntimeSpec(prefetch=3)
    # The combination rules are the placement's, for a fine-tune.
    for placement, reason in [
        (Placement(offload="stream", weights="fp8"), "it needs weights='raw'"),
        (Placement(offload="stream", gpu_budget_bytes=0), "no gpu_budget_bytes yet"),
        (Placement(devices=("cpu", "cpu")), "devices streams every rank"),
    ]:
        with pytest.raises(ValueError, match=f"runtime: .*{reason}"):
            spec.replace(runtime={"placement": placement}).validate()
    # A rank of several trains its device's part of the placement.
    rank = spec.replace(runtime={"placement": spec.runtime.placement.on("cpu")})
    rank.validate()
    assert rank.runtime.device == "cpu" and rank.runtime.devices is None


@pytest.mark.slow  # tens of seconds: the developer loop leaves it out
def test_loss_falls_and_export_serves(world, tmp_path):
    with run(
        world,
        tmp_path,
        run={"save_every": 100},
        schedule={"steps": 30},
        optimizer={"lr": 3e-3},
        runtime={"offload": "none"},
    ) as t:
        losses = [t.train_step()["loss"] for _ in range(30)]
        path = t.export()
    assert sum(losses[-8:]) / 8 < 0.8 * sum(losses[:8]) / 8, losses
    pipe = open_pipeline(path)
    frames = pipe.generate(
        VideoRequest("a red circle moving left", frames=4, height=16, width=16, steps=2, seed=0)
    )
    assert frames.shape == (4, 16, 16, 3)


def test_bad_dataset_fails_before_any_step(world, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metadata.jsonl").write_text('{"file": "missing.mp4", "text": "a clip"}\n')
    with pytest.raises(DatasetError, match="missing.mp4"):
        run(bad, tmp_path / "out")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
