"""Fine-tuning in each optimizer state format: a bf16 master is the model's weights, bf16-split is
the fp32 master bit for bit, every format resumes exactly and exports its fp32 values."""

import re

import pytest
import torch
from safetensors.torch import load_file

from megaslide.engine.native.world import write_dataset
from megaslide.engine.sources import resolve_source
from megaslide.engine.training.blockwise import NON_BLOCK, master_state_dicts
from megaslide.engine.training.finetune import open_trainer
from megaslide.engine.training.finetune_spec import (
    TRAINING_STATES,
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    RuntimeSpec,
    ScheduleSpec,
)
from megaslide.engine.training.optim import CPUAdamW

TINY = resolve_source(preset="tiny")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_dataset(
        tmp_path_factory.mktemp("world") / "data", 8, seed=0, frames=4, height=16, width=16
    )


def spec(output, state, **sections) -> FinetuneSpec:
    return FinetuneSpec(
        run=RunSpec(output=str(output), save_every=2, seed=5),
        schedule=ScheduleSpec(steps=3),
        optimizer=OptimizerSpec(lr=2e-3, weight_decay=0.01, state=state),
        clips=ClipSpec(frames=4, height=16, width=16, batch_size=2),
        runtime=RuntimeSpec(offload="stream"),
    ).replace(**sections)


def values(trainer) -> dict[str, torch.Tensor]:
    """The fp32 value of every master and frozen tensor, by "<module>.<name>"."""
    states = master_state_dicts(trainer.blockwise, values=True)
    return {f"{m}.{k}": v.clone() for m, sd in states.items() for k, v in sd.items()}


@pytest.mark.parametrize("state", ["bf16-split/fp32", "bf16-sr/8bit"])
def test_a_bf16_master_is_the_streamed_weights_themselves(world, tmp_path, state):
    with open_trainer(TINY, world, spec(tmp_path, state)) as t:
        step = t.blockwise
        assert step.optimizer.master_dtype == torch.bfloat16
        assert step.optimizer.seed == 5  # the run's seed keys bf16-sr's rounding
        for i, masters in step.masters.items():
            if i == NON_BLOCK:
                continue
            host = step.handle.host_tensors(i)
            for name, master in masters.items():
                # The host store's buffers: no fp32 master and no separate compute copy.
                assert master.dtype == torch.bfloat16
                assert master.data_ptr() == host[name].data_ptr()
        before = {i: {n: m.clone() for n, m in ms.items()} for i, ms in step.masters.items()}
        t.train_step()  # the tiny preset's zero-initialised output trains alone at first
        t.train_step()
        changed = [(i, n) for i, ms in step.masters.items() for n, m in ms.items()]
        changed = [(i, n) for i, n in changed if not torch.equal(before[i][n], step.masters[i][n])]
        assert any(i != NON_BLOCK for i, _ in changed), changed


def test_bf16_split_trains_the_fp32_master_bit_for_bit(world, tmp_path):
    """The bf16-split run's master, halves joined, is what fp32 AdamW makes of the same gradients
    from the same start. (A run in the fp32 format differs from it: its forward reads the fp32
    master where this one's reads the bf16 high halves, so the gradients are not the same.)"""
    with open_trainer(TINY, world, spec(tmp_path, "bf16-split/fp32")) as t:
        opt = t.blockwise.optimizer
        start = {b: opt.master_values(b) for b in opt.block_ids}
        start = {b: {n: v.clone() for n, v in named.items()} for b, named in start.items()}
        handed = []  # (block, gradients, lr) as the trainer hands them to the optimizer
        step_block = opt.step_block

        def recording(block_id, grads=None, **kw):
            handed.append((block_id, {n: g.clone() for n, g in grads.items()}, opt.lr))
            step_block(block_id, grads, **kw)

        opt.step_block = recording
        t.run()
        trained = {b: opt.master_values(b) for b in opt.block_ids}
        exported = t.export()
    assert len(handed) == 3 * len(start)
    s = t.spec.optimizer
    with CPUAdamW(start, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay) as ref:
        for block_id, grads, lr in handed:
            ref.lr = lr
            ref.step_block(block_id, grads)
    for b, named in start.items():
        for n, t32 in named.items():
            assert torch.equal(trained[b][n], t32), (b, n)
    # The export holds the fp32 master, not its bf16 high half.
    saved = {}
    for f in exported.glob("*.safetensors"):
        saved |= load_file(f)
    assert any(v.dtype == torch.float32 for v in saved.values())


