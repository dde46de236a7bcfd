"""Wan VACE (`WanVACEPipeline` on a `WanVACETransformer3DModel`: reference images, a control video,
a mask and the conditioning scale): the same frames as diffusers for the same seed, resident and
streamed (the VACE blocks streamed with the blocks), within one level batched; and the rules a
request and a model directory meet."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.request import LoraChoice, RequestError, VideoRequest

from wan_fixtures import NEGATIVE, PROMPT, build_tiny_wan
from wan_reference import diffusers_run, first_difference, megaslide_run, on_cpu_variants

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A VACE pipeline of three blocks (hints into the first and the last), a two-expert one
    (Wan2.2 VACE-Fun-style), a text-to-video one; two reference images of other shapes than the
    clip, a control video of 12 frames at the clip's size and a mask video (the right half and
    the last frames to generate, the rest kept)."""
    from PIL import Image

    from megaslide.engine.video import write_mp4

    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    root = tmp_path_factory.mktemp("vace-inputs")
    rng = np.random.default_rng(0)
    for name, shape in (("ref0.png", (40, 48, 3)), ("ref1.png", (24, 40, 3))):
        Image.fromarray((rng.random(shape) * 255).astype(np.uint8)).save(root / name)
    write_mp4(root / "control.mp4", (rng.random((12, 32, 32, 3)) * 255).astype(np.uint8), fps=8)
    mask = np.zeros((12, 32, 32, 3), np.uint8)
    mask[:, :, 16:] = 255
    mask[6:] = 255
    write_mp4(root / "mask.mp4", mask, fps=8)
    return {
        "vace": build_tiny_wan(root / "vace", vace=True, layers=3),
        "experts": build_tiny_wan(root / "experts", vace=True, experts=2, layers=3),
        "t2v": build_tiny_wan(root / "t2v"),
        "refs": [root / "ref0.png", root / "ref1.png"],
        "control": root / "control.mp4",
        "mask": root / "mask.mp4",
    }


def request(**changes) -> VideoRequest:
    fields = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=32,
        width=32,
        frames=9,
        steps=2,
        guidance=4.0,
        seed=3,
    )
    return VideoRequest(**{**fields, **changes})


def vace_request(wan, case: str, **changes) -> VideoRequest:
    """The request of a case: "all" (two reference images, control video, mask, scale 0.7),
    "control" (control video alone) or "bare" (nothing: text-to-video through the VACE blocks)."""
    fields = {
        "all": dict(
            reference_images=tuple(map(str, wan["refs"])),
            control_video=str(wan["control"]),
            mask=str(wan["mask"]),
            conditioning_scale=0.7,
        ),
        "control": dict(control_video=str(wan["control"])),
        "bare": {},
    }[case]
    return request(**{**fields, **changes})


def conditioning(clip: VideoRequest) -> dict:
    """The request's VACE inputs as `diffusers_run` takes them."""
    return {
        "reference_images": list(clip.reference_images),
        "control_video": clip.control_video,
        "mask": clip.mask,
        "conditioning_scale": 1.0 if clip.conditioning_scale is None else clip.conditioning_scale,
    }


def level_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize(
    ("variant", "case"),
    [on_cpu_variants("vace", "all"), ("vace", "bare"), ("experts", "control")],
)
def test_vace_same_video_as_diffusers(wan, variant, case):
    """Every step's latents (the reference images' frames with them) and the frames bitwise
    WanVACEPipeline's with each row alone, resident and streamed; within one uint8 level with
    the guidance pair batched into one pass (its cross-attention keys kept, the VACE blocks'
    too)."""
    clip = vace_request(wan, case)
    latents, frames = diffusers_run(wan[variant], clip, vace=conditioning(clip))
    assert frames.shape == (9, 32, 32, 3) and frames.std() > 1
    for offload in ("none", "stream"):
        pipe = open_pipeline(wan[variant], batched=False, offload=offload)
        ours, our_frames = megaslide_run(pipe, clip)
        differs = first_difference(ours, latents)
        assert differs is None, (offload, differs)
        assert np.array_equal(our_frames, frames), offload
        batched = open_pipeline(wan[variant], offload=offload)
        assert level_diff(batched.generate(clip), frames) <= 1, offload


