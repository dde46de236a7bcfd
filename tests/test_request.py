"""One video request, resolved once: defaults, limits and errors that name the parameter."""

import dataclasses

import pytest

from megaslide.engine.native.tokens import TOKEN_UNITS, count_tokens
from megaslide.engine.request import RequestError, VideoRequest, resolve
from megaslide.engine.sources import describe, resolve_source

from server_fakes import FAKE_LIMITS

INFO = describe(resolve_source(preset="tiny"))
TINY, DEFAULTS = INFO.limits, INFO.sampling


def error(request: VideoRequest, limits=TINY, **caps) -> RequestError:
    with pytest.raises(RequestError) as caught:
        resolve(request, limits, DEFAULTS, model="m", **caps)
    return caught.value


def test_defaults_come_from_the_model_and_an_absent_seed_is_drawn():
    video = resolve(VideoRequest("a red ball"), TINY, DEFAULTS, model="tiny")
    d = DEFAULTS
    assert (video.frames, video.width, video.height) == (d.frames, d.width, d.height)
    assert (video.steps, video.guidance, video.fps) == (d.steps, d.guidance, d.fps)
    assert video.negative_prompt == "" and 0 <= video.seed < 2**31
    assert resolve(VideoRequest("a", seed=5), TINY, DEFAULTS, model="tiny").seed == 5


def test_seconds_become_frames_at_the_requests_fps():
    video = resolve(VideoRequest("a", seconds=2, fps=8), TINY, DEFAULTS, model="tiny")
    assert video.frames == 16 and video.seconds == 2.0
    assert error(VideoRequest("a", seconds=2, frames=4)).param == "seconds"
    e = error(VideoRequest("a", seconds=60))
    assert e.param == "seconds"
    for bad in (float("inf"), float("nan"), -1.0, 1e308):
        assert error(VideoRequest("a", seconds=bad)).param == "seconds"


def test_every_rule_names_its_parameter():
    cases = [
        (VideoRequest(" "), "prompt", "must not be empty"),
        (VideoRequest("a", width=33, height=32), "size", "even"),
        (VideoRequest("a", width=512, height=512), "size", "at most 256"),
        (VideoRequest("a", width=30, height=32), "size", "multiple of 4"),
        (VideoRequest("a", frames=33), "num_frames", "1 to 32 frames"),
        (VideoRequest("a", frames=0), "num_frames", "at least 1"),
        (VideoRequest("a", steps=0), "num_inference_steps", "at least 1"),
        (VideoRequest("a", guidance=float("nan")), "guidance_scale", "finite"),
        (VideoRequest("a", seed=-1), "seed", "2**53"),
        (VideoRequest("a", seed=2**53), "seed", "2**53"),
        (VideoRequest("x" * 127), "prompt", "at most 126"),
        (VideoRequest("a", negative_prompt="y" * 127), "negative_prompt", "at most 126"),
    ]
    for request, param, fragment in cases:
        e = error(request)
        assert e.param == param and fragment in str(e), (request, e.param, str(e))
    assert error(VideoRequest("a", steps=60), max_steps=50).param == "num_inference_steps"
    assert error(VideoRequest("x" * 20), max_prompt_chars=10).code == "prompt_too_long"


def test_the_models_own_shape_rule_applies():
    dsa = describe(resolve_source(preset="tiny"), attention="dsa").limits
    e = error(VideoRequest("a", width=32, height=32, frames=4), limits=dsa)
    assert e.param == "size" and "3D-DSA" in str(e)
    resolve(VideoRequest("a", width=48, height=48, frames=4), dsa, DEFAULTS, model="tiny")
    assert "autoencoder" in str(error(VideoRequest("a", frames=3), limits=FAKE_LIMITS))


def test_prompt_length_is_counted_in_the_models_own_tokens():
    words = dataclasses.replace(
        FAKE_LIMITS,
        max_prompt_tokens=12,
        count_tokens=lambda p: count_tokens(p, "words"),
        prompt_unit=TOKEN_UNITS["words"],
    )
    few_words = "a magenta triangle moving left and a yellow square moving down"  # 11, 62 bytes
    resolve(VideoRequest(few_words), words, DEFAULTS, model="m")
    e = error(VideoRequest(few_words + " on black"), limits=words)
    assert "13 tokens (words and punctuation); this model takes at most 12" in str(e)
    assert "63 bytes" in str(error(VideoRequest("x" * 63), limits=FAKE_LIMITS))
