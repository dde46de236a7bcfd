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

SHAPE = dict(frames=12, width=32, height=32, steps=2, guidance=1.0)  # 3D-DSA: 3 tiles of 4 frames


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


@pytest.fixture(scope="module")
def alone(models) -> dict[str, np.ndarray]:
    """Each model's own full copy's clip (resident: streamed ones are bitwise the same)."""
    return {name: frames(open_pipeline(str(models[name]))) for name in ("base", "a")}


@pytest.mark.parametrize(
    "placement",
    [
        {},
        {"offload": "stream", "weights": "lossless"},
        {"offload": "stream", "gpu_budget_bytes": 1 << 30},  # blocks resident on the device
    ],
)
def test_fine_tune_served_as_delta_is_bitwise_its_full_copy(models, alone, placement):
    pipe = open_pipeline(str(models["base"]), **placement)
    delta = make_delta(info(models["a"]), info(models["base"]), pipe.compute_dtype)
    card = pipe.add_fine_tune("a", delta)
    assert 0 < card["bytes"] <= delta.nbytes * 1.01 and card["base"] == pipe.name
    np.testing.assert_array_equal(frames(pipe, "a"), alone["a"])
    # The base is the base again after a fine-tune's pass, and when the fine-tune is gone.
    np.testing.assert_array_equal(frames(pipe), alone["base"])
    frames(pipe, "a")
    pipe.remove_fine_tune("a")
    np.testing.assert_array_equal(frames(pipe), alone["base"])


def test_deltas_applied_per_tensor_as_on_a_gpu(models, alone):
    pipe = open_pipeline(str(models["base"]), offload="stream")
    pipe.handles["dit"].deltas_per_block = False  # a GPU's way: a decode per tensor
    pipe.add_fine_tune("a", make_delta(info(models["a"]), info(models["base"]), pipe.compute_dtype))
    np.testing.assert_array_equal(frames(pipe, "a"), alone["a"])
    np.testing.assert_array_equal(frames(pipe), alone["base"])


def test_ten_fine_tunes_registered_at_once(models, alone):
    pipe = open_pipeline(str(models["base"]))
    delta = make_delta(info(models["a"]), info(models["base"]), pipe.compute_dtype)
    for k in range(10):
        pipe.add_fine_tune(f"a{k}", delta)
    np.testing.assert_array_equal(frames(pipe, "a9"), alone["a"])
    np.testing.assert_array_equal(frames(pipe, "a0"), alone["a"])


def test_requests_of_several_fine_tunes_share_a_step_moving_each_block_once(models):
    pipe = open_pipeline(str(models["base"]), offload="stream")
    for name in ("a", "b"):
        pipe.add_fine_tune(
            name, make_delta(info(models[name]), info(models["base"]), pipe.compute_dtype)
        )
    guided = {**SHAPE, "guidance": 2.5}  # guidance pairs grouped by fine-tune too

    def batch(asked):
        videos = [VideoRequest("a blue cube", seed=s, fine_tune=f, **guided) for f, s in asked]
        return pipe.prepare_batch([pipe.resolve(v) for v in videos])

    mixed = [(None, 0), ("a", 1), ("b", 2), ("a", 3)]
    states, moved = batch(mixed), []
    while not all(s.done for s in states):
        moved.append(pipe.denoise_step(states)["h2d_bytes"])
    together = pipe.finish_batch(states)
    base = batch([(None, 0)] * 4)
    base_moved = [pipe.denoise_step(base)["h2d_bytes"] for _ in moved]
    # Block by block: each block crosses once for the whole mixed batch, as for the base's
    # alone (the deltas are put on in place on the CPU: nothing else crosses).
    assert moved[1:] == base_moved[1:] and moved[-1] > 0  # (the first step's first copies)
    own = {n: open_pipeline(str(models[n or "base"])) for n in (None, "a", "b")}
    for (name, seed), got in zip(mixed, together):
        want = own[name].generate(VideoRequest("a blue cube", seed=seed, **guided))
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, name


