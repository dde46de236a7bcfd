"""LoRA adapters, first-frame images and step caches on two CPU processes (gloo): each equals one
process sampling the same batch (one device, streamed).

Bitwise for one video a batch, whatever its levers, and for our DiT's batches. Sequence
parallelism changes no reduction of the model's (test_parallel.py says why), and the levers add
none: an adapter's delta is computed row by row of the tokens, on each rank's own tokens, before
the gather; an image conditions the latents every rank holds whole; the policies that decide
before the pass read outputs and latents that are exactly equal on every rank. The first-block
policy's measure is the one sum that changes: summed over the ranks' token shards instead of
over one sequence, it may differ from one process's in its last bits, so a decision could differ
only for a threshold within that of the measure; the thresholds here are far from it, except
those chosen between a rank's own measure and the whole one, to show that the ranks decide
together. A Wan batch of several videos is within one uint8 level, lever or not (the test says
why). Each batch is the same on both sides.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megaslide.engine.loader import load_adapter, open_pipeline
from megaslide.engine.lora import AdapterError
from megaslide.engine.parallel.multidevice import generate_on_devices
from megaslide.engine.parallel.rank_group import RankGroup
from megaslide.engine.request import LoraChoice, RequestError, VideoRequest, resolve
from megaslide.engine.sampling import step_cache
from megaslide.engine.sources import describe, resolve_source

TIMEOUT_S = 300  # a hang fails the test instead of the suite (a group's whole life)
TWO = ["cpu", "cpu"]


def sample(model, videos) -> tuple[list[np.ndarray], list[int]]:
    """Every video's frames and the passes it ran, stepped together in one batch."""
    states = model.prepare_batch(videos)
    while not all(s.done for s in states):
        model.denoise_step(states)
    return model.finish_batch(states), [s.passes for s in states]


def assert_same(split: list[np.ndarray], one: list[np.ndarray]) -> None:
    for i, (a, b) in enumerate(zip(split, one, strict=True)):
        diff = np.abs(a.astype(int) - b.astype(int)).max()
        assert np.array_equal(a, b), f"video {i}: max difference {diff}"


# ---------------------------------------------------------------------------------------------
# Our DiT: every step-cache policy and forecast


@pytest.fixture(scope="module")
def native():
    info = describe(resolve_source(preset="tiny"))
    group = RankGroup(info, TWO, timeout_s=TIMEOUT_S)
    yield info, group, open_pipeline(info, offload="stream")
    group.close()


def cache(policy: str, threshold: float, forecast: str = "none") -> dict:
    return {"policy": policy, "threshold": threshold, "forecast": forecast}


def native_video(info, seed: int, steps: int = 4, cache: dict | None = None):
    fields = dict(prompt="a red circle moving left", frames=4, width=16, height=16)
    request = VideoRequest(**fields, steps=steps, seed=seed, cache=cache)
    return resolve(request, info.limits, info.sampling, model=info.name)


@pytest.mark.slow
def test_every_step_cache_policy_on_two_ranks_equals_one_process(native):
    """Each policy and forecast in one batch with an uncached video: the same frames and the
    same passes as one process, and every cached video reused a step. (The tiny preset's blocks
    start as identities, adaLN-zero: its first-block measure is 0, and the Wan tests below are
    the ones that put it between the ranks' own measures.)"""
    info, group, pipe = native
    caches = [
        cache("output-change", 100.0),
        cache("adaptive", 100.0, "linear"),
        cache("first-block", 1.0),
        cache("first-block", 1.0, "quadratic"),
        None,
    ]
    videos = [native_video(info, seed, cache=c) for seed, c in enumerate(caches)]
    split, split_passes = sample(group, videos)
    one, passes = sample(pipe, videos)
    assert_same(split, one)
    assert split_passes == passes and all(p < 4 for p in passes[:-1]) and passes[-1] == 4


