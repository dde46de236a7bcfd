"""Samplers chosen per request (the model's scheduler, flow Euler or consistency sampling over an
explicit list of timesteps) and guidance limited to part of the schedule: each against the
reference it imitates (diffusers' scheduler classes, a step-distilled model's published rule)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.lora import AdapterError, sidecar_defaults
from megaslide.engine.native.config import SamplingDefaults
from megaslide.engine.request import (
    ModelLimits,
    RequestError,
    ResolvedVideo,
    VideoRequest,
    even_timesteps,
    resolve,
)
from megaslide.engine.sampling.loop import GuidanceMemory
from megaslide.engine.sampling.samplers import (
    consistency_step,
    euler_step,
    flow_scheduler,
    flow_times,
    timestep_sigmas,
)
from megaslide.engine.sources import resolve_source

from dit_fixtures import randomise_zero_inits
from wan_fixtures import build_tiny_wan, request
from wan_reference import diffusers_run, first_difference, megaslide_run

diffusers = pytest.importorskip("diffusers")

DISTILLED = (1000, 750, 500, 250)  # LightX2V's 4-step list
SHIFT = 5.0
LIMITS = ModelLimits(max_frames=16, max_size=64, size_multiple=(8, 8), frames_multiple=1,
                     max_prompt_tokens=64)  # fmt: skip


def resolved(**changes) -> ResolvedVideo:
    return resolve(VideoRequest("a circle", **changes), LIMITS, SamplingDefaults(), model="m")


# -- the schedule and the update rules --------------------------------------------------------


def test_timesteps_map_to_the_shifted_levels_of_the_training_grid():
    """A timestep t is the level t / 1000 shifted (SD3's eq. 23), as a step-distilled model's
    scheduler reads it off its grid of 1000 levels: within fp32 rounding of the exact value, and of
    diffusers' own shifting of t / 1000."""
    sigmas = timestep_sigmas(DISTILLED, SHIFT)
    exact = [SHIFT * (t / 1000) / (1 + (SHIFT - 1) * t / 1000) for t in DISTILLED]
    assert sigmas.dtype == torch.float32 and sigmas[0] == 1.0
    torch.testing.assert_close(sigmas.double(), torch.tensor(exact, dtype=torch.float64))
    theirs = diffusers.FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    theirs.set_timesteps(sigmas=[t / 1000 for t in DISTILLED])
    torch.testing.assert_close(theirs.sigmas[:-1], sigmas, rtol=0, atol=2e-7)
    assert torch.equal(flow_times(sigmas), torch.cat([sigmas, torch.zeros(1)]))
    assert even_timesteps(4) == DISTILLED and even_timesteps(3) == (1000, 666, 333)


@pytest.mark.parametrize("sampler", ["euler", "consistency"])
def test_our_update_rules_are_bitwise_diffusers_scheduler_classes(sampler):
    """Fed the same model outputs, our DiT's steps are the steps of diffusers' class for the
    sampler (FlowMatchEulerDiscreteScheduler, FlowMatchLCMScheduler), bit for bit; the
    consistency sampler's fresh noise comes from the same generator in the same order."""
    sigmas = timestep_sigmas(DISTILLED, SHIFT)
    theirs = flow_scheduler(sampler, sigmas, 1000, torch.device("cpu"))
    times = flow_times(sigmas)
    assert torch.equal(theirs.sigmas, times)
    g = torch.Generator().manual_seed(0)
    x_ours = x_theirs = torch.randn(1, 4, 3, 4, 4, generator=g)
    ours_g, theirs_g = (torch.Generator().manual_seed(9) for _ in range(2))
    for step, t in enumerate(theirs.timesteps):
        v = torch.randn(x_ours.shape, generator=g)
        kwargs = {"generator": theirs_g} if sampler == "consistency" else {}
        x_theirs = theirs.step(v, t, x_theirs, return_dict=False, **kwargs)[0]
        if sampler == "euler":
            x_ours = euler_step(x_ours, v, times[step], times[step + 1])
        else:
            x_ours = consistency_step(x_ours, v, times[step], times[step + 1], ours_g)
        assert torch.equal(x_ours, x_theirs), (sampler, step)


def test_euler_over_the_list_is_the_published_step_distilled_rule():
    """LightX2V's step-distilled update, `x0 = x - sigma v` then `x0 + sigma' v`, is the Euler step
    written another way: the same up to fp32 rounding."""
    sigmas = timestep_sigmas(DISTILLED, SHIFT).tolist() + [0.0]
    g = torch.Generator().manual_seed(1)
    ours = theirs = torch.randn(2, 16, generator=g, dtype=torch.float32)
    for i in range(len(DISTILLED)):
        v = torch.randn(ours.shape, generator=g)
        ours = euler_step(ours, v, torch.tensor(sigmas[i]), torch.tensor(sigmas[i + 1]))
        theirs = theirs - sigmas[i] * v
        if i < len(DISTILLED) - 1:
            theirs = theirs + v * sigmas[i + 1]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


# -- requests --------------------------------------------------------------------------------


def test_a_request_resolves_its_sampler_timesteps_and_interval():
    plain = resolved()
    assert (plain.sampler, plain.timesteps, plain.guidance_interval) == ("scheduler", None, None)
    listed = resolved(sampler="consistency", timesteps=DISTILLED, shift=SHIFT)
    assert (listed.steps, listed.timesteps, listed.shift) == (4, DISTILLED, SHIFT)
    assert resolved(sampler="euler", steps=3).timesteps == (1000, 666, 333)  # spread evenly
    assert resolved(guidance_interval=[0, 1]).guidance_interval is None  # every step
    halves = resolved(steps=4, guidance_interval=[0, 0.5])
    assert [halves.guided_at(i) for i in range(4)] == [True, True, False, False]
    again = ResolvedVideo.from_dict(json.loads(json.dumps(listed.to_dict())))
    assert again == listed  # through the job store's JSON


@pytest.mark.parametrize(
    "changes, param, match",
    [
        ({"sampler": "ddim"}, "sampler", "sampler 'ddim' is unknown"),
        ({"timesteps": DISTILLED}, "timesteps", "need the euler or consistency sampler"),
        ({"sampler": "euler", "timesteps": (1000, 1000)}, "timesteps", "strictly decreasing"),
        ({"sampler": "euler", "timesteps": (1001, 500)}, "timesteps", r"lie in \[1, 1000\]"),
        ({"sampler": "euler", "timesteps": (900.5,)}, "timesteps", "whole numbers"),
        ({"sampler": "euler", "timesteps": DISTILLED, "steps": 3}, "num_inference_steps", "3"),
        ({"shift": 0.0}, "shift", "positive"),
        ({"guidance_interval": (0.5, 0.5)}, "guidance_interval", "start < end"),
        ({"guidance_interval": (0.2,)}, "guidance_interval", "two numbers"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_field(changes, param, match):
    with pytest.raises(RequestError, match=match) as e:
        resolved(**changes)
    assert e.value.param == param


def test_an_adapter_carries_its_sampler_and_timesteps(tmp_path):
    """A step-distilled adapter's sidecar names its sampler and the timesteps it was distilled
    on; a list alone means Euler over it. What the request says wins."""
    side = tmp_path / "fast.safetensors.json"
    side.write_text(json.dumps({"sampling": {"timesteps": list(DISTILLED), "shift": SHIFT}}))
    defaults = sidecar_defaults(tmp_path / "fast.safetensors", {})
    assert defaults == {"timesteps": list(DISTILLED), "shift": SHIFT, "sampler": "euler"}
    video = resolve(VideoRequest("a circle", loras=("fast",)), LIMITS, SamplingDefaults(),
                    model="m", adapters={"fast": defaults})  # fmt: skip
    assert (video.sampler, video.timesteps, video.steps, video.shift) == (
        "euler",
        DISTILLED,
        4,
        SHIFT,
    )
    eight = resolve(VideoRequest("a circle", loras=("fast",), steps=8), LIMITS,
                    SamplingDefaults(), model="m", adapters={"fast": defaults})  # fmt: skip
    assert eight.timesteps == even_timesteps(8)  # the request's steps: the list no longer fits
    for bad, match in (
        ({"sampler": "heun"}, "not one of"),
        ({"timesteps": [1000, 250, 500]}, "strictly decreasing"),
        ({"sampler": "scheduler", "timesteps": [1000]}, "need the euler or consistency"),
    ):
        side.write_text(json.dumps({"sampling": bad}))
        with pytest.raises(AdapterError, match=match):
            sidecar_defaults(tmp_path / "fast.safetensors", {})


# -- our DiT ----------------------------------------------------------------------------------

REQ = dict(frames=4, height=16, width=16, seed=3)


@pytest.fixture(scope="module")
def dit():
    torch.set_num_threads(1)
    pipe = open_pipeline(resolve_source(preset="tiny"))
    randomise_zero_inits(pipe.dit)
    return pipe


def run(pipe, *requests: VideoRequest):
    states = pipe.prepare_batch([pipe.resolve(r) for r in requests])
    trail = []
    while not all(s.done for s in states):
        pipe.denoise_step(states)
        trail.append([s.latents.clone() for s in states])
    return states, trail


def test_consistency_sampling_renoises_from_the_requests_generator(dit):
    """The same seed gives the same clip batched or alone, and a clip other than Euler's over the
    same list."""
    fast = VideoRequest("a red circle", sampler="consistency", timesteps=DISTILLED, **REQ)
    euler = VideoRequest("a red circle", sampler="euler", timesteps=DISTILLED, **REQ)
    (alone,), trail = run(dit, fast)
    (_, _), both = run(dit, fast, euler)
    assert len(trail) == 4 and alone.row_passes == 8  # guided: two rows a step
    torch.testing.assert_close(both[-1][0], trail[-1][0], rtol=0, atol=1e-5)
    (_,), euler_trail = run(dit, euler)
    assert not torch.equal(euler_trail[1][0], trail[1][0])


def test_guidance_on_part_of_the_schedule_drops_the_unconditional_rows(dit):
    """Guided on the first half only: the same latents as full guidance while guided, then one row
    a step; a batch mixing both stays within rounding of each alone."""
    full = VideoRequest("a red circle", steps=4, **REQ)
    half = VideoRequest("a red circle", steps=4, guidance_interval=(0, 0.5), **REQ)
    (a,), full_trail = run(dit, full)
    (b,), half_trail = run(dit, half)
    assert (a.row_passes, b.row_passes) == (8, 6)
    assert torch.equal(full_trail[1][0], half_trail[1][0])
    assert not torch.equal(full_trail[2][0], half_trail[2][0])
    states, mixed = run(dit, full, half)
    assert [s.row_passes for s in states] == [8, 6]
    # The forecast guidance direction weighs the rounding of the batched sums by up to 2.
    for ours, alone in zip(mixed[-1], (full_trail[-1][0], half_trail[-1][0])):
        torch.testing.assert_close(ours, alone, rtol=0, atol=1e-4)


def test_unguided_steps_take_the_guidance_direction_forecast_from_the_guided_ones():
    """Linear in flow time through the last two guided steps of the same expert; as it is from
    one; nothing before the first."""
    memory = GuidanceMemory()
    a, b = torch.full((1, 2), 1.0), torch.full((1, 2), 3.0)
    assert memory.forecast(0, 0.5) is None
    memory.record(0, 0.9, a)
    assert torch.equal(memory.forecast(0, 0.5), a)
    memory.record(0, 0.8, b)
    torch.testing.assert_close(memory.forecast(0, 0.7), 2 * b - a)
    memory.record(0, 0.7, a)  # the oldest leaves: through (0.8, b) and (0.7, a)
    torch.testing.assert_close(memory.forecast(0, 0.6), 2 * a - b)
    assert memory.forecast(1, 0.3) is None  # another expert's steps are its own


# -- Wan, against diffusers' pipeline ----------------------------------------------------------


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return build_tiny_wan(tmp_path_factory.mktemp("wan") / "euler", scheduler="euler")


def with_scheduler(path, sampler: str, sigmas: torch.Tensor):
    """diffusers' WanPipeline with the sampler's own scheduler class over `sigmas`: the class
    set as a user sets a custom schedule on it (`set_timesteps(sigmas=...)`)."""
    pipe = diffusers.WanPipeline.from_pretrained(path)
    scheduler = flow_scheduler(sampler, sigmas, 1000, torch.device("cpu"))
    set_timesteps = scheduler.set_timesteps
    scheduler.set_timesteps = lambda steps, device=None: set_timesteps(
        sigmas=sigmas.tolist(), device=device
    )
    pipe.scheduler = scheduler
    return pipe


@pytest.mark.parametrize("sampler, guidance", [("euler", 1.0), ("consistency", 4.0)])
def test_wan_samples_a_distilled_list_bitwise_as_diffusers(wan, sampler, guidance):
    """Bitwise every step's latents and the frames, in the reference mode, resident and streamed:
    WanPipeline with the sampler's scheduler class over the same levels (the consistency one
    stepping with the generator that drew the starting noise)."""
    clip = request(sampler=sampler, timesteps=DISTILLED, shift=SHIFT, guidance=guidance)
    reference = with_scheduler(wan, sampler, timestep_sigmas(DISTILLED, SHIFT))
    latents, frames = diffusers_run(reference, clip, step_generator=sampler == "consistency")
    assert frames.std() > 1
    for offload in ("none", "stream"):
        pipe = open_pipeline(wan, batched=False, offload=offload)
        ours, our_frames = megaslide_run(pipe, clip)
        assert first_difference(ours, latents) is None, (offload, first_difference(ours, latents))
        assert np.array_equal(our_frames, frames), offload


def test_wan_guidance_interval_in_a_mixed_batch(wan):
    """A batch of a request guided throughout and one guided on its first half: the second runs
    one row on its last two steps, and each is within a level of its own run alone."""
    pipe = open_pipeline(wan)
    full, half = request(steps=4), request(steps=4, guidance_interval=(0, 0.5))
    alone = [pipe.generate(r) for r in (full, half)]
    states = pipe.prepare_batch([pipe.resolve(r) for r in (full, half)])
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    assert [s.row_passes for s in states] == [8, 6]
    for ours, theirs in zip(pipe.finish_batch(states), alone):
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1


@pytest.mark.parametrize("policy", ["output-change", "first-block"])
def test_a_guidance_interval_composes_with_step_caches(dit, policy):
    """Through a step cache that reuses nothing (threshold 0), first-block's cut pass included,
    a guidance interval gives the latents it gives alone; one that reuses runs fewer rows."""
    half = dict(steps=4, guidance_interval=(0, 0.5), **REQ)
    (plain,), trail = run(dit, VideoRequest("a red circle", **half))
    zero = {"policy": policy, "threshold": 0.0}
    (cached,), cached_trail = run(dit, VideoRequest("a red circle", cache=zero, **half))
    assert cached.row_passes == plain.row_passes == 6
    torch.testing.assert_close(cached_trail[-1][0], trail[-1][0], rtol=0, atol=1e-6)
    loose = {"policy": policy, "threshold": 100.0}
    (reused,), _ = run(dit, VideoRequest("a red circle", cache=loose, **half))
    assert reused.row_passes < 6


def test_a_models_own_defaults_name_its_sampler():
    """A step-distilled checkpoint's config says how it samples; a model that says nothing keeps
    its config as it was."""
    distilled = SamplingDefaults.from_dict({"sampler": "consistency", "timesteps": [1000, 500]})
    video = resolve(VideoRequest("a circle"), LIMITS, distilled, model="m")
    assert (video.sampler, video.timesteps, video.steps) == ("consistency", (1000, 500), 2)
    assert SamplingDefaults.from_dict(distilled.to_dict()) == distilled
    assert "sampler" not in SamplingDefaults().to_dict()
    with pytest.raises(ValueError, match="sampler 'ddim' is unknown"):
        SamplingDefaults.from_dict({"sampler": "ddim"})


def test_a_preview_is_the_clip_its_step_predicts(dit, wan):
    """After the last Euler step the predicted clean clip is the clip itself: its preview is the
    finished clip's middle frame (our DiT), or its first frame through Wan's VAE (within a level:
    the VAE decodes one latent frame alone). None before a step, and from a model that keeps no
    predictions."""
    cases = ((dit, REQ, lambda f: len(f) // 2), (open_pipeline(wan), {}, lambda f: 0))
    for pipe, clip, frame in cases:
        pipe.keep_predictions = True
        state = pipe.prepare(pipe.resolve(VideoRequest("a red circle", steps=3, **clip)))
        assert pipe.preview_batch([state]) == [None]
        while not state.done:
            pipe.denoise_step([state])
        (preview,) = pipe.preview_batch([state])
        frames = pipe.finish(state)
        assert preview.dtype == np.uint8 and preview.shape == frames.shape[1:]
        assert np.abs(preview.astype(int) - frames[frame(frames)].astype(int)).max() <= 1
        pipe.keep_predictions = False
        plain = pipe.prepare(pipe.resolve(VideoRequest("a red circle", steps=3, **clip)))
        pipe.denoise_step([plain])
        assert pipe.preview_batch([plain]) == [None]
