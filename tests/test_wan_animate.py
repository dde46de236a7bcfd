"""Wan Animate (`WanAnimatePipeline` on a `WanAnimateTransformer3DModel`: a character image, a
pose video and a face video, and for the replace mode a background video and its mask), one
segment: every step's latents and the frames bitwise diffusers' for the same seed, resident and
streamed (the face adapters streamed between the blocks); and the rules a request meets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.request import LoraChoice, RequestError, VideoRequest

from wan_fixtures import FACE_SIZE, NEGATIVE, PROMPT, build_tiny_wan
from wan_reference import diffusers_run, first_difference, megaslide_run, on_cpu_variants

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """An Animate pipeline of two blocks (a face adapter after each), a text-to-video one; a
    character image of another shape than the clip, pose, background and mask videos of 12
    frames at the clip's size, and a face video at another size than the motion encoder's."""
    from PIL import Image

    from megaslide.engine.video import write_mp4

    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    root = tmp_path_factory.mktemp("animate-inputs")
    rng = np.random.default_rng(0)

    def noise(*shape):
        return (rng.random(shape) * 255).astype(np.uint8)

    Image.fromarray(noise(40, 48, 3)).save(root / "character.png")
    write_mp4(root / "pose.mp4", noise(12, 32, 32, 3), fps=8)
    write_mp4(root / "face.mp4", noise(12, 2 * FACE_SIZE, 2 * FACE_SIZE, 3), fps=8)
    write_mp4(root / "background.mp4", noise(12, 32, 32, 3), fps=8)
    mask = np.zeros((12, 32, 32, 3), np.uint8)
    mask[:, 8:24, 8:24] = 255  # the person to replace: the middle
    write_mp4(root / "mask.mp4", mask, fps=8)
    return {
        "animate": build_tiny_wan(root / "animate", animate=True, layers=2),
        "t2v": build_tiny_wan(root / "t2v"),
        **{
            name: str(root / f"{name}.{ext}")
            for name, ext in (
                ("character", "png"),
                ("pose", "mp4"),
                ("face", "mp4"),
                ("background", "mp4"),
                ("mask", "mp4"),
            )
        },
    }


def request(wan, replace: bool = False, **changes) -> VideoRequest:
    fields = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=32,
        width=32,
        frames=9,
        steps=2,
        guidance=4.0,
        seed=3,
        image=wan["character"],
        pose_video=wan["pose"],
        face_video=wan["face"],
    )
    if replace:
        fields.update(background_video=wan["background"], background_mask=wan["mask"])
    return VideoRequest(**{**fields, **changes})


@pytest.mark.parametrize("replace", [False, on_cpu_variants(True)], ids=["animate", "replace"])
def test_animate_same_video_as_diffusers(wan, replace):
    """Every step's latents (the character's latent frame with them) and the frames bitwise
    WanAnimatePipeline's with each row alone, resident and streamed; within one uint8 level with
    the guidance pair batched into one pass (its cross-attention keys kept)."""
    clip = request(wan, replace)
    videos = {"pose_video": clip.pose_video, "face_video": clip.face_video}
    if replace:
        videos.update(background_video=clip.background_video, mask_video=clip.background_mask)
    latents, frames = diffusers_run(wan["animate"], clip, clip.image, animate=videos)
    assert frames.shape == (9, 32, 32, 3) and frames.std() > 1
    assert latents[0].shape[2] == 4  # the character's latent frame and the clip's three
    for offload in ("none", "stream"):
        pipe = open_pipeline(wan["animate"], batched=False, offload=offload)
        ours, our_frames = megaslide_run(pipe, clip)
        differs = first_difference(ours, latents)
        assert differs is None, (offload, differs)
        assert np.array_equal(our_frames, frames), offload
    assert level_diff(open_pipeline(wan["animate"]).generate(clip), frames) <= 1


def level_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def test_animate_and_replace_share_a_pass(wan):
    """An animate and a replace request (other seeds and prompts) step together, each within a
    level of its clip alone; a text-to-video model refuses Animate's videos by name."""
    pipe = open_pipeline(wan["animate"])
    clips = [request(wan), request(wan, True, seed=5, prompt="a blue square")]
    alone = [pipe.generate(c) for c in clips]
    states = pipe.prepare_batch([pipe.resolve(c) for c in clips])
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    for ours, theirs in zip(pipe.finish_batch(states), alone):
        assert level_diff(ours, theirs) <= 1
    assert level_diff(*alone) > 2