def test_the_vace_blocks_stream_and_condition_the_clip(wan):
    """The streamer holds the VACE blocks with the blocks, in the order they run (two VACE
    blocks, then three), none resident; the model says what it takes. Each input changes the
    clip: the scale (0 drops the hints), the reference images, the mask."""
    pipe = open_pipeline(wan["vace"], offload="stream")
    stats = pipe.handles["transformer"].stats()
    assert stats["num_blocks"] == stats["streamed_blocks"] == 5
    model = pipe.experts[0]
    assert pipe.handles["transformer"]._blocks[0].module is model.vace_blocks[0]
    limits = pipe.info.limits.to_dict()
    assert limits["vace_input"] and not limits["video_input"] and not limits["image_input"]
    assert limits["cache_policies"] == ["output-change", "adaptive", "first-block"]

    full = pipe.generate(vace_request(wan, "all", steps=1))
    for change in (
        dict(conditioning_scale=0.0),
        dict(reference_images=(str(wan["refs"][0]),)),
        dict(mask=None),
    ):
        changed = pipe.generate(vace_request(wan, "all", steps=1, **change))
        assert level_diff(full, changed) > 2, change


def test_requests_of_different_scales_share_a_pass(wan):
    """Two requests with other conditioning scales and seeds (one unguided) in one batch: the
    hints' scale goes per row, each clip within a level of its own alone; reference images are
    latent frames, so a request with another count of them is in another batch."""
    pipe = open_pipeline(wan["vace"])
    clips = [
        vace_request(wan, "all", conditioning_scale=0.3),
        vace_request(wan, "all", conditioning_scale=1.5, seed=5, guidance=1.0),
    ]
    alone = [pipe.generate(c) for c in clips]
    states = pipe.prepare_batch([pipe.resolve(c) for c in clips])
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    for ours, theirs in zip(pipe.finish_batch(states), alone):
        assert level_diff(ours, theirs) <= 1
    one = pipe.resolve(vace_request(wan, "all", reference_images=(str(wan["refs"][1]),)))
    assert one.batch_key != pipe.resolve(clips[0]).batch_key
    assert pipe.resolve(vace_request(wan, "bare")).batch_key == pipe.resolve(request()).batch_key


def test_vace_requests_are_checked(wan, tmp_path):
    """Each field named when wrong: a mask without a control video, too many reference images
    (or more than the model's frames leave room for), a missing file, a scale out of range;
    a control video or mask shorter than the clip is a ValueError naming the file.
    A model without VACE blocks refuses every VACE field by name."""
    from megaslide.engine.video import write_mp4

    pipe = open_pipeline(wan["vace"])
    resolved = pipe.resolve(vace_request(wan, "bare"))
    assert resolved.conditioning_scale == 1.0 and resolved.reference_images == ()
    ref = str(wan["refs"][0])
    refusals = [
        (dict(mask=str(wan["mask"])), "mask", "goes with a control video"),
        (dict(reference_images=(ref,) * 5), "reference_images", "at most 4"),
        (dict(reference_images=(ref,) * 4, frames=121), "reference_images", "room for 1"),
        (dict(reference_images=(str(tmp_path / "no.png"),)), "reference_images", "not found"),
        (dict(reference_images=ref), "reference_images", "must be a list"),
        (dict(control_video=str(tmp_path / "no.mp4")), "control_video", "not found"),
        (dict(conditioning_scale=-1.0), "conditioning_scale", r"in \[0, 10\]"),
        (dict(conditioning_scale=float("nan")), "conditioning_scale", r"in \[0, 10\]"),
    ]
    for changes, param, message in refusals:
        with pytest.raises(RequestError, match=message) as refused:
            pipe.resolve(vace_request(wan, "bare", **changes))
        assert refused.value.param == param, changes
    short = tmp_path / "short.mp4"
    write_mp4(short, np.zeros((5, 32, 32, 3), np.uint8), fps=8)
    for changes in (dict(control_video=str(short)), dict(mask=str(short))):
        clip = vace_request(wan, "control", **changes)
        with pytest.raises(ValueError, match="5 frames, 9 needed"):
            pipe.prepare(pipe.resolve(clip))

    t2v = open_pipeline(wan["t2v"])
    assert not t2v.info.limits.vace_input
    for name, value in (
        ("reference_images", (ref,)),
        ("control_video", str(wan["control"])),
        ("mask", str(wan["mask"])),
        ("conditioning_scale", 1.0),
    ):
        with pytest.raises(RequestError, match="does not take VACE's") as refused:
            t2v.resolve(request(**{name: value}))
        assert refused.value.param == name and refused.value.code == "unsupported_parameter"


