"""Step caches: per-request decisions in the sampler loop, for our DiT and for Wan."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.request import (
    CACHE_FORECASTS,
    CACHE_PRESETS,
    CacheSpec,
    RequestError,
    ResolvedVideo,
    VideoRequest,
    resolve_cache,
)
from megaslide.engine.sampling.flow import SampleState, cfg_combine, sample_step
from megaslide.engine.sampling.step_cache import (
    CURVE_FILE,
    FORECAST_ORDERS,
    POLICIES,
    Adaptive,
    History,
    StepCache,
    StepCurve,
    StepPolicy,
    calibrate,
    extrapolate,
)
from megaslide.engine.sources import resolve_source

from dit_fixtures import randomise_zero_inits

REQ = dict(frames=4, height=16, width=16, steps=6)
LOOSE = {"policy": "output-change", "threshold": 100.0}  # reuses whenever it may
FIRST_BLOCK = {"policy": "first-block", "threshold": 100.0}
ADAPTIVE_0 = {"policy": "adaptive", "threshold": 0}
ADAPTIVE_1 = {"policy": "adaptive", "threshold": 1.0}
# Policies that decide before the pass (first-block decides inside it, after block 0).
UPFRONT = sorted(p for p, policy in POLICIES.items() if not policy.probes)


@pytest.fixture(scope="module")
def pipe():
    p = open_pipeline(resolve_source(preset="tiny"), offload="stream")
    randomise_zero_inits(p.dit)
    return p


def run(pipe, states) -> list[np.ndarray]:
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    return [pipe.finish(s) for s in states]


def level_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def test_cache_off_is_the_plain_euler_sampler_bitwise(pipe):
    """Without a cache every step runs the model on the request's guidance pair, as before."""
    video = pipe.resolve(VideoRequest("a red circle", seed=1, **REQ))
    state = pipe.prepare(video)
    assert state.cache is None
    x, times = state.latents.clone(), state.times
    with torch.no_grad():
        for k in range(video.steps):
            v = pipe.dit(x.expand(2, *x.shape[1:]), times[k].expand(2), state.ctx, state.ctx_mask)
            x = x + (times[k + 1] - times[k]) * cfg_combine(v[:1], v[1:], video.guidance)
    (frames,) = run(pipe, [state])
    assert torch.equal(state.latents, x)
    assert np.array_equal(frames, pipe.generate(video))
    assert state.passes == video.steps


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_threshold_zero_reuses_nothing_and_changes_nothing(pipe, policy):
    off = pipe.resolve(VideoRequest("a red circle", seed=1, **REQ))
    zero = pipe.resolve(
        VideoRequest("a red circle", seed=1, cache={"policy": policy, "threshold": 0}, **REQ)
    )
    state = pipe.prepare(zero)
    (frames,) = run(pipe, [state])
    assert state.cache.passes == REQ["steps"] and state.cache.reused == 0
    assert np.array_equal(frames, pipe.generate(off))


@pytest.mark.parametrize("policy", UPFRONT)
def test_a_step_every_row_reuses_runs_no_pass_and_moves_no_weights(pipe, policy):
    """After its first two steps (a rate of change to go on) a loose cache reuses; on such a step
    the model does not run and the streamer copies nothing."""
    video = pipe.resolve(
        VideoRequest("a red circle", seed=1, cache={"policy": policy, "threshold": 100}, **REQ)
    )
    handle = pipe.handles["dit"]
    rows = []
    hook = pipe.dit.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    state, moved = pipe.prepare(video), []
    try:
        while not state.done:
            moved.append(pipe.denoise_step([state]).get("h2d_bytes", 0))
    finally:
        hook.remove()
    cache = state.cache
    assert cache.passes + cache.reused == REQ["steps"]
    assert 2 <= cache.passes < REQ["steps"] and len(rows) == cache.passes
    assert moved[:2] == [handle.stats()["streamed_block_bytes"]] * 2
    assert 0 in moved and moved.count(0) == cache.reused