def test_animate_streams_its_face_adapters_and_checks_requests(wan):
    """The streamer holds the face adapters between the blocks, in the order they run (block,
    adapter, block, adapter); the model says what it takes; a request's videos are checked by
    name, and a text-to-video model refuses them."""
    pipe = open_pipeline(wan["animate"], offload="stream")
    stats = pipe.handles["transformer"].stats()
    assert stats["num_blocks"] == stats["streamed_blocks"] == 4
    model = pipe.experts[0]
    held = [b.module for b in pipe.handles["transformer"]._blocks]
    assert held == [model.blocks[0], model.face_adapter[0], model.blocks[1], model.face_adapter[1]]
    limits = pipe.info.limits.to_dict()
    assert limits["animate_input"] and limits["image_required"]
    assert not (limits["vace_input"] or limits["video_input"])
    assert limits["cache_policies"] == ["output-change", "adaptive", "first-block"]
    assert pipe.info.sampling.guidance == 1.0  # WanAnimatePipeline's default: no guidance pair

    def refused(changes, param, model="animate"):
        target = open_pipeline(wan[model]) if model != "animate" else pipe
        with pytest.raises(RequestError) as err:
            target.resolve(request(wan, **changes))
        assert err.value.param == param, (changes, err.value)
        return str(err.value)

    refused(dict(pose_video=None), "pose_video")
    refused(dict(face_video=None), "face_video")
    refused(dict(image=None), "input_reference")
    refused(dict(background_video=wan["background"]), "background_mask")
    refused(dict(background_mask=wan["mask"]), "background_video")
    assert "not found" in refused(dict(face_video=wan["face"] + ".missing"), "face_video")
    refused(dict(frames=1), "frames")
    message = refused(
        dict(image=None, pose_video=wan["pose"], face_video=None), "pose_video", "t2v"
    )
    assert "Animate" in message
    # A pose video shorter than the clip is named when the request runs.
    with pytest.raises(ValueError, match="pose"):
        pipe.generate(request(wan, frames=13, pose_video=wan["pose"]))


def test_animate_from_the_command_line(wan, tmp_path, capsys):
    """`megaslide generate` takes Animate's videos and segments as flags (the clip's length from
    the pose video's, to the frame rule: 12 frames give 9, here in two segments of 5); a
    text-to-video model refuses them by name."""
    from megaslide.cli.main import main
    from megaslide.engine.video import read_video

    out = tmp_path / "animate.mp4"
    args = ["--size", "32x32", "--steps", "1", "--no-progress", "-o", str(out)]
    flags = [
        *("--image", wan["character"], "--pose-video", wan["pose"], "--face-video", wan["face"]),
        *("--background-video", wan["background"], "--background-mask", wan["mask"]),
        *("--segment-frame-length", "5", "--prev-segment-conditioning-frames", "1"),
    ]
    assert main(["generate", PROMPT, *args, "--model", str(wan["animate"]), *flags]) == 0
    assert read_video(out).shape == (9, 32, 32, 3)
    capsys.readouterr()
    local_t2v = ["generate", PROMPT, *args, "--model", str(wan["t2v"]), "--frames", "9"]
    assert main([*local_t2v, "--face-video", wan["face"]]) == 2
    assert "does not take Animate's face_video" in capsys.readouterr().err
    assert main([*local_t2v, "--segment-frame-length", "5"]) == 2
    assert "does not take Animate's segment_frame_length" in capsys.readouterr().err


