"""Autoencoders between pixels and the latent space the DiT works in.

Pixel clips are `(B, 3, F, H, W)` floats in [-1, 1]. The default is the identity: the DiT works in
pixel space. `wan-vae` is Wan2.1's causal 3D VAE, through diffusers' own class, for the presets
with Wan's latent space (`wan-14b`, `megaslide-105b`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..initialization import seeded


class Autoencoder(ABC):
    """Decodes latents to pixel clips, and says how shapes change between the two. (Fine-tuning
    trains pixel-space models only, so nothing encodes pixels yet.)"""

    latent_channels: int

    @abstractmethod
    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """`(C, F', H', W')` of the latent for a clip of this many frames and pixels."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


class IdentityAutoencoder(Autoencoder):
    """Pixel space: latents are the pixels themselves."""

    latent_channels = 3

    def latent_shape(self, frames, height, width):
        return (3, frames, height, width)

    def decode(self, latents):
        return latents


class WanVAE(Autoencoder):
    """Wan2.1's causal 3D VAE (diffusers' `AutoencoderKLWan` in its default configuration: 16
    latent channels, strides 4x8x8 with the first frame alone), with a preset's seeded random
    weights, and Wan's per-channel latent normalisation. It runs in fp32 where the latents are."""

    latent_channels = 16

    def __init__(self, seed: int = 0):
        try:
            from diffusers import AutoencoderKLWan
        except ImportError as exc:
            raise ImportError(
                "the 'wan-vae' autoencoder is diffusers' AutoencoderKLWan: "
                "pip install 'megaslide[wan]'"
            ) from exc
        with seeded(seed):
            self.vae = AutoencoderKLWan().eval()
        config = self.vae.config
        self.mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)

    def latent_shape(self, frames, height, width):
        return (self.latent_channels, 1 + (frames - 1) // 4, height // 8, width // 8)

    def _to(self, x: torch.Tensor) -> None:
        if self.mean.device != x.device:
            self.vae.to(x.device)
            self.mean, self.std = self.mean.to(x.device), self.std.to(x.device)

    @torch.no_grad()
    def decode(self, latents):
        self._to(latents)
        return self.vae.decode(latents.float() * self.std + self.mean).sample.clamp(-1, 1)


AUTOENCODERS = ("identity", "wan-vae")


def check_autoencoder(name: str) -> None:
    """Raise, naming the problem, if `build_autoencoder(name)` could not build it here."""
    if name not in AUTOENCODERS:
        raise ValueError(f"unknown autoencoder {name!r}; MegaSlide has {', '.join(AUTOENCODERS)}")
    if name == "wan-vae":
        import importlib.util

        if importlib.util.find_spec("diffusers") is None:
            raise ImportError(
                "the 'wan-vae' autoencoder needs diffusers: pip install 'megaslide[wan]'"
            )


def build_autoencoder(name: str, seed: int = 0) -> Autoencoder:
    """The autoencoder `name`; a learned one gets the random weights `seed` draws."""
    check_autoencoder(name)
    if name == "identity":
        return IdentityAutoencoder()
    return WanVAE(seed)