def test_a_first_block_reuse_step_moves_only_block_0(pipe):
    """first-block runs block 0 for every row on every step; on a step where its rows reuse, they
    skip the remaining blocks (a plain request beside them still runs them, as a smaller batch)
    and the streamer loads block 0 alone: it copies block 0, or nothing while a slot still holds
    it, and never the block after it ahead."""
    handle = pipe.handles["dit"]
    block_bytes = handle.stats()["streamed_block_bytes"] // len(pipe.dit.blocks)
    cached = pipe.prepare(
        pipe.resolve(VideoRequest("a red circle", seed=1, cache=FIRST_BLOCK, **REQ))
    )
    loads, rows = [], {0: [], 1: []}
    load = handle.load
    handle.load = lambda i: (loads[-1].append(i), load(i))[1]
    hooks = [
        pipe.dit.blocks[i].register_forward_pre_hook(lambda _m, a, i=i: rows[i].append(len(a[0])))
        for i in (0, 1)
    ]
    moved = []
    try:
        while not cached.done:
            loads.append([])
            before = handle.stats()["copies"]
            moved.append(
                (pipe.denoise_step([cached])["h2d_bytes"], handle.stats()["copies"] - before)
            )
    finally:
        del handle.load
    plain = pipe.prepare(pipe.resolve(VideoRequest("a blue square", seed=2, **REQ)))
    together = pipe.prepare(
        pipe.resolve(VideoRequest("a red circle", seed=1, cache=FIRST_BLOCK, **REQ))
    )
    rows[0].clear(), rows[1].clear()
    try:
        run(pipe, [together, plain])
    finally:
        for h in hooks:
            h.remove()
    cache = cached.cache
    assert cache.passes == 1 and cache.reused == REQ["steps"] - 1  # a loose threshold
    assert loads[0] == list(range(len(pipe.dit.blocks)))
    assert all(step == [0] for step in loads[1:])
    assert moved[0][0] >= (len(pipe.dit.blocks) - 1) * block_bytes  # a whole pass (block 0 may
    # still be in a slot from an earlier request)
    assert all(m in ((0, 0), (block_bytes, 1)) for m in moved[1:]) and (block_bytes, 1) in moved
    # Together with a plain request: block 0 sees both pairs, the later blocks the plain one alone.
    assert rows[0] == [4] * REQ["steps"] and rows[1] == [4] + [2] * (REQ["steps"] - 1)


def test_rows_that_reuse_leave_the_pass():
    """Two requests in one step: the one whose cache reuses is not in the batch the model sees."""

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.batches = []

        def forward(self, x, t, ctx, mask):
            self.batches.append(x.shape[0])
            return x * 0 + t.view(-1, 1, 1, 1, 1)  # changes with t: a finite rate of change

    ctx, mask = torch.zeros(2, 1, 1), torch.ones(2, 1, dtype=torch.bool)
    times = torch.linspace(1, 0, 6)

    def state(cache):
        return SampleState(torch.zeros(1, 1, 2, 1, 1), ctx, mask, times, 3.0, cache=cache)

    cached = state(StepCache.from_spec(CacheSpec(**LOOSE)))
    plain = state(None)
    model = Recorder()
    while not plain.done:
        sample_step(model, [cached, plain])
    # Both pairs for two steps, then the plain pair, then both for the final step.
    assert model.batches == [4, 4, 2, 2, 4]
    assert cached.cache.passes == 3 and cached.cache.reused == 2


