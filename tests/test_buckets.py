"""Aspect and length buckets: each clip's bucket, the plan, one bucket a batch, exact resume, and
a dataset of two sizes and two lengths trained without cropping."""

import json
from pathlib import Path

import pytest
import torch

from megaslide.cli.main import main
from megaslide.engine.family import TrainingShape
from megaslide.engine.request import ModelLimits
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.training.buckets import (
    Bucket,
    BucketPlan,
    BucketRules,
    plan_buckets,
    training_clips,
)
from megaslide.engine.training.data import BackgroundLoader, DatasetError, Sample
from megaslide.engine.training.finetune import open_trainer, resumed_in_buckets
from megaslide.engine.training.finetune_spec import (
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    RuntimeSpec,
    ScheduleSpec,
)

from mixed_clips import write_mixed_clips

TINY = resolve_source(preset="tiny")

# Wan's shape rules (size multiples of 16, frames 4k + 1, a latent frame per 4 pixel frames).
WAN = ModelLimits(
    max_frames=81,
    max_size=1280,
    size_multiple=(16, 16),
    frames_multiple=4,
    frames_offset=1,
    max_prompt_tokens=511,
)


def wan_tokens(frames, height, width):
    return ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)


def test_a_bucket_keeps_the_aspect_rounds_down_and_fits_the_budget():
    budget = wan_tokens(81, 480, 832)
    rules = BucketRules(WAN, wan_tokens, budget, max_frames=81)
    # A 720p clip of 100 frames: the first 81, scaled down to the budget, 16:9 within a multiple.
    b = rules.bucket(100, 1280, 720)
    assert b.frames == 81 and b.height % 16 == 0 and b.width % 16 == 0
    assert wan_tokens(*astuple(b)) <= budget
    assert abs(b.width / b.height - 1280 / 720) < 16 / b.height
    # Scaled as far as the budget allows: one more multiple a side would not fit.
    assert wan_tokens(b.frames, b.height + 16, b.width + 16) > budget
    # A shorter clip may be larger: the budget is tokens, frames times area.
    assert rules.bucket(41, 1280, 720).height > b.height
    # Frames round down to 4k + 1; a clip within the budget keeps its size (never scaled up).
    assert rules.bucket(50, 320, 240) == Bucket(49, 240, 320)
    assert rules.bucket(50, 330, 250) == Bucket(49, 240, 320)  # at most a multiple dropped
    # The run's clip length bounds frames; the model's largest side bounds the size.
    assert rules.bucket(60, 320, 240).frames == 57
    assert BucketRules(WAN, wan_tokens, budget, max_frames=33).bucket(60, 320, 240).frames == 33
    tall = BucketRules(WAN, wan_tokens, 10**9, max_frames=81).bucket(5, 160, 4000)
    assert tall.height == 1280 and tall.width == 48  # 160 * 1280 / 4000 = 51.2, rounded down
    # Too small for the smallest bucket: the reason says why.
    assert "smaller than the smallest size" in rules.bucket(9, 8, 240)
    native = ModelLimits(32, 256, (4, 4), 4, 126)
    short = BucketRules(native, lambda f, h, w: f * h * w // 16, 1024, 16).bucket(3, 32, 32)
    assert "3 frames: fewer than the shortest clip the model takes (4)" in short


def astuple(b: Bucket):
    return b.frames, b.height, b.width


def sample(root: Path, line: int, frames: int, width: int, height: int) -> Sample:
    path = (root / f"clips/{line}.mp4").absolute()
    return Sample(
        path=path, text=f"clip {line}", line=line, num_frames=frames, size=(width, height)
    )


def test_a_clip_without_a_bucket_or_a_bucket_the_model_refuses_is_named(tmp_path):
    def no_odd_widths(frames, height, width):
        if width // 4 % 2:
            raise ValueError("3D-DSA needs an even token grid")

    limits = ModelLimits(32, 256, (4, 4), 1, 126, check_shape=no_odd_widths)
    rules = BucketRules(limits, lambda f, h, w: f * h * w // 16, 4096, 16)
    samples = [
        sample(tmp_path, 1, 8, 32, 32),
        sample(tmp_path, 2, 8, 2, 32),
        sample(tmp_path, 3, 8, 36, 32),
    ]
    with pytest.raises(DatasetError) as e:
        plan_buckets(tmp_path, samples, rules, batch_size=1)
    assert e.value.problems == [
        "metadata.jsonl line 2 (clips/2.mp4): no bucket: 2x32 is smaller than the smallest "
        "size the model takes (4x4)",
        "bucket 36x32x8 (1 clip(s), first metadata.jsonl line 3 (clips/3.mp4)): "
        "3D-DSA needs an even token grid",
    ]


def a_plan(sizes=(3, 2, 1), batch_size=2) -> BucketPlan:
    buckets, start = {}, 0
    for k, n in enumerate(sizes):
        buckets[Bucket(4, 16, 16 + 4 * k)] = tuple(range(start, start + n))
        start += n
    return BucketPlan(buckets, {b: 1 for b in buckets}, batch_size, budget=100)


def test_an_epoch_is_whole_batches_of_one_bucket_drawn_from_the_seed():
    plan = a_plan()
    assert plan.batches_per_epoch == 4  # ceil(3/2) + 1 + 1
    shapes = plan.shapes
    epoch = plan.epoch_batches(seed=5, epoch=0)
    assert len(epoch) == 4 and all(len(b) == 2 for b in epoch)
    assert all(len({shapes[i] for i in b}) == 1 for b in epoch)  # one bucket a batch
    assert set().union(*map(set, epoch)) == set(range(6))  # every clip, every epoch
    assert epoch == plan.epoch_batches(seed=5, epoch=0)
    orders = {str(plan.epoch_batches(seed=s, epoch=e)) for s in (5, 6) for e in (0, 1, 2)}
    assert len(orders) > 1
    assert "   16x16x4      3       1        2" in "\n".join(plan.lines())
    assert (
        plan.lines()[0]
        == "3 bucket(s) of at most 100 tokens, 6 clip(s), 4 batch(es) of 2 an epoch:"
    )


class ShapedClips:
    """Clips of their plan's shapes, each filled with its index."""

    def __init__(self, plan: BucketPlan):
        self.shapes = plan.shapes

    def __len__(self):
        return len(self.shapes)

    def __getitem__(self, i):
        return torch.full((3, *self.shapes[i]), float(i)), f"clip {i}"


def test_a_resumed_loader_serves_the_batches_an_uninterrupted_one_does():
    plan = a_plan()
    clips = ShapedClips(plan)
    with BackgroundLoader(clips, seed=3, plan=plan) as full:
        uninterrupted = [next(full) for _ in range(10)]  # two epochs and a half
    for b in uninterrupted:
        assert b.video.shape[2:] == clips.shapes[b.indices[0]]
        assert [int(b.video[j, 0, 0, 0, 0]) for j in range(2)] == b.indices
    with BackgroundLoader(clips, seed=3, plan=plan) as first:
        for _ in range(5):
            next(first)
        state = first.state_dict()
    assert state["epoch"] == 1 and state["index"] == 1 and state["plan"] == plan.fingerprint
    with BackgroundLoader(clips, seed=0, plan=plan) as resumed:
        resumed.load_state_dict(state)
        assert [next(resumed).indices for _ in range(5)] == [b.indices for b in uninterrupted[5:]]
    # A position counts one plan's batches: another plan, or one clip size, refuses it.
    other = a_plan(sizes=(2, 2, 2))
    with pytest.raises(ValueError, match="bucket plan"):
        BackgroundLoader(ShapedClips(other), plan=other).load_state_dict(state)
    with pytest.raises(ValueError, match="one clip size"):
        BackgroundLoader(clips, batch_size=2).load_state_dict(state)


# -- a dataset of two sizes and two lengths, trained ------------------------------------------

CLIPS = [(16, 16, 4), (24, 16, 6)] * 3  # (W, H, F)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return write_mixed_clips(tmp_path_factory.mktemp("mixed"), CLIPS)


@pytest.fixture
def one_thread():
    # Tiny models on a small shared machine train fastest on one thread.
    torch.set_num_threads(1)


def test_buckets_are_the_default_for_mixed_clips_unless_a_size_is_asked(mixed, tmp_path):
    info = describe(TINY)
    shape = TrainingShape(frames=16, width=32, height=32, batch_size=2, buckets=None)
    samples, plan = training_clips(info, mixed, shape)
    assert [s.size + (s.num_frames,) for s in samples] == CLIPS
    assert plan.shapes == [(f, h, w) for w, h, f in CLIPS]  # within the budget: as they come
    assert plan.budget == 16 * 8 * 8  # one 32x32x16 clip's tokens
    # One size asked for: every clip resized and cropped to it, as before buckets.
    one = TrainingShape(frames=4, width=16, height=16, buckets=False)
    assert training_clips(info, mixed, one)[1] is None
    # A dataset of one size and length keeps one size too.
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips/0.mp4").write_bytes((mixed / "clips/0.mp4").read_bytes())
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file": "clips/0.mp4", "text": "a"}))
    alone = TrainingShape(frames=4, width=32, height=32, buckets=None)
    assert training_clips(info, tmp_path, alone)[1] is None
    with pytest.raises(DatasetError, match="video has 4 frames, training needs 16"):
        training_clips(info, tmp_path, TrainingShape(frames=16, width=32, height=32, buckets=None))


class Recorder:
    """A loader that remembers the batches it handed over."""

    def __init__(self, loader):
        self.loader, self.batches = loader, []

    def __next__(self):
        batch = next(self.loader)
        self.batches.append(batch)
        return batch

    def __getattr__(self, name):
        return getattr(self.loader, name)


def run(data, output, resume=False, steps=4):
    spec = FinetuneSpec(
        run=RunSpec(output=str(output), save_every=2),
        schedule=ScheduleSpec(steps=steps),
        optimizer=OptimizerSpec(lr=1e-3),
        clips=ClipSpec(batch_size=2),
        runtime=RuntimeSpec(offload="none"),
    )
    trainer = open_trainer(TINY, data, spec, resume=resume)
    trainer.loader = Recorder(trainer.loader)
    return trainer


def weights(trainer):
    return {k: v.clone() for k, v in trainer.blockwise.model.dit.state_dict().items()}


def test_mixed_clips_train_uncropped_in_buckets_and_resume_exactly(mixed, tmp_path, one_thread):
    with run(mixed, tmp_path / "a") as t:
        assert t.plan.batches_per_epoch == 4 and t.total_steps == 4
        t.run()
        uninterrupted, served = weights(t), t.loader.batches
    for batch in served:  # every clip at its own size and length: nothing cropped or trimmed
        own = {(CLIPS[i][2], CLIPS[i][1], CLIPS[i][0]) for i in batch.indices}
        assert own == {tuple(batch.video.shape[2:])}
    assert {tuple(b.video.shape[2:]) for b in served} == {(4, 16, 16), (6, 16, 24)}
    # Killed after step 3 (its last checkpoint: step 2), resumed: the same batches, the same weights.
    t = run(mixed, tmp_path / "b")
    for _ in range(3):
        t.train_step()
    t.loader.close()
    with run(mixed, tmp_path / "b", resume=True) as resumed:
        assert resumed.step == 2
        resumed.run()
        assert [b.indices for b in resumed.loader.batches] == [b.indices for b in served[2:]]
        after = weights(resumed)
    assert all(torch.equal(after[k], uninterrupted[k]) for k in after)


def test_the_cli_prints_the_plan_before_the_first_step(mixed, tmp_path, capsys, one_thread):
    code = main(
        [
            "finetune",
            "--preset",
            "tiny",
            "--data",
            str(mixed),
            "--output",
            str(tmp_path / "o"),
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--token-budget",
            "100",
            "--no-progress",
        ]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "2 bucket(s) of at most 100 tokens, 6 clip(s), 4 batch(es) of 2 an epoch:" in err
    assert "16x12x6      3      72" in err  # 24x16 scaled to the budget, 16:12 within 4 pixels
    assert err.index("bucket(s)") < err.index("fine-tuned model written")


def test_bucket_options_are_checked():
    spec = FinetuneSpec(run=RunSpec(output="o"))
    with pytest.raises(ValueError, match="clips.token_budget must be at least 1"):
        spec.replace(clips={"token_budget": 0}).validate()
    with pytest.raises(ValueError, match="clips.token_budget bounds buckets"):
        spec.replace(clips={"buckets": False, "token_budget": 100}).validate()
    old = FinetuneSpec.from_dict({"run": {"output": "o"}, "clips": {"frames": 4}})
    assert old.clips.buckets is None and old.clips.token_budget is None


def test_a_resumed_run_left_to_choose_keeps_how_it_started(tmp_path):
    assert resumed_in_buckets(tmp_path) is None  # no checkpoint: the dataset decides
    step = tmp_path / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    position = {"seed": 0, "epoch": 0, "index": 2}
    torch.save({"loader": position}, step / "state.pt")
    assert resumed_in_buckets(tmp_path) is False  # one size (a run from before buckets too)
    torch.save({"loader": {**position, "plan": "0123456789abcdef"}}, step / "state.pt")
    assert resumed_in_buckets(tmp_path) is True
