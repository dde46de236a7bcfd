"""Weight formats of the host store: how a streamed block's bytes are kept in RAM and cross the bus.

A format is a codec of the host store (encode once when the store is filled, decode in the
device slot just before the block computes), so the streamer copies a block's payload and asks
the store to decode it, and neither it nor the model knows which format is in use:

- `raw`: the block's flat buffer as it is (the default; the store is `HostBlockStore`).
- `lossless`: the flat buffer as 16-bit words with entropy-coded exponents (DFloat; format and
  kernels in `kernels/dfloat_reference.py` and `kernels/dfloat.py`). Bitwise the original after
  decoding, so outputs are bitwise those of `raw`; about 0.68x the bytes of trained bf16 weights.
  On fp32 weights (the CPU default) it is still exact but saves little (0.90x on the default
  model: the low halves of fp32 words are mantissa noise).
- `fp8`: every 2-D tensor named `*.weight` (the block's linear layers) as float8_e4m3fn with one
  power-of-two scale per output row (an int8 exponent: the row's largest magnitude lands in
  (224, 448]), dequantized into the slot in the compute dtype; every other tensor raw. Lossy:
  quality is measured in benchmarks/compression.py. A linear weight that its checkpoint already
  stores in fp8 (ComfyUI's fp8 single files: `Fp8Weight`, offered by the source's `stored_fp8`)
  keeps the file's bytes and its float scale (one per tensor or per row) instead: decoded as
  `(q.float() * scale).to(dtype)`, the very product the raw store computes when it upcasts the
  file on load, so the frames are bitwise those of `raw` on the same file.

With `fp8_matmul` (fp8_matmul.py) the decode is asked to leave the linear weights it keeps in
e4m3fn out of the slot and hands them back as `Fp8Operand`s (views of the payload's device copy,
with fp32 row scales) for their layers to multiply by.

`make_store(tensors, pinned, weights)` builds the store for a block; `EncodedBlockStore` is the
coded one. Its `payload` is what one copy moves; `decode(staging, out)` queues the decode on the
current stream, reading the payload's device copy in `staging` and writing the block's flat
layout into `out` (a slot). Over several devices one process encodes each block once and moves
the payload into shared memory (`share`, a `SharedPayload`); every rank `attach`es a store to it
and decodes into its own slots: one coded copy per host.

Caution: a coded store is read-only between fills (`tensors()` raises): fine-tuning, which
writes updated weights into the host store every step, needs `raw`. `fill` decodes, overwrites
and re-encodes the whole block, so filling tensor by tensor from many calls is slow (the loader
fills each block once).
"""

from __future__ import annotations

import dataclasses
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...kernels.dfloat import dfloat_decode
from ...kernels.dfloat_reference import dfloat_encode
from ...kernels.fp8_decode import fp8_decode_available, fp8_rows_decode
from ..placement import WEIGHT_FORMATS
from .fp8_matmul import Fp8Operand
from .host_store import (
    ALIGN_BYTES,
    BoundTensor,
    HostBlockStore,
    TensorEntry,
    fill_views,
    pack,
    pin_exact,
    unpin,
)

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclasses.dataclass(frozen=True)
class Part:
    """One tensor of a payload: where it sits in the payload's flat bytes."""

    offset: int  # bytes, a multiple of ALIGN_BYTES
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype)


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A weight as an fp8 checkpoint stores it: fp8 values and the float scale that restores them."""

    q: torch.Tensor  # float8_e4m3fn or float8_e5m2, the checkpoint's shape (out, ...)
    scale: torch.Tensor  # float32: () for one scale per tensor, (out,) for one per output row
    key: str  # where it came from, for messages

    def __post_init__(self):
        if self.q.dtype not in FP8_DTYPES:
            raise ValueError(f"{self.key}: {self.q.dtype} is not an fp8 dtype")
        per_row = self.scale.dim() == 1 and self.q.dim() > 0 and len(self.scale) == len(self.q)
        if self.scale.dtype != torch.float32 or not (self.scale.dim() == 0 or per_row):
            raise ValueError(
                f"{self.key}: scale {tuple(self.scale.shape)} {self.scale.dtype} fits no layout "
                f"of a {tuple(self.q.shape)} weight: one float32 value, or one per output row"
            )

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """`q * scale` in fp32, then cast to `dtype`: what loading the checkpoint computes (the
        reference the slot decode runs)."""
        scale = self.scale.view(-1, *([1] * (self.q.dim() - 1))) if self.scale.dim() else self.scale
        return (self.q.float() * scale).to(dtype)


class WeightCodec(ABC):
    """Encodes a block's flat buffer into payload tensors and decodes them into a slot."""

    name: str
    lossless: bool
    keeps_fp8 = False  # whether `encode` takes weights a checkpoint stores in fp8 as they are

    @abstractmethod
    def encode(
        self,
        raw: torch.Tensor,
        entries: Sequence[TensorEntry],
        stored: Mapping[int, Fp8Weight] = {},  # noqa: B006 (read only)
    ) -> tuple[list[torch.Tensor], Any]:
        """`raw`: the block's flat uint8 buffer (host). Returns the payload tensors (host, any
        dtypes) and what `decode` needs besides them (host-side metadata, never copied).
        `stored`: entries (by index) kept as their checkpoint's fp8, where `keeps_fp8`; their
        bytes in `raw` are not read."""

    def stored(self, parts: Sequence[torch.Tensor], meta: Any) -> dict[int, Fp8Weight]:
        """The entries `encode` was given as stored fp8, from the payload (views into `parts`)."""
        return {}

    @abstractmethod
    def decode(
        self,
        parts: Sequence[torch.Tensor],
        meta: Any,
        out: torch.Tensor,
        matmul: frozenset[int] = frozenset(),
    ) -> dict[int, Fp8Operand]:
        """Write the block's flat buffer into `out` (uint8, `(nbytes,)`, on the parts' device)
        from the payload tensors, queued on the current stream. `matmul`: entries (by index)
        whose layers multiply by fp8 operands (fp8_matmul.py); those the codec keeps as such are
        left out of `out` and returned as `Fp8Operand`s (views of `parts`), by index."""


