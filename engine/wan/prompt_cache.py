"""The prompt's keys and values in Wan's cross-attention, computed once per request, not per step.

A Wan block's cross-attention (`attn2`) projects the embedded prompt to keys and values,
`norm_k(to_k(c))` and `to_v(c)` (and Wan2.1-I2V's image features through `add_k_proj` /
`add_v_proj`), and the prompt embedding `c` is the text embedder's output for the request's UMT5
embeddings: none of it depends on the latents or the timestep. WanPipeline recomputes all of it
at every step, for 512 text tokens a row against a few hundred video tokens: on a small clip the
largest part of a block's multiply-adds. Here each row keeps its keys and values from its first
pass and later passes read them, skipping the text embedder and those projections.

Exactness. A row's keys and values are the same arithmetic on the same inputs whenever they are
computed; the cached ones are bitwise the recomputed ones wherever a Linear's rows do not depend
on the other rows of its batch (true of the CPU's GEMMs measured here; a GPU's GEMM may choose a
different kernel for a different row count, an ulp-level difference). The rest of the pass runs
diffusers' `WanAttnProcessor` op for op.

Validity. A row's entry is tied to its prompt (kept with its request's state), its expert, and
the adapters it ran with: an adapter on `to_k` / `to_v` (or on the text embedder) changes them,
so an entry records the adapter objects and scales of its row and is refilled when they differ
(a name registered again with `replace` is a new object). A pass uses the cache only when every
row has a valid entry; otherwise it runs as without the cache, on the real prompt embeddings,
and (re)fills every row's entry: rows joining a batch cost one ordinary pass.

Where it happens. A pass with kept keys hooks each block (`PromptCache.rows`): before the block
runs, its hook fills the rows' entries from the prompt embeddings when the pass fills (after the
streamer's hook, which has put the block's weights in place), gathers the block's keys and values
of every row, padded to the pass's width, into the processor's `kv`, and hands the block empty
prompt embeddings; the processor attends `kv`. So a block's forward is the same computation
whether its pass fills or reads, which a compiled block (compiled_blocks.py) needs: the hooks run
eagerly around the compiled forward, the gathered tensors are graph inputs, and a first step
(fill) and the steps after it (read) run one graph. Entries' lookups by block index, writes into
the rows' dicts and the prompt's own length stay out of the graph, each of which would otherwise
be a guard and a recompile (one per block, per step kind, per prompt length). A pass that fills
attends what it kept, as the passes after it do: for compact entries (`PromptKV.compact`, fp32: a
prompt's tokens and one padding token) that is within rounding of attending all 512. Compact rows
are padded to a power of two of at least 64 tokens (`pass_width`): a few widths, each a graph.

Memory: `rows x tokens x (keys + values widths) x blocks x bytes` (`entry_bytes`), e.g. 2 rows
(a guided request) x 512 x 2 x 384 x 6 blocks x 4 bytes = 18.9 MB for the benchmark's Wan, and
2 x 512 x 2 x 1536 x 30 x 2 = 189 MB for Wan2.1-1.3B in bf16. The pipeline fills entries only
while its requests' total stays within its budget (`WanVideoPipeline.prompt_cache_bytes`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import TEXT_TOKENS  # the text follows Wan2.1-I2V's image tokens, as in diffusers
from .forward import attention_blocks  # a VACE transformer's VACE blocks cross-attend as well

MIN_WIDTH = 64  # the fewest text tokens of a pass over compact rows (`pass_width`)


@dataclass
class PromptKV:
    """One row's cross-attention keys and values, by block: `(k, v, k_img, v_img)` each
    `(1, tokens, heads, d)` (the image's None without image features), and the adapters
    `(Adapter, scale)` the row ran with when they were computed."""

    adapters: tuple = ()
    length: int = TEXT_TOKENS  # the prompt's tokens: the rest of the 512 are its padding
    compact: bool = False  # keep the prompt's tokens and one padding token (see above)
    blocks: dict[int, tuple] = field(default_factory=dict)

    @property
    def kept(self) -> int:
        """Text tokens kept: 512, or compact the prompt's and one padding token."""
        return min(self.length + 1, TEXT_TOKENS) if self.compact else TEXT_TOKENS

    def valid(self, adapters: tuple, depth: int) -> bool:
        """Whether it holds every block's keys, computed with these adapters and scales."""
        same = len(adapters) == len(self.adapters) and all(
            a is b and s == t for (a, s), (b, t) in zip(adapters, self.adapters)
        )
        return same and len(self.blocks) == depth

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for kv in self.blocks.values() for t in kv if t is not None
        )


