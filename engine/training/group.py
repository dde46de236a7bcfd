"""Who else trains the same batch: the part of a training step that data parallel changes.

`BlockwiseStep` (blockwise.py) and the `Trainer` (finetune.py) run one step whichever group they
are in; a `TrainingGroup` answers the few questions where one process and a rank of several
differ:

* `rows(batch_size)`: which rows of the whole batch this process trains (every rank draws the
  whole batch's noise, times and dropped captions, as one process would, and keeps its rows);
* `non_block_masters(named, device)`: where the masters of the parameters outside the
  blocks come from (host copies, or the group's shared memory);
* `reduce(grads)`: a block's gradients on their way to the optimizer, and `in_flight`, how many
  blocks' gradients may still be on their way while the next block's backward computes;
* `end_step()`: what happens once the optimizer has updated every master;
* `owner_first()`: the order in which the processes prepare what they share (the dataset).

`OneProcess` is a run alone: its own rows, its own masters, gradients as they are. `DataParallel`
is one rank of a group joined already (parallel/data_parallel.py launches them): each block's
gradients are summed onto rank 0 (`torch.distributed.reduce`) as soon as the block's backward is
done and divided by the ranks there: the mean of equal shares' mean losses is the whole batch's
mean loss. The reduction runs while the next block's backward computes: a block's gradients go to
the optimizer once the block after it (in backward order) has been computed. Rank 0 alone holds
the optimizer (one m and v) and updates the one master, which every rank streams from: the
blocks' host stores and the non-block masters are the same pages of shared memory in every
process. A barrier at the end of each optimizer step keeps the other ranks from reading a master
before rank 0 has written it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..streaming.host_store import SharedWeights


class Reduction(ABC):
    """One block's gradients on their way to the optimizer's process."""

    @abstractmethod
    def gradients(self) -> dict[str, torch.Tensor] | None:
        """The gradients the optimizer applies (their mean over the group), waiting for them if
        need be; None in a process that holds no optimizer."""


class TrainingGroup(ABC):
    """The processes that train one batch together, as one of them sees it (module docstring)."""

    owner: bool  # this process holds the optimizer and writes metrics, checkpoints and exports
    world: int  # processes in the group: the whole batch is `world` times this process's rows
    in_flight: int  # blocks whose reduction may still be running while the next one computes
    shared: SharedWeights | None  # the weights (masters) the model is opened from, if shared

    @abstractmethod
    def rows(self, batch_size: int) -> slice:
        """This process's rows of a whole batch of `batch_size`."""

    @abstractmethod
    def non_block_masters(
        self, named: dict[str, nn.Parameter], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """The masters (in the parameters' dtype) of the parameters outside the blocks, named
        "<module>.<parameter>"."""

    @abstractmethod
    def reduce(self, grads: dict[str, torch.Tensor]) -> Reduction:
        """Start bringing `grads` (one block's, or any one set) to the optimizer's process."""

    @abstractmethod
    def end_step(self) -> None:
        """Called once every update of an optimizer step has been written to the masters."""

    @abstractmethod
    def owner_first(self) -> contextlib.AbstractContextManager[None]:
        """A context whose body runs in the owner first, then in the others: what the owner
        writes there (an encoded dataset), the others find written."""


def host_masters(named: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host copies of `named` (their dtype: the masters'); on the CPU the parameters themselves
    are the masters."""
    if device.type == "cpu":
        return {n: p.data for n, p in named.items()}
    return {n: p.detach().to("cpu", copy=True) for n, p in named.items()}


class _Local(Reduction):
    """Gradients already where the optimizer is: nothing to wait for."""

    def __init__(self, grads: dict[str, torch.Tensor]):
        self.grads = grads

    def gradients(self) -> dict[str, torch.Tensor]:
        return self.grads


class OneProcess(TrainingGroup):
    """A run alone: every row, its own masters, its gradients as they are."""

    owner, world, in_flight, shared = True, 1, 0, None

    def rows(self, batch_size: int) -> slice:
        return slice(0, batch_size)

    def non_block_masters(self, named, device):
        return host_masters(named, device)

    def reduce(self, grads):
        return _Local(grads)

    def end_step(self) -> None:
        pass  # the masters this process reads are the ones it has just updated

    @contextlib.contextmanager
    def owner_first(self) -> Iterator[None]:
        yield


class _Summed(Reduction):
    """Gradients on their way to rank 0: a flat copy of them summed by one asynchronous
    `torch.distributed.reduce`, so that the device (or, on gloo, this process's threads) goes on
    computing meanwhile."""

    def __init__(self, grads: dict[str, torch.Tensor], group: DataParallel):
        self.group = group
        # Only the flat copy stays alive: the gradients themselves can go with their block.
        self.shapes = {name: g.shape for name, g in grads.items()}
        # Summed in fp32 whatever the gradients' dtype (a bf16 master's are bf16): the sum and
        # the division by the ranks then round once, in the optimizer's widening, not per rank.
        self.flat = torch.cat([g.reshape(-1).float() for g in grads.values()])
        self.work = dist.reduce(self.flat, dst=0, op=dist.ReduceOp.SUM, async_op=True)

    def gradients(self) -> dict[str, torch.Tensor] | None:
        # NCCL: the compute stream waits for the reduce's stream (no host sync); gloo: this
        # thread waits for the sum, which the flat buffer holds only then.
        self.work.wait()
        if not self.group.owner:
            return None
        self.flat /= self.group.world
        out, offset = {}, 0
        for name, shape in self.shapes.items():
            n = shape.numel()
            out[name] = self.flat[offset : offset + n].view(shape)
            offset += n
        return out


@dataclass(frozen=True)
class DataParallel(TrainingGroup):
    """This process's place in a data-parallel group (joined already): it trains rows
    `rows(batch_size)` of each batch; rank 0 owns the optimizer. `shared` holds the weights
    every rank opened its model from (`open_model(shared=...)`): the one master."""

    rank: int
    world: int
    shared: SharedWeights

    in_flight = 1  # a block's reduction runs while the next block's backward computes

    @property
    def owner(self) -> bool:
        """Whether this rank holds the optimizer and writes checkpoints."""
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch of `batch_size` (equal shares)."""
        share = batch_size // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    def non_block_masters(self, named, device):
        """The non-block masters in shared memory; on the CPU the parameters become them."""
        masters = {}
        for key, p in named.items():
            module, _, name = key.partition(".")
            master = self.shared.tensors[module][name]
            if master.dtype != p.dtype or master.shape != p.shape:
                raise ValueError(
                    f"shared {key} is {master.dtype} {tuple(master.shape)}, the parameter "
                    f"{p.dtype} {tuple(p.shape)}: not the master of this model"
                )
            masters[key] = master
            if device.type == "cpu":
                # Every rank's parameter is the master's pages: rank 0's update is everyone's.
                p.data = master
        return masters

    def reduce(self, grads):
        """Start summing `grads` onto rank 0 (one collective for them all)."""
        return _Summed(grads, self)

    def end_step(self) -> None:
        # No rank may read a master (its next forward) before rank 0 has updated every one.
        self.barrier()

    @contextlib.contextmanager
    def owner_first(self) -> Iterator[None]:
        if not self.owner:
            self.barrier()  # the owner's body is done
        yield
        if self.owner:
            self.barrier()  # lets the others in

    def barrier(self) -> None:
        dist.barrier()


__all__ = ["DataParallel", "OneProcess", "Reduction", "TrainingGroup", "host_masters"]