def test_served_through_the_sdk_and_the_command_line(wan, tmp_path, capsys):
    """A served Animate model lists its inputs and takes the character, pose, face, background
    and mask videos from the SDK as multipart uploads, the clip's length the videos' (to the
    frame rule): the clip the pipeline makes of the same request; the same files named by their
    /v1/files ids repeat it. A missing face video, or a
    pose video on a text-to-video model, is a 400 naming the field; `megaslide generate
    --server` uploads them."""
    import megaslide_client
    from megaslide.cli.main import main
    from megaslide.engine.video import read_video
    from megaslide.server import Settings

    from server_fakes import live_server, torch_app

    models = [f"animate={wan['animate']}", f"t2v={wan['t2v']}"]
    settings = Settings(data_dir=tmp_path / "data", models=models, device="cpu", poll_after_ms=50)
    frames = {}
    small = dict(size="32x32", num_inference_steps=1, seed=1, poll_interval_ms=50)
    videos = dict(
        input_reference=wan["character"],
        pose_video=wan["pose"],
        face_video=wan["face"],
        background_video=wan["background"],
        background_mask=wan["mask"],
    )
    with (
        live_server(torch_app(settings, frames)) as url,
        megaslide_client.Client(base_url=url) as client,
    ):
        inputs = {m.id: m.inputs for m in client.models.list()}
        assert inputs["animate"] == [
            "text",
            "image",
            "pose_video",
            "face_video",
            "background_video",
            "background_mask",
        ]
        made = client.videos.create_and_poll(model="animate", prompt=PROMPT, **videos, **small)
        assert made.status == "completed" and made.num_frames == 9, made
        expected = open_pipeline(wan["animate"]).generate(
            request(wan, True, negative_prompt=None, seed=1, steps=1, guidance=None)
        )
        assert np.array_equal(frames[made.id], expected)
        # The same files of /v1/files named by id in a JSON request repeat it.
        ids = {f: client.files.create(file=p, purpose="input").id for f, p in videos.items()}
        named = client.videos.create_and_poll(
            model="animate", prompt=PROMPT, extra_body=ids, **small
        )
        assert named.status == "completed" and named.cached_from == made.id, named
        assert (made.segment_frame_length, made.prev_segment_conditioning_frames) == (9, 1)
        # In two segments of 5 frames: the clip the pipeline makes of the same request.
        segmented = client.videos.create_and_poll(
            model="animate", prompt=PROMPT, segment_frame_length=5, **videos, **small
        )
        assert segmented.status == "completed" and segmented.segment_frame_length == 5, segmented
        expected = open_pipeline(wan["animate"]).generate(
            request(
                wan,
                True,
                negative_prompt=None,
                seed=1,
                steps=1,
                guidance=None,
                segment_frame_length=5,
            )
        )
        assert np.array_equal(frames[segmented.id], expected)
        refusals = [
            ({**videos, "face_video": None}, "animate", "face_video"),
            ({**videos, "segment_frame_length": 6}, "animate", "segment_frame_length"),
            (
                {**videos, "prev_segment_conditioning_frames": 3},
                "animate",
                "prev_segment_conditioning_frames",
            ),
            (dict(pose_video=wan["pose"]), "t2v", "pose_video"),
            (dict(segment_frame_length=5), "t2v", "segment_frame_length"),
        ]
        for fields, model, param in refusals:
            with pytest.raises(megaslide_client.BadRequestError) as refused:
                client.videos.create(model=model, prompt=PROMPT, **fields)
            assert refused.value.param == param

        out = tmp_path / "remote.mp4"
        args = ["--size", "32x32", "--steps", "1", "--no-progress", "-o", str(out)]
        flags = [
            *("--image", wan["character"], "--pose-video", wan["pose"]),
            *("--face-video", wan["face"], "--segment-frame-length", "5"),
        ]
        assert main(["generate", PROMPT, "--server", url, "--model", "animate", *args, *flags]) == 0
        assert read_video(out).shape == (9, 32, 32, 3)


