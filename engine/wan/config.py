"""A diffusers-format Wan pipeline directory, read without torch.

    <dir>/model_index.json            the pipeline class (WanPipeline, WanImageToVideoPipeline,
                                      WanVACEPipeline, WanAnimatePipeline) and its components (boundary_ratio, expand_timesteps for
                                      Wan2.2)
    <dir>/transformer/config.json     WanTransformer3DModel, WanVACETransformer3DModel or
                                      WanAnimateTransformer3DModel (and
                                      transformer_2/ for Wan2.2-A14B and Wan2.2 VACE-Fun)
    <dir>/vae/config.json             AutoencoderKLWan: strides, latent channels, normalisation
    <dir>/text_encoder/config.json    UMT5EncoderModel
    <dir>/tokenizer/                  its SentencePiece tokenizer (tokenizer.json)
    <dir>/image_encoder/config.json   Wan2.1-I2V only: CLIPVisionModel
    <dir>/image_processor/            Wan2.1-I2V only: its CLIPImageProcessor
    <dir>/scheduler/scheduler_config.json
    <dir>/megaslide.json              optional: sampling defaults for this model

A first-frame image conditions a Wan model in one of two ways, read from the configs:
- Wan2.2-TI2V (`expand_timesteps`): the image's latent replaces the first latent frame;
- Wan2.1-I2V and Wan2.2-I2V-A14B (`image_condition`): the transformer takes `2 * z_dim + 4`
  input channels (36 for Wan's VAE): the noisy latents, a mask of the frames given (one channel
  per pixel frame a latent frame covers), and the latent of the image followed by black frames; Wan2.1-I2V's transformer also cross-attends the image's
  CLIP features (`image_dim`, from `image_encoder/`).

A last frame joins the first on the `image_condition` models (`WanImageToVideoPipeline`'s
`last_image`): black frames between the two, a mask given on both. Wan2.1-FLF2V's transformer
(`pos_embed_seq_len`: two images' CLIP tokens) cross-attends both images' CLIP features side by
side, each with its own learnt position embedding, so it needs both frames; Wan2.1-I2V's CLIP
embedder takes one image's and refuses a last frame; Wan2.2-I2V-A14B, without CLIP, takes one.

Any text-to-video model remakes an input video (`WanVideoToVideoPipeline`): no layout of its own.

VACE (`WanVACEPipeline`: Wan2.1 VACE 1.3B/14B, Wan2.2 VACE-Fun with two experts) is a text-to-video
transformer (`in_channels` the VAE's latent channels, no CLIP) with VACE blocks beside its blocks
(`vace_layers`: the blocks whose output each VACE block's hint adds to) and a patch embedding of
the conditioning latents (`vace_in_channels`: the control video's inactive and reactive latents,
`2 * z_dim`, and the mask folded to one channel per pixel of a latent pixel, `vae_spatial ** 2`;
96 for Wan's VAE).

Animate (`WanAnimatePipeline`: Wan2.2-Animate-14B) is the Wan2.1-I2V layout (`in_channels`
`2 * z_dim + 4`, CLIP features, one expert) on a `WanAnimateTransformer3DModel`: a pose patch
embedding, a motion encoder of square face frames (`motion_encoder_size` pixels), a face encoder
and a face adapter after every `inject_face_latents_blocks`-th block.

Weights are `*.safetensors` in each component folder, sharded or not. A missing file is named in
the error.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..native.config import ATTENTION_BACKENDS, SamplingDefaults
from ..request import CACHE_POLICIES, ModelLimits

PIPELINES = ("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline", "WanAnimatePipeline")
IMAGE_ENCODERS = (("transformers", "CLIPVisionModel"),)  # Wan2.1-I2V's
EXPERTS = ("transformer", "transformer_2")  # high-noise expert, then low-noise (Wan2.2-A14B)
TEXT_TOKENS = 512  # Wan's pipelines pad (and cut) every prompt to 512 UMT5 tokens
SAMPLING_FILE = "megaslide.json"


class WanFormatError(ValueError):
    """A Wan directory that cannot be read; the message names the file."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise WanFormatError(f"{path} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WanFormatError(f"{path}: not valid JSON ({e})") from None