# ---------------------------------------------------------------------------------------------
# Wan: adapters, images and caches together


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A Wan2.2-TI2V-style model (a first-frame image, per-token timesteps) on two ranks, the
    same on one process, an adapter file (every block's Linears, the time embedder, and the
    output projection after which the ranks gather) and an image."""
    from PIL import Image

    from lora_fixtures import write_peft
    from wan_fixtures import build_tiny_wan

    root = tmp_path_factory.mktemp("wan-levers")
    info = describe(resolve_source(str(build_tiny_wan(root / "ti2v", ti2v=True))))
    pipe = open_pipeline(info, offload="stream")
    out, dim = pipe.experts[0].proj_out.weight.shape
    g = torch.Generator().manual_seed(1)
    extra = {
        "transformer.proj_out.lora_A.weight": torch.randn(4, dim, generator=g) * 0.3,
        "transformer.proj_out.lora_B.weight": torch.randn(out, 4, generator=g) * 0.3,
    }
    lora = write_peft(root / "style.safetensors", time_embedder=True, seed=5, extra=extra)
    rng = np.random.default_rng(0)
    image = root / "first.png"
    Image.fromarray((rng.random((40, 48, 3)) * 255).astype(np.uint8)).save(image)
    group = RankGroup(info, TWO, timeout_s=TIMEOUT_S)
    yield {"info": info, "pipe": pipe, "group": group, "lora": lora, "image": str(image)}
    group.close()


def wan_video(wan, seed: int, **changes):
    info = wan["info"]
    fields = dict(prompt="a red circle", negative_prompt="blurry", frames=9, steps=3, seed=seed)
    request = VideoRequest(**{**fields, "width": 64, "height": 64, "guidance": 4.0, **changes})
    return resolve(request, info.limits, info.sampling, model=info.name, adapters={"style": {}})


@pytest.mark.slow
def test_wan_adapter_cards_are_a_pipelines(wan):
    group, pipe = wan["group"], wan["pipe"]
    card = group.add_adapter("style", wan["lora"])
    assert card == pipe.add_adapter("style", wan["lora"])
    assert group.adapter_cards() == pipe.adapter_cards() == [card]
    assert group.adapter_defaults() == pipe.adapter_defaults() == {"style": {}}
    with pytest.raises(AdapterError, match="already registered"):
        group.add_adapter("style", wan["lora"])


def levers(wan) -> dict[str, dict]:
    """Each lever alone, then all of them in one request."""
    style, image = (LoraChoice("style"),), wan["image"]
    first_block = cache("first-block", 100.0)
    return {
        "adapter": dict(loras=style),
        "image": dict(image=image),
        "first-block": dict(cache=first_block),
        "output-change": dict(cache=cache("output-change", 100.0), steps=4),
        "all": dict(loras=style, image=image, cache=first_block),
    }


@pytest.mark.slow
@pytest.mark.parametrize("lever", ["adapter", "image", "first-block", "all"])
def test_wan_each_lever_on_two_ranks_equals_one_process_bitwise(wan, lever):
    """One video a batch: bitwise. The adapter's and the image's effects are checked too."""
    video = wan_video(wan, 1, **levers(wan)[lever])
    split, split_passes = sample(wan["group"], [video])
    one, passes = sample(wan["pipe"], [video])
    assert_same(split, one)
    assert split_passes == passes
    if video.cache is not None:
        assert passes[0] < video.steps  # it reused a step
    else:
        (plain,), _ = sample(wan["pipe"], [wan_video(wan, 1)])
        assert not np.array_equal(one[0][1:], plain[1:])  # the lever changed the video


@pytest.mark.slow
def test_wan_adapter_image_and_cache_rows_in_one_batch(wan):
    """Every lever's rows and a plain one in one batch: within one uint8 level, the same passes.
    Not bitwise: a Wan pass of several videos split over two ranks rounds a few last bits
    unlike one process's pass of the same videos on this CPU, with no lever at all (each video
    alone is bitwise, above): the kernels' blocking follows the rows of a pass, B x N/2 tokens
    on a rank and B x N here."""
    videos = [wan_video(wan, seed, **kw) for seed, kw in enumerate(levers(wan).values())]
    videos.append(wan_video(wan, 9))
    split, split_passes = sample(wan["group"], videos)
    one, passes = sample(wan["pipe"], videos)
    for i, (a, b) in enumerate(zip(split, one, strict=True)):
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 1, f"video {i}"
    assert split_passes == passes == [3, 3, 1, 3, 1, 3]


@pytest.mark.slow
def test_an_adapter_removed_from_the_group_is_refused(wan):
    wan["group"].remove_adapter("style")
    assert wan["group"].adapter_cards() == [] and wan["group"].adapter_defaults() == {}
    with pytest.raises(RequestError, match="style"):
        wan["group"].prepare_batch([wan_video(wan, 1, **levers(wan)["adapter"])])


@pytest.mark.slow
def test_generate_on_devices_runs_every_lever_on_its_rank_group(tmp_path):
    """Wan2.1-I2V (the image as input channels and CLIP features) with an adapter and a
    first-block cache, through `generate_on_devices`: the frames and the MP4 of one process."""
    from PIL import Image

    from megaslide.engine.video import read_video

    from lora_fixtures import write_peft
    from wan_fixtures import build_tiny_wan

    info = describe(resolve_source(str(build_tiny_wan(tmp_path / "i2v", i2v=True))))
    image = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), np.uint8)).save(image)
    adapter = load_adapter(info, "style", write_peft(tmp_path / "style.safetensors", seed=5))
    request = VideoRequest(
        prompt="a red circle",
        frames=5,
        width=32,
        height=32,
        steps=3,
        guidance=4.0,
        seed=3,
        image=str(image),
        loras=(LoraChoice("style"),),
        cache=cache("first-block", 100.0),
    )
    video = resolve(request, info.limits, info.sampling, model=info.name, adapters={"style": {}})
    steps, pids = [], []
    output = tmp_path / "split.mp4"
    split = generate_on_devices(
        info,
        video,
        TWO,
        adapters=[adapter],
        output=output,
        timeout_s=TIMEOUT_S,
        progress=lambda step, total: steps.append((step, total)),
        on_spawn=pids.extend,
    )
    pipe = open_pipeline(info, offload="stream")
    pipe.register_adapter(adapter)
    (one,), passes = sample(pipe, [video])
    assert_same([split], [one])
    assert passes == [1] and steps == [(1, 3), (2, 3), (3, 3)] and len(pids) == 2
    assert read_video(output).shape == one.shape


@pytest.mark.slow
@pytest.mark.parametrize("inputs", ["first-last-frame", "video"])
def test_first_last_frames_and_an_input_video_on_two_ranks(tmp_path, inputs):
    """Wan2.1-FLF2V (both frames as input channels, both images' CLIP features) and
    video-to-video on a text-to-video model (the steps kept of a schedule), through
    `generate_on_devices`: bitwise the frames of one process, at 9 frames (6 tokens a rank),
    with the ranks on this process's thread count (a batched guidance pair rounds differently
    at another)."""
    from PIL import Image

    from megaslide.engine.video import write_mp4

    from wan_fixtures import build_tiny_wan

    rng = np.random.default_rng(0)
    fields = dict(prompt="a red circle", frames=9, width=32, height=32, steps=4, guidance=4.0)
    if inputs == "video":
        path = build_tiny_wan(tmp_path / "t2v")
        video = write_mp4(tmp_path / "in.mp4", rng.integers(0, 255, (9, 32, 32, 3), np.uint8))
        fields.update(video=str(video), strength=0.5)
    else:
        path = build_tiny_wan(tmp_path / "flf2v", flf2v=True)
        for name in ("first", "last"):
            pixels = rng.integers(0, 255, (32, 32, 3), np.uint8)
            Image.fromarray(pixels).save(tmp_path / f"{name}.png")
        fields.update(image=str(tmp_path / "first.png"), last_image=str(tmp_path / "last.png"))
    info = describe(resolve_source(str(path)))
    video = resolve(VideoRequest(**fields, seed=3), info.limits, info.sampling, model=info.name)
    steps = []
    split = generate_on_devices(
        info,
        video,
        TWO,
        timeout_s=TIMEOUT_S,
        progress=lambda step, total: steps.append((step, total)),
        threads=torch.get_num_threads(),
    )
    (one,), _ = sample(open_pipeline(info, offload="stream"), [video])
    assert_same([split], [one])
    total = 2 if inputs == "video" else 4  # video-to-video runs the last half of four steps
    assert steps[-1] == (total, total)


@pytest.mark.slow
def test_first_block_ranks_decide_together_from_the_whole_residual(wan, monkeypatch):
    """Thresholds between a rank's own measure of block 0's change and the whole sequence's:
    a rank deciding alone would decide unlike its peer (and skip a collective the peer waits
    in); summed over both, every rank decides as one process does, either way."""
    group, pipe = wan["group"], wan["pipe"]
    seen = []  # (residual, its cached one) of each decision, in this process only

    def measure(policy, history, residual, sp=None):
        if history.first is not None:
            seen.append((residual.clone(), history.first.clone()))
        return False

    monkeypatch.setattr(step_cache.FirstBlock, "reuse_probed", measure)
    sample(pipe, [wan_video(wan, 7, steps=2, cache=cache("first-block", 1.0))])
    monkeypatch.undo()
    ((residual, first),) = seen  # step 1's: (rows, N, D) each
    whole = step_cache.relative_l1(residual, first)
    ranks = [step_cache.relative_l1(r, f) for r, f in zip(residual.chunk(2, 1), first.chunk(2, 1))]
    low, high = sorted(ranks)
    assert low < whole < high
    for threshold, passes in (((low + whole) / 2, [2]), ((whole + high) / 2, [1])):
        video = wan_video(wan, 7, steps=2, cache=cache("first-block", threshold))
        split, split_passes = sample(group, [video])
        one, one_passes = sample(pipe, [video])
        assert_same(split, one)
        assert split_passes == one_passes == passes
