"""The DiT's shapes, presets, initialisation and positions."""

import math

import numpy as np
import pytest
import torch

from megaslide.engine.native.config import PRESETS, DiTConfig, TextEncoderConfig
from megaslide.engine.native.dit import VideoDiT, apply_rope, rope_frequencies, sincos_positions
from megaslide.engine.native.family import count_parameters
from megaslide.engine.native.text import BuiltinTextEncoder, tokenize

from dit_fixtures import randomise_zero_inits

TINY = PRESETS["tiny"].model


def make(config=TINY, seed=0):
    torch.manual_seed(seed)
    return VideoDiT(config).eval(), BuiltinTextEncoder(config.text).eval()


def test_forward_shapes_for_several_clip_shapes():
    dit, text = make()
    ctx, mask = text.encode(["a red circle", "x"])
    for frames, h, w in [(16, 64, 64), (3, 32, 48), (1, 8, 4)]:
        x = torch.randn(2, 3, frames, h, w)
        v = dit(x, torch.tensor([0.3, 0.9]), ctx, mask)
        assert v.shape == x.shape


def test_patchify_round_trips():
    dit, _ = make()
    x = torch.randn(2, 3, 4, 16, 24)
    tokens, grid = dit.patchify(x)
    assert grid == (4, 4, 6) and tokens.shape == (2, 96, 3 * math.prod(TINY.patch))
    assert torch.equal(dit.unpatchify(tokens, grid), x)


def test_adaln_zero_makes_every_block_the_identity_at_init():
    dit, text = make()
    x = torch.randn(1, 3, 4, 16, 16)
    h, c = dit.prologue(x, torch.tensor([0.5]), *text.encode(["anything at all"]))
    for block in dit.blocks:
        assert torch.equal(block(h, c), h)
    # ...and the whole model predicts zero velocity, whatever the input.
    assert not dit(x, torch.tensor([0.5]), *text.encode(["p"])).any()


def test_blocks_stop_being_identity_once_trained():
    # Guards the test above from passing because a block ignores its input entirely.
    dit, text = make()
    randomise_zero_inits(dit)
    x = torch.randn(1, 3, 4, 16, 16)
    assert dit(x, torch.tensor([0.5]), *text.encode(["p"])).abs().mean() > 1e-3


def test_text_changes_the_prediction_and_padding_does_not():
    dit, text = make()
    randomise_zero_inits(dit)
    x, t = torch.randn(1, 3, 4, 16, 16), torch.tensor([0.5])
    a = dit(x, t, *text.encode(["a red circle"]))
    b = dit(x, t, *text.encode(["a blue square"]))
    assert (a - b).abs().max() > 1e-4
    # Longer padding must not change anything: padded keys are masked out of cross-attention.
    extra = 32
    long_text = BuiltinTextEncoder(TextEncoderConfig(max_len=TINY.text.max_len + extra))
    long_text.load_state_dict(
        {
            k: (v if k != "pos" else torch.cat([v, torch.zeros(extra, v.shape[1])]))
            for k, v in text.state_dict().items()
        }
    )
    c = dit(x, t, *long_text.encode(["a red circle"]))
    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_rope_is_a_rotation_that_encodes_relative_position():
    config = DiTConfig(dim=96, heads=2)  # head dim 48: 16 channels per axis
    angles = rope_frequencies(config, (3, 4, 5))
    assert angles.shape == (60, 24)
    q, k = torch.randn(1, 1, 60, 48), torch.randn(1, 1, 60, 48)
    rq = apply_rope(q, angles)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # Same q/k content at two positions: the score depends only on the offset between them.
    q1 = q[..., :1, :].expand(1, 1, 60, 48)
    k1 = k[..., :1, :].expand(1, 1, 60, 48)
    s = apply_rope(q1, angles)[0, 0] @ apply_rope(k1, angles)[0, 0].T  # (60, 60)
    idx = lambda t, y, x: (t * 4 + y) * 5 + x  # noqa: E731
    torch.testing.assert_close(
        s[idx(0, 0, 0), idx(1, 2, 3)], s[idx(1, 1, 1), idx(2, 3, 4)], rtol=1e-4, atol=1e-4
    )


def test_presets_have_the_promised_sizes():
    assert count_parameters(PRESETS["tiny"].model)["total"] <= 5_000_000
    assert 100e6 <= count_parameters(PRESETS["small"].model)["total"] <= 300e6
    assert 1.0e11 <= count_parameters(PRESETS["megaslide-105b"].model)["total"] <= 1.1e11
    wan = count_parameters(PRESETS["wan-14b"].model)
    assert 13e9 <= wan["dit"] <= 15.5e9


def test_config_round_trips_and_rejects_bad_values():
    c = PRESETS["small"].model.replace(attention="dsa")
    assert DiTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="divisible"):
        DiTConfig(dim=100, heads=3)
    with pytest.raises(ValueError, match="attention"):
        DiTConfig(attention="flash")
    with pytest.raises(ValueError, match="unknown model config keys"):
        DiTConfig.from_dict({**c.to_dict(), "bogus": 1})


def test_check_latent_names_the_problem():
    with pytest.raises(ValueError, match="frames must be between"):
        TINY.check_latent(TINY.max_frames + 1, 64, 64)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        TINY.check_latent(8, 62, 64)
    with pytest.raises(ValueError, match="3D-DSA needs the token grid's y axis"):
        TINY.replace(attention="dsa").check_latent(8, 32, 64)


def test_tokenizer_rejects_long_prompts():
    ids, mask = tokenize(["ab", ""], TextEncoderConfig(max_len=8))
    assert mask.sum(1).tolist() == [4, 2]
    with pytest.raises(ValueError, match=r"7 bytes \(UTF-8\); this model takes at most 6"):
        tokenize(["x" * 7], TextEncoderConfig(max_len=8))