def weight_files(folder: Path) -> tuple[Path, ...]:
    """The safetensors files of one component: the shards an `*.index.json` names, else every
    `*.safetensors` in the folder."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        shards = sorted(set(_read_json(indexes[0])["weight_map"].values()))
        files = tuple(folder / s for s in shards)
        for f in files:
            if not f.is_file():
                raise WanFormatError(f"{f} is missing (named in {indexes[0].name})")
        return files
    files = tuple(sorted(folder.glob("*.safetensors")))
    if not files:
        raise WanFormatError(f"{folder} holds no *.safetensors weights")
    return files


@dataclass(frozen=True)
class WanConfig:
    """What MegaSlide needs to know of a Wan pipeline, from its JSON files."""

    experts: tuple[str, ...]  # component folders of the denoisers, high noise first
    boundary_ratio: float | None  # Wan2.2-A14B: switch experts below this fraction of 1000 steps
    expand_timesteps: bool  # Wan2.2-TI2V: one timestep per token (the first frame can be clean)
    patch: tuple[int, int, int]
    in_channels: int
    dim: int
    heads: int
    ffn_dim: int
    depth: int  # blocks per expert
    text_dim: int
    rope_max_seq_len: int
    vae_temporal: int
    vae_spatial: int
    z_dim: int
    text_depth: int
    text_width: int
    scheduler: str
    flow_shift: float
    num_train_timesteps: int
    # Self-attention backend; "dsa" swaps Wan's processor for 3D-DSA, "sage" for 8-bit attention
    # over all tokens (attention.py).
    attention: str = "dense"
    dsa_tile: tuple[int, int, int] = (1, 2, 2)
    dsa_window: tuple[int, int, int] = (3, 3, 3)
    # Image-to-video by extra input channels (Wan2.1-I2V, Wan2.2-I2V-A14B; see the module's
    # docstring), and whether a CLIP image encoder feeds the transformer (Wan2.1-I2V).
    image_condition: bool = False
    image_encoder: bool = False
    # Wan2.1-FLF2V: the CLIP embedder takes a first and a last frame's features
    # (`pos_embed_seq_len`).
    first_last_frame: bool = False
    # VACE (`WanVACETransformer3DModel`): the blocks each VACE block's hint adds to, in order
    # (empty: no VACE blocks), and the conditioning latents' channels.
    vace_layers: tuple[int, ...] = ()
    vace_in_channels: int = 0
    # Animate (`WanAnimateTransformer3DModel`): the face video's frame size (square, pixels); 0:
    # not an Animate model.
    face_size: int = 0
    # Single-file transformer checkpoints (one per expert) read instead of the directory's own
    # transformer weights (single_file.py): a fine-tune shared as one file over its base pipeline.
    transformer_files: tuple[str, ...] = ()

    def __post_init__(self):
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}"
            )
        if self.transformer_files:
            if len(self.transformer_files) != len(self.experts):
                raise WanFormatError(
                    f"{len(self.transformer_files)} transformer files for a model with "
                    f"{len(self.experts)} transformers ({', '.join(self.experts)}): give one each"
                )
            for f in self.transformer_files:
                if not Path(f).is_file():
                    raise WanFormatError(f"transformer file {f} not found")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def text_tokens(self) -> int:
        return TEXT_TOKENS

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """`(C, F', H', W')` of the latent of a clip in pixels (the causal VAE keeps frame 0 alone)."""
        s = self.vae_spatial
        return self.z_dim, (frames - 1) // self.vae_temporal + 1, height // s, width // s

    def token_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        _, f, h, w = self.latent_shape(frames, height, width)
        pt, ph, pw = self.patch
        return f // pt, h // ph, w // pw

    def check_grid(self, frames: int, height: int, width: int) -> None:
        """ValueError unless 3D-DSA can tile this clip's token grid (dense takes any)."""
        if self.attention != "dsa":
            return
        grid = self.token_grid(frames, height, width)
        for axis, n, t, w in zip("tyx", grid, self.dsa_tile, self.dsa_window):
            if n % t or n // t < w:
                raise ValueError(
                    f"3D-DSA needs the token grid's {axis} axis ({n}) to be a multiple of the tile "
                    f"({t}) with at least {w} tiles"
                )

    @property
    def vace(self) -> bool:
        """Whether the transformer carries VACE blocks (reference images, control video, mask)."""
        return bool(self.vace_layers)

    @property
    def animate(self) -> bool:
        """Whether the transformer is Wan Animate's (a character image, pose and face videos)."""
        return self.face_size > 0

    def replace(self, **changes) -> WanConfig:
        for key in ("dsa_tile", "dsa_window", "transformer_files", "vace_layers"):
            if key in changes:
                changes[key] = tuple(changes[key])
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_wan_config(path: Path) -> WanConfig:
    index = _read_json(path / "model_index.json")
    if index.get("_class_name") not in PIPELINES:
        raise WanFormatError(
            f"{path / 'model_index.json'}: pipeline {index.get('_class_name')!r} is not supported "
            f"(supported: {', '.join(PIPELINES)})"
        )
    experts = tuple(e for e in EXPERTS if (index.get(e) or [None])[0] is not None)
    if not experts:
        raise WanFormatError(f"{path / 'model_index.json'} names no transformer")
    for component in ("text_encoder", "tokenizer", "vae", "scheduler"):
        if (index.get(component) or [None])[0] is None:
            raise WanFormatError(f"{path / 'model_index.json'} names no {component}")
    t = _read_json(path / experts[0] / "config.json")
    for other in experts[1:]:
        o = _read_json(path / other / "config.json")
        shared = (
            "patch_size",
            "in_channels",
            "num_attention_heads",
            "attention_head_dim",
            "text_dim",
            "image_dim",
            "vace_layers",
            "vace_in_channels",
        )
        if any(o.get(k) != t.get(k) for k in shared):
            raise WanFormatError(f"{path / other / 'config.json'} does not match {experts[0]}")
    vae = _read_json(path / "vae" / "config.json")
    image_condition, image_encoder, first_last_frame = _image_conditioning(path, index, t, vae)
    vace_layers, vace_in_channels = _vace(path, index, t, vae, image_condition or image_encoder)
    face_size = _animate(path, index, t, experts, image_condition and image_encoder)
    text = _read_json(path / "text_encoder" / "config.json")
    scheduler = _read_json(path / "scheduler" / "scheduler_config.json")
    if not (path / "tokenizer").is_dir():
        raise WanFormatError(f"{path / 'tokenizer'} is missing")
    heads, head_dim = t.get("num_attention_heads", 40), t.get("attention_head_dim", 128)
    return WanConfig(
        experts=experts,
        boundary_ratio=index.get("boundary_ratio"),
        expand_timesteps=bool(index.get("expand_timesteps", False)),
        patch=tuple(t.get("patch_size", (1, 2, 2))),
        in_channels=t.get("in_channels", 16),
        dim=heads * head_dim,
        heads=heads,
        ffn_dim=t.get("ffn_dim", 13824),
        depth=t.get("num_layers", 40),
        text_dim=t.get("text_dim", 4096),
        rope_max_seq_len=t.get("rope_max_seq_len", 1024),
        vae_temporal=vae.get("scale_factor_temporal", 4),
        vae_spatial=vae.get("scale_factor_spatial", 8),
        z_dim=vae.get("z_dim", 16),
        text_depth=text.get("num_layers", 24),
        text_width=text.get("d_model", 4096),
        scheduler=scheduler.get("_class_name", "UniPCMultistepScheduler"),
        flow_shift=float(scheduler.get("flow_shift") or scheduler.get("shift") or 1.0),
        num_train_timesteps=scheduler.get("num_train_timesteps", 1000),
        image_condition=image_condition,
        image_encoder=image_encoder,
        first_last_frame=first_last_frame,
        vace_layers=vace_layers,
        vace_in_channels=vace_in_channels,
        face_size=face_size,
    )