def test_extrapolate_is_the_polynomial_through_the_computed_outputs():
    """A forecast is the line (or parabola) through the last computed outputs, at the reuse's
    flow time; without one a reuse takes the last computed output itself."""
    v0, v1, v2 = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(0)).unbind()
    t0, t1, t2, t = 1.0, 0.8, 0.55, 0.4
    expected = v1 + (v1 - v0) * (t - t1) / (t1 - t0)  # the first-order formula
    assert torch.allclose(extrapolate([t0, t1], [v0, v1], t), expected, atol=1e-6)
    assert torch.equal(extrapolate([t1], [v1], t), v1)

    def f(x):  # quadratic in the flow time: the parabola through three of its points is itself
        return v0 + x * v1 + x**2 * v2

    got = extrapolate([t0, t1, t2], [f(t0), f(t1), f(t2)], t)
    assert torch.allclose(got, f(t), atol=1e-5)
    assert extrapolate([t0, t1], [v0.half(), v1.half()], t).dtype == torch.float16

    def history(order):
        h = History(order)
        for ti in (t0, t1, t2):
            h.record(ti, torch.zeros(1, 1, 2, 1, 1), f(ti).reshape(1, 1, 2, 1, 3))
        return h

    plain, linear, quadratic = history(0), history(1), history(2)
    assert len(plain.outputs) == len(linear.outputs) == 2 and len(quadratic.outputs) == 3
    assert plain.forecast(plain.outputs, t) is plain.outputs[-1]
    line = f(t2) + (f(t2) - f(t1)) * (t - t2) / (t2 - t1)
    assert torch.allclose(linear.forecast(linear.outputs, t).flatten(), line.flatten(), atol=1e-5)
    assert torch.allclose(
        quadratic.forecast(quadratic.outputs, t).flatten(), f(t).flatten(), atol=1e-5
    )
    early = History(2)  # two computed steps held: a quadratic forecast is the line until three
    for ti in (t0, t1):
        early.record(ti, torch.zeros(1, 1, 2, 1, 1), f(ti).reshape(1, 1, 2, 1, 3))
    line = f(t1) + (f(t1) - f(t0)) * (t - t1) / (t1 - t0)
    assert torch.allclose(early.forecast(early.outputs, t).flatten(), line.flatten(), atol=1e-5)


class ReuseFrom(StepPolicy):
    """Computes the steps before `first`, reuses every one from it on."""

    name = "reuse-from"

    def __init__(self, first: int):
        super().__init__(0.0)
        self.first, self.asked = first, 0

    def reuse(self, history: History, t: float, t_next: float) -> bool:
        self.asked += 1
        return self.asked > self.first


@pytest.mark.parametrize(
    ("forecast", "degree"), [("none", 1), ("linear", 1), ("linear", 2), ("quadratic", 2)]
)
def test_a_reuse_forecasts_the_output_in_flow_time(forecast, degree):
    """A model whose output is a polynomial of the flow time, three steps computed and three
    reused: a forecast of the polynomial's degree reuses the very output the model would have
    given (the latents of the uncached run), a lower one does not; without a forecast each reuse
    takes the last computed output as it is."""

    class Polynomial(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x, t, ctx, mask):
            return x * 0 + (1 + t**degree).view(-1, 1, 1, 1, 1)  # (B, C, F, H, W)

    ctx, mask = torch.zeros(2, 1, 1), torch.ones(2, 1, dtype=torch.bool)
    times = torch.linspace(1, 0, 7)

    def sample(cache):
        s = SampleState(torch.zeros(1, 1, 2, 1, 1), ctx, mask, times, 3.0, cache=cache)
        while not s.done:
            sample_step(Polynomial(), [s])
        return s.latents

    order = {"none": 0, "linear": 1, "quadratic": 2}[forecast]
    cache = StepCache(ReuseFrom(3), order)
    latents, uncached = sample(cache), sample(None)
    assert (cache.passes, cache.reused) == (3, 3)
    gap = (latents - uncached).abs().max().item()
    assert gap < 1e-6 if order >= degree else gap > 1e-3, gap
    if forecast == "none":  # by hand: steps 3-5 take step 2's output
        x = torch.zeros(1, 1, 2, 1, 1)
        for k in range(6):
            v = x * 0 + (1 + times[min(k, 2)] ** degree)
            x = x + (times[k + 1] - times[k]) * v
        assert torch.equal(latents, x)


