"""Wan's VAE decoded a latent frame at a time with its chains fused (engine/wan/vae_decode.py),
against diffusers' own `AutoencoderKLWan.decode` bit for bit, and MP4 encoding overlapped with it
(engine/video.py `write_mp4_chunks`) against encoding the whole clip."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
av = pytest.importorskip("av")

from megaslide.engine.video import read_video, write_mp4, write_mp4_chunks  # noqa: E402
from megaslide.engine.wan.vae_decode import (  # noqa: E402
    decode_chunks,
    frame_chunks,
    fuse_chains,
)

from wan_fixtures import _vae  # noqa: E402

# Tiles of 32 pixels, 24 and 16 apart: the tiny clips below decode as 2 x 4 (Wan2.1) or 3 x 4
# (Wan2.2) overlapping tiles.
TILES = dict(
    tile_sample_min_height=32,
    tile_sample_min_width=32,
    tile_sample_stride_height=24,
    tile_sample_stride_width=16,
)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 values as their bit patterns: -0.0 and +0.0 differ, NaNs compare."""
    return x.contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def vaes():
    """Wan2.1's and Wan2.2-TI2V's tiny VAEs, their weights moved off their initial ones (RMS
    norms' gammas of 1 and zero biases would hide a wrong order of operations), untiled and
    tiled, with latents for each."""
    torch.manual_seed(0)
    out = {}
    for name, ti2v in (("wan2.1", False), ("wan2.2", True)):
        _, vae = _vae(ti2v)
        vae.eval()
        with torch.no_grad():
            for p in vae.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        pixels = vae.spatial_compression_ratio
        z = torch.randn(1, vae.config.z_dim, 2, 48 // pixels, 64 // pixels)
        tiled = copy.deepcopy(vae)
        tiled.enable_tiling(**TILES)
        out[name, "untiled"] = (vae, z)
        out[name, "tiled"] = (tiled, z)
    return out


@pytest.fixture(scope="module")
def decoded(vaes):
    """diffusers' decode of each, unfused."""
    with torch.no_grad():
        return {key: vae.decode(z).sample for key, (vae, z) in vaes.items()}


def fused(vae, norm="exact"):
    vae = copy.deepcopy(vae)
    fuse_chains(vae, norm=norm)
    return vae


KEYS = [(v, t) for v in ("wan2.1", "wan2.2") for t in ("untiled", "tiled")]


CASES = [(v, t, o) for v, t in KEYS for o in (("tiles", "frames") if t == "tiled" else ("tiles",))]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_chunks_of_the_fused_vae_are_diffusers_decode_bit_for_bit(vaes, decoded, case):
    *key, order = case
    key = tuple(key)
    vae, z = vaes[key]
    chunks = list(decode_chunks(fused(vae), z, order=order))
    # One chunk a latent frame: its first frame alone, then 4 frames each.
    assert [c.shape[2] for c in chunks] == [1, 4]
    assert torch.equal(bits(torch.cat(chunks, dim=2)), bits(decoded[key]))


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2"])
def test_uint8_chunks_are_the_pipelines_postprocessing_of_diffusers_decode(vaes, decoded, variant):
    vae, z = vaes[variant, "tiled"]
    video = decoded[variant, "tiled"]
    # diffusers' VideoProcessor denormalisation, as WanEncoders always postprocessed
    want = ((video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float() * 255).round()
    got = np.concatenate(list(frame_chunks(fused(vae), z)), axis=1)
    assert got.dtype == np.uint8 and got.shape == tuple(want.shape)
    np.testing.assert_array_equal(got, want.to(torch.uint8).numpy())


def test_the_families_sum_of_squares_norm_fused_equals_it_unfused(vaes):
    """The batched mode's faster norm keeps its frames: fused, it is bitwise the plain chain."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    vae, z = vaes["wan2.1", "tiled"]
    plain = copy.deepcopy(vae)
    for m in plain.modules():
        if isinstance(m, WanRMS_norm):
            m.forward = lambda x, m=m: (
                x / (x * x).sum(dim=1, keepdim=True).sqrt().clamp_min(1e-12) * m.scale * m.gamma
                + m.bias
            )
    with torch.no_grad():
        want = plain.decode(z).sample
    got = torch.cat(list(decode_chunks(fused(vae, norm="sum"), z)), dim=2)
    assert torch.equal(bits(got), bits(want))


def test_the_fused_encoder_is_diffusers_encoder_bit_for_bit(vaes):
    """fuse_chains rewrites the encoder's residual blocks too (the family encodes images and
    videos with the same VAE)."""
    vae, _ = vaes["wan2.2", "untiled"]
    x = torch.rand(1, 3, 5, 32, 48) * 2 - 1
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mode()
        got = fused(vae).encode(x).latent_dist.mode()
    assert torch.equal(bits(got), bits(want))


def test_sliced_rows_decode_as_diffusers_slices_them(vaes):
    vae, _ = vaes["wan2.1", "untiled"]
    z = torch.randn(2, vae.config.z_dim, 2, 3, 4)
    sliced = fused(vae)
    sliced.use_slicing = True
    with torch.no_grad():
        want = vae.decode(z[:1]).sample, vae.decode(z[1:]).sample
    got = torch.cat(list(decode_chunks(sliced, z)), dim=2)
    assert torch.equal(bits(got), bits(torch.cat(want)))


def test_bad_norms_and_orders_are_named(vaes):
    vae, z = vaes["wan2.1", "untiled"]
    with pytest.raises(ValueError, match="norm must be one of"):
        fuse_chains(copy.deepcopy(vae), norm="fast")
    with pytest.raises(ValueError, match="order must be one of"):
        next(decode_chunks(vae, z, order="rows"))


# ---------------------------------------------------------------------- overlapped MP4 encoding


def clip(frames: int = 9, h: int = 32, w: int = 48) -> np.ndarray:
    t = np.arange(frames)[:, None, None, None]
    y, x = np.mgrid[:h, :w]
    base = (x * 5 + y * 3)[None, :, :, None] + t * 11 + np.array([0, 60, 120])
    return (base % 256).astype(np.uint8)


def test_overlapped_encoding_writes_the_frames_of_the_whole_clip(tmp_path):
    frames = clip()
    whole = write_mp4(tmp_path / "whole.mp4", frames, fps=8)
    chunks = [frames[:1], frames[1:5], frames[5:5], frames[5:]]  # an empty chunk is skipped
    n = write_mp4_chunks(tmp_path / "chunks.mp4", iter(chunks), fps=8, depth=1)
    assert n == len(frames)
    np.testing.assert_array_equal(read_video(tmp_path / "chunks.mp4"), read_video(whole))


def test_a_failing_producer_publishes_nothing_and_raises_its_error(tmp_path):
    frames = clip()

    def decoder():
        yield frames[:1]
        yield frames[1:5]
        raise RuntimeError("decoder failed")

    with pytest.raises(RuntimeError, match="decoder failed"):
        write_mp4_chunks(tmp_path / "out.mp4", decoder(), fps=8)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([], "no frames"),
        ([clip(2, 32, 47)], "even"),
        ([clip(2), clip(2, 32, 32)], "a chunk is 32x32, the first was 48x32"),
    ],
    ids=["empty", "odd", "mismatched"],
)
def test_bad_chunks_are_refused_and_publish_nothing(tmp_path, chunks, message):
    with pytest.raises(ValueError, match=message):
        write_mp4_chunks(tmp_path / "out.mp4", iter(chunks), fps=8)
    assert list(tmp_path.iterdir()) == []


def test_an_encoder_error_reaches_the_caller_and_stops_the_producer(tmp_path):
    drawn = []

    def decoder():
        for i in range(50):
            drawn.append(i)
            yield clip(1)

    with pytest.raises(ValueError, match="preset"):  # x264 refuses the preset when it opens
        write_mp4_chunks(tmp_path / "out.mp4", decoder(), fps=8, preset="no-such-preset")
    assert len(drawn) < 50
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- the pipeline's output path


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "reference"])
def test_the_pipelines_chunks_are_its_clip(tmp_path_factory, batched):
    """`finish_chunks` (what `megaslide generate` encodes while it decodes) is `finish`, a latent
    frame at a time: 9 frames are 3 latent frames."""
    from megaslide.engine.loader import open_pipeline

    from wan_fixtures import build_tiny_wan, request

    root = tmp_path_factory.mktemp("wan")
    pipe = open_pipeline(build_tiny_wan(root / "unipc"), batched=batched)
    state = pipe.prepare(pipe.resolve(request(32, steps=1, frames=9)))
    while not state.done:
        pipe.denoise_step([state])
    chunks = list(pipe.finish_chunks(state))
    assert [len(c) for c in chunks] == [1, 4, 4]
    np.testing.assert_array_equal(np.concatenate(chunks), pipe.finish(state))