VACE_TRANSFORMER = "WanVACETransformer3DModel"


def _vace(
    path: Path, index: dict, transformer: dict, vae: dict, image: bool
) -> tuple[tuple[int, ...], int]:
    """`(vace_layers, vace_in_channels)` of a WanVACEPipeline's transformer (`((), 0)` for the
    other pipelines), checked against what diffusers' pipeline feeds it; WanFormatError naming
    the file otherwise."""
    config = path / "transformer" / "config.json"
    vace = index["_class_name"] == "WanVACEPipeline"
    if (transformer.get("_class_name") == VACE_TRANSFORMER) != vace:
        raise WanFormatError(
            f"{config}: a {transformer.get('_class_name')} under "
            f"{index['_class_name']}: WanVACEPipeline goes with {VACE_TRANSFORMER}, and only it"
        )
    if not vace:
        return (), 0
    if image:
        raise WanFormatError(
            f"{config}: a VACE transformer takes no image condition nor CLIP features "
            "(in_channels the VAE's latent channels, image_dim unset)"
        )
    depth = transformer.get("num_layers", 40)
    layers = tuple(transformer.get("vace_layers", (0, 5, 10, 15, 20, 25, 30, 35)))
    if not layers or layers[0] != 0 or list(layers) != sorted(set(layers)) or layers[-1] >= depth:
        raise WanFormatError(
            f"{config}: vace_layers {list(layers)} must rise from 0 and stay below num_layers "
            f"({depth})"
        )
    z, spatial = vae.get("z_dim", 16), vae.get("scale_factor_spatial", 8)
    channels = transformer.get("vace_in_channels", 96)
    if channels != 2 * z + spatial**2:
        raise WanFormatError(
            f"{config}: vace_in_channels {channels} is not the control video's two latents and "
            f"its mask folded per latent pixel (2 x {z} + {spatial}^2 = {2 * z + spatial**2})"
        )
    return layers, channels