def test_word_tokenizer_hashes_lower_cased_words():
    config = TextEncoderConfig(max_len=8, tokenizer="words", buckets=1000)
    ids, mask = tokenize(["A red circle.", "a  RED circle .", "a green circle"], config)
    assert mask.sum(1).tolist() == [6, 6, 5]  # BOS, a, red, circle, ".", EOS
    assert torch.equal(ids[0], ids[1])
    assert ids[0, 2] != ids[2, 2] and ids[0, 3] == ids[2, 3]  # red != green; circle == circle
    assert ids.max() < config.vocab_size and ids[0, 1:5].max() < config.buckets
    with pytest.raises(
        ValueError, match=r"7 tokens \(words and punctuation\); this model takes at most 6"
    ):
        tokenize(["one two three four five six seven"], config)
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        TextEncoderConfig(tokenizer="sentencepiece")


def test_dsa_with_a_window_covering_the_grid_equals_dense_attention():
    dense, text = make(TINY.replace(dsa_tile=(1, 2, 2), dsa_window=(3, 3, 3)))
    randomise_zero_inits(dense)
    slide = VideoDiT(dense.config.replace(attention="dsa")).eval()
    slide.load_state_dict(dense.state_dict())
    x = torch.randn(1, 3, 3, 24, 24)  # tokens (3, 6, 6): tiles (3, 3, 3), the window is everything
    ctx = text.encode(["a red circle"])
    with torch.no_grad():
        torch.testing.assert_close(
            slide(x, torch.tensor([0.5]), *ctx),
            dense(x, torch.tensor([0.5]), *ctx),
            rtol=1e-4,
            atol=1e-5,
        )


def test_dsa_motion_head_learns_from_the_key_flow_loss():
    from megaslide.engine.native.dit import pop_aux_losses

    config = TINY.replace(attention="dsa", dsa_tile=(1, 2, 2), dsa_window=(1, 3, 3))
    dit, text = make(config)
    dit.train()
    x = torch.randn(1, 3, 4, 32, 32)
    dit(x, torch.tensor([0.5]), *text.encode(["p"]))
    losses = pop_aux_losses(dit)
    assert len(losses) == config.depth and pop_aux_losses(dit) == []
    sum(losses).backward()
    assert dit.blocks[0].attn.motion.weight.grad.abs().sum() > 0
    # Dense models freeze the head: nothing to learn, nothing to decay.
    assert not make()[0].blocks[0].attn.motion.weight.requires_grad


@pytest.mark.parametrize("absolute", [False, True])
def test_only_absolute_positions_tell_tokens_of_a_uniform_clip_apart(absolute):
    """RoPE is relative: when every token is alike, every token's output is alike. Absolute
    positions are what lets a model draw where and when, starting from featureless input."""
    dit, text = make(TINY.replace(absolute_positions=absolute))
    randomise_zero_inits(dit)
    x = torch.full((1, 3, 4, 16, 16), 0.3)
    with torch.no_grad():
        out = dit(x, torch.tensor([0.9]), *text.encode(["a red circle"]))  # (1, 3, F, H, W)
    patches = dit.patchify(out)[0][0]  # (N, C*pt*ph*pw)
    spread = (patches - patches[0]).abs().max().item()
    assert (spread > 1e-3) if absolute else (spread < 1e-5), spread
    if absolute:
        p = sincos_positions(128, (16, 4, 4))
        gaps = torch.cdist(p, p) + torch.eye(len(p)) * 1e9
        assert gaps.min() > 0.1  # every token of the grid has its own position


def test_models_in_wan_latent_space_decode_through_the_wan_vae(tmp_path):
    """A DiT in Wan's latent space (16 channels, the causal 4x8x8 VAE), as the wan-14b and
    megaslide-105b presets are, opens and samples: frames come out of diffusers' Wan VAE."""
    pytest.importorskip("diffusers")
    from megaslide.engine.loader import open_pipeline
    from megaslide.engine.native.autoencoder import WanVAE, build_autoencoder
    from megaslide.engine.native.checkpoint import save_model
    from megaslide.engine.native.config import SamplingDefaults
    from megaslide.engine.request import VideoRequest

    assert PRESETS["megaslide-105b"].model.autoencoder == "wan-vae"
    config = DiTConfig(
        in_channels=16,
        patch=(1, 2, 2),
        dim=32,
        depth=1,
        heads=2,
        ffn_dim=64,
        text=TextEncoderConfig(dim=32, layers=1, heads=2, max_len=16),
        autoencoder="wan-vae",
        vae_stride=(4, 8, 8),
        max_frames=4,
        max_size=8,
    )
    sampling = SamplingDefaults(frames=5, height=32, width=32, steps=1)
    save_model(tmp_path / "m", VideoDiT(config), BuiltinTextEncoder(config.text), sampling)
    pipe = open_pipeline(tmp_path / "m")
    frames = pipe.generate(VideoRequest("a clip", seed=1, frames=5, width=32, height=32))
    assert frames.shape == (5, 32, 32, 3) and frames.dtype == np.uint8
    # Seeded: the same random VAE every time; its latents round-trip to the shapes it promises.
    vae = build_autoencoder("wan-vae", seed=0)
    assert isinstance(vae, WanVAE) and vae.latent_shape(9, 64, 48) == (16, 3, 8, 6)
    used = pipe.autoencoder.vae.parameters()
    assert all(torch.equal(a, b) for a, b in zip(vae.vae.parameters(), used))
    with pytest.raises(ValueError, match="unknown autoencoder"):
        build_autoencoder("sd-vae")
