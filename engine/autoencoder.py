"""Autoencoders between pixels and the latent space the DiT works in.

Pixel clips are `(B, 3, F, H, W)` floats in [-1, 1]. The default is the identity: the DiT works in
pixel space. A learned VAE plugs in behind the same two methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Autoencoder(ABC):
    """Maps pixel clips to latents and back, and says how shapes change between the two."""

    latent_channels: int

    @abstractmethod
    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """`(C, F', H', W')` of the latent for a clip of this many frames and pixels."""

    @abstractmethod
    def encode(self, pixels: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


class IdentityAutoencoder(Autoencoder):
    """Pixel space: latents are the pixels themselves."""

    latent_channels = 3

    def latent_shape(self, frames, height, width):
        return (3, frames, height, width)

    def encode(self, pixels):
        return pixels

    def decode(self, latents):
        return latents


def build_autoencoder(name: str) -> Autoencoder:
    if name == "identity":
        return IdentityAutoencoder()
    raise ValueError(
        f"autoencoder {name!r} is not bundled; this model needs its VAE weights (only 'identity' ships)"
    )
