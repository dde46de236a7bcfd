"""Text encoders: the small interface the pipeline uses and the built-in byte-level encoder.

The built-in encoder needs no vocabulary file: a prompt is its UTF-8 bytes, framed by BOS/EOS and
padded to `max_len`. Its weights are saved with the model, so a checkpoint is self-contained.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

PAD, BOS, EOS = 256, 257, 258
VOCAB_SIZE = 259


@dataclass(frozen=True)
class TextEncoderConfig:
    """Width and depth of the built-in byte-level text encoder."""

    dim: int = 128
    layers: int = 2
    heads: int = 4
    max_len: int = 128  # tokens (bytes), including BOS and EOS; longer prompts are rejected, not cut


class TextEncoder(ABC):
    """Turns prompts into token embeddings `(B, L, dim)` and a validity mask `(B, L)`."""

    dim: int
    max_len: int

    @abstractmethod
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


def tokenize(prompts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """UTF-8 bytes framed by BOS/EOS, padded to `max_len`: ids `(B, L)` int64 and mask `(B, L)` bool."""
    ids = torch.full((len(prompts), max_len), PAD, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        data = list(prompt.encode("utf-8"))
        if len(data) + 2 > max_len:
            raise ValueError(f"prompt is {len(data)} bytes; this model takes at most {max_len - 2}")
        ids[i, : len(data) + 2] = torch.tensor([BOS, *data, EOS])
    return ids, ids != PAD


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer with bidirectional attention over valid tokens."""

    def __init__(self, config: TextEncoderConfig):
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.dim)
        # No bias: a key bias cannot change attention (softmax ignores a per-row constant), so its
        # gradient would be pure rounding noise that AdamW amplifies into real updates.
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        self.mlp = nn.Sequential(nn.Linear(config.dim, 4 * config.dim), nn.GELU(), nn.Linear(4 * config.dim, config.dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # (B, h, L, d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])  # (B, h, L, d)
        x = x + self.out(o.transpose(1, 2).reshape(B, L, D))  # (B, L, D)
        return x + self.mlp(self.norm2(x))  # (B, L, D)


class ByteTextEncoder(nn.Module, TextEncoder):
    """Byte embeddings, learned positions and a few transformer layers."""

    def __init__(self, config: TextEncoderConfig):
        super().__init__()
        self.config = config
        self.dim, self.max_len = config.dim, config.max_len
        self.embed = nn.Embedding(VOCAB_SIZE, config.dim)
        self.pos = nn.Parameter(torch.randn(config.max_len, config.dim) * 0.02)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]  # (B, L, D)
        for layer in self.layers:
            x = layer(x, mask)  # (B, L, D)
        return self.norm(x)  # (B, L, D)

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.embed.weight.device
        ids, mask = tokenize(prompts, self.max_len)
        ids, mask = ids.to(device), mask.to(device)
        return self(ids, mask), mask