@pytest.mark.parametrize(
    "state",
    [
        s if s in ("bf16-split/8bit", "bf16-sr/8bit") else pytest.param(s, marks=pytest.mark.slow)
        for s in TRAINING_STATES
        if s != "fp32"  # (test_finetune.py)
    ],
)
def test_kill_and_resume_equals_uninterrupted(world, tmp_path, state):
    with open_trainer(TINY, world, spec(tmp_path / "a", state)) as t:
        t.run()
        uninterrupted = values(t)
    # Killed after step 3: the last checkpoint is step 2, step 3 is lost.
    t = open_trainer(TINY, world, spec(tmp_path / "b", state, schedule={"steps": 4}))
    for _ in range(3):
        t.train_step()
    t.loader.close()
    resumed_spec = spec(tmp_path / "b", state)
    with open_trainer(TINY, world, resumed_spec, resume=True) as resumed:
        assert resumed.step == 2
        resumed.run()
        after = values(resumed)
    assert after.keys() == uninterrupted.keys()
    assert all(torch.equal(after[k], uninterrupted[k]) for k in after)
    # A checkpoint is of its format: another format cannot resume from it.
    with pytest.raises(ValueError, match=re.escape(f"holds optimizer state {state!r}")):
        other = "bf16-sr/fp32" if state == "fp32/8bit" else "fp32/8bit"
        open_trainer(TINY, world, spec(tmp_path / "b", other), resume=True)


@pytest.mark.slow  # tens of seconds: the developer loop leaves it out
def test_bf16_sr_8bit_loss_falls(world, tmp_path):
    sections = {"schedule": {"steps": 16}, "run": {"save_every": 100}, "optimizer": {"lr": 3e-3}}
    with open_trainer(TINY, world, spec(tmp_path, "bf16-sr/8bit", **sections)) as t:
        losses = [t.train_step()["loss"] for _ in range(16)]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_a_bf16_master_without_rounding_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match="optimizer.state: optimizer state 'bf16/8bit': a 'bf16' master"
    ):
        spec(tmp_path, "bf16/8bit").validate()
    spec(tmp_path, "bf16-sr/8bit").validate()


def test_cli_finetune_optimizer_state(world, tmp_path, capsys):
    from megaslide.cli.main import main

    flags = ["finetune", "--preset", "tiny", "--data", str(world), "--frames", "4"]
    flags += ["--size", "16x16", "--batch-size", "2", "--steps", "2", "--offload", "stream"]
    flags += ["--output", str(tmp_path), "--no-progress", "--seed", "7"]
    assert main([*flags, "--optimizer-state", "bf16-sr/8bit"]) == 0
    saved = torch.load(tmp_path / "checkpoints/step-000002/optimizer.pt", weights_only=True)
    assert saved["state"] == "bf16-sr/8bit" and saved["seed"] == 7
    capsys.readouterr()
    # The default is fp32: a run of another format does not resume from this one's checkpoint.
    assert main([*flags, "--resume"]) == 2
    assert "holds optimizer state 'bf16-sr/8bit'" in capsys.readouterr().err
    assert main([*flags, "--optimizer-state", "bf16/fp32"]) == 2
    assert "a 'bf16' master rounds every update" in capsys.readouterr().err


def test_disk_tier_trains_and_resumes_as_the_ram_tier(world, tmp_path):
    """The optimizer's state in files (state_tier="disk"): the run is bitwise the RAM tier's,
    and a run killed after its files moved past the last checkpoint resumes exactly."""
    state = "bf16-split/8bit"
    with open_trainer(TINY, world, spec(tmp_path / "a", state)) as t:
        t.run()
        uninterrupted = values(t)
    disk = {"state_tier": "disk", "lr": 2e-3, "weight_decay": 0.01, "state": state}
    t = open_trainer(
        TINY, world, spec(tmp_path / "b", state, optimizer=disk, schedule={"steps": 4})
    )
    assert t.blockwise.optimizer.ring_nbytes > 0
    for _ in range(3):  # checkpoint at step 2; step 3's state reaches the files, then a "kill"
        t.train_step()
    t.blockwise.optimizer._disk.flush()
    t.loader.close()
    assert sorted(p.name for p in (tmp_path / "b/optimizer-state").iterdir())[:2] == [
        "block-0.absmax",
        "block-0.codes",
    ]
    with open_trainer(
        TINY, world, spec(tmp_path / "b", state, optimizer=disk), resume=True
    ) as resumed:
        assert resumed.step == 2
        resumed.run()
        after = values(resumed)
    assert all(torch.equal(after[k], uninterrupted[k]) for k in uninterrupted)


def test_cli_finetune_optimizer_state_tier(world, tmp_path):
    from megaslide.cli.main import main

    flags = ["finetune", "--preset", "tiny", "--data", str(world), "--frames", "4"]
    flags += ["--size", "16x16", "--batch-size", "2", "--steps", "2", "--offload", "stream"]
    flags += ["--output", str(tmp_path / "run"), "--no-progress", "--seed", "7"]
    flags += ["--optimizer-state", "bf16-sr/8bit", "--optimizer-state-tier", "disk"]
    assert main([*flags, "--optimizer-state-dir", str(tmp_path / "state")]) == 0
    assert (tmp_path / "state/block-0.codes").exists()
    saved = torch.load(tmp_path / "run/checkpoints/step-000002/optimizer.pt", weights_only=True)
    assert saved["state"] == "bf16-sr/8bit" and saved["step"][NON_BLOCK] == 2
