"""Wan image-to-video models (`WanImageToVideoPipeline`): Wan2.1-I2V with its CLIP image encoder
and Wan2.2-I2V-A14B's two experts without one. The same frames as diffusers for the same seed,
resident and streamed; the image is required; LoRA adapters reach the image cross-attention; the
server, the SDK and the CLI's remote mode send the image."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_model, open_pipeline
from megaslide.engine.request import LoraChoice, RequestError, VideoRequest
from megaslide.engine.sources import describe, resolve_source

from wan_fixtures import build_tiny_wan
from wan_reference import diffusers_run, first_difference, megaslide_run, on_cpu_variants, rehome

diffusers = pytest.importorskip("diffusers")

PROMPT, NEGATIVE = "a red circle moving left", "blurry"


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A Wan2.1-I2V-style pipeline (36-channel-style input, CLIP), a Wan2.2-I2V-A14B-style one
    (two experts, no image encoder), and two first-frame images."""
    from PIL import Image

    root = tmp_path_factory.mktemp("wan-i2v")
    rng = np.random.default_rng(0)
    for name, shape in (("first.png", (40, 48, 3)), ("other.png", (32, 32, 3))):
        Image.fromarray((rng.random(shape) * 255).astype(np.uint8)).save(root / name)
    return {
        "i2v": build_tiny_wan(root / "i2v", i2v=True),
        "experts": build_tiny_wan(root / "experts", i2v=True, experts=2),
        "image": root / "first.png",
        "other": root / "other.png",
        "root": root,
    }


def request(wan, image="image", **changes) -> VideoRequest:
    fields = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=32,
        width=32,
        frames=5,  # two latent frames: the image's and one more
        steps=2,  # on the A14B-style model, one step per expert
        guidance=4.0,
        seed=3,
        image=None if image is None else str(wan[image]),
    )
    return VideoRequest(**{**fields, **changes})


def level_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize("variant", [on_cpu_variants("i2v"), "experts"])
def test_same_seed_same_video_as_diffusers(wan, variant):
    """Bitwise, every step's latents and the frames, with each row alone (as
    WanImageToVideoPipeline runs them), resident and streamed (the CLIP encoder's layers stream
    too); within one uint8 level with the guidance pair batched into one pass. test_wan.py runs
    this again on other CPUs' code paths."""
    clip = request(wan)
    latents, frames = diffusers_run(wan[variant], clip, image=wan["image"])
    assert frames.std() > 1
    for offload in ("none", "stream"):
        exact = open_pipeline(wan[variant], batched=False, offload=offload)
        if offload == "stream":
            streamed = {"text_encoder", *exact.info.config.experts}
            if variant == "i2v":
                streamed.add("image_encoder")
            assert set(exact.handles) == streamed
        ours, our_frames = megaslide_run(exact, clip)
        differs = first_difference(ours, latents)
        assert differs is None, (variant, offload, differs)
        assert np.array_equal(our_frames, frames), (variant, offload)
        batched = open_pipeline(wan[variant], offload=offload)
        assert level_diff(batched.generate(clip), frames) <= 1, (variant, offload)


def test_the_image_conditions_the_clip_and_is_required(wan):
    """The CLIP features are diffusers' own; another image gives another clip; an I2V model
    without an image refuses the request, as WanImageToVideoPipeline does."""
    from PIL import Image

    pipe = open_pipeline(wan["i2v"], batched=False)
    reference = diffusers.WanImageToVideoPipeline.from_pretrained(wan["i2v"])
    rehome(reference.image_encoder)
    with Image.open(wan["image"]) as image:
        assert torch.equal(pipe.encoders.image(image), reference.encode_image(image, "cpu"))
    one = pipe.generate(request(wan))
    assert level_diff(one, pipe.generate(request(wan, image="other"))) > 8
    limits = pipe.info.limits
    assert limits.image_input and limits.image_required
    assert limits.to_dict()["image_required"]
    assert pipe.info.sampling.guidance == 5.0  # Wan2.1's; the A14B experts' I2V default is 3.5
    assert describe(resolve_source(wan["experts"])).sampling.guidance == 3.5
    with pytest.raises(RequestError, match="from a first-frame image") as refused:
        pipe.resolve(request(wan, image=None))
    assert refused.value.param == "input_reference"


def test_clip_weights_load_in_either_key_layout_and_equal_from_pretrained(wan, tmp_path):
    """transformers 4 wrote CLIPVisionModel's keys under `vision_model.` (the published
    Wan2.1-I2V files are so); transformers 5 has no such level. Both fill the same module."""
    from safetensors.torch import load_file, save_file

    reference = diffusers.WanImageToVideoPipeline.from_pretrained(wan["i2v"])
    old = tmp_path / "old-keys"
    shutil.copytree(wan["i2v"], old)
    weights = old / "image_encoder" / "model.safetensors"
    save_file({f"vision_model.{k}": v for k, v in load_file(weights).items()}, weights)
    for path in (wan["i2v"], old):
        parts, _ = open_model(describe(resolve_source(path)), dtype=torch.float32)
        for name in ("image_encoder", "transformer"):
            ours, theirs = parts[name].state_dict(), getattr(reference, name).state_dict()
            assert ours.keys() == theirs.keys(), name
            assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
        # The position ids are computed, not stored: built for real, equal to transformers'.
        ids = parts["image_encoder"].embeddings.position_ids
        assert torch.equal(ids, reference.image_encoder.embeddings.position_ids)


