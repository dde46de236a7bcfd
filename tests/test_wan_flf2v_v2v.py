"""Wan first-last-frame-to-video (`WanImageToVideoPipeline` with `last_image`: Wan2.1-FLF2V, and
Wan2.2-I2V-A14B without CLIP) and video-to-video (`WanVideoToVideoPipeline` on a text-to-video
model): the same frames as diffusers for the same seed, resident and streamed, within one level
batched; and the rules a request meets."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.request import RequestError, VideoRequest

from wan_fixtures import NEGATIVE, PROMPT, build_tiny_wan
from wan_reference import diffusers_run, first_difference, megaslide_run, on_cpu_variants, rehome

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A Wan2.1-FLF2V-style pipeline, a Wan2.2-I2V-A14B-style one (two experts, no CLIP), a
    Wan2.1-I2V-style one, a text-to-video one with each scheduler and a two-expert one, two
    images and an input video of 12 frames larger than the clip."""
    from PIL import Image

    from megaslide.engine.video import write_mp4

    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    root = tmp_path_factory.mktemp("wan-inputs")
    rng = np.random.default_rng(0)
    for name, shape in (("first.png", (40, 48, 3)), ("last.png", (32, 32, 3))):
        Image.fromarray((rng.random(shape) * 255).astype(np.uint8)).save(root / name)
    write_mp4(root / "input.mp4", (rng.random((12, 40, 48, 3)) * 255).astype(np.uint8), fps=8)
    return {
        "flf2v": build_tiny_wan(root / "flf2v", flf2v=True),
        "experts": build_tiny_wan(root / "experts", i2v=True, experts=2),
        "i2v": build_tiny_wan(root / "i2v", i2v=True),
        "unipc": build_tiny_wan(root / "unipc"),
        "euler": build_tiny_wan(root / "euler", scheduler="euler"),
        "t2v-experts": build_tiny_wan(root / "t2v-experts", experts=2),
        "first": root / "first.png",
        "last": root / "last.png",
        "video": root / "input.mp4",
    }


def request(wan, **changes) -> VideoRequest:
    fields = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=32,
        width=32,
        frames=9,  # three latent frames: the first's, one between, the last's
        steps=2,
        guidance=4.0,
        seed=3,
    )
    return VideoRequest(**{**fields, **changes})


def frames_request(wan, **changes) -> VideoRequest:
    return request(wan, image=str(wan["first"]), last_image=str(wan["last"]), **changes)


def video_request(wan, **changes) -> VideoRequest:
    fields = dict(steps=4, video=str(wan["video"]), strength=0.5)  # the last two of four steps
    return request(wan, **{**fields, **changes})


def level_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def check_parity(path, clip: VideoRequest, latents, frames) -> None:
    """Bitwise every step and the frames with each row alone, resident and streamed; within one
    uint8 level with the guidance pair batched into one pass."""
    assert frames.std() > 1
    for offload in ("none", "stream"):
        ours, our_frames = megaslide_run(open_pipeline(path, batched=False, offload=offload), clip)
        differs = first_difference(ours, latents)
        assert differs is None, (offload, differs)
        assert np.array_equal(our_frames, frames), offload
        batched = open_pipeline(path, offload=offload)
        assert level_diff(batched.generate(clip), frames) <= 1, offload


@pytest.mark.parametrize("variant", [on_cpu_variants("flf2v"), "experts"])
def test_first_last_frame_same_video_as_diffusers(wan, variant):
    """FLF2V's two images' CLIP features side by side (its embedder's learnt positions on them),
    and the A14B-style model's last frame by the VAE alone, as WanImageToVideoPipeline makes them
    from `image` and `last_image`."""
    clip = frames_request(wan)
    latents, frames = diffusers_run(wan[variant], clip, image=wan["first"], last_image=wan["last"])
    check_parity(wan[variant], clip, latents, frames)


def test_the_last_frame_conditions_the_clip_and_its_rules(wan):
    """FLF2V's CLIP features are diffusers' own for the two images; the last frame changes the
    clip; FLF2V needs one; Wan2.1-I2V (its CLIP embedder takes one image) refuses one, naming
    `last_frame`."""
    from PIL import Image

    pipe = open_pipeline(wan["flf2v"], batched=False)
    reference = diffusers.WanImageToVideoPipeline.from_pretrained(wan["flf2v"])
    rehome(reference.image_encoder)
    with Image.open(wan["first"]) as first, Image.open(wan["last"]) as last:
        both = [first.convert("RGB"), last.convert("RGB")]
        assert torch.equal(pipe.encoders.image(both), reference.encode_image(both, "cpu"))
    limits = pipe.info.limits.to_dict()
    assert limits["last_image_input"] and limits["last_image_required"]
    assert not limits["video_input"]
    with pytest.raises(RequestError, match="give the last one too") as refused:
        pipe.resolve(request(wan, image=str(wan["first"])))
    assert refused.value.param == "last_frame"
    with pytest.raises(RequestError, match="two or more"):
        pipe.resolve(frames_request(wan, frames=1))

    experts = open_pipeline(wan["experts"])
    assert experts.info.limits.last_image_input and not experts.info.limits.last_image_required
    one = experts.generate(request(wan, image=str(wan["first"])))
    assert level_diff(one, experts.generate(frames_request(wan))) > 2  # a tiny model's change
    with pytest.raises(RequestError, match="from a first-frame image") as refused:
        experts.resolve(request(wan, last_image=str(wan["last"])))
    assert refused.value.param == "input_reference"

    assert not open_pipeline(wan["unipc"]).info.limits.last_image_input
    model = open_pipeline(wan["i2v"])
    assert not model.info.limits.last_image_input
    with pytest.raises(RequestError, match="does not take a last-frame image") as refused:
        model.resolve(frames_request(wan))
    assert refused.value.param == "last_frame"


