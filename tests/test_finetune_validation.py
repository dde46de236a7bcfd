"""Validation videos and the held-out loss: every checkpoint samples its prompts into playable
MP4s, a failed prompt fails only itself, and the held-out clips never train."""

import json

import pytest
import torch

from megaslide.engine.native.world import write_dataset
from megaslide.engine.sources import resolve_source
from megaslide.engine.training.data import held_out_split, validate_dataset
from megaslide.engine.training.finetune import open_trainer
from megaslide.engine.training.finetune_spec import (
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    RuntimeSpec,
    ScheduleSpec,
    ValidationPrompt,
    ValidationSpec,
)
from megaslide.engine.video import read_video

TINY = resolve_source(preset="tiny")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_dataset(
        tmp_path_factory.mktemp("world") / "data", 8, seed=0, frames=4, height=16, width=16
    )


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared machine: threads only contend
    yield
    torch.set_num_threads(threads)


def run(world, output, validation: ValidationSpec, **sections):
    spec = FinetuneSpec(
        run=RunSpec(output=str(output), save_every=2, seed=3),
        schedule=ScheduleSpec(steps=2),
        optimizer=OptimizerSpec(lr=2e-3),
        clips=ClipSpec(frames=4, height=16, width=16, batch_size=2),
        runtime=RuntimeSpec(offload="none"),
        validation=validation,
    )
    return open_trainer(TINY, world, spec.replace(**sections), resume=False)


def test_held_out_clips_are_fixed_by_the_seed_and_never_train(world, tmp_path):
    samples = validate_dataset(world)
    train, held = held_out_split(samples, seed=3, count=2)
    again, held_again = held_out_split(samples, seed=3, count=2)
    assert [s.line for s in held] == [s.line for s in held_again] and len(held) == 2
    assert {s.line for s in train} | {s.line for s in held} == {s.line for s in samples}
    assert not {s.line for s in train} & {s.line for s in held}
    assert [s.line for s in held_out_split(samples, seed=4, count=2)[1]] != [s.line for s in held]
    with pytest.raises(ValueError, match="none would be left to train on"):
        held_out_split(samples, seed=3, count=len(samples))
    # A quarter of 8 clips: 2 held out, the loader serves the other 6.
    with run(world, tmp_path, ValidationSpec(split=0.25)) as t:
        assert len(t.data.held_out) == 2 and len(t.loader.dataset) == 6
        trained = {s.line for s in t.loader.dataset.samples}
        assert trained == {s.line for s in train}
        # The same weights give the same held-out loss: its draws are the run's, not the step's.
        assert t.validation_loss() == t.validation_loss()


def test_split_is_checked():
    spec = FinetuneSpec(run=RunSpec(output="x"), validation=ValidationSpec(split=1.5))
    with pytest.raises(ValueError, match="validation.split"):
        spec.validate()
    spec = FinetuneSpec(
        run=RunSpec(output="x"), validation=ValidationSpec(prompts=(ValidationPrompt(" "),))
    )
    with pytest.raises(ValueError, match=r"validation.prompts\[0\].prompt"):
        spec.validate()
    # Its plain-data form round-trips, prompts included.
    spec = FinetuneSpec(
        run=RunSpec(output="x"),
        validation=ValidationSpec(prompts=(ValidationPrompt("a", seed=2, steps=2),), split=2),
    )
    assert FinetuneSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("offload", ["none", "stream"])  # sampled as the run trains: streamed too
