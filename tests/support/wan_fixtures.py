"""Tiny random Wan pipelines in the real diffusers layout, built offline in about a second.

A SentencePiece tokenizer is trained on the fly on a few captions and wrapped by transformers'
`T5Tokenizer`; UMT5, the Wan transformer(s) and the Wan VAE get dims of a few dozen. Variants:
Wan2.1-style (one transformer, UniPC or flow-matching Euler), Wan2.2-A14B-style (two experts and
a boundary), Wan2.2-TI2V-style (per-token timesteps, a residual VAE with 2x2 patches),
Wan2.1-I2V-style (`WanImageToVideoPipeline`: the image condition as extra input channels and a
CLIP image encoder; with two experts Wan2.2-I2V-A14B-style, without the encoder),
Wan2.1-FLF2V-style (the I2V layout whose CLIP embedder takes a first and a last frame's features
side by side, `pos_embed_seq_len`), Wan VACE-style (`WanVACEPipeline`: VACE blocks beside the
blocks, one or two experts), Wan Animate-style (`WanAnimatePipeline`: the I2V layout with a pose
patch embedding, a motion encoder of 16x16 face frames, a face encoder and a face adapter after
every block), and sharded weights.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from megaslide.engine.request import VideoRequest

WORDS = (
    "a red green blue yellow white black circle square triangle moving left right up down "
    "not on background cat dog running jumping slowly quickly the sky river"
).split()


def tokenizer():
    import sentencepiece as spm
    from transformers import T5Tokenizer

    corpus = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(9)) for i in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        vocab_size=48,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


# The tiny transformers' widths, shared by every Wan variant the tests build.
TINY_DIMS = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    text_dim=32,
    freq_dim=16,
    ffn_dim=32,
    rope_max_seq_len=32,
)


def transformer(
    in_channels: int = 4,
    layers: int = 2,
    *,
    condition: int = 0,
    image_dim=None,
    pos_embed=None,
    vace_layers=None,
):
    """`condition`: extra input channels (I2V's mask and image latent); `image_dim`: the width of
    the CLIP features it cross-attends (Wan2.1-I2V); `pos_embed`: two images' CLIP tokens, whose
    positions FLF2V's embedder learns; `vace_layers`: a VACE transformer's, whose blocks hint
    (its conditioning: the control video's two latents and the 8x8-folded mask)."""
    from diffusers import WanTransformer3DModel, WanVACETransformer3DModel

    vace = {}
    if vace_layers is not None:
        vace = dict(vace_layers=list(vace_layers), vace_in_channels=2 * in_channels + 64)
    cls = WanVACETransformer3DModel if vace else WanTransformer3DModel
    return cls(
        **TINY_DIMS,
        in_channels=in_channels + condition,
        out_channels=in_channels,
        num_layers=layers,
        image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else 24,  # the model's width
        pos_embed_seq_len=pos_embed,
        **vace,
    )


FACE_SIZE = 16  # the tiny Animate model's face frames: 16x16 pixels


def animate_transformer(in_channels: int = 4, layers: int = 2):
    """A tiny WanAnimateTransformer3DModel: the I2V input channels (latents, mask, reference),
    CLIP features, a pose patch embedding, a motion encoder of FACE_SIZE face frames and a face
    adapter after every block (`inject_face_latents_blocks=1`, so each adapter runs)."""
    from diffusers import WanAnimateTransformer3DModel

    return WanAnimateTransformer3DModel(
        **TINY_DIMS,
        in_channels=2 * in_channels + 4,
        latent_channels=in_channels,
        out_channels=in_channels,
        num_layers=layers,
        image_dim=IMAGE_DIM,
        added_kv_proj_dim=24,
        motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8},
        motion_encoder_size=FACE_SIZE,
        motion_style_dim=16,
        motion_dim=4,
        motion_encoder_dim=16,
        face_encoder_hidden_dim=16,
        face_encoder_num_heads=2,
        inject_face_latents_blocks=1,
        motion_encoder_batch_size=4,
    )


IMAGE_DIM = 16  # the tiny CLIP's width
IMAGE_TOKENS = 17  # the tiny CLIP's tokens of one image: 16 patches and the class token


def image_encoder():
    """A tiny CLIP vision encoder (32x32 pixels in 8x8 patches: 16 patches and a class token) and
    its processor, as Wan2.1-I2V pairs them."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=IMAGE_DIM,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=IMAGE_DIM,
    )
    return CLIPVisionModel(config), CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32})


def build_tiny_wan(
    path: Path,
    *,
    experts: int = 1,
    scheduler: str = "unipc",
    ti2v: bool = False,
    i2v: bool = False,
    flf2v: bool = False,
    vace: bool = False,
    animate: bool = False,
    shard: str | None = None,
    layers: int = 2,
    seed: int = 0,
    sampling: dict | None = None,
) -> Path:
    """Write a tiny random Wan pipeline directory at `path` (as `save_pretrained` writes it), with
    sampling defaults a tiny model can take in `megaslide.json` (Wan's own are 480x832)."""
    from diffusers import WanAnimatePipeline, WanImageToVideoPipeline, WanPipeline, WanVACEPipeline

    i2v = i2v or flf2v or animate
    torch.manual_seed(seed)
    tok = tokenizer()
    text = _text_encoder(len(tok))
    channels, vae = _vae(ti2v)
    sched = _scheduler(scheduler)
    # Wan2.1-I2V: a mask channel per pixel frame of a latent frame (4), then the image's latent.
    condition = 4 + channels if i2v else 0
    clip = i2v and experts == 1  # Wan2.2-I2V-A14B has no image encoder
    image_dim = IMAGE_DIM if clip else None
    pos_embed = 2 * IMAGE_TOKENS if flf2v else None
    # VACE: hints into the first and the last block (three blocks: one between without).
    vace_layers = (0, layers - 1) if vace else None
    models = [
        animate_transformer(channels, layers)
        if animate
        else transformer(
            channels,
            layers,
            condition=condition,
            image_dim=image_dim,
            pos_embed=pos_embed,
            vace_layers=vace_layers,
        )
    ]
    models += [
        transformer(channels, layers, condition=condition, vace_layers=vace_layers)
        for _ in range(experts - 1)
    ]
    with torch.no_grad():  # Wan's output projection starts random here, so outputs are not zero
        for m in models:
            m.proj_out.weight.normal_(0, 0.5)
            for block in getattr(m, "vace_blocks", ()):  # the hints start random too
                block.proj_out.weight.normal_(0, 0.5)
            for adapter in getattr(m, "face_adapter", ()):  # and Animate's face adapters
                adapter.to_out.weight.normal_(0, 0.5)
            if pos_embed is not None:  # zero at init: the two images' positions would not count
                m.condition_embedder.image_embedder.pos_embed.normal_(0, 1.0)
    parts = dict(
        tokenizer=tok,
        text_encoder=text,
        vae=vae,
        scheduler=sched,
        transformer=models[0],
        transformer_2=models[1] if experts > 1 else None,
        boundary_ratio=0.9 if experts > 1 else None,
        expand_timesteps=ti2v,
    )
    if vace:
        del parts["expand_timesteps"]
        pipe = WanVACEPipeline(**parts)
    elif animate:
        for name in ("transformer_2", "boundary_ratio", "expand_timesteps"):
            del parts[name]
        encoder, processor = image_encoder()
        pipe = WanAnimatePipeline(**parts, image_encoder=encoder, image_processor=processor)
    elif i2v:
        encoder, processor = image_encoder() if clip else (None, None)
        pipe = WanImageToVideoPipeline(**parts, image_encoder=encoder, image_processor=processor)
    else:
        pipe = WanPipeline(**parts)
    options = {"max_shard_size": shard} if shard else {}
    pipe.save_pretrained(path, **options)
    size = 64 if ti2v else 32
    defaults = {
        "frames": 9,
        "height": size,
        "width": size,
        "fps": 8,
        "steps": 4,
        **(sampling or {}),
    }
    (Path(path) / "megaslide.json").write_text(json.dumps({"sampling": defaults}))
    return Path(path)


def _text_encoder(vocab_size: int):
    """A two-layer UMT5 encoder, 32 wide."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=vocab_size,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        )
    )


def _vae(ti2v: bool):
    """The latent channels and a tiny Wan VAE: Wan2.1's, or Wan2.2-TI2V's residual one."""
    from diffusers import AutoencoderKLWan

    if ti2v:  # Wan2.2-TI2V: a residual VAE that patchifies 2x2, 16 pixels per latent
        channels = 8
        vae = AutoencoderKLWan(
            base_dim=8,
            decoder_base_dim=8,
            z_dim=channels,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            is_residual=True,
            patch_size=2,
            in_channels=12,  # 3 colours x a 2x2 patch
            out_channels=12,
            scale_factor_spatial=16,
            latents_mean=[0.05 * i for i in range(channels)],
            latents_std=[1.0 + 0.1 * i for i in range(channels)],
        )
    else:
        channels = 4
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=channels,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.8, 1.2, 1.0],
        )
    return channels, vae


def _scheduler(name: str):
    """Wan's UniPC scheduler, or (any other name) the flow-matching Euler scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if name == "unipc":
        return UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        )
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


# Small clips: 9 frames (3 latent frames) of 32x32 (a 2x2 token grid a frame).
CLIP = dict(height=32, width=32, num_frames=9, num_inference_steps=4, guidance_scale=4.0)


PROMPT, NEGATIVE = "a red circle moving left", "blurry"


def request(size: int = 32, **changes) -> VideoRequest:
    """The parity tests' request: `CLIP` at `size`, a prompt and a negative one."""
    fields = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=size,
        width=size,
        frames=CLIP["num_frames"],
        steps=CLIP["num_inference_steps"],
        guidance=CLIP["guidance_scale"],
        seed=3,
    )
    return VideoRequest(**{**fields, **changes})