def test_a_vace_directory_is_checked(wan, tmp_path):
    """`vace_layers` and `vace_in_channels` read and checked against the VAE and the blocks; a
    VACE transformer under another pipeline class (and the reverse) named in the error. A VACE
    model is not fine-tuned (not built); split over devices, a frame's tokens must split alone
    (reference images add frames)."""
    from megaslide.engine.family import family
    from megaslide.engine.sources import describe, resolve_source
    from megaslide.engine.wan.config import WanFormatError, read_wan_config

    config = read_wan_config(wan["vace"])
    assert config.vace and config.vace_layers == (0, 2) and config.vace_in_channels == 72
    assert not read_wan_config(wan["t2v"]).vace
    cases = [
        ("transformer/config.json", {"vace_in_channels": 96}, "not the control video's"),
        ("transformer/config.json", {"vace_layers": [1, 2]}, "must rise from 0"),
        ("transformer/config.json", {"vace_layers": [0, 3]}, "must rise from 0"),
        ("model_index.json", {"_class_name": "WanPipeline"}, "goes with"),
    ]
    for file, change, message in cases:
        path = tmp_path / f"case{cases.index((file, change, message))}"
        shutil.copytree(wan["vace"], path)
        data = json.loads((path / file).read_text())
        (path / file).write_text(json.dumps({**data, **change}))
        with pytest.raises(WanFormatError, match=message):
            read_wan_config(path)

    info = describe(resolve_source(wan["vace"]))
    wan_family = family("wan")
    with pytest.raises(ValueError, match="VACE model: fine-tuning"):
        wan_family.training_components(info, None)
    with pytest.raises(ValueError, match="a frame's tokens"):
        wan_family.check_parallel(info, 5, 16, 48, 2)  # 2 frames of 1 x 3 tokens
    counts = wan_family.count_parameters(info)
    assert counts["blocks"] == 5