class LosslessCodec(WeightCodec):
    """Entropy-coded exponents of 16-bit words (DFloat); bitwise exact."""

    name = "lossless"
    lossless = True

    def encode(self, raw, entries, stored={}):  # noqa: B006 (read only)
        assert not stored, "the lossless store takes no fp8 weights"
        coded = dfloat_encode(raw)
        return list(coded.parts()), coded.num_words

    def decode(self, parts, meta, out, matmul=frozenset()):
        sm, table, lane_offsets, stream = parts
        dfloat_decode(sm, table, lane_offsets, stream, out[: 2 * meta].view(torch.int16))
        return {}


def fp8_quantizable(entry: TensorEntry) -> bool:
    """A linear layer's weight: a floating 2-D `*.weight` parameter stored row-major."""
    return (
        entry.kind == "param"
        and len(entry.shape) == 2
        and entry.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and any(n.rsplit(".", 1)[-1] == "weight" for n in entry.names)
        and entry.stride == (entry.shape[1], 1)
        and entry.shape[0] * entry.shape[1] > 0
    )


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, exponent): `q` float8_e4m3fn `(out, in)`, `exponent` int8 `(out,)`, with
    `w ~ q * 2**exponent`.

    Each row's scale is the power of two that brings its largest magnitude into (224, 448]
    (448 is e4m3fn's largest finite value): one byte a row where an fp32 scale took four, and
    since e4m3fn is itself floating point, a power-of-two scale costs no precision in its normal
    range (at most one binade at the bottom, below 2**-6 of the row's scale unit). Dequantizing
    is exact: a power-of-two product. An all-zero row gets exponent 0. Values are rounded to
    nearest by the cast."""
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1)
    exponent = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-126, 127)
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))
    # log2 rounds: where the power it gave leaves the row's maximum above 448, take the next.
    exponent += (amax / torch.exp2(exponent) > FP8_MAX).float()
    q = (w32 / torch.exp2(exponent)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, exponent.to(torch.int8)


def fp8_dequantize(q: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q * 2**exponent` per row in fp32 (exact), then cast to `dtype` (the reference the slot
    decode runs)."""
    return (q.float() * torch.exp2(exponent.float())[:, None]).to(dtype)


@dataclasses.dataclass(frozen=True)
class _Kept:
    """How `Fp8Codec` keeps entry `k` of a block, and the payload parts it takes, in order."""

    k: int
    how: str  # "raw": its bytes as stored (own strides); "exp2": q, int8 exponents (fp8_quantize);
    # "stored": the checkpoint's fp8 q (as uint8) and its float32 scale (an `Fp8Weight`)
    fp8: torch.dtype | None = None  # "stored": the checkpoint's fp8 dtype
    per_row: bool = False  # "stored": one scale per output row, else one in all
    key: str = ""  # "stored": where it came from

    @property
    def nparts(self) -> int:
        return 1 if self.how == "raw" else 2


class Fp8Codec(WeightCodec):
    """Linear weights as float8_e4m3fn with a power-of-two scale per output channel (one int8
    exponent), or as their checkpoint stores them in fp8 with its float scale; the rest raw."""

    name = "fp8"
    lossless = False
    keeps_fp8 = True

    def encode(self, raw, entries, stored={}):  # noqa: B006 (read only)
        parts, plan = [], []
        for k, entry in enumerate(entries):
            if k in stored:
                w = stored[k]
                parts += [w.q.contiguous().view(torch.uint8).reshape(-1), w.scale.reshape(-1)]
                plan.append(_Kept(k, "stored", w.q.dtype, w.scale.dim() == 1, w.key))
            elif fp8_quantizable(entry):
                q, scale = fp8_quantize(entry.view(raw))
                parts += [q.view(torch.uint8).reshape(-1), scale]
                plan.append(_Kept(k, "exp2"))
            else:
                parts.append(raw[entry.offset : entry.offset + entry.nbytes].clone())
                plan.append(_Kept(k, "raw"))
        return parts, (tuple(entries), tuple(plan))

    def decode(self, parts, meta, out, matmul=frozenset()):
        entries, plan = meta
        operands = {}
        # Where the Triton kernel runs (CUDA), every quantized weight of one dtype decodes in one
        # launch and the raw tensors copy in one foreach call (kernels/fp8_decode.py); elsewhere
        # each weight decodes by itself, through the same arithmetic.
        fused = fp8_decode_available(out.device)
        rows: dict[torch.dtype, list] = {}
        raw_out, raw_in = [], []
        it = iter(parts)
        for kept in plan:
            entry = entries[kept.k]
            taken = [next(it) for _ in range(kept.nparts)]
            if kept.how == "raw":
                raw_out.append(out[entry.offset : entry.offset + entry.nbytes])
                raw_in.append(taken[0])
            elif kept.how == "exp2":
                q = taken[0].view(torch.float8_e4m3fn).view(entry.shape)
                if kept.k in matmul:
                    operands[kept.k] = Fp8Operand(q, torch.exp2(taken[1].float()))
                elif fused:
                    at = entry.offset // entry.dtype.itemsize
                    rows.setdefault(entry.dtype, []).append(
                        (taken[0].view(entry.shape), taken[1], at)
                    )
                else:
                    entry.view(out).copy_(fp8_dequantize(q, taken[1], entry.dtype))
            else:
                w = self._stored(taken, entry, kept)
                if kept.k in matmul and w.q.dtype == torch.float8_e4m3fn:
                    scale = w.scale if kept.per_row else w.scale.expand(entry.shape[0]).contiguous()
                    operands[kept.k] = Fp8Operand(w.q, scale)
                    continue
                entry.view(out).copy_(w.dequantize(entry.dtype))
        if raw_out:
            torch._foreach_copy_(raw_out, raw_in)
        for dtype, weights in rows.items():
            fp8_rows_decode(weights, out, dtype)
        return operands

    def stored(self, parts, meta):
        entries, plan = meta
        found, it = {}, iter(parts)
        for kept in plan:
            taken = [next(it) for _ in range(kept.nparts)]
            if kept.how == "stored":
                found[kept.k] = self._stored(taken, entries[kept.k], kept)
        return found

    @staticmethod
    def _stored(taken: Sequence[torch.Tensor], entry: TensorEntry, kept: _Kept) -> Fp8Weight:
        q, scale = taken
        scale = scale if kept.per_row else scale[0]
        return Fp8Weight(q.view(kept.fp8).view(entry.shape), scale, kept.key)


def fp8_payload_nbytes(entries: Sequence[TensorEntry]) -> int:
    """Bytes of a block's fp8 payload, from its layout alone (what `Fp8Codec` and the store
    write: every part 64-byte aligned), so the format's size is known for any block shape."""
    cursor = 0
    for entry in entries:
        sizes = [entry.nbytes]
        if fp8_quantizable(entry):
            sizes = [entry.shape[0] * entry.shape[1], entry.shape[0]]  # q, int8 exponents
        for n in sizes:
            cursor = _round_up(cursor, ALIGN_BYTES) + n
    return _round_up(cursor, ALIGN_BYTES)


CODECS: dict[str, WeightCodec] = {"lossless": LosslessCodec(), "fp8": Fp8Codec()}


def codec(name: str) -> WeightCodec | None:
    """The codec of a weight format (None for `raw`); ValueError names the known formats."""
    if name == "raw":
        return None
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(
            f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {name!r}"
        ) from None


@dataclasses.dataclass(frozen=True)
class SharedPayload:
    """A coded block's host store as another process can adopt it (`EncodedBlockStore.attach`):
    its payload in shared memory and what decoding it needs (pickled, the payload travels as a
    handle, the rest as small host-side metadata)."""

    weights: str  # the codec's name
    payload: torch.Tensor  # flat uint8, in shared memory
    parts: tuple[Part, ...]
    meta: Any


def _placeholder(entry: TensorEntry) -> torch.Tensor:
    """What a released tensor of a coded block points at: its shape and dtype, no memory
    (stride 0), NaN where the dtype has one, so a stray use outside the block's load shows."""
    fill = float("nan") if entry.dtype.is_floating_point else 0
    return torch.full((), fill, dtype=entry.dtype).expand(entry.shape)


class EncodedBlockStore:
    """One block's tensors kept coded in host RAM: a payload buffer (optionally pinned) that one
    copy moves, and the codec that decodes it into a slot."""

    encoded = True

    def __init__(self, entries: Sequence[TensorEntry], nbytes: int, codec: WeightCodec, pinned):
        self.entries = tuple(entries)
        self.nbytes = nbytes  # of the decoded flat layout (what a slot holds)
        self.codec = codec
        self.pinned = pinned
        self.payload = torch.empty(0, dtype=torch.uint8)
        self.parts: tuple[Part, ...] = ()
        self.meta: Any = None
        self.filled = False  # nothing encoded yet: the block was built on meta
        self._pending: torch.Tensor | None = None  # raw bytes awaiting their first fill
        self._finalizer = None
        self.views = tuple(_placeholder(e) for e in self.entries)

    @classmethod
    def adopt(
        cls, tensors: Sequence[BoundTensor], codec: WeightCodec, pinned: bool = False
    ) -> EncodedBlockStore:
        """Encode `tensors` (a block's) into a new store and point them at placeholders; meta
        tensors are encoded when `fill` gives them values."""
        entries, nbytes = pack(tensors)
        store = cls(entries, nbytes, codec, pinned)
        if not all(b.tensor.is_meta for b in tensors):
            raw = torch.zeros(nbytes, dtype=torch.uint8)
            for bound, entry in zip(tensors, entries):
                if not bound.tensor.is_meta:
                    entry.view(raw).copy_(bound.tensor.detach())
            if any(b.tensor.is_meta for b in tensors):
                # Tensors a block computed for itself (rotary tables, say) are real already while
                # its weights are still on meta: keep them raw until `fill` brings the rest.
                store._pending = raw
            else:
                store._encode(raw)
        for bound, view in zip(tensors, store.views):
            _repoint_placeholder(bound.tensor, view)
        return store

    @classmethod
    def attach(
        cls, tensors: Sequence[BoundTensor], shared: SharedPayload, pinned: bool = False
    ) -> EncodedBlockStore:
        """A store over `shared`, a coded payload another process encoded from `tensors`' block
        (`share`), with the tensors pointed at placeholders: nothing is encoded or copied."""
        entries, nbytes = pack(tensors)
        store = cls(entries, nbytes, codec(shared.weights), pinned)
        store._adopt_payload(shared.payload, shared.parts, shared.meta)
        for bound, view in zip(tensors, store.views):
            _repoint_placeholder(bound.tensor, view)
        return store

    def share(self) -> SharedPayload:
        """This store's payload moved into shared memory (in place: the store keeps using it),
        for processes this one spawns to `attach`; ValueError for a store never filled."""
        if not self.filled or self._pending is not None:
            raise ValueError("a coded store is shared once its block is filled")
        # `share_memory_` moves the storage in place; a pinned payload would lose its pinning.
        if self.pinned:
            raise ValueError("share a coded store before pinning it (open it on the CPU)")
        return SharedPayload(self.codec.name, self.payload.share_memory_(), self.parts, self.meta)

    @property
    def payload_nbytes(self) -> int:
        return self.payload.numel()

    def _adopt_payload(self, payload: torch.Tensor, parts: Sequence[Part], meta: Any) -> None:
        """Make `payload` (encoded as `parts` and `meta` say) the store's, pinned if asked."""
        self.close()
        if self.pinned:
            pin_exact(payload)
            self._finalizer = weakref.finalize(self, unpin, payload.data_ptr(), payload.numel())
            self._finalizer.atexit = False  # at exit the driver unpins; the context may be gone
        self.payload, self.parts, self.meta, self.filled = payload, tuple(parts), meta, True

    def _encode(self, raw: torch.Tensor, stored: Mapping[int, Fp8Weight] = {}) -> None:  # noqa: B006
        tensors, meta = self.codec.encode(raw, self.entries, stored)
        parts, cursor = [], 0
        for t in tensors:
            offset = _round_up(cursor, ALIGN_BYTES)
            parts.append(Part(offset, t.dtype, t.numel()))
            cursor = offset + t.numel() * t.element_size()
        payload = torch.empty(_round_up(cursor, ALIGN_BYTES), dtype=torch.uint8)
        for part, t in zip(parts, tensors):
            part.view(payload).copy_(t.reshape(-1))
        self._adopt_payload(payload, parts, meta)

    def after_copy(self, ordering) -> None:
        """The copy from `payload` has been queued (nothing to do: the payload is the store's)."""

    def read(self) -> torch.Tensor:
        """The block's flat buffer, decoded on the host (uint8, `(nbytes,)`)."""
        if self._pending is not None:
            return self._pending.clone()
        raw = torch.zeros(self.nbytes, dtype=torch.uint8)
        if self.filled:
            self.codec.decode([p.view(self.payload) for p in self.parts], self.meta, raw)
        return raw

    def decode(
        self, staging: torch.Tensor, out: torch.Tensor, matmul: frozenset[int] = frozenset()
    ) -> dict[int, Fp8Operand]:
        """Decode the payload's copy in `staging` into `out` (a slot), on the current stream;
        the entries in `matmul` the codec keeps in fp8 come back as operands instead
        (`WeightCodec.decode`)."""
        return self.codec.decode([p.view(staging) for p in self.parts], self.meta, out, matmul)

    def fill(self, source: Mapping[str, torch.Tensor], prefix: str = "") -> set[int]:
        """Like `HostBlockStore.fill`; the block is decoded, overwritten and re-encoded. Linear
        weights that `source` stores in fp8 (its `stored_fp8(key)` gives an `Fp8Weight`) are
        kept as they are where the codec can (`fp8`); any other codec refuses them."""
        keys = [n for e in self.entries for n in e.names]
        if not any(prefix + n in source for n in keys):
            return set()
        raw = self._pending if self._pending is not None else self.read()
        # Weights kept as stored before, which this fill does not replace, stay as they are.
        stored = {}
        if self._pending is None and self.filled:
            stored = self.codec.stored([p.view(self.payload) for p in self.parts], self.meta)
        self._pending = None
        given = self._stored_fp8(source, prefix)
        rest = [k for k in range(len(self.entries)) if k not in given]
        views = [e.view(raw) for e in self.entries]
        filled = fill_views(
            [self.entries[k] for k in rest], [views[k] for k in rest], source, prefix
        )
        filled = {rest[i] for i in filled} | set(given)
        stored = {k: w for k, w in stored.items() if k not in filled} | given
        self._encode(raw, stored)
        return filled

    def _stored_fp8(self, source: Mapping[str, torch.Tensor], prefix: str) -> dict[int, Fp8Weight]:
        """The entries `source` stores in fp8 that this store keeps so (by index)."""
        stored_fp8 = getattr(source, "stored_fp8", None)
        if stored_fp8 is None:
            return {}
        found = {}
        for k, entry in enumerate(self.entries):
            key = next((prefix + n for n in entry.names if prefix + n in source), None)
            w = stored_fp8(key) if key is not None else None
            if w is None:
                continue
            if not self.codec.keeps_fp8:
                raise ValueError(
                    f"{w.key} is stored in fp8: weights={self.codec.name!r} would keep it "
                    "decoded, in more bytes than the file's; weights='fp8' keeps the file's "
                    "bytes (bitwise the video of weights='raw', which upcasts them on load)"
                )
            if not fp8_quantizable(entry):
                continue  # not a linear layer's weight: upcast into the raw bytes, as `raw` does
            if tuple(w.q.shape) != entry.shape:
                raise ValueError(f"{key!r}: checkpoint shape {tuple(w.q.shape)} != {entry.shape}")
            found[k] = w
        return found

    def tensors(self) -> dict[str, torch.Tensor]:
        raise ValueError(
            f"the host store holds {self.codec.name} weights, which cannot be written in place: "
            "fine-tuning needs weights='raw'"
        )

    def close(self) -> None:
        """Unpin the payload (if pinned)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None


def _repoint_placeholder(t: torch.Tensor, placeholder: torch.Tensor) -> None:
    if t.is_meta:
        other = placeholder
        if isinstance(t, torch.nn.Parameter):
            other = torch.nn.Parameter(other, requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, other)
    else:
        t.data = placeholder


def make_store(
    tensors: Sequence[BoundTensor], pinned: bool, weights: str = "raw"
) -> HostBlockStore | EncodedBlockStore:
    """The host store of one streamed block in weight format `weights`."""
    c = codec(weights)
    if c is None:
        return HostBlockStore.adopt(tensors, pinned)
    return EncodedBlockStore.adopt(tensors, c, pinned)
