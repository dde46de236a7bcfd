"""One full-parameter training step that touches one block at a time.

The step never holds the whole model's gradients, or (when streamed) its weights, on the device:

1. Forward, no autograd inside the blocks: the prologue (text encoder, embeddings) runs with
   autograd; each block is loaded, run, and released, and only its input is kept (block-boundary
   activation checkpointing). What the model is comes from its family, as a `TrainingModel`
   (model.py): the step knows prologue, blocks and epilogue, never the maths inside.
2. The epilogue and the loss run with autograd, giving the gradient at the last block's output.
3. Backward, blocks in reverse: load block i, recompute its forward from the saved input with
   autograd, backpropagate the incoming gradient, and hand block i's parameter gradients to the
   host: a CPU worker runs AdamW on block i's fp32 master while the device goes on to block i - 1.
   Gradients for what every block reads (timestep modulation, projected text) accumulate on leaf
   tensors across blocks.
4. Those accumulated gradients flow back through the prologue; the non-block parameters are
   updated last.

fp32 master weights live on the host. When streamed, the streamer's host store *is* the fp32
master of each block; on CUDA the compute happens under bf16 autocast, so the bf16 copy is cast on
the fly on the device and no host copy in the compute dtype exists (12 B/param on the host with m
and v). With `offload="none"` the blocks stay on the device and masters are separate host copies.

Data parallel (`DataParallel`, launched by parallel/data_parallel.py): every rank runs the step above on its
rows of the batch, with the same noise and flow times one process would draw for them. Each
block's gradients are summed onto rank 0 (`torch.distributed.reduce`) as soon as the block's
backward is done and divided by the ranks there: the mean of equal shares' mean losses is the
whole batch's mean loss. The reduction runs while the next block's backward computes: a block's
gradients go to the optimizer once the block after it (in backward order) has been computed. Rank 0 alone holds the optimizer (one m and v) and updates the one fp32
master, which every rank streams from: the blocks' host stores and the non-block masters are the
same pages of shared memory in every process. A barrier at the end of each optimizer step keeps
the other ranks from reading a master before rank 0 has written it.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..sampling.flow import noisy_sample, sample_training_times, velocity_target
from ..streaming.host_store import SharedWeights
from ..streaming.ordering import Ordering, make_ordering
from ..streaming.streamer import StreamHandle
from .finetune_spec import OptimizerSpec
from .model import TrainingModel
from .optim import CPUAdamW

NON_BLOCK = "non_block"  # optimizer block id of everything outside the blocks


@dataclass(frozen=True)
class StepConfig:
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    offload: str = "none"  # "none": blocks stay on the device; "stream": streamed from host RAM
    autocast: torch.dtype | None = None  # e.g. torch.bfloat16 on CUDA; None computes in fp32
    timing: bool = False  # per-block copy and compute times in the streamer's stats and trace
    aux_loss_weight: float = 0.1  # weight of the layers' auxiliary losses (3D-DSA motion heads)
    time_sampling: str = "logit-normal"  # distribution of training flow times (flow.TIME_SAMPLING)


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel group (joined already): it trains rows
    `rows(batch_size)` of each batch; rank 0 owns the optimizer. `shared` holds the fp32 weights
    every rank opened its model from (`open_model(shared=...)`): the one master."""

    rank: int
    world: int
    shared: SharedWeights

    @property
    def owner(self) -> bool:
        """Whether this rank holds the optimizer and writes checkpoints."""
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch of `batch_size` (equal shares)."""
        share = batch_size // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    def barrier(self) -> None:
        dist.barrier()


class _Reduction:
    """Gradients on their way to rank 0: a flat copy of them summed by one asynchronous
    `torch.distributed.reduce`, so that the device (or, on gloo, this process's threads) goes on
    computing meanwhile. One process: the gradients as they are, nothing started."""

    def __init__(self, grads: dict[str, torch.Tensor], parallel: DataParallel | None):
        self.parallel = parallel
        if parallel is None:
            self.grads = grads
            return
        # Only the flat copy stays alive: the gradients themselves can go with their block.
        self.shapes = {name: g.shape for name, g in grads.items()}
        self.flat = torch.cat([g.reshape(-1) for g in grads.values()])
        self.work = dist.reduce(self.flat, dst=0, op=dist.ReduceOp.SUM, async_op=True)

    def gradients(self) -> dict[str, torch.Tensor] | None:
        """The gradients (their mean over the ranks, on rank 0); None on the other ranks. Waits
        for the reduction."""
        if self.parallel is None:
            return self.grads
        # NCCL: the compute stream waits for the reduce's stream (no host sync); gloo: this
        # thread waits for the sum, which the flat buffer holds only then.
        self.work.wait()
        if not self.parallel.owner:
            return None
        self.flat /= self.parallel.world
        out, offset = {}, 0
        for name, shape in self.shapes.items():
            n = shape.numel()
            out[name] = self.flat[offset : offset + n].view(shape)
            offset += n
        return out


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
    """Owns the device copy of a model, its host fp32 masters and the CPU AdamW that updates them.

    The model comes placed in fp32 by the loader (`loader.open_model`), as its family's
    `TrainingModel`: with `offload="stream"`, its blocks streamed (`handle`) and their host stores
    the masters; otherwise everything on `device`, with host copies as masters (the parameters
    themselves on the CPU). Every parameter of the model's modules that requires grad trains.
    """

    def __init__(
        self,
        model: TrainingModel,
        device: str | torch.device,
        config: StepConfig,
        handle: StreamHandle | None = None,
        parallel: DataParallel | None = None,
    ):
        if config.offload not in ("none", "stream"):
            raise ValueError(f"offload must be 'none' or 'stream', got {config.offload!r}")
        if (config.offload == "stream") != (handle is not None):
            raise ValueError(
                "offload='stream' trains a streamed model: pass its handle (and only then)"
            )
        if parallel is not None and handle is None:
            raise ValueError("data parallel streams every rank's blocks from one shared master")
        self.model, self.config, self.parallel = model, config, parallel
        self.owner = parallel is None or parallel.owner
        self.device = torch.device(device)
        owner, prefix = model.blocks_owner, model.blocks_prefix
        for name, module in model.modules.items():
            for p in module.parameters():
                if p.dtype != torch.float32:
                    raise ValueError(f"{name} must come in fp32: its host copy is the fp32 master")
        # Host masters of the non-block parameters (and, unless streamed, of the blocks), named
        # "<module>.<parameter>".
        named = {
            f"{name}.{n}": p
            for name, module in model.modules.items()
            for n, p in trainable(module)
            if not (name == owner and n.startswith(prefix))
        }
        self.non_block_params = named
        if parallel is None:
            non_block_master = self._host_master(named)
        else:
            non_block_master = self._shared_master(named, parallel.shared)
        # Frozen parameters never change: a host copy of each is all checkpoints need.
        self.frozen = {
            f"{name}.{n}": p.detach().to("cpu", copy=True)
            for name, module in model.modules.items()
            for n, p in module.named_parameters()
            if not p.requires_grad
        }
        blocks = model.blocks
        self.handle = handle
        if handle is not None:
            self.blocks_io = handle
            # The streamer's host store of each block is its fp32 master: AdamW updates it in place
            # and the next load copies the new values.
            block_masters = {}
            for i, block in enumerate(blocks):
                names = {n for n, _ in trainable(block)}
                block_masters[i] = {n: t for n, t in handle.host_tensors(i).items() if n in names}
        else:
            self.blocks_io = _ResidentBlocks()
            block_masters = {i: self._host_master(dict(trainable(b))) for i, b in enumerate(blocks)}
        # Block masters are keyed by names inside the block ("attn.qkv.weight").
        self.masters = {**block_masters, NON_BLOCK: non_block_master}
        # One optimizer (one m and v) for the whole group: rank 0's.
        self.optimizer = CPUAdamW.from_spec(self.masters, config.optimizer) if self.owner else None
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megaslide-adamw")
        largest = max(sum(t.numel() for t in named.values()) for named in self.masters.values())
        largest = largest if self.owner else 0  # only the optimizer's rank brings gradients home
        # Gradients leave on a copy stream of their own, on the device (or simulated device) the
        # streamer orders its copies with.
        ordering = handle.ordering.sibling() if handle is not None else make_ordering(self.device)
        self.drain = _GradientDrain(ordering, largest)
        self.micro = 0

    def _host_master(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu":
            return {n: p.data for n, p in named.items()}  # the parameters are the masters
        return {n: p.detach().to("cpu", copy=True) for n, p in named.items()}

    def _shared_master(
        self, named: dict[str, nn.Parameter], shared: SharedWeights
    ) -> dict[str, torch.Tensor]:
        """The non-block masters in shared memory; on the CPU the parameters become them."""
        masters = {}
        for key, p in named.items():
            module, _, name = key.partition(".")
            master = shared.tensors[module][name]
            if master.dtype != torch.float32 or master.shape != p.shape:
                raise ValueError(
                    f"shared {key} is {master.dtype} {tuple(master.shape)}, the parameter "
                    f"fp32 {tuple(p.shape)}: not the master of this model"
                )
            masters[key] = master
            if self.device.type == "cpu":
                # Every rank's parameter is the master's pages: rank 0's update is everyone's.
                p.data = master
        return masters

    @property
    def h2d_bytes(self) -> int:
        return self.handle.h2d_bytes if self.handle is not None else 0

    def autocast(self):
        if self.config.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.config.autocast)

    def micro_step(self, x0: torch.Tensor, condition: Any, generator: torch.Generator) -> dict:
        """Forward and backward of one micro-batch; the optimizer steps after `grad_accum` of them.

        `x0` `(B, C, F, H, W)` clean clips as the model takes them (pixels, or VAE latents);
        `condition` what the model's prologue conditions on (prompts, or text embeddings); noise
        and flow times come from `generator`, the times mapped into the model's `time_range`.
        Data parallel: `x0` and `condition` are this rank's rows; the draws are the whole batch's.
        """
        start = time.perf_counter()
        model = self.model
        x_t, t, target = self._noised(x0, generator)
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
        (loss / self.config.optimizer.grad_accum).backward()

        # 3. Blocks in reverse: recompute, backpropagate, hand gradients to the CPU optimizer.
        outbox = _Outbox(self, last)
        grad, reducing = self._blocks_backward(x.grad, inputs, leaves, static, outbox)

        # 4. Through the prologue with everything the blocks and the epilogue sent back.
        sent_back = [
            leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for leaf in leaves.values()
        ]
        torch.autograd.backward([h, *carried.values()], [grad, *sent_back])
        if reducing is not None:
            outbox.update(outbox.send(*reducing))
        named = self.non_block_params
        sent = outbox.send(NON_BLOCK, self._reduce(_grads_or_zeros(named)))
        for p in named.values():
            p.grad = None
        outbox.update(sent)
        loss = self._finish_step(loss.detach(), outbox, last)
        # One host read per micro-step for the metrics; the values are needed on the host anyway.
        return {
            "loss": loss.item(),
            "grad_norm": outbox.sq_norm.sqrt().item() * self.config.optimizer.grad_accum,
            "step_time_s": time.perf_counter() - start,
            "stepped": last,
        }

    def _noised(self, x0: torch.Tensor, generator: torch.Generator):
        """The flow-matching draws on this device: `x_t` `(B, C, F, H, W)`, the times `t` `(B,)`
        and the velocity target, for this rank's rows of the whole batch's draws."""
        world = 1 if self.parallel is None else self.parallel.world
        B = x0.shape[0] * world  # the global batch: every rank draws it whole, as one process would
        t = sample_training_times(B, generator, self.config.time_sampling)  # (B,)
        lo, hi = self.model.time_range
        if (lo, hi) != (0.0, 1.0):
            t = lo + (hi - lo) * t
        noise = torch.randn((B, *x0.shape[1:]), generator=generator)  # (B, C, F, H, W)
        if self.parallel is not None:
            rows = self.parallel.rows(B)
            t, noise = t[rows], noise[rows]  # this rank's rows: (B / world, ...)
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
        gradients to `outbox`. The gradient at the first block's input, and (data parallel) the
        block whose reduction is still on its way."""
        model, io, blocks = self.model, self.blocks_io, self.model.blocks
        weight = torch.tensor(
            self.config.aux_loss_weight / self.config.optimizer.grad_accum, device=self.device
        )
        # Data parallel: the block whose gradients are being reduced while the next computes.
        reducing: tuple[int, _Reduction] | None = None
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
                reduction = self._reduce(_grads_or_zeros(params))
                # One process: the copy starts before the gradients' last reference goes below.
                sent = outbox.send(i, reduction) if self.parallel is None else None
                for p in params.values():
                    p.grad = None  # gradients exist only for the block being processed
                io.release(i)
                if self.handle is not None:
                    # Re-fetch the host views: this also tells the streamer that block i's host copy
                    # is about to change, so a stale slot copy is never reused.
                    self.handle.host_tensors(i)
                if self.parallel is None:
                    outbox.update(sent)
                else:
                    if reducing is not None:
                        outbox.update(outbox.send(*reducing))
                    reducing = (i, reduction)
        return grad, reducing

    def _finish_step(self, loss: torch.Tensor, outbox: _Outbox, last: bool) -> torch.Tensor:
        """Waits for every update of this micro-step and, after the last micro-step of an
        optimizer step, clips, meets the other ranks and publishes. The loss to report."""
        whole = self._reduce({"loss": loss}).gradients()
        if whole is not None:
            loss = whole["loss"]  # rank 0 reports the whole batch's loss; a rank its own rows'
        for f in outbox.pending:
            # The next forward reads the masters these updates write: wait for every one of them.
            f.result()
        if last and self.owner and self.config.optimizer.max_grad_norm is not None:
            for block_id in self.masters:  # clipping needs every gradient before any update
                self.optimizer.step_block(block_id)
        if last and self.parallel is not None:
            # No rank may read a master (its next forward) before rank 0 has updated every one.
            self.parallel.barrier()
        if last:
            self._publish()
        self.micro = 0 if last else self.micro + 1
        return loss

    @property
    def d2h_bytes(self) -> int:
        return self.drain.bytes

    def _reduce(self, grads: dict[str, torch.Tensor]) -> _Reduction:
        """Data parallel: start summing `grads` onto rank 0 (one collective for them all); its
        `gradients()` are their mean over the ranks on rank 0, None on the others. One process:
        `grads` as they are."""
        return _Reduction(grads, self.parallel)

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
    """One micro-step's gradients on their way to the CPU optimizer: each block's (reduced)
    gradients are copied to the host and updated there by the optimizer's worker."""

    def __init__(self, step: BlockwiseStep, last: bool):
        self.step, self.last = step, last
        self.pending: list[Future] = []
        self.sq_norm = torch.zeros((), device=step.device)

    def send(self, block_id, reduction: _Reduction):
        """The block's gradients on their way to the host: what `update` takes, or None on a rank
        whose share went to rank 0."""
        grads = reduction.gradients()
        if grads is None:
            return None
        self.sq_norm += sum(g.float().square().sum() for g in grads.values())
        return (block_id, *self.step.drain.send(grads))

    def update(self, sent) -> None:
        """The optimizer's update of a block, once its gradients have landed on the host."""
        if sent is not None:
            future = self.step.worker.submit(self.step._update, *sent, self.last)
            self.pending.append(self.step.drain.attach(future))


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


def master_state_dicts(step: BlockwiseStep) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter of the trained modules on the host, fp32 masters and frozen ones:
    `{module name: state dict}`."""
    model = step.model
    flat = dict(step.frozen)
    for block_id, named in step.masters.items():
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


__all__ = ["BlockwiseStep", "DataParallel", "StepConfig", "NON_BLOCK", "master_state_dicts"]