def test_a_directory_whose_classes_disagree_is_named(wan, tmp_path):
    """An Animate transformer under another pipeline class, or the other way round, and face
    adapters that do not divide the blocks, are refused naming the file."""
    import json
    import shutil

    from megaslide.engine.wan.config import WanFormatError, read_wan_config

    assert read_wan_config(wan["animate"]).face_size == FACE_SIZE
    broken = shutil.copytree(wan["animate"], tmp_path / "broken")
    index = json.loads((broken / "model_index.json").read_text())
    (broken / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "WanImageToVideoPipeline"})
    )
    with pytest.raises(WanFormatError, match="transformer/config.json.*WanAnimatePipeline"):
        read_wan_config(broken)
    (broken / "model_index.json").write_text(json.dumps(index))
    config = json.loads((broken / "transformer" / "config.json").read_text())
    (broken / "transformer" / "config.json").write_text(
        json.dumps({**config, "num_layers": 3, "inject_face_latents_blocks": 2})
    )
    with pytest.raises(WanFormatError, match="inject_face_latents_blocks 2 does not divide"):
        read_wan_config(broken)


@pytest.fixture(scope="module")
def long_inputs(wan, tmp_path_factory):
    """Pose, face, background and mask videos of 17 frames (the module's others have 12)."""
    from megaslide.engine.video import write_mp4

    root = tmp_path_factory.mktemp("animate-long")
    rng = np.random.default_rng(1)
    write_mp4(root / "pose.mp4", (rng.random((17, 32, 32, 3)) * 255).astype(np.uint8), fps=8)
    face = (rng.random((17, FACE_SIZE, FACE_SIZE, 3)) * 255).astype(np.uint8)
    write_mp4(root / "face.mp4", face, fps=8)
    write_mp4(root / "background.mp4", (rng.random((17, 32, 32, 3)) * 255).astype(np.uint8), fps=8)
    mask = np.zeros((17, 32, 32, 3), np.uint8)
    mask[:, 4:20, 12:28] = 255
    write_mp4(root / "mask.mp4", mask, fps=8)
    return {name: str(root / f"{name}.mp4") for name in ("pose", "face", "background", "mask")}


def diffusers_videos(clip: VideoRequest) -> dict:
    videos = {"pose_video": clip.pose_video, "face_video": clip.face_video}
    if clip.background_video is not None:
        videos.update(background_video=clip.background_video, mask_video=clip.background_mask)
    return videos


def test_two_segments_same_video_as_diffusers(wan):
    """A clip of two segments (9 frames in segments of 5, one frame carried over): every step's
    latents of both segments and the stitched frames bitwise WanAnimatePipeline's with the row
    alone, resident and streamed; within one uint8 level batched; the steps counted over both
    segments, and the frames in chunks the same as at once."""
    clip = request(wan, segment_frame_length=5)
    latents, frames = diffusers_run(
        wan["animate"], clip, clip.image, animate=diffusers_videos(clip)
    )
    assert frames.shape == (9, 32, 32, 3) and len(latents) == 2 * clip.steps
    assert latents[0].shape[2] == 3  # the character's latent frame and a segment's two
    for offload in ("none", "stream"):
        pipe = open_pipeline(wan["animate"], batched=False, offload=offload)
        ours, our_frames = megaslide_run(pipe, clip)
        differs = first_difference(ours, latents)
        assert differs is None, (offload, differs)
        assert np.array_equal(our_frames, frames), offload
    pipe = open_pipeline(wan["animate"])
    state = pipe.prepare(pipe.resolve(clip))
    assert (state.num_steps, state.segments.count) == (2 * clip.steps, 2)
    while not state.done:
        pipe.denoise_step([state])
    assert level_diff(pipe.finish(state), frames) <= 1
    assert np.array_equal(np.concatenate(list(pipe.finish_chunks(state))), pipe.finish(state))