@pytest.mark.slow  # samples two mixed batches: about 20 s on a loaded 2-core CPU
def test_a_mixed_step_decodes_each_delta_once_per_pass_on_the_cpu(models, monkeypatch):
    """A streamed step of the base and two fine-tunes on the CPU: each block's slot gets the
    base's bytes back by a copy before the next fine-tune's delta goes on, so each fine-tune's
    block delta is decoded once a block; the tensors outside the blocks switch twice a part at
    most (prologues, then epilogues in reverse); the text encoder (which b changes) never
    switches during a step. The clips are bitwise those of taking deltas off instead, decoded
    by the torch reference."""
    from megaslide.engine.streaming import variants

    pipe = open_pipeline(str(models["base"]), offload="stream")
    for name in ("a", "b"):
        pipe.add_fine_tune(
            name, make_delta(info(models[name]), info(models["base"]), pipe.compute_dtype)
        )
    handle, encoder = pipe.handles["dit"], pipe._variants["text_encoder"]
    blocks = {id(d) for v in handle._variants.values() for p in v.blocks.values() for *_, d in p}
    outside = {id(v.non_block.delta) for v in handle._variants.values()}
    encoders = {id(v.delta) for v in encoder._variants.values()}
    decoded = []
    apply = variants.delta_apply

    def counted(delta, words, sign):
        decoded.append(id(delta))
        return apply(delta, words, sign)

    def clips():
        asked = [(None, 0), ("a", 1), ("b", 2)]
        videos = [VideoRequest("a blue cube", seed=s, fine_tune=f, **SHAPE) for f, s in asked]
        states = pipe.prepare_batch([pipe.resolve(v) for v in videos])
        pipe.denoise_step(states)
        decoded.clear()
        pipe.denoise_step(states)  # the second step: the order of a running batch
        step = list(decoded)
        assert all(s.done for s in states)
        return pipe.finish_batch(states), step

    monkeypatch.setattr(variants, "delta_apply", counted)
    got, step = clips()
    depth = len(handle._blocks)
    assert sum(d in blocks for d in step) == depth * 2  # a's and b's, once a block
    assert sum(d in outside for d in step) <= 2 * (1 + 2)  # <= 3 a pass: None->a->b, reversed
    assert not any(d in encoders for d in step) and len(step) <= depth * 2 + 6
    monkeypatch.setattr(type(handle), "_base_bytes", lambda self, block: None)
    monkeypatch.setenv("MEGASLIDE_NATIVE_CODEC", "0")  # the torch reference decodes
    want, step = clips()
    assert sum(d in blocks for d in step) > depth * 2  # deltas taken off again
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_delta_of_another_base_is_refused(models, tmp_path):
    other = fine_tuned_copy(models["base"], tmp_path / "other", seed=9)
    delta = make_delta(info(models["a"]), info(other), torch.float32)
    pipe = open_pipeline(str(models["base"]))
    with pytest.raises(DeltaError, match=r"not megaslide-tiny: megaslide-tiny has another dit\."):
        pipe.add_fine_tune("a", delta)
    assert pipe.fine_tunes == {}
    with pytest.raises(DeltaError, match="computes in torch.float32"):
        pipe.add_fine_tune("a", make_delta(info(models["a"]), info(models["base"]), torch.bfloat16))


def test_an_fp8_base_takes_no_deltas(models):
    pipe = open_pipeline(str(models["base"]), offload="stream", weights="fp8")
    delta = make_delta(info(models["a"]), info(models["base"]), pipe.compute_dtype)
    with pytest.raises(DeltaError, match="raw or lossless"):
        pipe.add_fine_tune("a", delta)


def test_a_delta_the_host_cannot_hold_is_served_from_its_file(models, alone, monkeypatch):
    from megaslide.engine.sampling import pipeline as pipeline_module

    write_delta(info(models["a"]), info(models["base"]), torch.float32)
    monkeypatch.setattr(pipeline_module, "host_memory_available", lambda: (1000, "MemAvailable"))
    pipe = open_pipeline(str(models["base"]), offload="stream")
    with pytest.raises(DeltaError, match="host memory: fine-tune 'a' needs"):
        pipe.add_fine_tune("a", read_delta(models["a"], torch.float32))
    card = pipe.add_fine_tune("a", read_delta(models["a"], torch.float32, mapped=True))
    assert card["tier"] == "disk" and card["bytes"] == 0
    np.testing.assert_array_equal(frames(pipe, "a"), alone["a"])
    np.testing.assert_array_equal(frames(pipe), alone["base"])


def test_unknown_fine_tune_is_a_request_error(models):
    pipe = open_pipeline(str(models["base"]))
    with pytest.raises(RequestError, match="no fine-tune 'nope'") as err:
        pipe.resolve(VideoRequest("x", fine_tune="nope", **SHAPE))
    assert err.value.param == "fine_tune"


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


@pytest.mark.slow  # a fine-tuning job, then three videos, in process
def test_the_server_serves_a_finished_fine_tune_as_a_delta_over_its_base(tmp_path):
    import warnings

    from megaslide.server import Settings

    from api_helpers import processed, upload, wait_status
    from processes import noise_dataset_archive
    from server_fakes import torch_app

    with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient

    base = packaged_models()[DEFAULT_MODEL]
    data = tmp_path / "data"
    settings = Settings(data_dir=data, models=[str(base)], device="cpu", poll_after_ms=50)
    sampled: dict[str, np.ndarray] = {}
    clip = {"num_frames": 12, "size": "32x32", "num_inference_steps": 2}
    with TestClient(torch_app(settings, sampled)) as c:
        f = processed(
            c, upload(c, noise_dataset_archive(tmp_path, 2, frames=12), "d.tar.gz").json()
        )
        hyper = {"n_epochs": 1, "batch_size": 1, "num_frames": 12, "size": "32x32"}
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": base.name,
                "training_file": f["id"],
                "seed": 1,
                "hyperparameters": hyper,
            },
        ).json()
        done = until_done(c, job["id"])
        assert done["status"] == "succeeded", done
        tuned = done["fine_tuned_model"]
        asked = [(base.name, 1), (tuned, 2), (tuned, 3)]
        ids = [
            c.post(
                "/v1/videos", json={"prompt": "a tuned clip", "model": m, "seed": s, **clip}
            ).json()["id"]
            for m, s in asked
        ]
        for video_id in ids:
            assert wait_status(c, video_id, timeout=120)["status"] == "completed"
    (exported,) = {p.parents[2] for p in data.rglob("delta/bfloat16/delta.json")}
    # The worker made the delta it serves (in its own dtype) beside the trainer's bf16 one.
    assert read_delta(exported, torch.float32) is not None
    for (model, seed), video_id in zip(asked, ids):
        own = open_pipeline(str(base if model == base.name else exported))
        want = own.generate(
            VideoRequest("a tuned clip", seed=seed, frames=12, width=32, height=32, steps=2)
        )
        assert np.abs(sampled[video_id].astype(int) - want.astype(int)).max() <= 1, model