def entry_bytes(model: nn.Module, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one row's entry for `model` with `tokens` context tokens (image and text)."""
    width = 0
    for block in attention_blocks(model):
        attn = block.attn2
        width += attn.to_k.out_features + attn.to_v.out_features
    return tokens * width * torch.empty((), dtype=dtype).element_size()


class PromptCacheProcessor:
    """diffusers' `WanAttnProcessor` for a cross-attention that attends the keys and values
    `kv` its block's hook set for the pass (`PromptCache.rows`); plain diffusers without."""

    def __init__(self, index: int, base):
        self.index, self.base = index, base
        self.rows: Sequence[PromptKV] | None = None
        self.fill = False
        self.mask: torch.Tensor | None = None  # compact rows' scores bias `(B, 1, 1, tokens)`
        self.width = TEXT_TOKENS  # text tokens of the pass's keys: rows of fewer padded to it
        # The pass's keys and values `(k, v, k_img, v_img)`, each `(B, tokens, heads, d)`, set
        # before the block runs and dropped after it.
        self.kv: tuple | None = None

    def before(self, block: nn.Module, args: tuple, kwargs: dict):
        """The block's forward pre-hook (eager, after the streamer's: the weights are in place):
        fill the rows' entries from the prompt embeddings when the pass fills, then gather this
        block's keys and values of every row into `kv`, and hand the block empty prompt
        embeddings, as a pass that reads gives it."""
        bound = _signature(type(block)).bind(block, *args, **kwargs)
        context = bound.arguments["encoder_hidden_states"]  # (B, [image +] 512 or 0, D)
        if self.fill:
            k, v, k_img, v_img = _keys_values(block.attn2, context)
            for i, row in enumerate(self.rows):
                text = slice(i, i + 1), slice(0, row.kept)
                row.blocks[self.index] = (
                    k[text].clone(),
                    v[text].clone(),
                    *(None if t is None else t[i : i + 1].clone() for t in (k_img, v_img)),
                )
            bound.arguments["encoder_hidden_states"] = context[:, :0]
        kept = [row.blocks[self.index] for row in self.rows]
        self.kv = (
            # (B, width, heads, d): rows of fewer tokens padded, masked out by `mask`
            *(torch.cat([_pad(kv[j], self.width) for kv in kept]) for j in (0, 1)),
            *(None if kept[0][j] is None else torch.cat([kv[j] for kv in kept]) for j in (2, 3)),
        )
        return bound.args[1:], bound.kwargs

    def after(self, block: nn.Module, args: tuple, output) -> None:
        """The block's forward post-hook: its keys and values of the pass are no longer needed."""
        self.kv = None

    @property
    def _attention_backend(self):
        return self.base._attention_backend

    @property
    def _parallel_config(self):
        return self.base._parallel_config

    @_parallel_config.setter
    def _parallel_config(self, value):
        self.base._parallel_config = value

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if self.kv is None:  # no kept keys this pass: diffusers' own processor
            return self.base(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        # The pass's keys and values of this block, set by `PromptCache`'s hook around it: the
        # prompt embeddings given here are empty (the hook took them).
        k, v, k_img, v_img = self.kv
        attention_mask = self.mask
        # From here on as WanAttnProcessor (cross-attention: no rotary, no context parallel).
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, N, h, d)

        def attend(k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
            out = dispatch_attention_fn(
                query,
                k,
                v,
                attn_mask=mask,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                parallel_config=None,
            )
            return out.flatten(2, 3).type_as(query)  # (B, N, h*d)

        out = attend(k, v, attention_mask)
        if k_img is not None:
            out = out + attend(k_img, v_img)
        return attn.to_out[1](attn.to_out[0](out))


@functools.cache
def _signature(kind: type) -> inspect.Signature:
    return inspect.signature(kind.forward)


def _pad(t: torch.Tensor, tokens: int) -> torch.Tensor:
    """`(1, n, heads, d)` -> `(1, tokens, heads, d)`, zeros after."""
    return (
        t
        if t.shape[1] == tokens
        else torch.nn.functional.pad(t, (0, 0, 0, 0, 0, tokens - t.shape[1]))
    )


def pass_width(rows: Sequence[PromptKV]) -> int:
    """Text tokens of a pass's keys: the rows' most kept, rounded up to a power of two of at least
    `MIN_WIDTH` (at most 512), so that compiled blocks see a few widths, not one per prompt."""
    kept = max(row.kept for row in rows)
    return (
        kept
        if kept == TEXT_TOKENS
        else min(TEXT_TOKENS, max(MIN_WIDTH, 1 << (kept - 1).bit_length()))
    )


def padding_mask(rows: Sequence[PromptKV], dtype: torch.dtype, device) -> torch.Tensor | None:
    """The scores' bias of a pass over compact rows `(B, 1, 1, pass_width)`: 0 on a row's prompt
    tokens, `log(512 - L)` on its padding token, -inf past its kept tokens; None when no row is
    compact (every row keeps all 512)."""
    if not any(row.compact for row in rows):
        return None
    mask = torch.full((len(rows), 1, 1, pass_width(rows)), -math.inf)
    for i, row in enumerate(rows):
        mask[i, ..., : row.kept] = 0
        if row.compact and row.length < TEXT_TOKENS:
            mask[i, ..., row.length] = math.log(TEXT_TOKENS - row.length)
    return mask.to(device, dtype)


def _keys_values(attn: nn.Module, context: torch.Tensor):
    """`WanAttnProcessor`'s keys and values of `context` `(B, [image +] 512, D)`, each `(B,
    tokens, heads, d)`: the text's, then the image's (None without image features)."""
    image = None
    if attn.add_k_proj is not None:
        split = context.shape[1] - TEXT_TOKENS
        image, context = context[:, :split], context[:, split:]
    k = attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1))
    v = attn.to_v(context).unflatten(2, (attn.heads, -1))
    k_img = v_img = None
    if image is not None:
        k_img = attn.norm_added_k(attn.add_k_proj(image)).unflatten(2, (attn.heads, -1))
        v_img = attn.add_v_proj(image).unflatten(2, (attn.heads, -1))
    return k, v, k_img, v_img


