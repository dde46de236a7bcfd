"""One full-parameter training step that touches one block at a time.

The step never holds the whole model's gradients, or (when streamed) its weights, on the device:

1. Forward, no autograd inside the blocks: the prologue (text encoder, embeddings) runs with
   autograd; each block is loaded, run, and released, and only its input is kept (block-boundary
   activation checkpointing). What the model is comes from its family, as a `TrainingModel`
   (model.py): the step knows prologue, blocks and epilogue, never the maths inside.
2. The epilogue and the loss run with autograd, giving the gradient at the last block's output.
3. Backward, blocks in reverse: load block i, recompute its forward from the saved input with
   autograd, backpropagate the incoming gradient, and hand block i's parameter gradients to the
   host: a CPU worker runs AdamW on block i's master while the device goes on to block i - 1.
   Gradients for what every block reads (timestep modulation, projected text) accumulate on leaf
   tensors across blocks.
4. Those accumulated gradients flow back through the prologue; the non-block parameters are
   updated last.

Master weights live on the host, in the optimizer's state format (`OptimizerSpec.state`,
state_format.py). When streamed, the streamer's host store *is* the master of each block: fp32 by
default, on CUDA cast to bf16 on the fly by autocast, so no host copy in the compute dtype exists
(12 B/param on the host with m and v). With a bf16 master ("bf16-split", "bf16-sr") the model
comes in bf16: the host store's bf16 buffers are the master and the compute copy at once, updated
in place after each block's backward, and the step computes under bf16 autocast on every device
(a "bf16-split" master's low halves and the moments stay in the optimizer). With
`offload="none"` the blocks stay on the device and masters are separate host copies.

Who else trains the same batch is a `TrainingGroup` (group.py) the step calls
unconditionally: which rows it trains, how a block's gradients reach the optimizer, what ends an
optimizer step, where the non-block masters come from. `OneProcess` by default; `DataParallel`
for a rank of several, whose blocks' gradients are summed onto rank 0 while the next block's
backward computes, and whose masters are one copy in shared memory that rank 0 alone updates.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..sampling.flow import noisy_sample, sample_training_times, velocity_target
from ..streaming.ordering import Ordering, make_ordering
from ..streaming.streamer import StreamHandle
from .finetune_spec import OptimizerSpec
from .group import OneProcess, Reduction, TrainingGroup, host_masters
from .model import TrainingModel
from .optim import CPUAdamW
from .state_format import StateFormat

NON_BLOCK = "non_block"  # optimizer block id of everything outside the blocks


@dataclass(frozen=True)
class StepConfig:
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    offload: str = "none"  # "none": blocks stay on the device; "stream": streamed from host RAM
    autocast: torch.dtype | None = None  # e.g. torch.bfloat16 on CUDA; None computes in fp32
    timing: bool = False  # per-block copy and compute times in the streamer's stats and trace
    aux_loss_weight: float = 0.1  # weight of the layers' auxiliary losses (3D-DSA motion heads)
    time_sampling: str = "logit-normal"  # distribution of training flow times (flow.TIME_SAMPLING)
    seed: int = 0  # keys a bf16-sr master's stochastic rounding (the run's seed)


class _ResidentBlocks:
    """The streamer's load/release interface for blocks that never leave the device."""

    def load(self, i):
        pass

    def release(self, i):
        pass

    @contextlib.contextmanager
    def manual(self, order=None):
        yield self