def until_done(c, job_id: str) -> dict:
    from server_fakes import until

    return until(
        lambda: (
            (j := c.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"]
            in ("succeeded", "failed", "cancelled")
            and j
        ),
        120,
        f"{job_id} to finish",
    )


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from lora_fixtures import write_peft
    from wan_fixtures import build_tiny_wan

    root = tmp_path_factory.mktemp("wan-deltas")
    base = build_tiny_wan(root / "base", experts=2)
    weights = [f"{e}/diffusion_pytorch_model.safetensors" for e in ("transformer", "transformer_2")]
    return {
        "base": base,
        "tuned": fine_tuned_copy(base, root / "tuned", seed=4, files=weights),
        "vae": fine_tuned_copy(
            base, root / "vae", seed=5, files=("vae/diffusion_pytorch_model.safetensors",)
        ),
        "peft": write_peft(root / "peft.safetensors", alpha=8),
    }


def wan_request(**changes) -> VideoRequest:
    from wan_fixtures import request

    return request(steps=3, **changes)


def test_a_wan_fine_tune_is_bitwise_its_full_copy_with_adapters_and_caches(wan):
    offload = "stream"
    from megaslide.engine.request import LoraChoice

    pipe = open_pipeline(wan["base"], offload=offload)
    delta = make_delta(info(wan["tuned"]), info(wan["base"]), pipe.compute_dtype)
    assert delta.deltas.keys() == {"transformer", "transformer_2"}  # both experts changed
    pipe.add_fine_tune("t", delta)
    pipe.add_adapter("lora", wan["peft"])
    own = open_pipeline(wan["tuned"], offload=offload)
    own.add_adapter("lora", wan["peft"])
    for changes in ({}, {"loras": (LoraChoice("lora", 0.7),), "cache": "fast"}):
        got = pipe.generate(wan_request(fine_tune="t", **changes))
        np.testing.assert_array_equal(got, own.generate(wan_request(**changes)), str(changes))


def test_wan_requests_of_a_fine_tune_and_its_base_share_a_step(wan):
    pipe = open_pipeline(wan["base"], offload="stream")
    pipe.add_fine_tune("t", make_delta(info(wan["tuned"]), info(wan["base"]), pipe.compute_dtype))
    asked = [(None, 1), ("t", 2), (None, 3), ("t", 4)]
    states = pipe.prepare_batch([pipe.resolve(wan_request(seed=s, fine_tune=f)) for f, s in asked])
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    together = pipe.finish_batch(states)
    own = {None: open_pipeline(wan["base"]), "t": open_pipeline(wan["tuned"])}
    for (name, seed), got in zip(asked, together):
        want = own[name].generate(wan_request(seed=seed))
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, (name, seed)


def test_a_fine_tune_may_not_change_the_decoder(wan):
    with pytest.raises(DeltaError, match="may not change the vae"):
        make_delta(info(wan["vae"]), info(wan["base"]), torch.float32)


@pytest.mark.slow  # two processes (gloo)
def test_fine_tunes_on_two_ranks_equal_one_process(wan):
    from megaslide.engine.parallel.rank_group import RankGroup
    from megaslide.engine.request import resolve

    base = info(wan["base"])
    group = RankGroup(base, ["cpu", "cpu"], timeout_s=300)
    try:
        delta = make_delta(info(wan["tuned"]), base, group.compute_dtype)
        group.add_fine_tune("t", delta)
        with pytest.raises(DeltaError, match="already has a fine-tune 't'"):
            group.add_fine_tune("t", delta)
        asked = [(None, 1), ("t", 2)]
        videos = [
            resolve(
                wan_request(seed=s, fine_tune=f),
                base.limits,
                base.sampling,
                model=base.name,
                fine_tunes={"t"},
            )
            for f, s in asked
        ]
        states = group.prepare_batch(videos)
        while not all(s.done for s in states):
            group.denoise_step(states)
        split = group.finish_batch(states)
    finally:
        group.close()
    own = {None: open_pipeline(wan["base"]), "t": open_pipeline(wan["tuned"])}
    for (name, seed), got in zip(asked, split):
        want = own[name].generate(wan_request(seed=seed))
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, name