def test_a_first_last_frame_directory_is_checked(wan, tmp_path):
    """`pos_embed_seq_len` must be two images' CLIP tokens, on a transformer with an image
    condition and CLIP features: named in the error otherwise."""
    from megaslide.engine.wan.config import WanFormatError, read_wan_config

    assert read_wan_config(wan["flf2v"]).first_last_frame
    assert not read_wan_config(wan["i2v"]).first_last_frame
    cases = [("flf2v", 30, "not two images' CLIP tokens"), ("experts", 34, "without image_dim")]
    for source, length, message in cases:
        path = tmp_path / source
        shutil.copytree(wan[source], path)
        file = path / "transformer" / "config.json"
        config = json.loads(file.read_text())
        file.write_text(json.dumps({**config, "pos_embed_seq_len": length}))
        with pytest.raises(WanFormatError, match=message):
            read_wan_config(path)


@pytest.mark.parametrize("variant", [on_cpu_variants("unipc"), "euler"])
def test_video_to_video_same_video_as_diffusers(wan, variant):
    """The input video's first nine of twelve frames, resized to the clip, encoded, noised to
    the first of the steps kept (UniPC's `add_noise`, flow-matching Euler's `scale_noise`) with
    the request's generator, as WanVideoToVideoPipeline does at strength 0.5."""
    clip = video_request(wan)
    latents, frames = diffusers_run(wan[variant], clip, video=wan["video"], strength=0.5)
    assert len(latents) == 2  # the last half of four steps
    check_parity(wan[variant], clip, latents, frames)


def test_video_to_video_rules_and_batching(wan, tmp_path):
    """The strength keeps the last part of the schedule (0.8 by default, as diffusers'); a
    strength without a video, one that keeps no step, a video on an image-to-video model and a
    video shorter than the clip are refused. A video-to-video request and a
    text-to-video one share a batch at different points of their schedules, each within a level
    of its clip alone; a two-expert model takes a video too."""
    from megaslide.engine.video import write_mp4

    pipe = open_pipeline(wan["unipc"])
    assert pipe.info.limits.video_input
    resolved = pipe.resolve(video_request(wan, strength=None, steps=5))
    assert resolved.strength == 0.8 and pipe.prepare(resolved).num_steps == 4
    refusals = [
        (request(wan, strength=0.5), "strength", "goes with an input video"),
        (video_request(wan, strength=0.2), "strength", "runs none of them"),
        (video_request(wan, strength=1.5), "strength", r"in \(0, 1\]"),
    ]
    for clip, param, message in refusals:
        with pytest.raises(RequestError, match=message) as refused:
            pipe.resolve(clip)
        assert refused.value.param == param
    with pytest.raises(RequestError, match="does not take an input video") as refused:
        open_pipeline(wan["flf2v"]).resolve(video_request(wan))
    assert refused.value.param == "input_video"
    short = tmp_path / "short.mp4"
    write_mp4(short, np.zeros((5, 32, 32, 3), np.uint8), fps=8)
    with pytest.raises(ValueError, match="5 frames, 9 needed"):
        pipe.prepare(pipe.resolve(video_request(wan, video=str(short))))

    alone = [pipe.generate(video_request(wan)), pipe.generate(request(wan, steps=4, seed=5))]
    states = pipe.prepare_batch(
        [pipe.resolve(video_request(wan)), pipe.resolve(request(wan, steps=4, seed=5))]
    )
    assert [s.num_steps for s in states] == [2, 4]
    while not all(s.done for s in states):
        pipe.denoise_step([s for s in states if not s.done])
    for ours, theirs in zip(pipe.finish_batch(states), alone):
        assert level_diff(ours, theirs) <= 1
    assert level_diff(alone[0], pipe.generate(video_request(wan, strength=1.0))) > 8

    # Wan2.2-A14B-style experts: the steps kept run the expert owning their timesteps (the
    # low-noise one below the boundary), as any request's do.
    experts = open_pipeline(wan["t2v-experts"])
    state = experts.prepare(experts.resolve(video_request(wan)))
    assert state.timestep < experts.boundary and experts.expert(state) == 1
    assert experts.generate(video_request(wan)).std() > 1