class BlockwiseStep:
    """Owns the device copy of a model, its host masters and the CPU AdamW that updates them.

    The model comes placed by the loader (`loader.open_model`) in the masters' dtype
    (`master_dtype`: fp32, or bf16 for a bf16 master), as its family's `TrainingModel`: with
    `offload="stream"`, its blocks streamed (`handle`) and their host stores the masters;
    otherwise everything on `device`, with host copies as masters (the parameters themselves on
    the CPU). Every parameter of the model's modules that requires grad trains.
    """

    def __init__(
        self,
        model: TrainingModel,
        device: str | torch.device,
        config: StepConfig,
        handle: StreamHandle | None = None,
        group: TrainingGroup | None = None,
    ):
        if config.offload not in ("none", "stream"):
            raise ValueError(f"offload must be 'none' or 'stream', got {config.offload!r}")
        if (config.offload == "stream") != (handle is not None):
            raise ValueError(
                "offload='stream' trains a streamed model: pass its handle (and only then)"
            )
        group = OneProcess() if group is None else group
        if group.shared is not None and handle is None:
            raise ValueError("a group sharing one master streams every rank's blocks from it")
        self.model, self.config, self.group = model, config, group
        self.owner = group.owner
        self.device = torch.device(device)
        owner, prefix = model.blocks_owner, model.blocks_prefix
        dtype = master_dtype(config.optimizer)
        if dtype != torch.float32 and config.autocast != dtype:
            raise ValueError(
                f"optimizer state {config.optimizer.state!r}: the blocks compute from the bf16 "
                "master, under autocast=torch.bfloat16"
            )
        for name, module in model.modules.items():
            for n, p in trainable(module):
                if p.dtype != dtype:
                    raise ValueError(
                        f"{name}.{n} is {p.dtype}: optimizer state {config.optimizer.state!r} "
                        f"keeps {dtype} masters, and the parameter's host copy is its master"
                    )
        # Masters of the non-block parameters, named "<module>.<parameter>": the group's.
        named = {
            f"{name}.{n}": p
            for name, module in model.modules.items()
            for n, p in trainable(module)
            if not (name == owner and n.startswith(prefix))
        }
        self.non_block_params = named
        non_block_master = group.non_block_masters(named, self.device)
        # Frozen parameters never change: a host copy of each is all checkpoints need.
        self.frozen = {
            f"{name}.{n}": p.detach().to("cpu", copy=True)
            for name, module in model.modules.items()
            for n, p in module.named_parameters()
            if not p.requires_grad
        }
        self.handle = handle
        self.blocks_io = handle if handle is not None else _ResidentBlocks()
        # Block masters are keyed by names inside the block ("attn.qkv.weight").
        self.masters = {**self._block_masters(), NON_BLOCK: non_block_master}
        # The order updates come in: the blocks backward, then the rest. The optimizer's disk
        # tier reads each block's state ahead of its update in this order.
        self.update_order = [*reversed(range(len(model.blocks))), NON_BLOCK]
        # One optimizer (one m and v) for the whole group: its owner's.
        self.optimizer = (
            CPUAdamW.from_spec(
                self.masters, config.optimizer, seed=config.seed, state_order=self.update_order
            )
            if self.owner
            else None
        )
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megaslide-adamw")
        largest = max(sum(t.numel() for t in named.values()) for named in self.masters.values())
        largest = largest if self.owner else 0  # only the optimizer's rank brings gradients home
        # Gradients leave on a copy stream of their own, on the device (or simulated device) the
        # streamer orders its copies with.
        ordering = handle.ordering.sibling() if handle is not None else make_ordering(self.device)
        self.drain = _GradientDrain(ordering, largest)
        self.micro = 0

    def _block_masters(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each block's masters: streamed, the streamer's host store of the block (AdamW
        updates it in place and the next load copies the new values); resident, host copies."""
        blocks, handle = self.model.blocks, self.handle
        if handle is None:
            return {i: host_masters(dict(trainable(b)), self.device) for i, b in enumerate(blocks)}
        masters = {}
        for i, block in enumerate(blocks):
            names = {n for n, _ in trainable(block)}
            masters[i] = {n: t for n, t in handle.host_tensors(i).items() if n in names}
        return masters

    @property
    def h2d_bytes(self) -> int:
        return self.handle.h2d_bytes if self.handle is not None else 0

    @property
    def stream_handles(self) -> dict[str, StreamHandle]:
        """The streamer's handle of the blocks, when streamed ("": the one model's)."""
        return {"": self.handle} if self.handle is not None else {}

    def autocast(self):
        if self.config.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.config.autocast)

    def micro_step(
        self,
        x0: torch.Tensor,
        condition: Any,
        generator: torch.Generator | None,
        *,
        drawn: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> dict:
        """Forward and backward of one micro-batch; the optimizer steps after `grad_accum` of them.

        `x0` `(B, C, F, H, W)` clean clips as the model takes them (pixels, or VAE latents);
        `condition` what the model's prologue conditions on (prompts, or text embeddings); noise
        and flow times come from `generator`, the times mapped into the model's `time_range`.
        In a group of several, `x0` and `condition` are this process's rows (`group.rows`); the
        draws are the whole batch's. `drawn`: the rows' flow times `(B,)` and noise, drawn by the
        caller instead (experts.py: each expert trains the rows whose times it owns).
        """
        start = time.perf_counter()
        model = self.model
        x_t, t, target = self._noised(x0, generator) if drawn is None else self._placed(x0, *drawn)
        last = self.micro + 1 == self.config.optimizer.grad_accum

        # 1. Prologue with autograd; blocks without, keeping each block's input.
        with self.autocast():
            h, carried, static = model.prologue(x_t, t, condition)  # (B, N, D)
        # Leaves for what every block reads: blocks' gradients accumulate on them.
        leaves = {k: v.detach().requires_grad_() for k, v in carried.items()}
        x, inputs = self._blocks_forward(h.detach(), leaves, static)

        # 2. Epilogue and loss with autograd.
        x = x.detach().requires_grad_()
        with self.autocast():
            v = model.epilogue(x, leaves, static)  # (B, C, F, H, W)
            loss = torch.nn.functional.mse_loss(v.float(), target.float())
        # Each micro-batch's own gradient: the optimizer sums them and divides by grad_accum.
        loss.backward()

        # 3. Blocks in reverse: recompute, backpropagate, hand gradients to the CPU optimizer.
        outbox = _Outbox(self, last)
        grad = self._blocks_backward(x.grad, inputs, leaves, static, outbox)

        # 4. Through the prologue with everything the blocks and the epilogue sent back.
        self._prologue_backward(h, carried, grad, leaves, outbox)
        loss = self._finish_step(loss.detach(), outbox, last)
        # One host read per micro-step for the metrics; the values are needed on the host anyway.
        return {
            "loss": loss.item(),
            "grad_norm": outbox.sq_norm.sqrt().item(),  # this micro-batch's gradient
            "step_time_s": time.perf_counter() - start,
            "stepped": last,
        }

    @torch.no_grad()
    def held_out_loss(self, x0: torch.Tensor, condition: Any, generator: torch.Generator) -> float:
        """The flow-matching loss of clips the run never trains on, the weights left as they are:
        `micro_step`'s forward alone, its draws from `generator`, all of `x0`'s rows here (the
        group's owner judges its checkpoints by itself)."""
        x_t, t, target = self._noised(x0, generator, whole=True)
        with self.autocast():
            h, carried, static = self.model.prologue(x_t, t, condition)  # (B, N, D)
        x, _ = self._blocks_forward(h, carried, static)  # (B, N, D)
        with self.autocast():
            v = self.model.epilogue(x, carried, static)  # (B, C, F, H, W)
            loss = torch.nn.functional.mse_loss(v.float(), target.float())
        # The one host read of the evaluation: the value goes into the metrics line.
        return loss.item()

    def _noised(self, x0: torch.Tensor, generator: torch.Generator, whole: bool = False):
        """The flow-matching draws on this device: `x_t` `(B, C, F, H, W)`, the times `t` `(B,)`
        and the velocity target, for this process's rows of the whole batch's draws (`whole`:
        `x0` is the whole batch, drawn here alone)."""
        # The whole batch: every rank draws it, as one process.
        B = x0.shape[0] * (1 if whole else self.group.world)
        t = sample_training_times(B, generator, self.config.time_sampling)  # (B,)
        lo, hi = self.model.time_range
        if (lo, hi) != (0.0, 1.0):
            t = lo + (hi - lo) * t
        noise = torch.randn((B, *x0.shape[1:]), generator=generator)  # (B, C, F, H, W)
        rows = slice(None) if whole else self.group.rows(B)
        return self._placed(x0, t[rows], noise[rows])  # this process's rows: (B / world, ...)

    def _placed(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor):
        """`x_t`, `t` and the velocity target on this device, for clips `x0` drawn `t`, `noise`."""
        x0, noise, t = x0.to(self.device), noise.to(self.device), t.to(self.device)
        x_t = noisy_sample(x0, noise, t)  # (B, C, F, H, W)
        return x_t, t, velocity_target(x0, noise)

    def _blocks_forward(self, x: torch.Tensor, leaves: dict, static) -> tuple[torch.Tensor, list]:
        """The blocks without autograd, each loaded, run and released: the last block's output
        `(B, N, D)` and every block's input, kept for the recompute in backward."""
        io, inputs = self.blocks_io, []
        with torch.no_grad(), io.manual(order="forward"), self.autocast():
            for i in range(len(self.model.blocks)):
                io.load(i)
                inputs.append(x)
                x = self.model.block(i, x, leaves, static)  # (B, N, D)
                io.release(i)
        return x, inputs

    def _blocks_backward(self, grad, inputs: list, leaves: dict, static, outbox: _Outbox):
        """Blocks in reverse: recompute each from its input, backpropagate `grad`, hand its
        gradients to `outbox` (the group's `in_flight` latest may still be on their way). The
        gradient at the first block's input."""
        model, io, blocks = self.model, self.blocks_io, self.model.blocks
        weight = torch.tensor(self.config.aux_loss_weight, device=self.device)
        with io.manual(order="reverse"):
            for i in reversed(range(len(blocks))):
                io.load(i)
                xi = inputs[i].requires_grad_()
                with self.autocast():
                    out = model.block(i, xi, leaves, static)  # (B, N, D)
                aux = model.aux_losses(i)  # e.g. the 3D-DSA motion heads' consistency loss
                torch.autograd.backward([out, *aux], [grad, *([weight] * len(aux))])
                grad = xi.grad
                inputs[i] = None  # this boundary activation is no longer needed
                params = dict(trainable(blocks[i]))
                outbox.post(i, self.group.reduce(_grads_or_zeros(params)))
                for p in params.values():
                    p.grad = None  # gradients exist only for the block being processed
                io.release(i)
                if self.handle is not None:
                    # Re-fetch the host views: this also tells the streamer that block i's host copy
                    # is about to change, so a stale slot copy is never reused.
                    self.handle.host_tensors(i)
                outbox.flush()
        return grad

    def _prologue_backward(self, h, carried: dict, grad, leaves: dict, outbox: _Outbox) -> None:
        """Backpropagate through the prologue the gradient at the first block's input and what the
        blocks and the epilogue sent back to the leaves; hand every gradient left to `outbox`."""
        sent_back = [
            leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for leaf in leaves.values()
        ]
        torch.autograd.backward([h, *carried.values()], [grad, *sent_back])
        outbox.flush(keep=0)  # the last block's gradients, if still on their way
        named = self.non_block_params
        outbox.post(NON_BLOCK, self.group.reduce(_grads_or_zeros(named)))
        for p in named.values():
            p.grad = None
        outbox.flush(keep=0)

    def _finish_step(self, loss: torch.Tensor, outbox: _Outbox, last: bool) -> torch.Tensor:
        """Waits for every update of this micro-step and, after the last micro-step of an
        optimizer step, clips, ends the group's step and publishes. The loss to report: in a
        group, the owner's is the whole batch's, another process's its own rows'."""
        whole = self.group.reduce({"loss": loss}).gradients()
        if whole is not None:
            loss = whole["loss"]
        for f in outbox.pending:
            # The next forward reads the masters these updates write: wait for every one of them.
            f.result()
        if last and self.owner and self.config.optimizer.max_grad_norm is not None:
            # Clipping needs every gradient before any update; then the updates go in the usual
            # order (any order gives the same result; this one is the disk tier's read-ahead).
            for block_id in self.update_order:
                self.optimizer.step_block(block_id)
        if last:
            self.group.end_step()
            self._publish()
        self.micro = 0 if last else self.micro + 1
        return loss

    @property
    def d2h_bytes(self) -> int:
        return self.drain.bytes

    def skip_micro_steps(self, count: int) -> None:
        """`count` micro-steps of this optimizer step in which the model had no rows (experts.py:
        no time of the micro-batch was this expert's): zero gradients join the accumulation, as
        a micro-batch whose loss does not depend on the model would give. When that completes the
        optimizer step, the step ends as `micro_step`'s last would."""
        if count < 1:
            return
        if self.micro + count > self.config.optimizer.grad_accum:
            raise RuntimeError(
                f"{self.micro} + {count} micro-steps exceed grad_accum "
                f"{self.config.optimizer.grad_accum}"
            )
        largest = max(sum(t.numel() for t in named.values()) for named in self.masters.values())
        zero = torch.zeros(largest)
        for block_id in self.update_order:
            named = self.masters[block_id]
            offsets = [0, *itertools.accumulate(t.numel() for t in named.values())]
            zeros = {
                n: zero[a : a + t.numel()].view(t.shape)
                for (n, t), a in zip(named.items(), offsets)
            }
            for _ in range(count):
                self.optimizer.accumulate(block_id, zeros)
        self.micro += count
        if self.micro < self.config.optimizer.grad_accum:
            return
        for block_id in self.update_order:
            if self.handle is not None and block_id != NON_BLOCK:
                # Tells the streamer that the block's host copy is about to change, so a stale
                # slot copy is never reused (as the backward does before each block's update).
                self.handle.host_tensors(block_id)
            self.optimizer.step_block(block_id)
        self.group.end_step()
        self._publish()
        self.micro = 0

    def state_dicts(self, *, values: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """`master_state_dicts` of this step: every trained module's state by module name."""
        return master_state_dicts(self, values=values)

    def _update(self, block_id, grads: dict[str, torch.Tensor], landed, last: bool) -> None:
        # The optimizer reads the pinned buffers the D2H copy is filling: wait for that copy
        # (this worker thread only; the GPU and the thread driving it go on).
        self.drain.wait(landed)
        if not last or self.config.optimizer.max_grad_norm is not None:
            self.optimizer.accumulate(block_id, grads)
        else:
            self.optimizer.step_block(block_id, grads)

    def _publish(self) -> None:
        """Make the device see the updated masters where it keeps its own copies."""
        if self.device.type == "cpu":
            return
        with torch.no_grad():
            for n, p in self.non_block_params.items():
                p.copy_(self.masters[NON_BLOCK][n])
            if self.handle is None:
                for i, block in enumerate(self.model.blocks):
                    for n, p in trainable(block):
                        p.copy_(self.masters[i][n])

    def close(self) -> None:
        self.worker.shutdown(wait=True)
        if self.optimizer is not None:
            self.optimizer.close()
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class _Outbox:
    """One micro-step's gradients on their way to the CPU optimizer: each block's gradients, once
    the group has reduced them, are copied to the host and updated there by the optimizer's worker.

    `post` queues a block's reduction and `flush` updates all but the group's `in_flight` newest:
    in a group whose reductions overlap the next block's backward, a block is copied and updated
    one block later. With nothing in flight the copy starts at `post`, before the caller drops the
    gradients, and `flush` must follow before the next `post` (the drain's ring holds one copy
    that no update reads yet)."""

    def __init__(self, step: BlockwiseStep, last: bool):
        self.step, self.last = step, last
        self.keep = step.group.in_flight
        self.queue: deque[tuple[Any, Reduction, Any]] = deque()  # (block id, reduction, sent)
        self.pending: list[Future] = []
        self.sq_norm = torch.zeros((), device=step.device)

    def post(self, block_id, reduction: Reduction) -> None:
        sent = self._send(block_id, reduction) if self.keep == 0 else _NOT_SENT
        self.queue.append((block_id, reduction, sent))

    def flush(self, keep: int | None = None) -> None:
        """Hand every queued block but the newest `keep` (default: the group's `in_flight`) to
        the optimizer, waiting for its reduction if need be."""
        keep = self.keep if keep is None else keep
        while len(self.queue) > keep:
            block_id, reduction, sent = self.queue.popleft()
            if sent is _NOT_SENT:
                sent = self._send(block_id, reduction)
            self._update(sent)

    def _send(self, block_id, reduction: Reduction):
        """The block's gradients on their way to the host: what `_update` takes, or None in a
        process whose share went to the optimizer's."""
        grads = reduction.gradients()
        if grads is None:
            return None
        self.sq_norm += sum(g.float().square().sum() for g in grads.values())
        return (block_id, *self.step.drain.send(grads))

    def _update(self, sent) -> None:
        """The optimizer's update of a block, once its gradients have landed on the host."""
        if sent is not None:
            future = self.step.worker.submit(self.step._update, *sent, self.last)
            self.pending.append(self.step.drain.attach(future))


_NOT_SENT = object()  # a queued block whose reduction `flush` waits for


class _GradientDrain:
    """Moves one block's fp32 gradients to the host on a copy stream of its own, into a ring of two
    pinned buffers, so the copy overlaps the next block's backward. Where device memory is host
    memory (the CPU) it hands them over as they are."""

    def __init__(self, ordering: Ordering, max_numel: int):
        self.ordering = ordering
        self.bytes = 0
        self.direct = ordering.device_is_host
        if not self.direct:
            self.buffers = [ordering.host_buffer(max_numel) for _ in range(2)]
            self.readers: list[Future | None] = [None, None]
            self.turn = 0

    def send(self, grads: dict[str, torch.Tensor]):
        """Start copying; returns host tensors and an event to `wait` on before reading them."""
        if self.direct:
            return grads, None  # already on the host: nothing crosses a bus
        self.bytes += sum(g.numel() * 4 for g in grads.values())
        j = self.turn
        if self.readers[j] is not None:
            # The optimizer task that reads buffer j must be done before the copies below overwrite
            # it; without this join it could step with this block's gradients, or half of them.
            self.readers[j].result()
        backward_done = self.ordering.new_event()
        # Marks the end of this block's backward on the compute stream, for the wait below.
        self.ordering.record_on_compute(backward_done)
        # The copies must not read gradients the backward kernels are still writing.
        self.ordering.copy_wait(backward_done)
        out, offset = {}, 0
        for name, g in grads.items():
            view = self.buffers[j][offset : offset + g.numel()].view(g.shape)
            offset += g.numel()
            self.ordering.copy(view, g)
            # The caller drops its references next; without this the allocator could hand g's
            # memory to the next block's backward while the copy is still reading it.
            self.ordering.keep_alive(g)
            out[name] = view
        landed = self.ordering.new_event()
        # Marks the end of these copies on the drain stream: what the optimizer waits for.
        self.ordering.record_on_copy(landed)
        return out, landed

    def wait(self, landed) -> None:
        """Block the calling thread until the copies `send` returned `landed` with have finished."""
        if landed is not None:
            # Host sync of the optimizer's thread: it reads the buffers these copies fill; without
            # it AdamW could step with what the buffer held before (two sends ago), or a mix.
            self.ordering.host_wait(landed)

    def attach(self, reader: Future) -> Future:
        """Record the optimizer task that reads the buffer `send` just filled."""
        if not self.direct:
            self.readers[self.turn] = reader
            self.turn ^= 1
        return reader


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _grads_or_zeros(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, zeros for one the loss did not reach this step (e.g. no prompt was
    long enough to touch the last text positions, whose gradient torch would also make zero)."""
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}


def master_dtype(spec: OptimizerSpec) -> torch.dtype:
    """The dtype a model trained with `spec` comes in: its masters', fp32 or bf16."""
    return torch.bfloat16 if StateFormat.parse(spec.state).master_is_compute_copy else torch.float32


def master_state_dicts(
    step: BlockwiseStep, *, values: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter of the trained modules on the host, masters and frozen ones:
    `{module name: state dict}`. The masters as stored (what reopens the run exactly, with the
    optimizer's state), or with `values` their fp32 values (`CPUAdamW.master_values`: a
    bf16-split master's halves joined) and the frozen ones widened to fp32, which only the
    optimizer's process can give."""
    model = step.model
    flat = dict(step.frozen)
    masters = step.masters
    if values:
        masters = {block_id: step.optimizer.master_values(block_id) for block_id in masters}
        # Frozen ones too (opened in a bf16 master's dtype): one dtype for the whole export.
        flat = {k: t.float() if t.is_floating_point() else t for k, t in flat.items()}
    for block_id, named in masters.items():
        if block_id == NON_BLOCK:
            flat |= named
        else:
            prefix = f"{model.blocks_owner}.{model.blocks_prefix}{block_id}."
            flat |= {prefix + n: t for n, t in named.items()}
    states: dict[str, dict[str, torch.Tensor]] = {name: {} for name in model.modules}
    for key, tensor in flat.items():
        name, _, rest = key.partition(".")
        states[name][rest] = tensor
    return states


__all__ = ["BlockwiseStep", "StepConfig", "NON_BLOCK", "master_dtype", "master_state_dicts"]