def test_mixed_batch_gives_each_request_its_video_alone():
    """Cached and uncached requests stepped together: each gets the video it gets alone, bitwise
    when each row runs alone, within one uint8 level when rows share a pass."""
    requests = [
        VideoRequest("a red circle", seed=1, cache=LOOSE, **REQ),
        VideoRequest("a blue square", seed=5, guidance=1.0, **REQ),
        VideoRequest("a green bar", seed=7, cache={"policy": "adaptive", "threshold": 1}, **REQ),
        VideoRequest("a red bar", seed=9, cache=FIRST_BLOCK, **REQ),
        VideoRequest(
            "a blue bar", seed=11, cache={"policy": "first-block", "threshold": 0.2}, **REQ
        ),
        # Forecasting rows: each keeps its own computed outputs (or residuals) to extrapolate.
        VideoRequest("a red circle", seed=13, cache={**LOOSE, "forecast": "linear"}, **REQ),
        VideoRequest("a green bar", seed=15, cache={**FIRST_BLOCK, "forecast": "quadratic"}, **REQ),
    ]
    for batched, tolerance in ((False, 0), (True, 1)):
        pipe = open_pipeline(resolve_source(preset="tiny"), batched=batched)
        randomise_zero_inits(pipe.dit)
        videos = [pipe.resolve(r) for r in requests]
        alone_states = [pipe.prepare(v) for v in videos]
        alone = [run(pipe, [s])[0] for s in alone_states]
        states = [pipe.prepare(v) for v in videos]
        together = run(pipe, states)
        for a, b, sa, sb in zip(alone, together, alone_states, states):
            assert level_diff(a, b) <= tolerance, batched
            assert sa.passes == sb.passes
        assert states[0].passes < REQ["steps"] and states[1].passes == REQ["steps"]


def test_requests_name_a_cache_once_and_round_trip(pipe):
    video = pipe.resolve(VideoRequest("p", cache="fast"))
    assert video.cache == CacheSpec(**CACHE_PRESETS["fast"])
    assert ResolvedVideo.from_dict(video.to_dict()) == video
    assert pipe.resolve(VideoRequest("p")).cache is None
    assert pipe.resolve(VideoRequest("p", cache="off")).cache is None
    assert resolve_cache({"policy": "adaptive", "threshold": 0}) == CacheSpec("adaptive", 0.0)
    forecast = pipe.resolve(VideoRequest("p", cache={**LOOSE, "forecast": "linear"}))
    assert forecast.cache == CacheSpec("output-change", 100.0, "linear")
    assert forecast.cache.to_dict() == {**LOOSE, "forecast": "linear"}
    assert ResolvedVideo.from_dict(forecast.to_dict()) == forecast
    # Without a forecast (or with "none") a cache reads back as it did before forecasts.
    assert resolve_cache({**LOOSE, "forecast": "none"}) == CacheSpec(**LOOSE)
    assert video.to_dict()["cache"] == CACHE_PRESETS["fast"]
    bad = [
        ("warp", "preset 'warp' is unknown"),
        ({"policy": "teacache", "threshold": 0.1}, "policy 'teacache' is unknown"),
        ({"policy": "adaptive"}, "needs a threshold"),
        ({"policy": "adaptive", "threshold": -1}, "threshold must be a number"),
        ({"policy": "adaptive", "threshold": "0.1"}, "threshold must be a number"),
        ({"policy": "adaptive", "threshold": 0.1, "k": 3}, "unknown field"),
        ({**LOOSE, "forecast": "cubic"}, "forecast 'cubic' is unknown"),
        (3, "preset name or an object"),
    ]
    for value, message in bad:
        with pytest.raises(RequestError, match=message) as info:
            pipe.resolve(VideoRequest("p", cache=value))
        assert info.value.param == "cache"


def test_a_retried_step_decides_and_counts_once():
    cache = StepCache.from_spec(CacheSpec(**LOOSE))
    x = torch.ones(1, 1, 2, 1, 1)
    for step, (t, t_next) in enumerate([(1.0, 0.8), (0.8, 0.6)]):
        assert not cache.reuse(step, t, t_next)
        cache.record(t, x, x * t)
    assert cache.reuse(2, 0.6, 0.4) and cache.reuse(2, 0.6, 0.4)
    assert (cache.passes, cache.reused) == (2, 1)