def test_served_through_the_sdk_and_the_command_line(wan, tmp_path, capsys):
    """A served VACE model lists its inputs and takes two reference images (the multipart field
    repeated), a control video, a mask and a scale from the SDK, the clip's length the control
    video's (to the frame rule): the clip the pipeline makes of the same request; the same files
    of /v1/files named by id in a JSON request (or in a form field beside uploads) repeat it. A
    mask that is no video, an FFmpeg playlist as a control video, one too long to decode, a
    reference image that is no image, five reference images and VACE's inputs on a
    text-to-video model are 400s naming the field. `megaslide generate` sends them with
    `--server` and runs them locally."""
    import megaslide_client
    from megaslide.cli.main import main
    from megaslide.engine.video import read_video, write_mp4
    from megaslide.server import Settings

    from server_fakes import live_server, torch_app

    models = [f"vace={wan['vace']}", f"t2v={wan['t2v']}"]
    settings = Settings(
        data_dir=tmp_path / "data", models=models, device="cpu", poll_after_ms=50
    ).model_copy(update={"max_video_frames": 16})
    frames = {}
    small = dict(
        size="32x32", num_inference_steps=2, guidance_scale=4.0, seed=1, poll_interval_ms=50
    )
    vace = dict(
        reference_images=wan["refs"],
        control_video=wan["control"],
        mask=wan["mask"],
        conditioning_scale=0.7,
    )
    with (
        live_server(torch_app(settings, frames)) as url,
        megaslide_client.Client(base_url=url) as client,
    ):
        inputs = {m.id: m.inputs for m in client.models.list()}
        assert inputs == {
            "vace": ["text", "reference_images", "control_video", "mask"],
            "t2v": ["text", "video"],
        }
        made = client.videos.create_and_poll(model="vace", prompt=PROMPT, **vace, **small)
        assert made.status == "completed" and made.num_frames == 9, made
        assert made.conditioning_scale == 0.7
        local = open_pipeline(wan["vace"])
        expected = local.generate(vace_request(wan, "all", negative_prompt=None, seed=1))
        assert np.array_equal(frames[made.id], expected)
        ids = {
            name: client.files.create(file=wan[key], purpose="input").id
            for name, key in (("control_video", "control"), ("mask", "mask"))
        }
        refs = [client.files.create(file=f, purpose="input").id for f in wan["refs"]]
        named = client.videos.create_and_poll(
            model="vace",
            prompt=PROMPT,
            conditioning_scale=0.7,
            extra_body={**ids, "reference_images": refs},
            **small,
        )
        assert named.status == "completed" and named.cached_from == made.id, named
        # Uploads beside ids: the reference images' ids as a JSON list in a form field.
        mixed = client.videos.create_and_poll(
            model="vace",
            prompt=PROMPT,
            control_video=wan["control"],
            mask=wan["mask"],
            conditioning_scale=0.7,
            extra_body={"reference_images": refs},
            **small,
        )
        assert mixed.status == "completed" and mixed.cached_from in (made.id, named.id), mixed

        long = tmp_path / "long.mp4"
        write_mp4(long, np.zeros((17, 32, 32, 3), np.uint8), fps=8)
        control = dict(control_video=wan["control"])
        playlist = tmp_path / "list.m3u8"
        playlist.write_text(f"#EXTM3U\n#EXTINF:1,\nfile://{wan['control']}\n")
        refusals = [
            (dict(mask=b"not a video", **control), "mask", "not a MP4"),
            (dict(control_video=playlist), "control_video", "not a MP4"),
            (dict(reference_images=[b"not an image"]), "reference_images", "not a readable image"),
            (dict(control_video=long), "control_video", "more than 16 frames"),
            (dict(reference_images=[wan["refs"][0]] * 5), "reference_images", "at most 4"),
            (dict(model="t2v", **control), "control_video", "does not take a control video"),
            (dict(model="t2v", conditioning_scale=1.0), "conditioning_scale", "VACE"),
        ]
        for fields, param, message in refusals:
            with pytest.raises(megaslide_client.BadRequestError, match=message) as refused:
                client.videos.create(**{"model": "vace", "prompt": PROMPT, **fields})
            assert refused.value.param == param

        out = tmp_path / "remote.mp4"
        args = ["--size", "32x32", "--steps", "2", "--no-progress", "-o", str(out)]
        flags = [
            *("--reference-image", str(wan["refs"][0])),
            *("--control-video", str(wan["control"]), "--mask", str(wan["mask"])),
            *("--conditioning-scale", "0.5"),
        ]
        assert main(["generate", PROMPT, "--server", url, "--model", "vace", *args, *flags]) == 0
        assert read_video(out).shape == (9, 32, 32, 3)
    assert main(["generate", PROMPT, *args, "--model", str(wan["vace"]), *flags]) == 0
    assert read_video(out).shape == (9, 32, 32, 3)
    capsys.readouterr()
    local_t2v = ["generate", PROMPT, *args, "--model", str(wan["t2v"])]
    assert main([*local_t2v, "--control-video", str(wan["control"])]) == 2
    assert "does not take VACE's control_video" in capsys.readouterr().err