class PromptCache:
    """Cross-attention keys and values kept per row across steps, on the blocks of `model` (and
    a VACE transformer's VACE blocks, indexed first)."""

    def __init__(self, model: nn.Module):
        self.processors, self.blocks = [], attention_blocks(model)
        for i, block in enumerate(self.blocks):
            processor = PromptCacheProcessor(i, block.attn2.processor)
            block.attn2.set_processor(processor)
            self.processors.append(processor)

    @property
    def depth(self) -> int:
        return len(self.processors)

    @contextlib.contextmanager
    def rows(
        self, rows: Sequence[PromptKV] | None, *, fill: bool, dtype=torch.float32, device="cpu"
    ) -> Iterator[None]:
        """Inside, the cross-attentions of a pass over `rows` write each row's keys and values
        (`fill`, from the prompt embeddings they are given) or read them (the embeddings they
        are given are ignored); `dtype` and `device` are the pass's. None: diffusers' own
        processor."""
        if rows is None:
            yield
            return
        mask, width = padding_mask(rows, dtype, device), pass_width(rows)
        hooks = []
        for p, block in zip(self.processors, self.blocks):
            p.rows, p.fill, p.mask, p.width = rows, fill, mask, width
            # Registered for the pass, so that they run after the streamer's hooks (which put
            # the block's weights in place: a fill reads `to_k` and `to_v`).
            hooks.append(block.register_forward_pre_hook(p.before, with_kwargs=True))
            hooks.append(block.register_forward_hook(p.after, always_call=True))
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
            for p in self.processors:
                p.rows, p.fill, p.mask, p.kv = None, False, None, None

    def remove(self, model: nn.Module) -> None:
        """Put diffusers' processors back."""
        for p, block in zip(self.processors, attention_blocks(model)):
            block.attn2.set_processor(p.base)