def test_a_step_curve_predicts_each_calibrated_single_reuse():
    """On the calibration schedule the adaptive policy's predicted cost of reusing at one step is
    the clip error that reuse was measured to make; it reuses where that is under the threshold."""
    times = (1.0, 0.75, 0.5, 0.25, 0.0)
    curve = StepCurve(times, change=(0.2, 0.05, 0.4), error=(1e-4, 4e-6, 1e-2))
    assert curve.between(1.0, 0.25) == pytest.approx(0.65)
    assert curve.between(0.75, 0.625) == pytest.approx(0.025)  # half of step 2's change
    for k, e in enumerate(curve.error, start=1):
        cost = (
            curve.gain(times[k]) * (times[k] - times[k + 1]) * curve.between(times[k - 1], times[k])
        )
        assert cost == pytest.approx(e**0.5)
    x = torch.ones(1, 1, 2, 1, 1)
    for threshold, reuses in ((0.001, False), (0.003, True)):  # step 2's error is 0.002 RMS
        history = History()
        history.record(1.0, x, x)
        history.record(0.75, x, x * 1.1)
        assert Adaptive(threshold, curve).reuse(history, 0.5, 0.25) is reuses


def test_the_adaptive_policy_reads_the_curve_of_its_forecast(tmp_path):
    """A curve with a linear forecast's errors: a linear request reads them, a plain one the plain
    errors, a quadratic one (not measured) the plain errors and says so; a file without them (as
    written before curves per forecast) reads as plain only, and the file keeps that format."""
    times = (1.0, 0.75, 0.5, 0.25, 0.0)
    plain = StepCurve(times, change=(0.2, 0.05, 0.4), error=(1e-4, 4e-6, 1e-2))
    curve = StepCurve(
        times, plain.change, plain.error, forecast_error={"linear": (2e-4, 1e-8, 1e-2)}
    )
    assert curve.forecasts == ("none", "linear") and plain.forecasts == ("none",)
    picked = {}
    for forecast in CACHE_FORECASTS:
        spec = CacheSpec(policy="adaptive", threshold=0.001, forecast=forecast)
        policy = StepCache.from_spec(spec, curve).policy
        picked[forecast] = (policy.curve_forecast, policy.curve.error)
    assert picked == {
        "none": ("none", plain.error),
        "linear": ("linear", (2e-4, 1e-8, 1e-2)),
        "quadratic": ("none", plain.error),
    }
    # Step 2's plain reuse costs 0.002 RMS, its linear one 0.0001: only the latter is under 0.001.
    x = torch.ones(1, 1, 2, 1, 1)
    for forecast, reuses in (("none", False), ("linear", True)):
        history = History(FORECAST_ORDERS[forecast])
        history.record(1.0, x, x)
        history.record(0.75, x, x * 1.1)
        assert Adaptive(0.001, curve, forecast).reuse(history, 0.5, 0.25) is reuses
    (tmp_path / CURVE_FILE).write_text(json.dumps(plain.to_json()))
    old = json.loads((tmp_path / CURVE_FILE).read_text())
    assert set(old) == {"format", "times", "change", "error"}  # the format as before
    assert StepCurve.read(tmp_path) == plain
    assert Adaptive(0.001, StepCurve.read(tmp_path), "linear").curve_forecast == "none"
    (tmp_path / CURVE_FILE).write_text(json.dumps(curve.to_json()))
    assert StepCurve.read(tmp_path) == curve
    assert {k: v for k, v in curve.to_json().items() if k != "forecast_error"} == old
    with pytest.raises(ValueError, match="steps - 1 changes and errors"):
        StepCurve(times, plain.change, plain.error, forecast_error={"linear": (1e-4,)})
    with pytest.raises(ValueError, match="forecast errors for"):
        StepCurve(times, plain.change, plain.error, forecast_error={"none": plain.error})