ANIMATE_TRANSFORMER = "WanAnimateTransformer3DModel"


def _animate(path: Path, index: dict, transformer: dict, experts: tuple, image: bool) -> int:
    """The face frames' size of a WanAnimatePipeline's transformer (0 for the other pipelines),
    checked against what diffusers' pipeline feeds it; WanFormatError naming the file
    otherwise."""
    config = path / "transformer" / "config.json"
    animate = index["_class_name"] == "WanAnimatePipeline"
    if (transformer.get("_class_name") == ANIMATE_TRANSFORMER) != animate:
        raise WanFormatError(
            f"{config}: a {transformer.get('_class_name')} under "
            f"{index['_class_name']}: WanAnimatePipeline goes with {ANIMATE_TRANSFORMER}, and only "
            "it"
        )
    if not animate:
        return 0
    if len(experts) != 1 or not image:
        raise WanFormatError(
            f"{config}: an Animate transformer is one expert with an image condition and CLIP "
            "features (in_channels 2 x z_dim + 4, image_dim set, an image_encoder)"
        )
    depth = transformer.get("num_layers", 40)
    every = transformer.get("inject_face_latents_blocks", 5)
    if not (isinstance(every, int) and every >= 1 and depth % every == 0):
        # diffusers' forward runs face_adapter[i // every] after each block i divisible by
        # `every`, of which there are num_layers // every.
        raise WanFormatError(
            f"{config}: inject_face_latents_blocks {every} does not divide num_layers {depth} "
            "(a face adapter runs after every such block)"
        )
    return int(transformer.get("motion_encoder_size", 512))