def test_a_directory_the_pipelines_would_not_run_is_named(wan, tmp_path):
    from megaslide.engine.wan.config import WanFormatError, read_wan_config

    def broken(edit, name):
        path = tmp_path / name
        shutil.copytree(wan["i2v"], path)
        edit(path)
        return path

    def config_edit(**changes):
        def edit(path):
            config = json.loads((path / "transformer" / "config.json").read_text())
            (path / "transformer" / "config.json").write_text(json.dumps({**config, **changes}))

        return edit

    cases = [
        (lambda p: shutil.rmtree(p / "image_encoder"), "gone", "image_encoder/config.json"),
        (config_edit(pos_embed_seq_len=30), "flf2v", "not two images' CLIP tokens"),
        (config_edit(in_channels=10), "channels", "in_channels 10 is neither"),
    ]
    for edit, name, message in cases:
        with pytest.raises(WanFormatError, match=message):
            read_wan_config(broken(edit, name))


def test_adapters_reach_the_image_cross_attention_like_diffusers(wan):
    """An original-layout Wan2.1-I2V adapter (its `k_img` / `v_img` and `img_emb` keys), and a
    text-to-video adapter on the I2V model (diffusers pads it with zero factors for the image
    projections), give bitwise diffusers' video with each row alone."""
    pytest.importorskip("peft")
    from lora_fixtures import write_original

    root = wan["root"]
    adapters = {
        "i2v": write_original(root / "i2v-lora.safetensors", i2v=True),
        "t2v": write_original(root / "t2v-lora.safetensors", seed=4),
    }
    clip = request(wan)
    pipe = open_pipeline(wan["i2v"], batched=False)
    card = pipe.add_adapter("i2v", adapters["i2v"])
    assert card["modules"] == 20 + 4 + 2  # and both image projections of each block, the embedder
    pipe.add_adapter("t2v", adapters["t2v"])
    clips = []
    for name, file in adapters.items():
        reference = diffusers.WanImageToVideoPipeline.from_pretrained(wan["i2v"])
        reference.load_lora_weights(str(file), adapter_name=name)
        reference.set_adapters([name], [0.8])
        _, theirs = diffusers_run(reference, clip, image=wan["image"])
        clips.append(pipe.generate(request(wan, loras=(LoraChoice(name, 0.8),))))
        assert np.array_equal(clips[-1], theirs), name
    assert level_diff(*clips) > 8


def test_served_with_the_sdk_and_the_command_line(wan, tmp_path):
    """A served I2V model takes the image from the SDK (multipart `input_reference`) and from
    `megaslide generate --server URL --image`; a request without one is a 400 naming it."""
    import megaslide_client
    from megaslide.cli.main import main
    from megaslide.server import Settings

    from server_fakes import live_server, torch_app

    settings = Settings(
        data_dir=tmp_path / "data", models=[f"i2v={wan['i2v']}"], device="cpu", poll_after_ms=50
    )
    with live_server(torch_app(settings)) as url, megaslide_client.Client(base_url=url) as client:
        (model,) = client.models.list()
        assert model.inputs == ["text", "image"] and model.limits["image_required"]
        video = client.videos.create_and_poll(
            prompt=PROMPT,
            size="32x32",
            num_frames=5,
            num_inference_steps=2,
            seed=1,
            input_reference=wan["image"],
            poll_interval_ms=50,
        )
        assert video.status == "completed", video
        with pytest.raises(megaslide_client.BadRequestError) as refused:
            client.videos.create(prompt=PROMPT)
        assert refused.value.param == "input_reference"
        out = tmp_path / "remote.mp4"
        args = ["--size", "32x32", "--frames", "5", "--steps", "2", "--no-progress"]
        command = [
            "generate",
            PROMPT,
            "--server",
            url,
            "-o",
            str(out),
            "--image",
            str(wan["image"]),
        ]
        assert main([*command, *args]) == 0
        assert out.read_bytes()[4:8] == b"ftyp"


def test_command_line_generates_describes_and_plans(wan, tmp_path, capsys):
    """`megaslide generate --image` locally, a refusal naming the image when it is missing, and
    `info` / `plan` counting the CLIP encoder (its layers stream like UMT5's)."""
    from megaslide.cli.main import main

    out = tmp_path / "local.mp4"
    args = ["--size", "32x32", "--frames", "5", "--steps", "2", "--no-progress"]
    command = ["generate", PROMPT, "--model", str(wan["i2v"]), "-o", str(out), *args]
    assert main([*command, "--image", str(wan["image"])]) == 0
    assert out.read_bytes()[4:8] == b"ftyp"
    capsys.readouterr()
    assert main(command) == 2
    assert "from a first-frame image" in capsys.readouterr().err
    assert main(["info", "--model", str(wan["i2v"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    counts = info["parameter_counts"]
    assert counts["image_blocks"] == 3 and info["limits"]["image_required"]
    assert counts["total"] == sum(
        counts[k] for k in ("denoiser", "text_encoder", "image_encoder", "vae")
    )
    assert main(["plan", "--model", str(wan["i2v"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == counts["total"]


def test_first_block_cache_cuts_the_pass_with_the_image_features(wan):
    """The first-block step cache runs its own cut of the transformer's forward: with threshold 0
    (never reuse) it gives the model's own frames, the CLIP features included; with a high one it
    reuses and the clip moves."""
    pipe = open_pipeline(wan["i2v"])
    # The plain passes keep all the context tokens' keys: compact entries are only within a level
    # of recomputing them (prompt_cache.py), as the cut pass does.
    pipe.prompt_cache_compact = False
    plain = pipe.generate(request(wan, steps=3))
    never = pipe.generate(request(wan, steps=3, cache={"policy": "first-block", "threshold": 0.0}))
    always = {"policy": "first-block", "threshold": 100.0}
    assert np.array_equal(never, plain)
    assert level_diff(pipe.generate(request(wan, steps=3, cache=always)), plain) > 0