@pytest.mark.slow  # tens of seconds: the developer loop leaves it out
def test_calibrate_measures_a_curve_the_pipeline_reads(tmp_path, pipe):
    """A calibration of a few steps: one change and one clip error per step that can reuse, read
    back from a model directory; the adaptive policy reading it keeps threshold 0 uncached and a
    mixed batch as alone."""
    short = {**REQ, "steps": 4}  # a calibration costs `steps` samples a request
    requests = [VideoRequest("a red circle", seed=1, **short)]
    curve = calibrate(pipe, requests)
    assert len(curve.times) == 5 and len(curve.error) == 3 and curve.forecasts == ("none",)
    assert all(c > 0 for c in curve.change) and all(e > 0 for e in curve.error)
    (tmp_path / CURVE_FILE).write_text(json.dumps(curve.to_json()))
    assert StepCurve.read(tmp_path) == curve and StepCurve.read(tmp_path / "none") is None
    # Per forecast: the plain errors as without it (deterministic); the linear ones the same at
    # step 1 (one computed output: nothing to extrapolate), their own after; read back.
    both = calibrate(pipe, requests, ("none", "linear"))
    assert both.forecasts == ("none", "linear") and both.for_forecast("none") == curve
    linear = both.forecast_error["linear"]
    assert linear[0] == curve.error[0] and linear[1:] != curve.error[1:]
    assert calibrate(pipe, requests, ("linear",)) == both  # deterministic; `none` always
    (tmp_path / CURVE_FILE).write_text(json.dumps(both.to_json()))
    assert StepCurve.read(tmp_path) == both
    with pytest.raises(ValueError, match="unknown"):
        calibrate(pipe, requests, ("cubic",))
    assert pipe.step_curve is None  # a preset has no directory, so no curve
    assert open_pipeline("megaslide-tiny").step_curve is not None  # the packaged model has one
    pipe.step_curve = curve
    try:
        zero = pipe.prepare(
            pipe.resolve(VideoRequest("a red circle", seed=1, cache=ADAPTIVE_0, **short))
        )
        assert zero.cache.policy.curve == curve
        assert np.array_equal(run(pipe, [zero])[0], pipe.generate(pipe.resolve(requests[0])))
        assert zero.cache.reused == 0
        cached = VideoRequest("a bar", seed=2, cache=ADAPTIVE_1, **short)
        videos = [pipe.resolve(r) for r in (cached, requests[0])]
        alone = [run(pipe, [pipe.prepare(v)])[0] for v in videos]
        states = [pipe.prepare(v) for v in videos]
        assert all(level_diff(a, b) <= 1 for a, b in zip(alone, run(pipe, states)))
        assert states[0].cache.reused > 0 and states[1].passes == 4
    finally:
        pipe.step_curve = None


# -- Wan ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    pytest.importorskip("diffusers")
    from wan_fixtures import build_tiny_wan

    root = tmp_path_factory.mktemp("wan")
    return {
        "deep": build_tiny_wan(root / "deep", layers=4),  # more blocks than slots
        "experts": build_tiny_wan(root / "experts", experts=2),
    }


def wan_request(**changes) -> VideoRequest:
    from wan_fixtures import CLIP

    fields = dict(
        prompt="a red circle moving left",
        height=32,
        width=32,
        frames=CLIP["num_frames"],
        steps=8,
        guidance=CLIP["guidance_scale"],
        seed=3,
    )
    return VideoRequest(**{**fields, **changes})


@pytest.mark.parametrize("policy", UPFRONT)  # first-block: its own test below
def test_wan_threshold_zero_changes_nothing_and_a_loose_cache_skips_whole_passes(wan, policy):
    pipe = open_pipeline(wan["deep"], offload="stream")
    off = pipe.generate(wan_request())
    zero = pipe.prepare(pipe.resolve(wan_request(cache={"policy": policy, "threshold": 0})))
    assert np.array_equal(run(pipe, [zero])[0], off)
    assert zero.cache.passes == 8
    loose = pipe.prepare(pipe.resolve(wan_request(cache={"policy": policy, "threshold": 100})))
    moved = []
    while not loose.done:
        moved.append(pipe.denoise_step([loose])["h2d_bytes"])
    assert 2 <= loose.cache.passes < 8
    assert moved.count(0) == loose.cache.reused  # a reused step moves no weights
    assert min(moved) == 0 < max(moved)