def test_five_frames_carried_and_the_videos_padded_as_diffusers(wan, long_inputs):
    """The replace mode with five frames carried over: 17 frames in segments of 13 (the videos
    padded to 21 by walking back over their frames, the clip cut to 17) bitwise
    WanAnimatePipeline's with the row alone; within one uint8 level batched."""
    clip = request(
        wan,
        frames=17,
        steps=1,
        segment_frame_length=13,
        prev_segment_conditioning_frames=5,
        pose_video=long_inputs["pose"],
        face_video=long_inputs["face"],
        background_video=long_inputs["background"],
        background_mask=long_inputs["mask"],
    )
    latents, frames = diffusers_run(
        wan["animate"], clip, clip.image, animate=diffusers_videos(clip)
    )
    assert frames.shape == (17, 32, 32, 3) and len(latents) == 2
    ours, our_frames = megaslide_run(open_pipeline(wan["animate"], batched=False), clip)
    assert first_difference(ours, latents) is None, first_difference(ours, latents)
    assert np.array_equal(our_frames, frames)
    assert level_diff(open_pipeline(wan["animate"]).generate(clip), frames) <= 1


def test_segments_share_passes_with_other_requests(wan):
    """A request of two segments steps in one batch with a one-segment request that joins a
    step later (other seeds and prompts): its second segment starts while the other steps on,
    and each clip is within a level of its own alone."""
    pipe = open_pipeline(wan["animate"])
    long = request(wan, segment_frame_length=5, steps=2)
    short = request(wan, frames=5, steps=2, seed=5, prompt="a blue square")
    alone = [pipe.generate(c) for c in (long, short)]
    first = pipe.prepare(pipe.resolve(long))
    pipe.denoise_step([first])
    second = pipe.prepare(pipe.resolve(short))
    states = [first, second]
    seen = []
    while not all(s.done for s in states):
        pipe.denoise_step(states)
        seen.append((first.segments.index, second.step))
    assert seen[:2] == [(0, 1), (1, 2)]  # the long one's second segment began beside the other
    assert first.num_steps == 4 and second.num_steps == 2
    for ours, theirs in zip(pipe.finish_batch(states), alone):
        assert level_diff(ours, theirs) <= 1
    assert alone[0].shape == (9, 32, 32, 3) and alone[1].shape == (5, 32, 32, 3)


def test_segments_are_counted_as_diffusers_counts_them(wan):
    """The segments of a clip and the frames its videos are padded with are the pipeline's
    (`pad_video_frames`), and a request's segment fields are checked by name."""
    from megaslide.engine.wan.animate import reflected, segment_count

    pad = diffusers.WanAnimatePipeline.pad_video_frames
    for available, total in [(5, 10), (2, 7), (9, 21), (12, 12)]:
        assert reflected(available, total) == pad(None, list(range(available)), total)
    assert [segment_count(f, 77, 1) for f in (9, 77, 78, 153, 154)] == [1, 1, 2, 2, 3]
    assert [segment_count(f, 13, 5) for f in (13, 17, 21, 22)] == [1, 2, 2, 3]

    pipe = open_pipeline(wan["animate"], batched=False)

    def refused(changes, param, target=pipe):
        with pytest.raises(RequestError) as err:
            target.resolve(request(wan, **changes))
        assert err.value.param == param, (changes, err.value)
        return str(err.value)

    assert "4k + 1" in refused(dict(segment_frame_length=6), "segment_frame_length")
    refused(dict(segment_frame_length=1), "segment_frame_length")
    refused(dict(segment_frame_length=True), "segment_frame_length")
    refused(dict(segment_frame_length="9"), "segment_frame_length")
    refused(dict(prev_segment_conditioning_frames=2), "prev_segment_conditioning_frames")
    message = refused(
        dict(segment_frame_length=9, prev_segment_conditioning_frames=5), "segment_frame_length"
    )
    assert "twice" in message
    t2v = open_pipeline(wan["t2v"])
    for name in ("segment_frame_length", "prev_segment_conditioning_frames"):
        with pytest.raises(RequestError) as err:
            t2v.resolve(VideoRequest(prompt=PROMPT, height=32, width=32, frames=9, **{name: 5}))
        assert err.value.param == name and "Animate" in str(err.value)
    resolved = pipe.resolve(request(wan))
    assert (resolved.segment_frame_length, resolved.prev_segment_conditioning_frames) == (9, 1)
    # A request resolved before the segments were fields (a stored one) runs in one segment.
    older = dataclasses.replace(
        resolved, segment_frame_length=None, prev_segment_conditioning_frames=None
    )
    segments = pipe.prepare(older).segments
    assert (segments.length, segments.carried, segments.count) == (9, 1, 1)
    assert pipe.resolve(request(wan, segment_frame_length=5)).batch_key[1] == ("segment", 5)


