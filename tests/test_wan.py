"""Wan models in the diffusers layout: loading, the same video as diffusers for the same seed,
streaming, batching, 3D-DSA, image-to-video, and the command line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_model, open_pipeline
from megaslide.engine.request import RequestError, VideoRequest
from megaslide.engine.sampling.pipeline import CPU_ROWS_PER_PASS
from megaslide.engine.sources import describe, resolve_source

from wan_fixtures import PROMPT, build_tiny_wan, request
from wan_reference import (
    CPU_VARIANTS,
    diffusers_run,
    first_difference,
    megaslide_run,
    on_cpu_variants,
    run_on_cpu_variant,
)

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """Tiny random Wan pipelines, one per variant."""
    root = tmp_path_factory.mktemp("wan")
    return {
        "unipc": build_tiny_wan(root / "unipc", shard="20KB"),  # sharded weights
        "euler": build_tiny_wan(root / "euler", scheduler="euler"),
        "experts": build_tiny_wan(root / "experts", experts=2),
        "ti2v": build_tiny_wan(root / "ti2v", ti2v=True),
        "deep": build_tiny_wan(root / "deep", layers=4),
    }


@pytest.fixture(scope="module")
def reference(wan):
    """`reference(variant, clip)`: diffusers' run of a request, computed once per module."""
    runs = {}

    def run(variant: str, clip: VideoRequest):
        if (variant, clip) not in runs:
            runs[variant, clip] = diffusers_run(wan[variant], clip)
        return runs[variant, clip]

    return run


def level_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


# One case per task runs again on the other CPUs' code paths (the kernels are what differ there;
# schedulers and experts are the same arithmetic on every ISA).
@pytest.mark.parametrize(
    "variant", [on_cpu_variants("unipc"), "euler", "experts", on_cpu_variants("ti2v")]
)
def test_same_seed_same_video_as_diffusers(wan, reference, variant):
    """Bitwise, every step's latents and the frames, in the reference mode (each row alone, as
    WanPipeline runs them), resident and streamed; the weights on both sides at 64-byte boundaries
    (tests/support/wan_reference.py says why)."""
    clip = request(64 if variant == "ti2v" else 32)  # TI2V's VAE takes 16 pixels per latent
    latents, frames = reference(variant, clip)
    assert frames.std() > 1  # a random model draws something, not a constant
    for offload in ("none", "stream"):
        pipe = open_pipeline(wan[variant], batched=False, offload=offload)
        ours, our_frames = megaslide_run(pipe, clip)
        differs = first_difference(ours, latents)
        assert differs is None, (variant, offload, differs)
        assert np.array_equal(our_frames, frames), (variant, offload)


@pytest.mark.parametrize("variant", ["unipc", "euler", "experts", "ti2v"])
def test_batched_guidance_pairs_within_one_level_of_diffusers(wan, reference, variant):
    """With both halves of a guidance pair in one pass the GEMMs have other shapes, so the sums
    run in another order: within one uint8 level, not bitwise."""
    clip = request(64 if variant == "ti2v" else 32)
    _, frames = reference(variant, clip)
    for offload in ("none", "stream"):
        batched = open_pipeline(wan[variant], offload=offload)
        assert level_diff(batched.generate(clip), frames) <= 1, (variant, offload)