def test_wan_first_block_at_zero_is_uncached_and_a_reuse_step_loads_only_block_0(wan):
    pipe = open_pipeline(wan["deep"], offload="stream")
    # The plain passes keep all 512 tokens' keys: compact entries are only within a level of
    # recomputing them (prompt_cache.py), as the cut pass does.
    pipe.prompt_cache_compact = False
    handle = pipe.handles[pipe.config.experts[0]]
    off = pipe.generate(wan_request())
    zero = pipe.prepare(pipe.resolve(wan_request(cache={"policy": "first-block", "threshold": 0})))
    assert np.array_equal(run(pipe, [zero])[0], off)
    assert zero.cache.passes == 8 and zero.cache.reused == 0
    loose = pipe.prepare(pipe.resolve(wan_request(cache=FIRST_BLOCK)))
    loads, load = [], handle.load
    handle.load = lambda i: (loads[-1].append(i), load(i))[1]
    try:
        while not loose.done:
            loads.append([])
            pipe.denoise_step([loose])
    finally:
        del handle.load
    assert loose.cache.passes == 1 and loose.cache.reused == 7
    assert loads[0] == [0, 1, 2, 3] and all(step == [0] for step in loads[1:])


def test_wan_first_block_in_a_mixed_batch(wan):
    """A first-block request and a plain one stepped together get what they get alone (within a
    uint8 level: the later blocks run a smaller batch on reuse steps)."""
    pipe = open_pipeline(wan["deep"])
    requests = [
        wan_request(steps=4, cache=FIRST_BLOCK),
        wan_request(steps=4, seed=4, prompt="a blue square"),
    ]
    alone = [pipe.generate(pipe.resolve(r)) for r in requests]
    states = [pipe.prepare(pipe.resolve(r)) for r in requests]
    together = run(pipe, states)
    assert all(level_diff(a, b) <= 1 for a, b in zip(alone, together))
    assert states[0].cache.passes < 4 and states[1].passes == 4


def test_wan_forecasts_in_a_mixed_batch(wan):
    """Forecasting requests and a plain one stepped together get what they get alone (within a
    uint8 level), and a forecast changes what a reuse takes."""
    pipe = open_pipeline(wan["deep"])
    requests = [
        wan_request(steps=5, cache={**LOOSE, "forecast": "linear"}),
        wan_request(steps=5, seed=4, cache={**FIRST_BLOCK, "forecast": "quadratic"}),
        wan_request(steps=5, seed=5, prompt="a blue square"),
    ]
    alone = [pipe.generate(pipe.resolve(r)) for r in requests]
    states = [pipe.prepare(pipe.resolve(r)) for r in requests]
    together = run(pipe, states)
    assert all(level_diff(a, b) <= 1 for a, b in zip(alone, together))
    assert states[0].cache.passes < 5 and states[1].cache.passes < 5 and states[2].passes == 5
    plain = pipe.generate(pipe.resolve(wan_request(steps=5, cache=LOOSE)))
    assert level_diff(plain, alone[0]) > 0


def test_wan_two_experts_keep_their_own_histories(wan):
    """An output of the high-noise expert is never reused for the low-noise one: each expert
    computes its own first two steps before it reuses."""
    pipe = open_pipeline(wan["experts"])
    state = pipe.prepare(pipe.resolve(wan_request(steps=12, cache=LOOSE)))
    ran = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, _a, e=e: ran.append(e))
        for e, m in enumerate(pipe.experts)
    ]
    experts, computed = [], []
    while not state.done:
        experts.append(pipe.expert(state))
        before = len(ran)
        pipe.denoise_step([state])
        computed.append(len(ran) > before)
    for h in hooks:
        h.remove()
    assert set(state.cache.histories) == {0, 1}
    for e in (0, 1):
        mine = [c for x, c in zip(experts, computed) if x == e]
        assert len(mine) >= 3 and mine[:2] == [True, True] and not all(mine), (e, mine)
    assert state.cache.passes == sum(computed) == len(ran)
    # first-block too: each expert computes its own first step, then reuses its own residual.
    state = pipe.prepare(pipe.resolve(wan_request(steps=12, cache=FIRST_BLOCK)))
    run(pipe, [state])
    assert set(state.cache.histories) == {0, 1} and state.cache.passes == 2


