"""The built-in text encoder: a small transformer over the tokens of `tokens.py`.

A prompt is cut into text ids by the encoder's tokenizer ("bytes" or "words", see tokens.py),
framed by BOS/EOS and padded to `max_len`. The encoder's weights are saved with the model, so a
checkpoint is self-contained.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..initialization import init_module
from .config import TextEncoderConfig
from .tokens import TOKEN_UNITS, token_ids


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
        qkv = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, -1)  # (B, L, 3, h, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (B, h, L, d) each
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :]
        )  # (B, h, L, d)
        x = x + self.out(o.transpose(1, 2).reshape(B, L, D))  # (B, L, D)
        return x + self.mlp(self.norm2(x))  # (B, L, D)


class BuiltinTextEncoder(nn.Module):
    """Token embeddings, learned positions and a few transformer layers."""

    def __init__(self, config: TextEncoderConfig):
        super().__init__()
        self.config = config
        self.dim, self.max_len = config.dim, config.max_len
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Parameter(torch.randn(config.max_len, config.dim) * 0.02)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)

    def init_weights(self) -> None:
        """Fresh random weights, drawn in the order the constructor draws them: the positions
        come between the embedding and the layers, so this module initialises its whole tree."""
        self.embed.reset_parameters()
        with torch.no_grad():
            self.pos.copy_(torch.randn(self.pos.shape) * 0.02)
        for layer in self.layers:
            init_module(layer)
        self.norm.reset_parameters()

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