def test_image_to_video_first_frame_matches_diffusers(wan, tmp_path):
    from PIL import Image

    pixels = (np.random.default_rng(0).random((40, 48, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "first.png")
    image_request = request(64, image=str(tmp_path / "first.png"))
    latents, frames = diffusers_run(wan["ti2v"], image_request, image=tmp_path / "first.png")
    exact = open_pipeline(wan["ti2v"], batched=False)
    ours, our_frames = megaslide_run(exact, image_request)
    differs = first_difference(ours, latents)
    assert differs is None, differs
    assert np.array_equal(our_frames, frames)
    without = exact.generate(request(64))
    assert level_diff(without, frames) > 8  # the image changes the clip
    with pytest.raises(RequestError, match="does not take a first-frame image"):
        open_pipeline(wan["unipc"]).resolve(image_request)


@pytest.mark.cpu_variants
def test_plain_from_pretrained_within_one_level(wan):
    """diffusers' own loading leaves each weight at the file's offsets; where MKL's kernels depend
    on alignment the last bits differ from ours, never by more than one uint8 level."""
    clip = request()
    _, plain = diffusers_run(wan["experts"], clip, aligned=False)
    assert level_diff(open_pipeline(wan["experts"], batched=False).generate(clip), plain) <= 1


@pytest.mark.parametrize("variant", sorted(CPU_VARIANTS))
@pytest.mark.slow
def test_parity_holds_on_other_cpus_code_paths(variant):
    """The parity tests above, test_wan_i2v.py's, test_wan_flf2v_v2v.py's, test_wan_vace.py's and
    test_wan_animate.py's, again in a child process on the kernels an AVX2-only or an SSE4.2
    machine would run (MKL, ATen and oneDNN told to use no wider vectors), so a machine with
    AVX-512 catches what an AMD one would."""
    here = Path(__file__)
    files = ("test_wan_i2v.py", "test_wan_flf2v_v2v.py", "test_wan_vace.py", "test_wan_animate.py")
    others = [here.with_name(f) for f in files]
    done = run_on_cpu_variant(variant, "cpu_variants", here, *others)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    # Text-to-video (Wan2.1's VAE and Wan2.2's), plain loading, image-to-video, first-last-frame,
    # video-to-video, VACE and Animate, none skipped by mistake.
    assert re.search(r"^8 passed, \d+ deselected in", done.stdout, re.M), done.stdout[-2000:]


def test_requests_share_one_pass_and_one_weight_crossing_per_step(wan, monkeypatch):
    """Three requests (two guided pairs and one unguided row) in one batch: their five prompts,
    three distinct (one negative for both pairs, the first's prompt again), in one UMT5 pass,
    one forward per step, each streamed block copied to the device once per step, the clips
    decoded two per VAE pass, and each clip within one level of its run alone."""
    pipe = open_pipeline(wan["deep"], offload="stream")
    handle = pipe.handles["transformer"]
    plan = handle.plan
    assert plan.num_slots < len(pipe.experts[0].blocks)  # blocks must really stream
    requests = [
        request(seed=1),
        request(seed=2, prompt="a blue square"),
        request(seed=5, guidance=1.0),
    ]
    alone = [pipe.generate(r) for r in requests]
    encoded, decoded = [], []
    text_hook = pipe.encoders.text_encoder.register_forward_pre_hook(
        lambda _m, args: encoded.append(args[0].shape[0])
    )
    states = pipe.prepare_batch([pipe.resolve(r) for r in requests])
    text_hook.remove()
    assert encoded == [3]
    passes = []

    def count_rows(_module, _args, kwargs):
        passes.append(kwargs["hidden_states"].shape[0])

    hook = pipe.experts[0].register_forward_pre_hook(count_rows, with_kwargs=True)
    before = handle.h2d_bytes
    steps = states[0].num_steps
    for _ in range(steps):
        pipe.denoise_step(states)
    hook.remove()
    assert passes == [5] * steps  # 2 + 2 + 1 rows in one pass per step
    block_bytes = handle.stats()["streamed_block_bytes"]
    assert handle.h2d_bytes - before == steps * block_bytes
    frames = pipe.encoders.frames  # the VAE's pass over a chunk of clips
    monkeypatch.setattr(
        pipe.encoders, "frames", lambda z, **kw: decoded.append(len(z)) or frames(z, **kw)
    )
    monkeypatch.setattr(pipe, "decode_chunk", 2)
    together = pipe.finish_batch(states)
    assert decoded == [2, 1]
    for a, b in zip(alone, together):
        assert level_diff(a, b) <= 1
    stats = handle.stats()
    assert stats["peak_device_weight_bytes"] <= stats["non_block_bytes"] + 2 * plan.slot_bytes


@pytest.mark.slow  # tens of seconds: the developer loop leaves it out
def test_resident_cpu_passes_hold_a_few_rows(wan):
    """On a CPU with the weights resident, the same three requests are encoded and stepped in
    passes of at most CPU_ROWS_PER_PASS rows (a guidance pair never split), each clip within a
    level of its run alone."""
    pipe = open_pipeline(wan["deep"], offload="none")
    requests = [  # five distinct prompts
        request(seed=1),
        request(seed=2, prompt="a blue square", negative_prompt="dark"),
        request(seed=5, prompt="a green circle", guidance=1.0),
    ]
    alone = [pipe.generate(r) for r in requests]
    encoded, passes = [], []
    text_hook = pipe.encoders.text_encoder.register_forward_pre_hook(
        lambda _m, args: encoded.append(args[0].shape[0])
    )
    hook = pipe.experts[0].register_forward_pre_hook(
        lambda _m, _a, kw: passes.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    states = pipe.prepare_batch([pipe.resolve(r) for r in requests])
    text_hook.remove()
    assert encoded == [4, 1]  # the five prompts, a few a pass too
    steps = states[0].num_steps
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    hook.remove()
    assert CPU_ROWS_PER_PASS == 4 and passes == [4, 1] * steps
    for a, b in zip(alone, pipe.finish_batch(states)):
        assert level_diff(a, b) <= 1


def test_two_experts_switch_at_the_boundary_and_stream_apart(wan):
    pipe = open_pipeline(wan["experts"], offload="stream")
    assert set(pipe.handles) == {"text_encoder", "transformer", "transformer_2"}
    state = pipe.prepare(pipe.resolve(request()))
    used = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, _a, e=e: used.append(e))
        for e, m in enumerate(pipe.experts)
    ]
    while not state.done:
        pipe.denoise_step([state])
    for h in hooks:
        h.remove()
    times = [float(t) for t in state.scheduler.timesteps]
    assert used == [0 if t >= 900 else 1 for t in times]  # boundary_ratio 0.9 of 1000
    assert 0 in used and 1 in used
    # Each expert streams through slots of its own: neither set of blocks sits on the device.
    for name in ("transformer", "transformer_2"):
        assert pipe.handles[name].stats()["resident_blocks"] == 0


def test_a_request_crossing_the_boundary_in_a_mixed_batch_steps_once(wan):
    """A step groups the requests by the expert each is at when it begins: one that crosses the
    boundary during the high-noise expert's pass is not stepped again by the low-noise one."""
    pipe = open_pipeline(wan["experts"])
    crossing, low = (pipe.prepare(pipe.resolve(request(seed=s))) for s in (1, 2))
    while pipe.expert(low) == 0:
        pipe.denoise_step([low])
    while crossing.scheduler.timesteps[crossing.step + 1] >= pipe.boundary:
        pipe.denoise_step([crossing])  # to the high-noise expert's last step
    steps = crossing.step, low.step
    pipe.denoise_step([crossing, low])
    assert (crossing.step, low.step) == (steps[0] + 1, steps[1] + 1)
    assert pipe.expert(crossing) == 1


def test_meta_build_and_fill_equal_from_pretrained(wan):
    for variant in ("unipc", "experts"):
        reference = diffusers.WanPipeline.from_pretrained(wan[variant])
        parts, _ = open_model(describe(resolve_source(wan[variant])), dtype=torch.float32)
        for name, module in parts.items():
            ours, theirs = module.state_dict(), getattr(reference, name).state_dict()
            assert ours.keys() == theirs.keys(), name
            assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
            # Rotary tables are computed, not stored: rebuilt for real, equal to diffusers'.
            for key, buf in module.named_buffers():
                assert torch.equal(buf, dict(getattr(reference, name).named_buffers())[key])


def test_slide_attention_runs_and_one_window_over_the_grid_is_dense(wan):
    """3D-DSA swapped into Wan's self-attention. A 64x64, 13-frame clip is a (4, 4, 4) token
    grid: one tile over all of it is dense attention (equal within a level); a sliding window of
    3 time tiles of 2x2 tokens runs and moves the clip (how far, on trained and untrained
    weights, is measured by benchmarks/wan_dsa.py)."""
    path = wan["unipc"]
    clip = request(64, frames=13)
    dense = open_pipeline(path).generate(clip)
    one_tile = open_pipeline(path, attention="dsa", dsa_tile=(4, 4, 4), dsa_window=(1, 1, 1))
    assert level_diff(one_tile.generate(clip), dense) <= 1
    sliding = open_pipeline(path, attention="dsa", dsa_tile=(1, 2, 2), dsa_window=(3, 1, 1))
    assert sliding.generate(clip).shape == dense.shape
    with pytest.raises(RequestError, match="3D-DSA needs the token grid's t axis"):
        sliding.resolve(request(64, frames=5))  # 2 latent frames: fewer than the window's 3


def test_a_broken_directory_is_named(wan, tmp_path, capsys):
    from megaslide.cli.main import main

    broken = tmp_path / "broken"
    shutil.copytree(wan["euler"], broken)
    shutil.rmtree(broken / "vae")
    code = main(["generate", "x", "--model", str(broken), "-o", str(tmp_path / "a.mp4")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "vae/config.json is missing" in err
    (broken / "model_index.json").write_text(json.dumps({"_class_name": "WanVideoToVideoPipeline"}))
    assert main(["info", "--model", str(broken)]) == 2
    assert "not supported" in capsys.readouterr().err


def test_command_line_generates_and_describes_a_wan_model(wan, tmp_path, capsys):
    from megaslide.cli.main import main

    out = tmp_path / "wan.mp4"
    args = ["--size", "32x32", "--frames", "9", "--steps", "2", "--no-progress"]
    assert main(["generate", PROMPT, "--model", str(wan["experts"]), "-o", str(out), *args]) == 0
    assert out.stat().st_size > 0
    capsys.readouterr()
    assert main(["info", "--model", str(wan["experts"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "wan" and info["parameter_counts"]["experts"] == 2
    assert info["limits"]["frames_multiple"] == 4 and info["limits"]["size_multiple"] == [16, 16]
    assert main(["plan", "--model", str(wan["experts"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["experts"] == 2
    assert (
        main(["generate", PROMPT, "--model", str(wan["unipc"]), "-o", str(out), "--frames", "8"])
        == 2
    )
    assert "4k + 1" in capsys.readouterr().err