# -- the request's way in: command line, HTTP API, SDK -----------------------------------------------


def test_command_line_cache_and_stats_count_the_passes(tmp_path, capsys):
    from megaslide.cli.main import main

    argv = ["generate", "a red circle", "--preset", "tiny", "--steps", "6", "--frames", "4"]
    argv += [
        "--size",
        "16x16",
        "--no-progress",
        "--offload",
        "stream",
        "-o",
        str(tmp_path / "a.mp4"),
    ]
    assert main([*argv, "--cache", "output-change:100", "--stats", str(tmp_path / "s.json")]) == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["steps"] == 6 and 2 <= stats["passes"] < 6
    assert stats["cache"] == {"policy": "output-change", "threshold": 100.0}
    assert f"{stats['passes']} passes for 6 steps" in capsys.readouterr().err
    assert (
        main([*argv, "--cache", "output-change:100:linear", "--stats", str(tmp_path / "s.json")])
        == 0
    )
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["cache"] == {"policy": "output-change", "threshold": 100.0, "forecast": "linear"}
    assert main([*argv, "--stats", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["passes"] == 6
    for value, message in (("warp", "preset 'warp' is unknown"), ("adaptive:x", "not a number")):
        assert main([*argv, "--cache", value]) == 2
        assert message in capsys.readouterr().err


def test_the_api_takes_a_cache_and_answers_the_passes(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("av")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    from megaslide.server import Settings

    from api_helpers import wait_status
    from server_fakes import torch_app

    settings = Settings(data_dir=tmp_path / "data", preset="tiny", device="cpu", poll_after_ms=50)
    clip = {"num_frames": 4, "size": "16x16", "num_inference_steps": 6, "seed": 1}
    with TestClient(torch_app(settings)) as c:
        cached = c.post("/v1/videos", json={"prompt": "a", **clip, "cache": LOOSE}).json()
        plain = c.post("/v1/videos", json={"prompt": "b", **clip}).json()
        forecast = {**LOOSE, "forecast": "quadratic"}
        ahead = c.post("/v1/videos", json={"prompt": "e", **clip, "cache": forecast}).json()
        bad = c.post("/v1/videos", json={"prompt": "c", **clip, "cache": "warp"})
        form = c.post("/v1/videos", data={"prompt": "d", "cache": '{"policy": "adaptive"}'})
        cached = wait_status(c, cached["id"], timeout=120)
        plain = wait_status(c, plain["id"], timeout=120)
        ahead = wait_status(c, ahead["id"], timeout=120)
    assert cached["status"] == plain["status"] == "completed"
    assert cached["cache"] == LOOSE and 2 <= cached["passes"] < 6
    assert plain["cache"] is None and plain["passes"] == 6
    assert ahead["status"] == "completed" and ahead["cache"] == forecast
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache"
    assert form.status_code == 400 and "needs a threshold" in form.json()["error"]["message"]


def test_the_sdk_sends_the_cache():
    from megaslide_client.resources.videos import create_body

    base = dict.fromkeys(
        (
            "model seconds size num_frames fps num_inference_steps guidance_scale "
            "negative_prompt seed priority extra_body"
        ).split()
    )
    assert create_body(prompt="p", cache="fast", **base)["cache"] == "fast"
    assert create_body(prompt="p", cache=LOOSE, **base)["cache"] == LOOSE
    forecast = {**LOOSE, "forecast": "linear"}
    assert create_body(prompt="p", cache=forecast, **base)["cache"] == forecast
    assert "cache" not in create_body(prompt="p", cache=None, **base)