@pytest.mark.parametrize(
    "placement",
    [
        dict(host_tier="disk"),
        pytest.param(dict(weights="lossless"), marks=pytest.mark.slow),  # the same streamer
        pytest.param(dict(weights="fp8"), marks=pytest.mark.slow),
    ],
    ids=["disk", "lossless", "fp8"],
)
def test_the_disk_tier_and_weight_formats_hold_the_face_adapters(wan, placement):
    """The face adapters are streamed blocks like any other: read from the model's files each
    step (the disk tier, the CLIP image encoder's renamed keys with them) or kept in a lossless
    host format, the reference mode's latents and frames are bitwise the resident pipeline's;
    stored in fp8 with the blocks, the clip moves, within a few levels."""
    clip = request(wan, True, steps=1)
    latents, frames = megaslide_run(open_pipeline(wan["animate"], batched=False), clip)
    pipe = open_pipeline(wan["animate"], batched=False, offload="stream", **placement)
    stats = pipe.handles["transformer"].stats()
    assert stats["streamed_blocks"] == 4 and stats["weights"] == placement.get("weights", "raw")
    clip_stats = pipe.handles["image_encoder"].stats()
    assert clip_stats["streamed_blocks"] == 3
    assert clip_stats["host_tier"] == stats["host_tier"] == placement.get("host_tier", "ram")
    ours, our_frames = megaslide_run(pipe, clip)
    if placement.get("weights") == "fp8":
        assert first_difference(ours, latents) is not None  # fp8 is lossy: it must change
        assert 0 < level_diff(our_frames, frames) <= 16
    else:
        assert first_difference(ours, latents) is None
        assert np.array_equal(our_frames, frames)


@pytest.mark.slow  # diffusers' pipeline with PEFT, and three clips of ours
def test_a_lora_on_the_blocks_and_face_adapters_as_diffusers_applies_it(wan, tmp_path):
    """A diffusers / PEFT-layout adapter on the blocks and the face adapters (streamed between
    the blocks) and on the face encoder (resident) gives bitwise WanAnimatePipeline's clip after
    `load_lora_weights` with each row alone, resident and streamed, and changes it; batched,
    within a level."""
    pytest.importorskip("peft")
    from lora_fixtures import DIM, _factors, write_peft

    g = torch.Generator().manual_seed(7)
    extra = {}
    names = [f"face_adapter.{i}.{o}" for i in (0, 1) for o in ("to_q", "to_k", "to_v", "to_out")]
    for name, n_in in [*((n, DIM) for n in names), ("face_encoder.out_proj", 16)]:
        down, up = _factors(g, 4, n_in, DIM, 0.3)
        extra[f"transformer.{name}.lora_A.weight"] = down
        extra[f"transformer.{name}.lora_B.weight"] = up
    file = write_peft(tmp_path / "animate-lora.safetensors", bias=False, extra=extra)

    clip = request(wan)
    adapted = request(wan, loras=(LoraChoice("a", 0.8),))
    reference = diffusers.WanAnimatePipeline.from_pretrained(wan["animate"])
    reference.load_lora_weights(str(file), adapter_name="a")
    reference.set_adapters(["a"], [0.8])
    videos = {"pose_video": clip.pose_video, "face_video": clip.face_video}
    _, theirs = diffusers_run(reference, clip, clip.image, animate=videos)
    for offload in ("none", "stream"):
        pipe = open_pipeline(wan["animate"], batched=False, offload=offload)
        card = pipe.add_adapter("a", file)
        assert card["modules"] == 2 * 10 + 2 * 4 + 1
        assert np.array_equal(pipe.generate(adapted), theirs), offload
    assert level_diff(theirs, pipe.generate(clip)) > 2
    batched = open_pipeline(wan["animate"], offload="stream")
    batched.add_adapter("a", file)
    assert level_diff(batched.generate(adapted), theirs) <= 1