def test_sage_attention_reaches_the_vace_blocks(wan):
    """`attention="sage"` runs every self-attention in 8 bits, the VACE blocks' too, and the clip
    stays close to dense attention's."""
    from megaslide.engine.wan.attention import WanSageAttnProcessor

    pipe = open_pipeline(wan["vace"], attention="sage")
    model = pipe.experts[0]
    for block in [*model.vace_blocks, *model.blocks]:
        assert isinstance(block.attn1.processor, WanSageAttnProcessor)
        assert not isinstance(block.attn2.processor, WanSageAttnProcessor)
    clip = vace_request(wan, "all", steps=1)
    assert level_diff(pipe.generate(clip), open_pipeline(wan["vace"]).generate(clip)) <= 8


@pytest.mark.slow  # two more streamed pipelines: the same streamer as the tests above
def test_the_disk_tier_and_a_weight_format_hold_the_vace_blocks(wan):
    """The VACE blocks are streamed blocks like any other: read from the model's files each step
    (the disk tier) or kept in a lossless host format, the reference mode's latents and frames
    are bitwise the resident pipeline's."""
    clip = vace_request(wan, "control")
    latents, frames = megaslide_run(open_pipeline(wan["vace"], batched=False), clip)
    for placement in (dict(host_tier="disk"), dict(weights="lossless")):
        pipe = open_pipeline(wan["vace"], batched=False, offload="stream", **placement)
        stats = pipe.handles["transformer"].stats()
        assert stats["streamed_blocks"] == 5
        ours, our_frames = megaslide_run(pipe, clip)
        assert first_difference(ours, latents) is None, placement
        assert np.array_equal(our_frames, frames), placement


def test_fp8_stores_the_vace_blocks_linears_in_fp8(wan):
    """`weights="fp8"` codes every linear weight of the VACE blocks (their attention, feed
    forward, the first one's `proj_in` and each hint's `proj_out`) and of the blocks in fp8 with a
    power-of-two scale per row, the rest raw; the clip, all VACE inputs given, stays within the
    35 dB the default model is held to of bf16's resident clip (49 dB measured here, 2 steps:
    docs/models.md), and is not bf16's (the format ran)."""
    from torch import nn

    clip = vace_request(wan, "all")
    bf16 = open_pipeline(wan["vace"], dtype="bfloat16").generate(clip)
    pipe = open_pipeline(wan["vace"], dtype="bfloat16", offload="stream", weights="fp8")
    handle = pipe.handles["transformer"]
    model = pipe.experts[0]
    assert [b.module for b in handle._blocks][:2] == list(model.vace_blocks)
    coded = []
    for block in handle._blocks:
        entries, plan = block.store.meta
        coded.append({entries[k.k].names[0] for k in plan if k.how == "exp2"})
        linears = {
            f"{n}.weight" for n, m in block.module.named_modules() if isinstance(m, nn.Linear)
        }
        assert coded[-1] == linears, coded[-1] ^ linears
    assert {"proj_in.weight", "proj_out.weight", "attn1.to_q.weight"} <= coded[0]
    assert {"proj_out.weight", "ffn.net.2.weight"} <= coded[1]
    frames = pipe.generate(clip)
    stats = pipe.stats()["transformer"]
    assert stats["weights"] == "fp8" and stats["streamed_blocks"] == 5
    assert stats["host_store_bytes"] < 0.65 * stats["streamed_block_bytes"]
    mse = np.mean((frames.astype(np.float64) - bf16.astype(np.float64)) ** 2)
    db = 10 * np.log10(255.0**2 / mse) if mse else float("inf")
    assert 35.0 <= db < float("inf"), f"fp8 PSNR {db:.1f} dB"