def _image_conditioning(
    path: Path, index: dict, transformer: dict, vae: dict
) -> tuple[bool, bool, bool]:
    """`(image_condition, image_encoder, first_last_frame)` of a pipeline (see the module's
    docstring), checked against what diffusers' Wan pipelines would run; WanFormatError naming
    the file otherwise."""
    pipeline = index["_class_name"]
    config = path / "transformer" / "config.json"
    z, mask = vae.get("z_dim", 16), vae.get("scale_factor_temporal", 4)
    channels = transformer.get("in_channels", 16)
    if channels not in (z, 2 * z + mask):
        raise WanFormatError(
            f"{config}: in_channels {channels} is neither the VAE's {z} latent channels "
            f"(text-to-video, TI2V) nor {2 * z + mask} (image-to-video: latents, mask, image)"
        )
    image_condition = channels == 2 * z + mask
    image_pipelines = ("WanImageToVideoPipeline", "WanAnimatePipeline")
    if image_condition and (pipeline not in image_pipelines or index.get("expand_timesteps")):
        raise WanFormatError(
            f"{config}: a transformer of {channels} input channels takes an image condition: "
            "model_index.json must name WanImageToVideoPipeline (or WanAnimatePipeline) without "
            "expand_timesteps"
        )
    if pipeline == "WanImageToVideoPipeline" and not (
        image_condition or index.get("expand_timesteps")
    ):
        raise WanFormatError(
            f"{config}: WanImageToVideoPipeline needs a transformer of {2 * z + mask} input "
            f"channels (or expand_timesteps), not {channels}"
        )
    image_encoder = transformer.get("image_dim") is not None
    pos_embed = transformer.get("pos_embed_seq_len")
    if pos_embed is not None and not (image_condition and image_encoder):
        raise WanFormatError(
            f"{config}: pos_embed_seq_len is set (a first-last-frame model's CLIP positions) "
            f"on a transformer without {'an image condition' if image_encoder else 'image_dim'}"
        )
    if image_encoder:
        for component in ("image_encoder", "image_processor"):
            if (index.get(component) or [None])[0] is None:
                raise WanFormatError(
                    f"{config} has image_dim set, but {path / 'model_index.json'} names no "
                    f"{component}"
                )
        if tuple(index["image_encoder"]) not in IMAGE_ENCODERS:
            raise WanFormatError(
                f"{path / 'model_index.json'}: image_encoder {index['image_encoder']} is not "
                f"supported (supported: {', '.join(c for _, c in IMAGE_ENCODERS)})"
            )
        clip = _read_json(path / "image_encoder" / "config.json")  # named when missing
        _read_json(path / "image_processor" / "preprocessor_config.json")
        # CLIP's tokens of one image: its patches and the class token.
        tokens = (clip.get("image_size", 224) // clip.get("patch_size", 32)) ** 2 + 1
        if pos_embed is not None and pos_embed != 2 * tokens:
            raise WanFormatError(
                f"{config}: pos_embed_seq_len {pos_embed} is not two images' CLIP tokens "
                f"(2 x {tokens}, from {path / 'image_encoder' / 'config.json'})"
            )
    return image_condition, image_encoder, pos_embed is not None


def default_sampling(config: WanConfig, path: Path) -> SamplingDefaults:
    """Wan's published defaults (480x832, 81 frames at 16 fps; TI2V-5B: 704x1280, 121 at 24;
    Animate: WanAnimatePipeline's, 720x1280, a segment of 77 frames, 20 steps, no guidance),
    overridden by `megaslide.json` in the directory when it has a "sampling" entry."""
    if config.animate:
        base = SamplingDefaults(frames=77, height=720, width=1280, fps=16, steps=20, guidance=1.0)
    elif config.vae_spatial == 16:  # Wan2.2-TI2V-5B's VAE
        base = SamplingDefaults(frames=121, height=704, width=1280, fps=24, steps=50, guidance=5.0)
    else:
        # Wan2.2's A14B experts: 4.0 for text-to-video, 3.5 for image-to-video (its i2v config).
        guidance = (3.5 if config.image_condition else 4.0) if len(config.experts) > 1 else 5.0
        base = SamplingDefaults(
            frames=81, height=480, width=832, fps=16, steps=50, guidance=guidance
        )
    base = base.replace(shift=config.flow_shift)
    own = path / SAMPLING_FILE
    if own.is_file():
        base = base.replace(**_read_json(own).get("sampling", {}))
    return base


def clean_prompt(text: str) -> str:
    """The cleaning Wan's pipelines apply before tokenizing (mojibake fixed by ftfy when it is
    installed, HTML entities, runs of whitespace), for counting a prompt's tokens; sampling uses
    diffusers' own function."""
    try:
        import ftfy
    except ImportError:
        pass
    else:
        text = ftfy.fix_text(text)
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


@cache
def _tokenizer(folder: str):
    from tokenizers import Tokenizer

    file = Path(folder) / "tokenizer.json"
    if not file.is_file():
        raise WanFormatError(f"{file} is missing (needed to count a prompt's tokens)")
    return Tokenizer.from_file(str(file))


def count_tokens(prompt: str, folder: str) -> int:
    """UMT5 tokens of a prompt, without the end-of-sequence token."""
    return len(_tokenizer(folder).encode(clean_prompt(prompt), add_special_tokens=False).ids)


def wan_limits(config: WanConfig, sampling: SamplingDefaults, path: Path) -> ModelLimits:
    pt, ph, pw = config.patch
    return ModelLimits(
        max_frames=config.vae_temporal * (config.rope_max_seq_len * pt - 1) + 1,
        max_size=config.rope_max_seq_len * max(ph, pw) * config.vae_spatial,
        size_multiple=(ph * config.vae_spatial, pw * config.vae_spatial),
        frames_multiple=config.vae_temporal * pt,
        frames_offset=1,
        # Wan2.2-TI2V may take a first-frame image (its clean latent replaces the first latent
        # frame); the I2V models need one, as diffusers' WanImageToVideoPipeline does.
        image_input=config.expand_timesteps or config.image_condition,
        image_required=config.image_condition,
        # A last frame: on the image-condition models whose CLIP embedder (if any) takes two
        # images' features (the module's docstring).
        last_image_input=config.image_condition
        and (config.first_last_frame or not config.image_encoder),
        last_image_required=config.first_last_frame,
        # Video-to-video: text-to-video models (WanVideoToVideoPipeline's own inputs); a VACE
        # transformer runs with its conditioning only (WanVACEPipeline's inputs).
        video_input=not (config.image_condition or config.expand_timesteps or config.vace),
        vace_input=config.vace,
        animate_input=config.animate,
        # Every step cache, a VACE or Animate model's too (forward.py cuts their passes; an
        # Animate segment starts its cache afresh).
        cache_policies=CACHE_POLICIES,
        experts=len(config.experts),
        max_prompt_tokens=TEXT_TOKENS - 1,  # and the end-of-sequence token
        prompt_unit="tokens (UMT5)",
        count_tokens=lambda prompt: count_tokens(prompt, str(path / "tokenizer")),
        check_shape=config.check_grid,
    )