@pytest.mark.slow  # diffusers' pipeline with PEFT, and a clip of ours
def test_an_original_layout_adapter_as_diffusers_applies_it(wan, tmp_path):
    """An original-layout (ComfyUI) Wan2.1-I2V-style adapter, the format most Wan adapters are
    shared in (the blocks' attention and feed-forward, their image projections `k_img` /
    `v_img`, the image embedder), goes through diffusers' converter onto an Animate model:
    bitwise WanAnimatePipeline's clip after `load_lora_weights`, its face adapters streamed."""
    pytest.importorskip("peft")
    from lora_fixtures import write_original

    file = write_original(tmp_path / "i2v-lora.safetensors", i2v=True)
    clip = request(wan)
    pipe = open_pipeline(wan["animate"], batched=False, offload="stream")
    assert pipe.add_adapter("o", file)["modules"] == 20 + 4 + 2
    reference = diffusers.WanAnimatePipeline.from_pretrained(wan["animate"])
    reference.load_lora_weights(str(file), adapter_name="o")
    reference.set_adapters(["o"], [0.8])
    videos = {"pose_video": clip.pose_video, "face_video": clip.face_video}
    _, theirs = diffusers_run(reference, clip, clip.image, animate=videos)
    ours = pipe.generate(request(wan, loras=(LoraChoice("o", 0.8),)))
    assert np.array_equal(ours, theirs)
    assert level_diff(ours, pipe.generate(clip)) > 2


def test_step_caches_start_afresh_with_each_segment(wan):
    """The caches that decide before a pass run on Animate: threshold 0 reuses nothing and
    changes nothing; a loose one reuses, but each segment (a new trajectory from fresh noise)
    computes its first two steps, whose outputs it measures, and its last."""
    pipe = open_pipeline(wan["animate"], offload="stream")
    clip = request(wan, segment_frame_length=5, steps=4)
    off = pipe.generate(clip)
    zero = pipe.generate(dataclasses.replace(clip, cache=dict(policy="output-change", threshold=0)))
    assert np.array_equal(zero, off)
    loose = pipe.prepare(
        pipe.resolve(dataclasses.replace(clip, cache=dict(policy="output-change", threshold=100)))
    )
    moved = []
    while not loose.done:
        moved.append(pipe.denoise_step([loose])["h2d_bytes"])
    assert [m > 0 for m in moved] == [True, True, False, True] * 2, moved
    assert loose.cache.reused == 2 and loose.cache.passes == 6
    assert pipe.finish(loose).shape == off.shape