@pytest.mark.parametrize(
    "policy", ["output-change", pytest.param("adaptive", marks=pytest.mark.slow)]
)
def test_step_caches_and_previews_on_vace(wan, policy):
    """The caches that decide before a pass run on a VACE model (its reference images' frames in
    the outputs they keep): threshold 0 reuses nothing and changes nothing; a loose one skips
    whole passes, which move no weights. A preview shows the clip's first frame, not a
    reference image's."""
    pipe = open_pipeline(wan["vace"], offload="stream")
    off = pipe.generate(vace_request(wan, "all", steps=4))
    zero = pipe.prepare(
        pipe.resolve(vace_request(wan, "all", steps=4, cache=dict(policy=policy, threshold=0)))
    )
    zero.keep_x0 = True
    while not zero.done:
        pipe.denoise_step([zero])
        assert zero.x0.shape[2] == 3  # the clip's latent frames, without the two references
    assert zero.cache.passes == 4 and np.array_equal(pipe.finish(zero), off)
    (preview,) = pipe.preview_batch([zero])
    assert preview.shape == (32, 32, 3)
    loose = pipe.resolve(
        vace_request(wan, "all", steps=4, cache=dict(policy=policy, threshold=100))
    )
    loose = pipe.prepare(loose)
    moved = []
    while not loose.done:
        moved.append(pipe.denoise_step([loose])["h2d_bytes"])
    assert 2 <= loose.cache.passes < 4
    assert moved.count(0) == loose.cache.reused and max(moved) > 0


def test_a_vace_pass_cut_at_its_blocks_is_its_forward(wan):
    """The pass cut at its blocks (forward.py: the VACE blocks' hints made in the prologue, each
    added after its block times its row's scale), run in a row, is the transformer's forward
    bitwise: two requests of different scales in one pass (a scale per row), and one row alone
    (the reference mode's scales, one per layer)."""
    pipe = open_pipeline(wan["vace"])
    clips = [
        vace_request(wan, "all"),
        vace_request(wan, "all", conditioning_scale=1.5, seed=5, guidance=1.0),
    ]
    states = pipe.prepare_batch([pipe.resolve(c) for c in clips])
    pipe._keep = set()  # no kept cross-attention keys and values: the cut pass keeps none
    for group in (states, states[1:]):
        with torch.no_grad():
            whole = torch.cat(pipe.forward(0, group))  # (rows, C, F', H', W')
            cut = pipe.cut(0, group)
            h, carry = cut.prologue()
            for i in range(cut.depth):
                h = cut.block(i, h, carry)
            assert torch.equal(cut.epilogue(h, carry), whole)


@pytest.mark.slow  # three streamed clips and a batch of two
def test_a_first_block_cache_on_vace(wan):
    """first-block on a streamed VACE model: threshold 0 reuses nothing and gives the uncached
    clip bitwise; a loose one reuses, its reused steps loading the VACE blocks and block 0
    alone. A plain request stepped beside it gets its clip alone (within a uint8 level: the
    later blocks run a smaller batch on reuse steps)."""
    pipe = open_pipeline(wan["vace"], offload="stream")
    # The plain passes keep all 512 tokens' keys: compact entries are only within a level of
    # recomputing them (prompt_cache.py), as the cut pass does.
    pipe.prompt_cache_compact = False
    clip = vace_request(wan, "all", steps=3)
    loose_clip = replace(clip, cache=dict(policy="first-block", threshold=100))
    off = pipe.generate(clip)
    zero = pipe.prepare(pipe.resolve(replace(clip, cache=dict(policy="first-block", threshold=0))))
    while not zero.done:
        pipe.denoise_step([zero])
    assert zero.cache.reused == 0 and np.array_equal(pipe.finish(zero), off)
    handle = pipe.handles["transformer"]
    loose = pipe.prepare(pipe.resolve(loose_clip))
    loads, load = [], handle.load
    handle.load = lambda i: (loads[-1].append(i), load(i))[1]
    try:
        while not loose.done:
            loads.append([])
            pipe.denoise_step([loose])
    finally:
        del handle.load
    # streamed: the two VACE blocks, then the three blocks
    assert loose.cache.passes == 1 and loose.cache.reused == 2
    assert loads[0] == [0, 1, 2, 3, 4] and all(step == [0, 1, 2] for step in loads[1:])
    plain = vace_request(wan, "all", steps=3, conditioning_scale=1.5, seed=5)
    states = [pipe.prepare(pipe.resolve(c)) for c in (loose_clip, plain)]
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    assert states[0].cache.reused > 0 and states[1].passes == 3
    alone = [pipe.finish(loose), pipe.generate(plain)]
    for ours, theirs in zip(pipe.finish_batch(states), alone):
        assert level_diff(ours, theirs) <= 1


