"""CPU AdamW for host-resident master weights (fp32, or a compact format), one block at a time.

The math is torch.optim.AdamW exactly as documented at
https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html (amsgrad=False, maximize=False).
For each parameter p with gradient g, at step t (counted from 1):

    p   = p * (1 - lr * weight_decay)            # decoupled weight decay, before the moments
    m   = beta1 * m + (1 - beta1) * g            # first moment
    v   = beta2 * v + (1 - beta2) * g * g        # second moment
    m_hat = m / (1 - beta1 ** t)                 # bias corrections
    v_hat = v / (1 - beta2 ** t)
    p   = p - lr * m_hat / (sqrt(v_hat) + eps)   # eps is added after the square root

The arithmetic is not ours: every update of the fp32 state runs torch's own fused CPU kernel
(`torch._fused_adamw_`, the kernel behind `torch.optim.AdamW(fused=True)`; present on the CPU since
torch 2.4, the project's floor, so there is no slower fallback path), and with one micro-batch and
no clipping the result is bitwise that of `torch.optim.AdamW(fused=True)` (tested); the compact
formats' own kernel repeats that kernel's operations (below). What this module adds is the
machinery the fine-tuning loop needs around it:

* Blocks. Parameters come as an ordered mapping ``block_id -> {name: fp32 tensor}`` and
  `CPUAdamW.step_block` updates one block, so the loop can update block i while the GPU computes
  the gradients of block i-1.
* The compute-dtype copy. `step_block(..., out=...)` writes ``master.to(out.dtype)`` into the given
  buffers in the same pass: parameters are processed in chunks of `chunk_numel` elements and each
  chunk is cast right after its update, while it is still in cache, so the cast costs the 2 B/param
  write but not a second read of the fp32 master from memory.
* Parameter groups: weight decay applies to tensors with ndim >= 2; 1-D tensors (norm scales,
  biases) get none, unless `decay_filter` says otherwise.
* Gradient accumulation over `accumulation_steps` micro-batches into an fp32 host buffer; the step
  uses the mean of the micro-batch gradients (the gradient of the mean loss, what torch users get by
  calling ``(loss / k).backward()`` k times).
* Optional global-norm clipping as `torch.nn.utils.clip_grad_norm_` does it (see "Clipping" below).
* `state_dict` / `load_state_dict` with m, v (or a compact format's stores) and the step
  counts, for exact resume.

State formats (`state=`, state_format.py; the codecs in compact.py). The default "fp32" is the
above: fp32 master, m and v, 12 B/param plus the 2 B compute copy. A compact format
"<master>/<moments>" stores less and runs one of two update paths (`update_path` says which):

* "native": a fused CPU kernel (compact_kernel.py), built with the system compiler on first use
  and cached, does per element what the torch-ops path does per chunk (decode, AdamW, encode:
  the same codes, the same random bits, the arithmetic of torch's vectorized kernel) in one pass
  over memory, as fast as the fp32 format or faster. It may differ from the torch-ops path in
  the last bit where torch's kernel runs its scalar tail (tests/test_optim_native.py).
* "torch-ops", when the kernel cannot be built or ``MEGASLIDE_NATIVE_OPTIM=0``: per chunk, each
  worker decodes the master (bf16 halves joined, or bf16 widened) and the moments (8-bit codes
  times their block absmax) into its own fp32 buffers, calls `torch._fused_adamw_` on them, and
  encodes the result back (split into halves, or rounded to bf16 stochastically; m and v
  re-quantized): about forty torch ops per chunk instead of one kernel call, 0.1-0.6x the fp32
  format's speed (benchmarks/optimizer.py).

Either way the update's arithmetic is torch's AdamW; only storage and rounding differ. With a bf16
master ("bf16-split", "bf16-sr") the caller hands bf16 tensors, which the optimizer updates in
place and which are the compute copy themselves: `master_dtype` says so and `out=` is refused.
Chunks of a compact format are cut at multiples of 256 elements inside each tensor (a tensor's
tail is padded in scratch), so quantization blocks never straddle tensors and the result does
not depend on chunk size or thread count. Stochastic rounding draws its bits from a hash of
(seed, step, block, tensor, element), so a resumed run rounds exactly as an uninterrupted one.

The disk tier (``state_tier="disk"``, optim_disk.py): the per-tensor state only the optimizer
reads (m and v or their codes; a bf16-split master's low halves) lives in files under
`state_dir`, and `step_block` runs on a ring buffer its I/O thread read ahead of the update and
writes back behind it. `state_order` is the order the caller steps blocks in (default: the
backward's, last block first); stepping out of it is correct, only slower (a block is then read
on demand). The update is the same code on the same bytes, so results are bitwise the RAM
tier's; `state_dict` returns views of the files (mapped, after everything was written back) and
`load_state_dict` writes into them. Host RAM for that state: `ring_nbytes`.

Clipping: the clipping coefficient depends on the norm of the gradient of *every* block, and no
block may be updated before it is known. We hold all gradients: with clipping on, every block's
gradients (all micro-batches) go into its fp32 host buffer via `accumulate`, the global norm is
taken once all blocks are in, and only then are blocks stepped (``step_block(block_id)`` without
grads). Extra host memory: one fp32 gradient buffer for the whole model, 4 B/param
(`clipping_extra_bytes`); with accumulation_steps > 1 that buffer exists anyway and clipping costs
nothing more. The price is time, not memory: with clipping the updates cannot overlap the backward
pass. (The alternative, a second backward pass that only measures the norm, costs no memory but a
whole extra backward; we do not implement it.) With clipping on, a non-finite global norm raises
`FloatingPointError` before any weight changes.

Threads: updates and accumulation run on `threads` worker threads owned by the optimizer (default:
torch's intra-op thread count at construction); the calls block until the workers are done. Each worker runs
torch ops single-threaded and pulls chunks from a shared cursor, so one worker can cast a chunk
while another streams the next update through memory, and a worker whose core is taken by someone
else simply does fewer chunks. (Running the kernels on torch's intra-op pool instead puts an OpenMP
barrier in every chunk; with one core busy elsewhere that was several times slower here.)
`torch.set_num_threads` is process-wide in torch's bookkeeping, but under torch's OpenMP backend
(the Linux builds) the count it sets is kept per calling thread: each worker sets 1 for itself when
it starts and the constructing thread then restores its previous value, so the rest of the process
keeps its setting. Do not change torch's thread count from another thread while an optimizer is
being constructed.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from . import compact, compact_kernel
from .finetune_spec import OptimizerSpec
from .optim_disk import DEFAULT_STATE_RING_DEPTH, StateLayout, StateRing
from .state_format import QUANT_BLOCK, StateFormat

FP32_BYTES = 4

# The fused kernel splits each tensor into 64-byte cache-line units (16 fp32) and runs 16-wide
# vectors with a scalar tail; cutting tensors at multiples of 64 elements keeps the vector/tail
# split, and therefore the rounding, identical to one call on the whole tensor.
_CHUNK_ALIGN = 64

FP32_CHUNK_NUMEL = 1 << 19  # fp32 state: one streaming pass, large chunks amortize the calls
# Compact formats decode a chunk into fp32 scratch (master, m, v and integer temporaries, about
# 50 B per element) with ~40 torch ops per chunk: 128K elements (6 MB, in L3) was the fastest
# here; smaller chunks pay more per-op dispatch, larger ones fall out of cache.
COMPACT_CHUNK_NUMEL = 1 << 17
# The fused kernel (compact_kernel.py) needs no scratch and keeps each 256-element block in
# registers and L1, so chunk size only sets the per-call overhead (a few microseconds of Python
# per slice) against the balance between workers.
NATIVE_CHUNK_NUMEL = 1 << 18

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def default_decay_filter(name: str, param: Tensor) -> bool:
    """Decay matrices and conv kernels (ndim >= 2); not 1-D norm scales and biases."""
    return param.ndim >= 2


def grad_buffer_bytes(
    num_params: int, *, accumulation_steps: int = 1, max_grad_norm: float | None = None
) -> int:
    """Host bytes of the fp32 gradient buffer: needed for accumulation or clipping, else none."""
    needed = accumulation_steps > 1 or max_grad_norm is not None
    return FP32_BYTES * num_params if needed else 0


def clipping_extra_bytes(num_params: int, *, accumulation_steps: int = 1) -> int:
    """Host bytes that turning on global-norm clipping adds: the whole-model fp32 gradient buffer
    (4 B/param) when there is no accumulation, nothing when accumulation already holds one."""
    return FP32_BYTES * num_params if accumulation_steps == 1 else 0


@dataclass
class _Chunk:
    """At most `chunk_numel` elements of one block, as 1-D slices of one or more parameters,
    all with the same weight decay. Views of p, m and v are built once; grads are sliced per
    step."""

    weight_decay: float
    slices: list[tuple[str, int, int]]  # (name, start, end) in the flattened parameter
    params: list[Tensor]
    m: list[Tensor]  # fp32 moments; empty with 8-bit moments
    v: list[Tensor]
    g: list[Tensor] | None = None  # views of the block's gradient buffer, once it exists
    # Compact formats: where each slice sits in the worker's scratch (slices padded to
    # QUANT_BLOCK), the scratch length, and views of the stored halves and codes.
    offsets: list[int] | None = None
    widths: list[int] | None = None  # slice lengths padded to QUANT_BLOCK
    padded: int = 0
    lo: list[Tensor] | None = None  # bf16-split: low halves, int16
    codes: list[Tensor] | None = None  # 8-bit: (2, padded slice) uint8 views of m and sqrt(v)
    absmax: list[Tensor] | None = None  # 8-bit: (2, padded slice / 256) fp32 views
    keys: list[int] | None = None  # bf16-sr: tensor index within the block, for the hash


def _bind_chunk(c: _Chunk, b: _Block) -> None:
    """Point a chunk's state views (m, v; lo; codes, absmax) at its block's state tensors."""
    c.m = [b.m[n].view(-1)[a:e] for n, a, e in c.slices] if b.m else []
    c.v = [b.v[n].view(-1)[a:e] for n, a, e in c.slices] if b.v else []
    c.lo = [b.lo[n].view(-1)[a:e] for n, a, e in c.slices] if b.lo is not None else None
    c.codes = c.absmax = None
    if b.codes is not None:  # 8-bit state is stored padded: the chunk's padded widths
        q = QUANT_BLOCK
        c.codes = [b.codes[n][:, a : a + w] for (n, a, _), w in zip(c.slices, c.widths)]
        c.absmax = [
            b.absmax[n][:, a // q : (a + w) // q] for (n, a, _), w in zip(c.slices, c.widths)
        ]


@dataclass
class _Block:
    """Optimizer state of one block."""

    params: dict[str, Tensor]  # masters (fp32, or bf16), owned by the caller, updated in place
    m: dict[str, Tensor]  # fp32 moments (empty with 8-bit moments)
    v: dict[str, Tensor]
    step: Tensor  # 0-dim fp32: the form the fused kernel reads the step count in
    chunks: list[_Chunk]
    index: int = 0  # registration order, for the stochastic rounding key
    lo: dict[str, Tensor] | None = None  # bf16-split: the masters' low halves
    codes: dict[str, Tensor] | None = None  # 8-bit: (2, numel padded to 256) uint8
    absmax: dict[str, Tensor] | None = None  # 8-bit: (2, padded numel / 256) fp32
    grad_buf: dict[str, Tensor] | None = None  # fp32 sums of micro-batch gradients
    micro: int = 0  # micro-batches accumulated since the last step of this block
    norms: Tensor | None = None  # (n_tensors,) per-tensor norms of grad_buf, for clipping
    layout: StateLayout | None = None  # disk tier: the state's flat layout in its file


class CPUAdamW:
    """AdamW on host fp32 masters, one block at a time, writing the compute-dtype copy.

    Usage in a streamed backward (k = accumulation_steps, no clipping)::

        opt = CPUAdamW({i: block_params(i) for i in range(n_blocks)}, lr=1e-4, weight_decay=0.01)
        for micro in range(k):
            for i in reversed(range(n_blocks)):      # gradients arrive block by block
                grads = ...                          # {name: CPU tensor}, fp32 or bf16
                if micro < k - 1:
                    opt.accumulate(i, grads)
                else:
                    opt.step_block(i, grads, out=bf16_copy(i))

    With clipping, every micro-batch of every block goes to `accumulate`, then
    ``opt.step_block(i, out=...)`` for each block (see the module docstring).
    """

    @classmethod
    def from_spec(
        cls, blocks: Mapping[Hashable, Mapping[str, Tensor]], spec: OptimizerSpec, **options
    ) -> CPUAdamW:
        """The optimizer a fine-tuning spec's optimizer section asks for (`options`: threads,
        chunk_numel, decay_filter, seed, state_order, ring_depth)."""
        return cls(
            blocks,
            lr=spec.lr,
            betas=spec.betas,
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            accumulation_steps=spec.grad_accum,
            max_grad_norm=spec.max_grad_norm,
            state=spec.state,
            state_tier=spec.state_tier,
            state_dir=spec.state_dir,
            **options,
        )

    def __init__(
        self,
        blocks: Mapping[Hashable, Mapping[str, Tensor]],
        *,
        lr: float = 1e-3,  # torch.optim.AdamW's defaults; a fine-tune's come from its spec
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
        decay_filter: Callable[[str, Tensor], bool] = default_decay_filter,
        threads: int | None = None,
        chunk_numel: int | None = None,
        state: str = "fp32",
        seed: int = 0,
        state_tier: str = "ram",
        state_dir: str | os.PathLike | None = None,
        state_order: Sequence[Hashable] | None = None,
        ring_depth: int = DEFAULT_STATE_RING_DEPTH,
    ):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}"
            )
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        if state_tier not in ("ram", "disk"):
            raise ValueError(f"state_tier must be 'ram' or 'disk', got {state_tier!r}")
        if state_tier == "disk" and state_dir is None:
            raise ValueError("state_tier='disk' needs a state_dir for the state's files")
        self.format = StateFormat.parse(state)
        # A compact format runs the fused kernel when it builds (or is cached), else torch ops.
        self._kernel = compact_kernel.load() if self.format.compact else None
        if not self.format.compact:
            self.update_path = "torch-fused"  # torch._fused_adamw_ on the fp32 state
        else:
            self.update_path = "native" if self._kernel is not None else "torch-ops"
        if chunk_numel is None:
            chunk_numel = (
                FP32_CHUNK_NUMEL
                if not self.format.compact
                else NATIVE_CHUNK_NUMEL
                if self._kernel is not None
                else COMPACT_CHUNK_NUMEL
            )
        align = QUANT_BLOCK if self.format.compact else _CHUNK_ALIGN
        if chunk_numel < align or chunk_numel % align:
            raise ValueError(f"chunk_numel must be a positive multiple of {align}")

        self.lr = float(lr)  # may be changed between steps (schedules); read at each step_block
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.accumulation_steps = int(accumulation_steps)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.chunk_numel = int(chunk_numel)
        self.seed = int(seed)  # keys the stochastic rounding of a bf16-sr master
        self.last_grad_norm: float | None = None  # global norm of the last clipped step
        self.state_tier = state_tier

        self._blocks: dict[Hashable, _Block] = {}
        for index, (block_id, named) in enumerate(blocks.items()):
            self._blocks[block_id] = self._build_block(block_id, named, decay_filter)
            self._blocks[block_id].index = index
        # Disk tier: the state lives in files, read into a ring in the order blocks are stepped
        # (by default the backward's, last block first) and written back behind.
        self._disk: StateRing | None = None
        if state_tier == "disk":
            order = list(reversed(self._blocks)) if state_order is None else list(state_order)
            layouts = {bid: b.layout for bid, b in self._blocks.items()}
            self._disk = StateRing(state_dir, layouts, order, ring_depth)
        # Clipping bookkeeping for the current step: the clip coefficient, once every block's
        # gradients are in, and the blocks that still have to be stepped with it.
        self._clip_scale: Tensor | None = None
        self._pending: set[Hashable] = set()

        self._scratch: list[Tensor | None] = [None] * self.threads
        self._compact: list[compact.Scratch | None] = [None] * self.threads
        self._pool: ThreadPoolExecutor | None = _single_threaded_pool(self.threads)

    # ------------------------------------------------------------------ setup

    def _build_block(self, block_id, named: Mapping[str, Tensor], decay_filter) -> _Block:
        params: dict[str, Tensor] = {}
        dtype = self.master_dtype
        for name, p in named.items():
            if p.dtype != dtype or p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError(
                    f"block {block_id!r} param {name!r}: master weights of state "
                    f"{self.format.name!r} must be contiguous {_DTYPE_NAMES[dtype]} CPU tensors, "
                    f"got {p.dtype} on {p.device}, contiguous={p.is_contiguous()}"
                )
            params[name] = p
        b = _Block(params=params, m={}, v={}, step=torch.zeros((), dtype=torch.float32), chunks=[])
        shapes = self._state_shapes(params)
        if self.state_tier == "disk":
            b.layout = StateLayout(shapes)  # bound to a ring buffer around each update
        else:  # zeros: m = v = 0, and zero codes under a zero absmax decode to m = v = 0
            zeros = {
                key: {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in named.items()}
                for key, named in shapes.items()
            }
            self._bind(b, zeros)
        decayed = [n for n, p in params.items() if decay_filter(n, p)]
        plain = [n for n, p in params.items() if not decay_filter(n, p)]
        b.chunks = self._make_chunks(decayed, self.weight_decay, b) + self._make_chunks(
            plain, 0.0, b
        )
        if b.layout is None:
            for c in b.chunks:
                _bind_chunk(c, b)
        return b

    def _state_shapes(self, params: Mapping[str, Tensor]) -> dict[str, dict[str, tuple]]:
        """(shape, dtype) of each per-tensor state this format keeps, by store and name."""
        f32, out = torch.float32, {}
        if self.format.moments == "fp32":
            out["m"] = {n: (tuple(p.shape), f32) for n, p in params.items()}
            out["v"] = {n: (tuple(p.shape), f32) for n, p in params.items()}
        else:  # (2, numel padded to 256): m and sqrt(v), and one absmax per 256 of each
            padded = {n: _round_up(p.numel(), QUANT_BLOCK) for n, p in params.items()}
            out["codes"] = {n: ((2, k), torch.uint8) for n, k in padded.items()}
            out["absmax"] = {n: ((2, k // QUANT_BLOCK), f32) for n, k in padded.items()}
        if self.format.master == "bf16-split":  # the given bf16 weights are the master exactly
            out["lo"] = {n: (tuple(p.shape), torch.int16) for n, p in params.items()}
        return out

    def _bind(self, b: _Block, stores: Mapping[str, Mapping[str, Tensor]] | None) -> None:
        """Make `stores` (by _Block attribute name) the block's state, or none (None)."""
        stores = stores or {}
        b.m, b.v = dict(stores.get("m", {})), dict(stores.get("v", {}))
        b.lo = dict(stores["lo"]) if "lo" in stores else None
        b.codes = dict(stores["codes"]) if "codes" in stores else None
        b.absmax = dict(stores["absmax"]) if "absmax" in stores else None

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the master tensors the optimizer is given and updates: fp32, or bf16
        for the bf16 masters, whose tensors are then the compute copy itself (`out=` is refused;
        a trainer streams these tensors to the device as they are)."""
        return torch.bfloat16 if self.format.master_is_compute_copy else torch.float32

    def _make_chunks(self, names, weight_decay, b: _Block) -> list[_Chunk]:
        """Cut tensors into <= chunk_numel slices (at multiples of 64; of 256 in a compact
        format, where each tensor's tail is padded to 256 in scratch); pack small ones together."""
        params = b.params
        pad = QUANT_BLOCK if self.format.compact else 1
        align = QUANT_BLOCK if self.format.compact else _CHUNK_ALIGN
        chunks: list[_Chunk] = []
        cur: list[tuple[str, int, int]] = []
        cur_numel = 0
        for name in names:
            numel = _round_up(params[name].numel(), pad)
            start = 0
            while start < numel:
                room = self.chunk_numel - cur_numel
                if numel - start <= room:
                    end = numel
                else:
                    end = start + (room // align) * align
                if end == start:  # no aligned room left in this chunk: close it
                    chunks.append(cur)
                    cur, cur_numel = [], 0
                    continue
                cur.append((name, start, end))
                cur_numel += end - start
                start = end
            if cur_numel >= self.chunk_numel:
                chunks.append(cur)
                cur, cur_numel = [], 0
        if cur:
            chunks.append(cur)

        if not pad > 1:

            def views(store, s):
                return [store[n].view(-1)[a:e] for n, a, e in s]

            return [_Chunk(weight_decay, s, views(params, s), [], []) for s in chunks]
        # Compact: slices end at the real end of their tensor; the padding is scratch only.
        out = []
        order = {n: i for i, n in enumerate(params)}
        for s in chunks:
            real = [(n, a, min(e, params[n].numel())) for n, a, e in s]
            widths = [e - a for _, a, e in s]  # padded
            offsets = [0]
            for w in widths:
                offsets.append(offsets[-1] + w)
            c = _Chunk(
                weight_decay,
                real,
                [params[n].view(-1)[a:e] for n, a, e in real],
                [],
                [],
                offsets=offsets[:-1],
                widths=widths,
                padded=offsets[-1],
                keys=[order[n] for n, _, _ in s],
            )
            out.append(c)
        return out

    # ------------------------------------------------------------------ public API

    @property
    def block_ids(self) -> list[Hashable]:
        """Block ids in registration order."""
        return list(self._blocks)

    @property
    def ring_nbytes(self) -> int:
        """Host RAM the disk tier's ring of state buffers holds (0 on the RAM tier)."""
        return self._disk.ring_nbytes if self._disk is not None else 0

    def num_steps(self, block_id: Hashable) -> int:
        """Optimizer steps taken by one block."""
        return int(self._blocks[block_id].step.item())

    def copy_params(self, block_id: Hashable, out: Mapping[str, Tensor]) -> None:
        """Write ``master.to(out.dtype)`` for one block (e.g. the compute copy before step 1)."""
        b = self._blocks[block_id]
        self._check_tensors(block_id, b, out, "out", allow_any_float=True)
        names = list(b.params)
        torch._foreach_copy_([out[n] for n in names], [b.params[n] for n in names])

    def master_values(self, block_id: Hashable) -> dict[str, Tensor]:
        """The fp32 value of each master of one block: a bf16-split master's halves joined (the
        fp32 master exactly), a bf16 master widened (exact), an fp32 master itself (no copy)."""
        b = self._blocks[block_id]
        if self.format.master == "fp32":
            return dict(b.params)
        if self.format.master != "bf16-split":
            return {n: p.float() for n, p in b.params.items()}
        lo = self._state_of(block_id)["lo"]
        s = compact.Scratch(QUANT_BLOCK)  # join_halves reads only its constants
        out = {}
        for n, hi in b.params.items():
            out[n] = torch.empty(hi.shape, dtype=torch.float32)
            compact.join_halves(hi, lo[n], out[n], s)
        return out

    def _state_of(self, block_id: Hashable) -> dict[str, dict[str, Tensor]]:
        """A block's per-tensor state by store, between steps: the live tensors, or on the disk
        tier views of its file (mapped, once the ring has written everything back)."""
        if self._disk is None:
            b = self._blocks[block_id]
            return {key: dict(getattr(b, key)) for key in self._stores()}
        self._disk.flush()
        return self._disk.mapped(block_id)

    def accumulate(self, block_id: Hashable, grads: Mapping[str, Tensor]) -> None:
        """Add one micro-batch's gradients of one block into its fp32 host buffer.

        Use it for the first k-1 micro-batches (then `step_block(block_id, grads)` with the last),
        or, with clipping, for all k (then `step_block(block_id)` once every block is in).
        """
        b = self._blocks[block_id]
        k = self.accumulation_steps
        if b.micro >= k:
            raise RuntimeError(
                f"block {block_id!r} already holds {k} micro-batch gradient(s); step it first"
            )
        self._check_tensors(block_id, b, grads, "grads", allow_any_float=True)
        if b.grad_buf is None:
            b.grad_buf = {n: torch.empty(p.shape, dtype=torch.float32) for n, p in b.params.items()}
            for c in b.chunks:
                c.g = [b.grad_buf[n].view(-1)[a:e] for n, a, e in c.slices]
        first = b.micro == 0

        def add(c: _Chunk, worker: int) -> None:
            g = [grads[n].view(-1)[a:e] for n, a, e in c.slices]
            if first:
                torch._foreach_copy_(c.g, g)  # overwrites last step's sums: no zeroing pass
            else:
                torch._foreach_add_(c.g, g)  # a bf16/fp16 grad is widened to fp32 exactly

        self._parallel(b.chunks, add)
        b.micro += 1
        if b.micro == k and self.max_grad_norm is not None:
            # Per-tensor norms now, while this block is the one being worked on; the global norm
            # combines them in block order once all blocks are in (as clip_grad_norm_ stacks them).
            b.norms = torch.stack(torch._foreach_norm([b.grad_buf[n] for n in b.params]))

    def step_block(
        self,
        block_id: Hashable,
        grads: Mapping[str, Tensor] | None = None,
        *,
        out: Mapping[str, Tensor] | None = None,
    ) -> None:
        """Apply one AdamW step to one block, then write its compute-dtype copy into `out`.

        `grads` are the gradients of the last micro-batch (fp32, or bf16/fp16 which are widened
        exactly); pass None when all micro-batches went through `accumulate` (required with
        clipping). `out`, if given, maps every parameter name to a CPU tensor of the same shape
        (typically bf16, possibly pinned); it receives ``master.to(out.dtype)`` after the update.
        """
        b = self._blocks[block_id]
        grads = self._step_inputs(block_id, b, grads, out)
        # The fused kernel divides the gradients by grad_scale (and writes the quotient back, which
        # is harmless: it only ever sees our own buffer here): sum / k is the mean, and clipping
        # divides by 1 / clip_coef.
        grad_scale = None
        if self.max_grad_norm is not None:
            grad_scale = self._clip_grad_scale(block_id)
        elif self.accumulation_steps > 1:
            grad_scale = torch.tensor(float(self.accumulation_steps), dtype=torch.float32)
        src = grads if grads is not None else b.grad_buf

        b.step.add_(1)  # torch increments the step before the update; t starts at 1
        hyper = dict(
            lr=self.lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            amsgrad=False,
            maximize=False,
            grad_scale=grad_scale,
        )
        if self.format.compact:
            update = self._compact_update(b, src, out, hyper)
        else:

            def update(c: _Chunk, worker: int) -> None:
                g = [src[n].view(-1)[a:e] for n, a, e in c.slices]
                if any(t.dtype != torch.float32 for t in g):
                    g = self._widen(g, worker)
                torch._fused_adamw_(
                    c.params,
                    g,
                    c.m,
                    c.v,
                    [],
                    [b.step] * len(g),
                    weight_decay=c.weight_decay,
                    **hyper,
                )
                if out is not None:  # cast this chunk now, while it is still in cache
                    torch._foreach_copy_([out[n].view(-1)[a:e] for n, a, e in c.slices], c.params)

        self._run_on_state(block_id, b, update)
        b.micro = 0
        b.norms = None

    def _step_inputs(self, block_id, b: _Block, grads, out) -> Mapping[str, Tensor] | None:
        """`step_block`'s arguments checked; the gradients to update with (None: the block's
        accumulated buffer, which the given micro-batch has joined)."""
        k = self.accumulation_steps
        if self.max_grad_norm is not None and grads is not None:
            raise ValueError(
                "with max_grad_norm set, pass every micro-batch to accumulate() and "
                "call step_block(block_id) without grads once all blocks are in"
            )
        if out is not None:
            if self.format.master_is_compute_copy:
                raise ValueError(
                    f"state {self.format.name!r} keeps a bf16 master: the tensors given to the "
                    "optimizer are the compute copy, updated in place; pass no out="
                )
            self._check_tensors(block_id, b, out, "out", allow_any_float=True)
        if grads is not None and (k > 1 or b.micro > 0):
            self.accumulate(block_id, grads)
            grads = None
        if grads is None and b.micro != k:
            raise RuntimeError(f"block {block_id!r} has {b.micro} of {k} micro-batch gradients")
        if grads is not None:
            self._check_tensors(block_id, b, grads, "grads", allow_any_float=True)
        return grads

    def _compact_update(self, b: _Block, src, out, hyper: dict) -> Callable[[_Chunk, int], None]:
        """The per-chunk update of a compact format: the native kernel where it is built, else
        the torch-ops reference; the compute copy into `out` for an fp32 master."""
        grad_scale = hyper["grad_scale"]
        step = int(b.step.item())  # a host CPU scalar, no device sync: keys the SR hash
        native = None
        if self._kernel is not None:
            # .item() of a CPU scalar: the kernel takes the divisor as a number
            scale = None if grad_scale is None else float(grad_scale.item())
            native = {  # per weight decay: chunks with and without it
                wd: compact_kernel.hyper(self.lr, *self.betas, self.eps, wd, step, scale)
                for wd in {c.weight_decay for c in b.chunks}
            }
        direct = (torch.float32, torch.bfloat16) if native is not None else (torch.float32,)
        # An fp32 master with 8-bit moments writes its compute copy: the kernel writes a
        # bf16 one in its pass, other dtypes are cast after it as in the fp32 format.
        fused_copy = (
            out is not None
            and native is not None
            and all(t.dtype == torch.bfloat16 for t in out.values())
        )

        def update(c: _Chunk, worker: int) -> None:
            g = [src[n].view(-1)[a:e] for n, a, e in c.slices]
            if any(t.dtype not in direct for t in g):
                g = self._widen(g, worker)
            copy = [out[n].view(-1)[a:e] for n, a, e in c.slices] if out is not None else None
            if native is not None:
                hyper_c = native[c.weight_decay]
                self._update_native(b, c, g, step, hyper_c, copy if fused_copy else None)
            else:
                self._update_compact(b, c, g, step, hyper, worker)
            if copy is not None and not fused_copy:
                torch._foreach_copy_(copy, c.params)

        return update

    def _run_on_state(self, block_id, b: _Block, update: Callable[[_Chunk, int], None]) -> None:
        """`update` over the block's chunks, on its state in RAM or, with the disk tier, in a
        ring buffer read ahead for it and written back behind it."""
        if self._disk is None:
            self._parallel(b.chunks, update)
            return
        self._bind(b, self._disk.acquire(block_id))
        for c in b.chunks:
            _bind_chunk(c, b)
        try:
            self._parallel(b.chunks, update)
        finally:
            self._bind(b, None)
            for c in b.chunks:
                _bind_chunk(c, b)  # no views of the buffer left behind
            self._disk.release(block_id)

    def step(
        self,
        grads: Mapping[Hashable, Mapping[str, Tensor]] | None = None,
        *,
        out: Mapping[Hashable, Mapping[str, Tensor]] | None = None,
    ) -> None:
        """Whole-model step: every block, in order (convenience for resident training and tests)."""
        if self.max_grad_norm is not None and grads is not None:
            for block_id in self._blocks:
                self.accumulate(block_id, grads[block_id])
            grads = None
        for block_id in self._blocks:
            self.step_block(
                block_id,
                None if grads is None else grads[block_id],
                out=None if out is None else out[block_id],
            )

    def state_dict(self) -> dict:
        """m, v and step per block plus the hyperparameters. Tensors are the live state (no copy:
        at 12 B/param a copy may not fit); serialize them before the next step. Must be taken
        between optimizer steps, not in the middle of an accumulation.

        The master weights are the caller's tensors and not in here, except for what a compact
        format keeps beside them: a bf16-split master's low halves (`lo`). With 8-bit moments,
        `m` and `v` are absent and `codes` (uint8, (2, numel padded to 256): m and sqrt(v)) and
        `absmax` (fp32, one per 256 of each) take their place. `state` names the format and
        `seed` keys a bf16-sr master's rounding; a state dict loads only into the same format."""
        self._check_idle("state_dict")
        states = {bid: self._state_of(bid) for bid in self._blocks}
        stores = {key: {bid: states[bid][key] for bid in self._blocks} for key in self._stores()}
        return {
            "format": "megaslide.cpu_adamw.v1",
            "state": self.format.name,
            "seed": self.seed,
            "hparams": {
                "lr": self.lr,
                "betas": list(self.betas),
                "eps": self.eps,
                "weight_decay": self.weight_decay,
                "accumulation_steps": self.accumulation_steps,
                "max_grad_norm": self.max_grad_norm,
            },
            "step": {bid: int(b.step.item()) for bid, b in self._blocks.items()},
            **stores,
        }

    def _stores(self) -> tuple[str, ...]:
        """The per-tensor state this format keeps, by _Block attribute name."""
        moments = ("m", "v") if self.format.moments == "fp32" else ("codes", "absmax")
        return moments + (("lo",) if self.format.master == "bf16-split" else ())

    def load_state_dict(self, state: Mapping) -> None:
        """Restore m, v, steps and lr saved by `state_dict` (copied into our own tensors)."""
        self._check_idle("load_state_dict")
        if state.get("format") != "megaslide.cpu_adamw.v1":
            raise ValueError(f"not a CPUAdamW state dict (format={state.get('format')!r})")
        saved_format = state.get("state", "fp32")  # dicts from before compact formats: fp32
        if saved_format != self.format.name:
            raise ValueError(
                f"state dict of state format {saved_format!r}, optimizer of {self.format.name!r}"
            )
        if set(state["step"]) != set(self._blocks):
            raise ValueError(
                f"state dict blocks {sorted(map(str, state['step']))} do not match "
                f"optimizer blocks {sorted(map(str, self._blocks))}"
            )
        keys = self._stores()
        live = {bid: self._state_of(bid) for bid in self._blocks}
        for bid in self._blocks:
            for key in keys:
                store = live[bid][key]
                saved = state[key][bid]
                if set(saved) != set(store):
                    raise ValueError(f"block {bid!r}: state dict {key} names do not match params")
                for name, t in store.items():
                    if saved[name].shape != t.shape:
                        raise ValueError(
                            f"block {bid!r} {key}[{name!r}]: shape "
                            f"{tuple(saved[name].shape)} != {tuple(t.shape)}"
                        )
        for bid, b in self._blocks.items():
            for key in keys:
                for name, t in live[bid][key].items():
                    t.copy_(state[key][bid][name])
            b.step.fill_(float(state["step"][bid]))
        if self._disk is not None:
            self._disk.invalidate()  # the files were written: the ring's copies are stale
        self.lr = float(state["hparams"]["lr"])
        self.seed = int(state.get("seed", 0))

    def __enter__(self) -> CPUAdamW:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker threads (on the disk tier, after writing the state back); the
        optimizer cannot step afterwards."""
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ------------------------------------------------------------------ internals

    def _parallel(self, chunks: list[_Chunk], fn: Callable[[_Chunk, int], None]) -> None:
        """Run fn(chunk, worker_index) for every chunk on the worker threads; wait for all.

        Workers pull chunks from a shared cursor rather than a fixed split, so a worker whose core
        is busy with something else (the thread driving the GPU, another process) just takes fewer
        chunks instead of holding up the whole block.
        """
        if self._pool is None:
            raise RuntimeError("the optimizer was closed")
        cursor = _Cursor()

        def loop(worker: int) -> None:
            while (i := cursor.take()) < len(chunks):
                fn(chunks[i], worker)

        futures = [self._pool.submit(loop, w) for w in range(self.threads)]
        for f in futures:
            f.result()  # waits for the worker and re-raises its exception, if any

    def _update_compact(
        self, b: _Block, c: _Chunk, g: list[Tensor], step: int, hyper: dict, worker: int
    ) -> None:
        """One chunk of a compact format: decode into fp32 scratch, the fused kernel, encode."""
        s = self._compact[worker]
        if s is None:
            s = self._compact[worker] = compact.Scratch(self.chunk_numel)
        fmt, n = self.format, c.padded
        spans = [(o, e - a) for o, (_, a, e) in zip(c.offsets, c.slices)]

        if fmt.master == "fp32":
            p = c.params  # updated in place, as in the fp32 format
        else:
            p = [s.p[o : o + k] for o, k in spans]
            for dst, hi, i in zip(p, c.params, range(len(p))):
                if fmt.master == "bf16-split":
                    compact.join_halves(hi, c.lo[i], dst, s)
                else:
                    dst.copy_(hi)  # bf16 -> fp32 is exact
        if fmt.moments == "fp32":
            m, v = c.m, c.v
        else:
            absmax, mv = s.absmax[:, : n // QUANT_BLOCK], s.mv[:, :n]
            q = QUANT_BLOCK
            for o, cv, av in zip(c.offsets, c.codes, c.absmax):
                s.i[:, o : o + cv.shape[1]].copy_(cv)  # uint8 -> int32, straight into scratch
                absmax[:, o // q : o // q + av.shape[1]].copy_(av)
            compact.decode_8bit(absmax, mv, s)
            for (o, k), cv in zip(spans, c.codes):
                if k < cv.shape[1]:  # a tensor's tail: zero the padding, kept out of absmax
                    mv[:, o + k : o + cv.shape[1]].zero_()
            m = [mv[0, o : o + k] for o, k in spans]
            v = [mv[1, o : o + k] for o, k in spans]

        torch._fused_adamw_(p, g, m, v, [], [b.step] * len(g), weight_decay=c.weight_decay, **hyper)

        # Random bits for stochastic rounding, one 32-bit draw per element (padding included):
        # the low 16 round a bf16-sr master, the high 16 the 8-bit v.
        rand = None
        if fmt.master == "bf16-sr" or fmt.moments == "8bit":
            rand = s.bits[:n]
            for o, (_, a, _), width, t in zip(c.offsets, c.slices, c.widths, c.keys):
                key = compact.sr_key(self.seed, step, b.index, t)
                compact.hash_start(rand[o : o + width], s, a, key)
            compact.hash_finish(rand, s.tmp, s)
        if fmt.moments == "8bit":
            compact.encode_8bit(mv, absmax, s, rand)
            for o, cv, av in zip(c.offsets, c.codes, c.absmax):
                cv.copy_(s.i[:, o : o + cv.shape[1]])  # int32 codes -> uint8 storage
                av.copy_(absmax[:, o // q : o // q + av.shape[1]])
        if fmt.master == "bf16-split":
            for (o, k), hi, lo in zip(spans, c.params, c.lo):
                compact.split_halves(s.p[o : o + k], hi, lo, s.tmp[:k], s)
        elif fmt.master == "bf16-sr":
            for (o, k), hi in zip(spans, c.params):
                compact.stochastic_round(s.p[o : o + k], hi, rand[o : o + k], s.tmp[:k], s)
        elif fmt.master == "bf16":
            for (o, k), hi in zip(spans, c.params):
                hi.copy_(s.p[o : o + k])  # round to nearest even

    def _update_native(
        self, b: _Block, c: _Chunk, g: list[Tensor], step: int, hyper, copy: list[Tensor] | None
    ) -> None:
        """One chunk of a compact format in the fused kernel, slice by slice; `copy`: bf16
        slices to write an fp32 master's compute copy into, or None."""
        fmt, kernel = self.format, self._kernel
        kind = compact_kernel.MASTER_KINDS[fmt.master]
        keyed = fmt.master == "bf16-sr" or fmt.moments == "8bit"
        for i, ((_, start, _), p, grad) in enumerate(zip(c.slices, c.params, g)):
            key = compact.sr_key(self.seed, step, b.index, c.keys[i]) if keyed else 0
            kernel.update(
                kind,
                p,
                c.lo[i] if c.lo is not None else None,
                copy[i] if copy is not None else None,
                c.m[i] if c.m else None,
                c.v[i] if c.v else None,
                c.codes[i] if c.codes is not None else None,
                c.absmax[i] if c.absmax is not None else None,
                grad,
                start,
                key,
                hyper,
            )

    def _widen(self, grads: list[Tensor], worker: int) -> list[Tensor]:
        """Copy bf16/fp16 gradient slices into this worker's fp32 scratch (exact widening)."""
        scratch = self._scratch[worker]
        if scratch is None:
            scratch = self._scratch[worker] = torch.empty(self.chunk_numel, dtype=torch.float32)
        wide, offset = [], 0
        for g in grads:
            w = scratch[offset : offset + g.numel()]
            w.copy_(g)
            wide.append(w)
            offset += g.numel()
        return wide

    def _clip_grad_scale(self, block_id: Hashable) -> Tensor:
        """k / clip_coef as a 0-dim tensor; the global norm is computed at a step's first block."""
        if self._clip_scale is None:
            missing = [bid for bid, b in self._blocks.items() if b.norms is None]
            if missing:
                raise RuntimeError(
                    f"clipping needs the gradients of every block before any update; blocks "
                    f"{missing[:5]} have not accumulated {self.accumulation_steps} micro-batch(es)"
                )
            k = self.accumulation_steps
            # Same formula as torch.nn.utils.clip_grad_norm_: norm of the per-tensor norms,
            # coef = max_norm / (norm + 1e-6) clamped to 1. The buffers hold sums, so / k.
            total = (
                torch.linalg.vector_norm(torch.cat([b.norms for b in self._blocks.values()])) / k
            )
            # .item() is a host read of a CPU scalar, no device sync: we need the number to refuse
            # a non-finite norm before touching any weight, and to report it.
            self.last_grad_norm = float(total.item())
            if not math.isfinite(self.last_grad_norm):
                raise FloatingPointError(
                    f"global gradient norm is {self.last_grad_norm}; no weights were updated"
                )
            coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
            self._clip_scale = (k / coef).to(torch.float32)
            self._pending = set(self._blocks)
        if block_id not in self._pending:
            raise RuntimeError(f"block {block_id!r} was already stepped in this clipped step")
        scale = self._clip_scale
        self._pending.discard(block_id)
        if not self._pending:
            self._clip_scale = None
        return scale

    def _check_tensors(
        self, block_id, b: _Block, tensors: Mapping[str, Tensor], what: str, allow_any_float: bool
    ) -> None:
        if set(tensors) != set(b.params):
            extra = sorted(set(tensors) - set(b.params))[:3]
            missing = sorted(set(b.params) - set(tensors))[:3]
            raise ValueError(
                f"block {block_id!r} {what}: names do not match the parameters "
                f"(missing {missing}, unexpected {extra})"
            )
        for name, t in tensors.items():
            p = b.params[name]
            if t.shape != p.shape:
                raise ValueError(
                    f"block {block_id!r} {what}[{name!r}]: shape {tuple(t.shape)} "
                    f"!= parameter shape {tuple(p.shape)}"
                )
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(
                    f"block {block_id!r} {what}[{name!r}]: must be a contiguous CPU "
                    f"tensor, got device {t.device}, contiguous={t.is_contiguous()}"
                )
            if not t.is_floating_point() or (not allow_any_float and t.dtype != torch.float32):
                raise ValueError(f"block {block_id!r} {what}[{name!r}]: bad dtype {t.dtype}")

    def _check_idle(self, what: str) -> None:
        busy = [bid for bid, b in self._blocks.items() if b.micro]
        if busy or self._pending:
            raise RuntimeError(
                f"{what} must be called between optimizer steps; blocks "
                f"{(busy or sorted(self._pending, key=str))[:5]} are mid-step"
            )


class _Cursor:
    """A counter shared by the workers of one step_block: each take() returns a fresh index."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            i = self._next
            self._next += 1
            return i


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _single_threaded_pool(threads: int) -> ThreadPoolExecutor:
    """A pool of `threads` workers, each running torch ops on one intra-op thread.

    Every worker calls torch.set_num_threads(1) once at start (a barrier makes sure all have
    started); under OpenMP that sets the calling thread's own count (the tests check it). The
    constructing thread then restores its previous value, which also restores torch's
    process-wide record of it.
    """
    previous = torch.get_num_threads()
    barrier = threading.Barrier(threads)

    def init() -> None:
        # torch sets up each thread's count lazily, from the process-wide value, the first time
        # the thread asks; ask first, or that first use would undo the 1 set here.
        torch.get_num_threads()
        torch.set_num_threads(1)
        barrier.wait()

    pool = ThreadPoolExecutor(threads, thread_name_prefix="cpu-adamw")
    for f in [pool.submit(init) for _ in range(threads)]:
        f.result()
    torch.set_num_threads(previous)
    return pool