@pytest.mark.slow  # two processes
def test_two_ranks_make_one_process_clip(wan):
    """Sequence parallel on two CPU processes (gloo), replace mode in two segments: a pass's
    three latent frames of four tokens split six and six, so a rank's shard ends mid-frame and
    each face adapter sees every token (gathered before it, this rank's rows kept after); the
    frames of one process streamed, bitwise."""
    from megaslide.engine.parallel.multidevice import generate_on_devices
    from megaslide.engine.request import resolve
    from megaslide.engine.sources import describe, resolve_source

    info = describe(resolve_source(str(wan["animate"])))
    clip = resolve(
        request(wan, True, segment_frame_length=5), info.limits, info.sampling, model=info.name
    )
    # Each rank with this process's threads: a CPU matmul's reduction order follows the thread
    # count (the guidance pair's batched rows differ by a level between one and two threads).
    threads = torch.get_num_threads()
    split = generate_on_devices(info, clip, ["cpu", "cpu"], threads=threads, timeout_s=300)
    one = open_pipeline(info, offload="stream").generate(clip)
    assert np.array_equal(split, one), level_diff(split, one)


def test_sequence_parallel_needs_a_frames_tokens_to_split(wan):
    """A clip whose token count splits but whose frame's tokens (3x3 at 48x48) do not is refused
    by name before any process starts: the character's frame and the segments set frames apart."""
    from megaslide.engine.family import family
    from megaslide.engine.sources import describe, resolve_source

    info = describe(resolve_source(str(wan["animate"])))
    check = family(info.family).check_parallel
    check(info, 9, 32, 32, 2)  # 2x2 tokens a frame
    with pytest.raises(ValueError, match=r"Animate model over 2 devices needs a frame's tokens"):
        check(info, 5, 48, 48, 2)  # 2x3x3 tokens: 18 split, 9 a frame do not


def test_an_animate_pass_cut_at_its_blocks_is_its_forward(wan):
    """The pass cut at its blocks (forward.py: the pose tokens added and the motion vectors
    made in the prologue, each face adapter after its block), run in a row, is the
    transformer's forward bitwise, over an animate and a replace request's rows (guided)."""
    pipe = open_pipeline(wan["animate"])
    clips = [request(wan), request(wan, replace=True, seed=5)]
    states = pipe.prepare_batch([pipe.resolve(c) for c in clips])
    pipe._keep = set()  # no kept cross-attention keys and values: the cut pass keeps none
    with torch.no_grad():
        whole = torch.cat(pipe.forward(0, states))  # (rows, C, F', H', W')
        cut = pipe.cut(0, states)
        h, carry = cut.prologue()
        for i in range(cut.depth):
            h = cut.block(i, h, carry)
        assert torch.equal(cut.epilogue(h, carry), whole)


@pytest.mark.slow  # three streamed clips of two segments each
def test_a_first_block_cache_on_animate(wan):
    """first-block on a streamed Animate model, over two segments: threshold 0 reuses nothing
    and gives the uncached clip bitwise; a loose one reuses, its reused steps loading block 0
    and its face adapter alone, and each segment computes its first step afresh."""
    pipe = open_pipeline(wan["animate"], offload="stream")
    # The plain passes keep all 512 tokens' keys: compact entries are only within a level of
    # recomputing them (prompt_cache.py), as the cut pass does.
    pipe.prompt_cache_compact = False
    clip = request(wan, segment_frame_length=5, steps=3)
    off = pipe.generate(clip)
    zero = dataclasses.replace(clip, cache=dict(policy="first-block", threshold=0))
    assert np.array_equal(pipe.generate(zero), off)
    handle = pipe.handles["transformer"]
    loose = dataclasses.replace(clip, cache=dict(policy="first-block", threshold=100))
    loose = pipe.prepare(pipe.resolve(loose))
    loads, load = [], handle.load
    handle.load = lambda i: (loads[-1].append(i), load(i))[1]
    try:
        while not loose.done:
            loads.append([])
            pipe.denoise_step([loose])
    finally:
        del handle.load
    # streamed: block 0, its face adapter, block 1, its face adapter
    full, first = [0, 1, 2, 3], [0, 1]
    assert loads == [full, first, first] * 2, loads
    assert pipe.finish(loose).shape == off.shape