@pytest.mark.slow  # diffusers' pipeline with PEFT, and two clips of ours
def test_a_lora_on_the_vace_blocks_as_diffusers_applies_it(wan, tmp_path):
    """A diffusers / PEFT-layout adapter on the blocks and the VACE blocks (their attention, and
    the hints' output projections) gives bitwise diffusers' clip with each row alone, and
    changes it."""
    pytest.importorskip("peft")
    from lora_fixtures import DIM, _factors, write_peft

    g = torch.Generator().manual_seed(7)
    extra = {}
    for i in (0, 1):
        for name in (f"vace_blocks.{i}.attn1.to_q", f"vace_blocks.{i}.attn2.to_v"):
            down, up = _factors(g, 4, DIM, DIM, 0.3)
            extra[f"transformer.{name}.lora_A.weight"] = down
            extra[f"transformer.{name}.lora_B.weight"] = up
        down, up = _factors(g, 4, DIM, DIM, 0.3)
        extra[f"transformer.vace_blocks.{i}.proj_out.lora_A.weight"] = down
        extra[f"transformer.vace_blocks.{i}.proj_out.lora_B.weight"] = up
    file = write_peft(tmp_path / "vace-lora.safetensors", blocks=3, bias=False, extra=extra)

    clip = vace_request(wan, "all")
    pipe = open_pipeline(wan["vace"], batched=False)
    card = pipe.add_adapter("v", file)
    assert card["modules"] == 3 * 10 + 2 * 3
    reference = diffusers.WanVACEPipeline.from_pretrained(wan["vace"])
    reference.load_lora_weights(str(file), adapter_name="v")
    reference.set_adapters(["v"], [0.8])
    _, theirs = diffusers_run(reference, clip, vace=conditioning(clip))
    ours = pipe.generate(vace_request(wan, "all", loras=(LoraChoice("v", 0.8),)))
    assert np.array_equal(ours, theirs)
    assert level_diff(ours, pipe.generate(clip)) > 2


@pytest.mark.slow
def test_two_ranks_make_one_process_clip(wan):
    """Sequence parallel on two CPU processes (gloo): the VACE blocks' tokens split with the
    blocks' where they enter, each rank's hints added to its own tokens; the frames of one
    process streamed, bitwise, with two reference images, a control video and a mask."""
    from megaslide.engine.parallel.multidevice import generate_on_devices
    from megaslide.engine.request import resolve
    from megaslide.engine.sources import describe, resolve_source

    info = describe(resolve_source(str(wan["vace"])))
    clip = resolve(vace_request(wan, "all"), info.limits, info.sampling, model=info.name)
    split = generate_on_devices(info, clip, ["cpu", "cpu"], timeout_s=300)
    one = open_pipeline(info, offload="stream").generate(clip)
    assert np.array_equal(split, one), level_diff(split, one)


@pytest.mark.slow  # two processes, and a clip of one
def test_two_ranks_with_a_first_block_cache_make_one_process_clip(wan):
    """A first-block cache under sequence parallel: the cut pass's hints are each rank's tokens'
    (VACE block 0 splits its inputs as in the forward), the ranks decide together; a loose
    cache that reuses gives the frames of one process, bitwise."""
    from megaslide.engine.parallel.multidevice import generate_on_devices
    from megaslide.engine.request import resolve
    from megaslide.engine.sources import describe, resolve_source

    info = describe(resolve_source(str(wan["vace"])))
    loose = vace_request(wan, "all", steps=3, cache=dict(policy="first-block", threshold=100))
    clip = resolve(loose, info.limits, info.sampling, model=info.name)
    split = generate_on_devices(info, clip, ["cpu", "cpu"], timeout_s=300)
    pipe = open_pipeline(info, offload="stream")
    state = pipe.prepare(clip)
    while not state.done:
        pipe.denoise_step([state])
    assert state.cache.reused > 0
    one = pipe.finish(state)
    assert np.array_equal(split, one), level_diff(split, one)