def test_served_through_the_sdk_and_the_command_line(wan, tmp_path, capsys):
    """A served FLF2V model takes both frames from the SDK (multipart `input_reference` and
    `last_frame`), a text-to-video one an input video and a strength (the clip's length the
    video's, to the frame rule), each the clip the pipeline makes of the same request, and the
    video as a file of /v1/files named by id in a JSON request (a repeat of the upload's); a video
    that is no MP4, WebM or GIF, an FFmpeg playlist, one too long to decode or too short for the
    clip is a 400 naming `input_video`. `megaslide generate` sends them with `--server` and runs
    them locally."""
    import megaslide_client
    from megaslide.cli.main import main
    from megaslide.engine.video import read_video, write_mp4
    from megaslide.server import Settings

    from server_fakes import live_server, torch_app

    models = [f"flf2v={wan['flf2v']}", f"t2v={wan['unipc']}"]
    settings = Settings(
        data_dir=tmp_path / "data", models=models, device="cpu", poll_after_ms=50
    ).model_copy(update={"max_video_frames": 16})
    frames = {}
    small = dict(
        size="32x32", num_inference_steps=2, guidance_scale=4.0, seed=1, poll_interval_ms=50
    )
    with (
        live_server(torch_app(settings, frames)) as url,
        megaslide_client.Client(base_url=url) as client,
    ):
        inputs = {m.id: m.inputs for m in client.models.list()}
        assert inputs == {"flf2v": ["text", "image", "last_image"], "t2v": ["text", "video"]}
        both = client.videos.create_and_poll(
            model="flf2v",
            prompt=PROMPT,
            num_frames=9,
            input_reference=wan["first"],
            last_frame=wan["last"],
            **small,
        )
        assert both.status == "completed", both
        local = open_pipeline(wan["flf2v"])
        expected = local.generate(frames_request(wan, negative_prompt=None, seed=1))
        assert np.array_equal(frames[both.id], expected)
        remade = client.videos.create_and_poll(
            model="t2v", prompt=PROMPT, input_video=wan["video"], strength=0.5, **small
        )
        assert remade.status == "completed" and remade.num_frames == 9, remade
        assert remade.strength == 0.5 and both.strength is None
        local = open_pipeline(wan["unipc"])
        expected = local.generate(video_request(wan, negative_prompt=None, seed=1, steps=2))
        assert np.array_equal(frames[remade.id], expected)
        # The same video uploaded to /v1/files and named by its id in a JSON request.
        file = client.files.create(file=wan["video"], purpose="input")
        assert file.status == "processed"
        named = client.videos.create_and_poll(
            model="t2v", prompt=PROMPT, strength=0.5, extra_body={"input_video": file.id}, **small
        )
        assert named.status == "completed" and named.cached_from == remade.id, named

        playlist = tmp_path / "list.m3u8"
        playlist.write_text(f"#EXTM3U\n#EXTINF:1,\nfile://{wan['video']}\n")
        long = tmp_path / "long.mp4"
        write_mp4(long, np.zeros((17, 32, 32, 3), np.uint8), fps=8)
        refusals = [
            (dict(input_video=b"not a video"), "not a MP4 or QuickTime, WebM or Matroska, GIF"),
            (dict(input_video=playlist), "not a MP4"),
            (dict(input_video=long), "more than 16 frames"),
            (dict(input_video=wan["video"], num_frames=13), "has 12 frames"),
            (dict(model="flf2v", input_video=wan["video"]), "does not take an input video"),
        ]
        for fields, message in refusals:
            with pytest.raises(megaslide_client.BadRequestError, match=message) as refused:
                client.videos.create(**{"model": "t2v", "prompt": PROMPT, **fields})
            assert refused.value.param == "input_video"

        out = tmp_path / "remote.mp4"
        args = ["--size", "32x32", "--steps", "2", "--no-progress", "-o", str(out)]
        remote = ["generate", PROMPT, "--server", url, *args]
        assert main([*remote, "--model", "t2v", "--video", str(wan["video"])]) == 0
        assert out.read_bytes()[4:8] == b"ftyp"
        flf = ["--image", str(wan["first"]), "--last-image", str(wan["last"])]
        assert main([*remote, "--model", "flf2v", "--frames", "9", *flf]) == 0
    local = ["generate", PROMPT, *args, "--model"]
    assert main([*local, str(wan["flf2v"]), "--frames", "9", *flf]) == 0
    # Without --frames, the video's length to the frame rule: 12 frames make a clip of 9.
    assert main([*local, str(wan["unipc"]), "--video", str(wan["video"]), "--strength", "0.5"]) == 0
    assert read_video(out).shape == (9, 32, 32, 3)
    capsys.readouterr()
    assert main([*local, str(wan["flf2v"]), "--image", str(wan["first"])]) == 2
    assert "give the last one too" in capsys.readouterr().err
