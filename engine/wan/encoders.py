"""The frozen ends of a Wan pipeline (UMT5 and its tokenizer, the VAE, Wan2.1-I2V's CLIP image
encoder), shared by sampling (family.py) and the fine-tuning cache (training.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .config import TEXT_TOKENS, WanConfig
from .vae_decode import decode_chunks, frame_chunks, fuse_chains, to_frames


def libraries():
    """diffusers and transformers, or an error naming the extra that installs them."""
    try:
        import diffusers
        import transformers
    except ImportError as e:
        raise ImportError(
            f"Wan models need the wan extra ({e.name} is missing): pip install 'megaslide[wan]'"
        ) from None
    return diffusers, transformers


class WanEncoders:
    """The frozen ends of a Wan pipeline: UMT5 with its tokenizer, the VAE, and Wan2.1-I2V's CLIP
    image encoder with its processor. Sampling and the fine-tuning cache (training.py) encode
    through the same code."""

    def __init__(
        self,
        path: Path,
        config: WanConfig,
        text_encoder: nn.Module,
        vae: nn.Module,
        image_encoder: nn.Module | None = None,
    ):
        _, transformers = libraries()
        self.config, self.text_encoder, self.vae = config, text_encoder, vae
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(
            path / "tokenizer", local_files_only=True
        )
        self.image_encoder, self.image_processor = image_encoder, None
        if image_encoder is not None:
            # The class model_index.json names, as diffusers loads it: with transformers 5 that
            # can be a torchvision or a PIL backend, whichever diffusers would get here too.
            index = json.loads((path / "model_index.json").read_text())
            processor = getattr(transformers, index["image_processor"][1])
            self.image_processor = processor.from_pretrained(
                path / "image_processor", local_files_only=True
            )
        # Tiles only above 256 pixels a side, so a smaller clip decodes exactly as without.
        self.vae.enable_tiling()
        mean = torch.tensor(self.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(self.vae.config.latents_std).view(1, -1, 1, 1, 1)
        self._latents_mean, self._latents_std_inv = mean, 1.0 / std

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device  # the VAE is resident: never streamed

    @torch.no_grad()
    def prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """UMT5 embeddings `(B, 512, text_dim)` on the text encoder's device, zero past each
        prompt's end, and the prompts' lengths in tokens `(B,)`."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean  # the pipeline's own cleaning

        tokens = self.tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=TEXT_TOKENS,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        device = self.text_encoder.shared.weight.device
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        hidden = self.text_encoder(ids, mask).last_hidden_state  # (B, 512, text_dim)
        lengths = mask.gt(0).sum(dim=1)
        keep = torch.arange(TEXT_TOKENS, device=device)[None, :] < lengths[:, None]  # (B, 512)
        return torch.where(keep[..., None], hidden, torch.zeros((), dtype=hidden.dtype)), lengths

    @torch.no_grad()
    def image(self, image) -> torch.Tensor:
        """A PIL image (or a list of them: FLF2V's first and last frames) -> CLIP features `(1 or
        B, N, image_dim)` fp32, as WanImageToVideoPipeline encodes them: the processor's resize,
        crop and normalisation, then the hidden states of the encoder's second-to-last layer."""
        pixels = self.image_processor(images=image, return_tensors="pt").pixel_values
        device = self.image_encoder.embeddings.patch_embedding.weight.device
        out = self.image_encoder(pixel_values=pixels.to(device), output_hidden_states=True)
        return out.hidden_states[-2]  # (1, N, image_dim): N = patches + the class token

    def _normalisation(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self._latents_mean.to(like.device, like.dtype),
            self._latents_std_inv.to(like.device, like.dtype),
        )

    @torch.no_grad()
    def clip(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels `(B, 3, F, H, W)` in [-1, 1] -> normalised latents `(B, C, F', H', W')` fp32: the
        VAE's mode, `(latent - mean) / std`, as Wan's pipelines condition on an image."""
        latent = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode()
        latent = latent.to(self.device, torch.float32)
        mean, std_inv = self._normalisation(latent)
        return (latent - mean) * std_inv

    def _vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> the VAE's own scale, on its device and in its dtype."""
        latents = latents.to(self.device, self.vae.dtype)
        mean, std_inv = self._normalisation(latents)
        return latents / std_inv + mean

    @torch.no_grad()
    def frames(self, latents: torch.Tensor) -> Iterator[np.ndarray]:
        """Normalised latents `(B, C, F', H', W')` -> uint8 frames `(B, f, H, W, 3)`, a latent
        frame's at a time as the VAE decodes them (vae_decode.py: 1 frame, then 4 per latent
        frame), so the caller never holds the float video. Their concatenation over time is
        `decode(latents)`."""
        yield from frame_chunks(self.vae, self._vae_latents(latents))

    @torch.no_grad()
    def decode_tail(self, latents: torch.Tensor, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """`decode(latents)`, and its last `n` frames before postprocessing `(B, 3, n, H, W)` in
        [-1, 1], bitwise `vae.decode`'s (what Wan Animate's next segment starts from)."""
        chunks, tail = [], None
        for chunk in decode_chunks(self.vae, self._vae_latents(latents)):  # (B, 3, f, H, W)
            tail = chunk if tail is None else torch.cat([tail, chunk], dim=2)
            tail = tail[:, :, -n:].clone()  # before `to_frames` overwrites the chunk
            chunks.append(to_frames(chunk))
        return np.concatenate(chunks, axis=1), tail

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Normalised latents `(B, C, F', H', W')` -> uint8 frames `(B, F, H, W, 3)`, in one pass
        of the VAE (its activations grow with B: the caller bounds it): bitwise `vae.decode` and
        diffusers' postprocessing (diffusers' own with the reference mode's exact norms)."""
        return np.concatenate(list(self.frames(latents)), axis=1)


def fast_vae_norms(vae: nn.Module) -> None:
    """The Wan VAE's channel RMS norms, in place, with their norm computed as `sqrt(sum(x * x))`
    rather than by `F.normalize`'s `linalg.vector_norm`, which on a CPU reduces over the
    channels of a `(B, C, T, H, W)` tensor many times slower (a fifth of a decode of the
    benchmark's clips). The same math, summed in another order: a few ulps apart, so frames
    within one uint8 level of diffusers' decode (a level where a value sits on a rounding edge,
    about 5e-5 of them in `benchmarks/wan_batch.py`'s clips). The chains around the norms are
    fused as `vae_decode.fuse_chains` fuses them (bitwise the unfused sum-of-squares norm)."""
    fuse_chains(vae, norm="sum")


__all__ = ["WanEncoders", "fast_vae_norms", "libraries"]