def test_an_original_layout_adapter_on_the_vace_blocks_equals_its_peft_twin(wan, tmp_path):
    """An original-layout (ComfyUI) file with `vace_blocks.*` keys, which diffusers' converter
    does not know: the VACE blocks' attention, feed-forward and hint projections (alphas folded,
    `diff_b` biases) become the deltas of the same adapter in PEFT's names, and with alpha equal
    to the rank its clip is bitwise the PEFT twin's (whose clip is diffusers', above)."""
    from safetensors.torch import save_file

    from megaslide.engine.wan.lora import wan_deltas

    g = torch.Generator().manual_seed(11)
    original, peft = {}, {}
    layers = [("blocks.0.self_attn.q", "blocks.0.attn1.to_q")]
    for i in (0, 1):
        layers += [
            (f"vace_blocks.{i}.self_attn.q", f"vace_blocks.{i}.attn1.to_q"),
            (f"vace_blocks.{i}.cross_attn.o", f"vace_blocks.{i}.attn2.to_out.0"),
            (f"vace_blocks.{i}.ffn.2", f"vace_blocks.{i}.ffn.net.2"),
            (f"vace_blocks.{i}.after_proj", f"vace_blocks.{i}.proj_out"),
        ]
    layers.append(("vace_blocks.0.before_proj", "vace_blocks.0.proj_in"))
    for theirs, ours in layers:
        n_in = 32 if ".ffn." in theirs else 24  # the tiny model's feed-forward width, or its dim
        down, up = torch.randn(4, n_in, generator=g) * 0.3, torch.randn(24, 4, generator=g) * 0.3
        bias = torch.randn(24, generator=g) * 0.05
        original[f"diffusion_model.{theirs}.lora_down.weight"] = down
        original[f"diffusion_model.{theirs}.lora_up.weight"] = up
        original[f"diffusion_model.{theirs}.alpha"] = torch.tensor(4.0)
        original[f"diffusion_model.{theirs}.diff_b"] = bias
        peft[f"transformer.{ours}.lora_A.weight"] = down
        peft[f"transformer.{ours}.lora_B.weight"] = up
        peft[f"transformer.{ours}.lora_B.bias"] = bias
    save_file(original, str(tmp_path / "original.safetensors"))
    save_file(peft, str(tmp_path / "peft.safetensors"))

    # Another alpha is folded into the factors: the product is alpha / rank times theirs.
    halved = dict(original, **{"diffusion_model.vace_blocks.1.after_proj.alpha": torch.tensor(2.0)})
    folded = wan_deltas(halved, {})["vace_blocks.1.proj_out"]
    plain = wan_deltas(original, {})["vace_blocks.1.proj_out"]
    torch.testing.assert_close(folded.up @ folded.down, 0.5 * (plain.up @ plain.down))

    pipe = open_pipeline(wan["vace"])
    pipe.add_adapter("original", tmp_path / "original.safetensors")
    pipe.add_adapter("peft", tmp_path / "peft.safetensors")
    clips = [
        pipe.generate(vace_request(wan, "all", loras=(LoraChoice(name, 0.8),)))
        for name in ("original", "peft")
    ]
    assert np.array_equal(clips[0], clips[1])
    assert level_diff(clips[0], pipe.generate(vace_request(wan, "all"))) > 2

    # A hint projection with one factor is named.
    del original["diffusion_model.vace_blocks.0.before_proj.lora_up.weight"]
    with pytest.raises(Exception, match="vace_blocks.0.proj_in.lora_up.weight is missing"):
        wan_deltas(original, {})
