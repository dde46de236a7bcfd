"""Fine-tunes kept as lossless deltas over their base (engine/deltas.py): made from model
directories, refused when they belong to another base, and served bitwise as the fine-tune's own
full copy would be, resident and streamed, alone and beside the base and other fine-tunes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from megaslide.cli.main import main
from megaslide.engine.deltas import DeltaError, ModelDelta, make_delta, read_delta, write_delta
from megaslide.engine.loader import open_pipeline
from megaslide.engine.request import RequestError, VideoRequest
from megaslide.engine.sources import DEFAULT_MODEL, describe, packaged_models, resolve_source

SHAPE = dict(frames=12, width=32, height=32, steps=3)


def fine_tuned_copy(base: Path, out: Path, seed: int, files=("model.safetensors",)) -> Path:
    """A copy of the model directory `base` whose weights in `files` moved the way a short
    fine-tune moves them: by about 1% of each tensor's RMS, a few by much more."""
    shutil.copytree(base, out)
    generator = torch.Generator().manual_seed(seed)
    for name in files:
        tensors = load_file(str(base / name))
        for key, t in tensors.items():
            if not t.is_floating_point():
                continue
            rms = t.float().pow(2).mean().sqrt().clamp_min(1e-3)
            noise = torch.randn(t.shape, generator=generator) * rms * 0.01
            tensors[key] = (t.float() + noise).to(t.dtype)
        save_file(tensors, str(out / name))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deltas")
    base = packaged_models()[DEFAULT_MODEL]
    return {
        "base": base,
        "a": fine_tuned_copy(base, root / "a", seed=1),
        # B changes the text encoder too: its prompts encode with B's weights.
        "b": fine_tuned_copy(
            base, root / "b", seed=2, files=("model.safetensors", "text_encoder.safetensors")
        ),
    }


def info(path: Path):
    return describe(resolve_source(str(path)))


def frames(pipe, fine_tune=None, seed=0, prompt="a red ball moves right"):
    return pipe.generate(VideoRequest(prompt, seed=seed, fine_tune=fine_tune, **SHAPE))


def test_delta_round_trips_and_is_small(models, tmp_path):
    path, delta = write_delta(info(models["a"]), info(models["base"]), torch.float32)
    assert path == models["a"] / "delta" / "float32"
    loaded = read_delta(models["a"], torch.float32)
    assert loaded.deltas.keys() == {"dit"}  # the text encoder is the base's
    assert loaded.nbytes == delta.nbytes
    assert read_delta(models["a"], torch.bfloat16) is None
    held = sum(
        t.numel() * t.element_size()
        for t in load_file(str(models["a"] / "model.safetensors")).values()
    )
    # fp32 words of weights moved by 1% of their RMS keep about 16 bits of news each: the delta
    # saves little in fp32 (bf16's figures are the benchmark's), but must not be larger.
    assert delta.nbytes < held


@pytest.mark.parametrize(
    "placement", [{}, {"offload": "stream"}, {"offload": "stream", "weights": "lossless"}]
)
def test_fine_tune_served_as_delta_is_bitwise_its_full_copy(models, placement):
    pipe = open_pipeline(str(models["base"]), **placement)
    delta = make_delta(info(models["a"]), info(models["base"]), pipe.compute_dtype)
    card = pipe.add_fine_tune("a", delta)
    assert card["bytes"] == delta.nbytes and card["base"] == pipe.name
    own = open_pipeline(str(models["a"]), **placement)
    np.testing.assert_array_equal(frames(pipe, "a"), frames(own))
    # The base is the base again after a fine-tune's pass, and the fine-tune after that.
    np.testing.assert_array_equal(
        frames(pipe), frames(open_pipeline(str(models["base"]), **placement))
    )
    np.testing.assert_array_equal(frames(pipe, "a", seed=3), frames(own, seed=3))


def test_requests_of_several_fine_tunes_share_a_step(models):
    pipe = open_pipeline(str(models["base"]), offload="stream")
    for name in ("a", "b"):
        pipe.add_fine_tune(
            name, make_delta(info(models[name]), info(models["base"]), pipe.compute_dtype)
        )
    asked = [(None, 0), ("a", 1), ("b", 2), ("a", 3)]
    videos = [
        pipe.resolve(VideoRequest("a blue cube", seed=s, fine_tune=f, **SHAPE)) for f, s in asked
    ]
    states = pipe.prepare_batch(videos)
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    together = pipe.finish_batch(states)
    for (name, seed), got in zip(asked, together):
        alone = open_pipeline(str(models[name or "base"]), offload="stream")
        want = alone.generate(VideoRequest("a blue cube", seed=seed, **SHAPE))
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, name


def test_a_delta_of_another_base_is_refused(models, tmp_path):
    other = fine_tuned_copy(models["base"], tmp_path / "other", seed=9)
    delta = make_delta(info(models["a"]), info(other), torch.float32)
    pipe = open_pipeline(str(models["base"]))
    with pytest.raises(DeltaError, match=r"not megaslide-tiny: megaslide-tiny has another dit\."):
        pipe.add_fine_tune("a", delta)
    assert pipe.fine_tunes == {}
    with pytest.raises(DeltaError, match="computes in torch.float32"):
        pipe.add_fine_tune("a", make_delta(info(models["a"]), info(models["base"]), torch.bfloat16))


def test_unknown_fine_tune_is_a_request_error(models):
    pipe = open_pipeline(str(models["base"]))
    with pytest.raises(RequestError, match="no fine-tune 'nope'") as err:
        pipe.resolve(VideoRequest("x", fine_tune="nope", **SHAPE))
    assert err.value.param == "fine_tune"


def test_removed_fine_tune_leaves_the_base(models):
    pipe = open_pipeline(str(models["base"]), offload="stream", gpu_budget_bytes=1 << 30)
    pipe.add_fine_tune("a", make_delta(info(models["a"]), info(models["base"]), pipe.compute_dtype))
    frames(pipe, "a")
    pipe.remove_fine_tune("a")
    np.testing.assert_array_equal(frames(pipe), frames(open_pipeline(str(models["base"]))))


def test_unreadable_delta_is_named(tmp_path):
    (tmp_path / "delta.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DeltaError, match="format 'something-else'"):
        ModelDelta.load(tmp_path)


def test_cli_writes_a_delta(models, tmp_path, capsys):
    model = shutil.copytree(models["a"], tmp_path / "m")
    shutil.rmtree(model / "delta", ignore_errors=True)
    assert main(["delta", str(model), "--base", DEFAULT_MODEL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["changed_components"] == ["dit"] and report["dtype"] == "bfloat16"
    assert 0 < report["ratio"] < report["ratio_changed_components"] < 1
    assert read_delta(model, torch.bfloat16).nbytes == report["delta_bytes"]
    # Another architecture is no base of it.
    other = shutil.copytree(models["base"], tmp_path / "deeper")
    config = json.loads((other / "config.json").read_text())
    config["model"]["depth"] += 1
    (other / "config.json").write_text(json.dumps(config))
    assert main(["delta", str(model), "--base", str(other)]) == 2
    assert "not one architecture" in capsys.readouterr().err
