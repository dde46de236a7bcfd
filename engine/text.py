"""Text encoders: the small interface the pipeline uses and the built-in encoder.

The built-in encoder needs no vocabulary file. A prompt is cut into tokens by one of two rules:
"bytes" (its UTF-8 bytes: any text, but the encoder must learn what a word is) or "words"
(lower-cased words and punctuation, each hashed into one of `buckets` ids: a word is one
embedding from the first step, which a small model trained from scratch learns far faster).
Tokens are framed by BOS/EOS and padded to `max_len`. The encoder's weights are saved with the
model, so a checkpoint is self-contained.
"""

from __future__ import annotations

import re
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

TOKENIZERS = ("bytes", "words")
_WORD = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class TextEncoderConfig:
    """Tokenizer, width and depth of the built-in text encoder."""

    dim: int = 128
    layers: int = 2
    heads: int = 4
    max_len: int = 128  # tokens, including BOS and EOS; longer prompts are rejected, not cut
    tokenizer: str = "bytes"  # "bytes" or "words" (see the module docstring)
    buckets: int = 4096  # hashed word ids ("words" only)

    def __post_init__(self):
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")

    @property
    def base(self) -> int:
        """Ids below this are text; PAD, BOS and EOS follow it."""
        return 256 if self.tokenizer == "bytes" else self.buckets

    @property
    def vocab_size(self) -> int:
        return self.base + 3


TOKEN_UNITS = {"bytes": "bytes (UTF-8)", "words": "tokens (words and punctuation)"}


def count_tokens(prompt: str, tokenizer: str = "bytes") -> int:
    """How many text tokens a prompt takes (BOS and EOS not counted)."""
    return len(token_ids(prompt, tokenizer))


def token_ids(prompt: str, tokenizer: str = "bytes", buckets: int = 4096) -> list[int]:
    """A prompt's text ids, without framing: UTF-8 bytes, or hashed lower-cased words."""
    if tokenizer == "bytes":
        return list(prompt.encode("utf-8"))
    # crc32 is stable across processes and platforms, unlike hash() of a str.
    return [zlib.crc32(w.encode("utf-8")) % buckets for w in _WORD.findall(prompt.lower())]


class TextEncoder(ABC):
    """Turns prompts into token embeddings `(B, L, dim)` and a validity mask `(B, L)`."""

    dim: int
    max_len: int

    @abstractmethod
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


def tokenize(prompts: list[str], config: TextEncoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Text ids framed by BOS/EOS, padded to `max_len`: ids `(B, L)` int64 and mask `(B, L)` bool."""
    pad, bos, eos = config.base, config.base + 1, config.base + 2
    ids = torch.full((len(prompts), config.max_len), pad, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        data = token_ids(prompt, config.tokenizer, config.buckets)
        if len(data) + 2 > config.max_len:
            raise ValueError(
                f"prompt is {len(data)} {TOKEN_UNITS[config.tokenizer]}; "
                f"this model takes at most {config.max_len - 2}"
            )
        ids[i, : len(data) + 2] = torch.tensor([bos, *data, eos])
    return ids, ids != pad


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
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, 4 * config.dim), nn.GELU(), nn.Linear(4 * config.dim, config.dim)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = (
            self.qkv(self.norm1(x)).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        )  # (B, h, L, d)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :]
        )  # (B, h, L, d)
        x = x + self.out(o.transpose(1, 2).reshape(B, L, D))  # (B, L, D)
        return x + self.mlp(self.norm2(x))  # (B, L, D)


class BuiltinTextEncoder(nn.Module, TextEncoder):
    """Token embeddings, learned positions and a few transformer layers."""

    def __init__(self, config: TextEncoderConfig):
        super().__init__()
        self.config = config
        self.dim, self.max_len = config.dim, config.max_len
        self.embed = nn.Embedding(config.vocab_size, config.dim)
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
        ids, mask = tokenize(prompts, self.config)
        ids, mask = ids.to(device), mask.to(device)
        return self(ids, mask), mask