def test_every_checkpoint_samples_its_prompts_into_playable_mp4s(world, tmp_path, offload):
    prompts = (
        ValidationPrompt(
            "a red circle moving left", seed=1, width=16, height=16, frames=4, steps=2
        ),
        # 15 pixels wide cannot be sampled: this video fails, the run and the others go on.
        ValidationPrompt("a blue square", seed=2, width=15, height=16, frames=4, steps=2),
        ValidationPrompt("a blue square", seed=2, width=32, height=16, frames=4, steps=2),
    )
    with run(
        world,
        tmp_path,
        ValidationSpec(prompts=prompts, split=2),
        schedule={"steps": 4},
        runtime={"offload": offload},
    ) as t:
        metrics = [t.train_step() for _ in range(4)]
        checkpoints = t.checkpoints()
    assert [m.get("validation_loss") is not None for m in metrics] == [False, True, False, True]
    assert [c["step"] for c in checkpoints] == [2, 4]
    for checkpoint, m in zip(checkpoints, metrics[1::2]):
        assert checkpoint["validation_loss"] == m["validation_loss"]
        videos = checkpoint["validation"]
        assert [v["status"] for v in videos] == ["succeeded", "failed", "succeeded"]
        assert "width" in videos[1]["error"] and videos[1]["file"] is None
        assert [v["prompt"] for v in videos] == [p.prompt for p in prompts]
        assert read_video(videos[0]["path"]).shape == (4, 16, 16, 3)
        assert read_video(videos[2]["path"]).shape == (4, 16, 32, 3)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [("validation_loss" in x) for x in lines] == [False, True, False, True]


def test_the_cli_samples_every_checkpoint_and_the_last(world, tmp_path):
    from megaslide.cli.main import main as cli_main

    flags = ["finetune", "--preset", "tiny", "--data", str(world), "--frames", "4"]
    flags += ["--size", "16x16", "--steps", "3", "--save-every", "2", "--no-progress"]
    flags += ["--output", str(tmp_path), "--validation-prompt", "a red circle"]
    flags += ["--validation-size", "16x16", "--validation-frames", "4", "--validation-steps", "2"]
    assert cli_main([*flags, "--validation-split", "2"]) == 0
    # Step 2's checkpoint, and the one the run ends with at step 3.
    for step in (2, 3):
        folder = tmp_path / "validation" / f"step-{step:06d}"
        assert read_video(folder / "0.mp4").shape == (4, 16, 16, 3)
        record = json.loads((folder / "videos.json").read_text())
        assert isinstance(record["validation_loss"], float)


@pytest.mark.parametrize("experts", [1, 2])  # two: both trained in the run, both sampled
def test_a_wan_run_samples_its_checkpoints_and_refuses_a_split(tmp_path, experts):
    pytest.importorskip("diffusers")
    from wan_fixtures import build_tiny_wan

    model = build_tiny_wan(tmp_path / "wan", layers=2, experts=experts)
    data = write_dataset(tmp_path / "world", 4, seed=0, frames=9, height=32, width=32)
    prompt = ValidationPrompt("a red circle", seed=1, width=32, height=32, frames=5, steps=2)
    spec = FinetuneSpec(
        run=RunSpec(output=str(tmp_path / "run"), save_every=1),
        schedule=ScheduleSpec(steps=1),
        clips=ClipSpec(batch_size=2),
        runtime=RuntimeSpec(offload="stream"),
        validation=ValidationSpec(prompts=(prompt,)),
    )
    with open_trainer(model, data, spec) as t:
        metrics = t.train_step()
        (checkpoint,) = t.checkpoints()
    assert "validation_loss" not in metrics and checkpoint["validation_loss"] is None
    (video,) = checkpoint["validation"]
    assert video["status"] == "succeeded", video["error"]
    assert read_video(video["path"]).shape == (5, 32, 32, 3)
    held_out = spec.replace(validation={"split": 1}, run={"output": str(tmp_path / "other")})
    with pytest.raises(ValueError, match="validation.split"):
        open_trainer(model, data, held_out)


@pytest.mark.slow  # processes of its own
def test_a_data_parallel_run_is_judged_by_its_first_rank(world, tmp_path):
    from megaslide.engine.parallel.data_parallel import finetune_on_devices

    prompt = ValidationPrompt("a red circle", seed=1, width=16, height=16, frames=4, steps=2)
    spec = FinetuneSpec(
        run=RunSpec(output=str(tmp_path), save_every=2, seed=3),
        schedule=ScheduleSpec(steps=2),
        clips=ClipSpec(frames=4, height=16, width=16, batch_size=2),
        runtime=RuntimeSpec(offload="stream", devices=("cpu", "cpu")),
        validation=ValidationSpec(prompts=(prompt,), split=2),
    )
    finetune_on_devices(TINY, world, spec, timeout_s=120, threads=1)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [("validation_loss" in x) for x in lines] == [False, True]
    folder = tmp_path / "validation" / "step-000002"
    assert read_video(folder / "0.mp4").shape == (4, 16, 16, 3)
