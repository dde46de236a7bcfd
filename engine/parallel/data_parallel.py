"""Fine-tuning over several devices: data parallel, one optimizer, one master in host RAM.

`finetune_on_devices(source, data, spec)` with `spec.runtime.devices = ("cpu", "cpu")` (or
`("cuda:0", "cuda:1")`) runs the fine-tune `open_trainer` would run, in one process per device
(ranks.py: spawned, joined in a gloo or NCCL group, a failed rank fails the job):

* Weights. This process fills the trained components' weights once into shared memory, in the
  masters' dtype (fp32, or bf16 for a bf16 master state format: optimizer.state)
  (`loader.share_weights`); every rank opens its model from those pages (`open_model(shared=)`).
  The streamed blocks' host stores are then the same pages in every process, as are the non-block
  masters (on the CPU the parameters themselves; on CUDA each rank copies them to its device after
  each step). One master per host, page-locked per rank on CUDA for its DMA, not copied.
* The step (training/group.py, `DataParallel`). Every rank reads the same batch and draws the same
  noise, flow times and dropped captions as one process would, and keeps its rows
  (`batch_size / ranks` of them). Clips in aspect and length buckets (training/buckets.py) are
  planned and ordered alike by every rank, so all take the same bucket at each step, and every
  batch is whole, so the shares stay equal. Each block's gradients are summed onto rank 0 as its backward
  ends and averaged there; rank 0's CPU AdamW (the only m and v) updates the shared master while
  the ranks go on to the next block; a barrier ends the step.
* Rank 0 writes the metrics, the checkpoints and the export, once, exactly as one process does; a
  run resumes from them on any number of devices (the optimizer state does not depend on them).

The result equals one process on the whole batch up to floating-point reduction order: each rank
averages its rows' losses and rank 0 averages the ranks' gradients, where one process sums every
row in one reduction. A rank that dies fails the run (`RankFailed`); what rank 0 was writing then is
removed, so the run's newest complete checkpoint stays the newest thing there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import remove_stale
from ..family import family
from ..loader import as_source, share_weights
from ..sources import ModelSource
from ..streaming.host_store import SharedWeights
from ..training.blockwise import master_dtype
from ..training.finetune import CHECKPOINTS, Trainer, trained_model
from ..training.finetune_spec import FinetuneSpec
from ..training.group import DataParallel
from .ranks import RankFailed, RankLink, join_group, parse_devices, run_ranks

__all__ = ["RankFailed", "finetune_on_devices"]


@dataclass(frozen=True)
class _Job:
    """What every rank is handed (pickled; the shared weights travel as handles)."""

    source: ModelSource
    data: str
    spec: FinetuneSpec
    resume: bool
    export: bool
    threads: int
    shared: SharedWeights


def finetune_on_devices(
    source: ModelSource | str | Path | None,
    data: str | os.PathLike,
    spec: FinetuneSpec,
    *,
    resume: bool = False,
    export: bool = True,
    threads: int | None = None,
    progress: Callable[[dict], None] | None = None,
    on_plan: Callable[[list[str]], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_spawn: Callable[[list[int]], None] | None = None,
    timeout_s: float | None = None,
) -> dict:
    """Run the fine-tune `spec` asks for on `spec.runtime.devices` to its end (or `until`).

    With `export`, rank 0 ends with a checkpoint of the last step and writes the model to
    `<output>/model`, as `megaslide finetune` does. `threads`: CPU threads per rank (default:
    this machine's cores shared out). `on_plan(lines)` once the run is open, with its clips'
    aspect and length buckets (`BucketPlan.lines()`; not called for one clip size),
    `on_start(step, total_steps)` once the run is open (step: where a resumed run starts), `progress(metrics)` after each step, `on_spawn(pids)` once the
    ranks have started. Returns `{"step", "total_steps", "metrics", "model"}` (the last step's
    metrics, the export's path or None). ValueError before anything starts for a spec or devices
    that cannot run; RankFailed if a rank fails, TimeoutError after `timeout_s`.
    """
    spec.validate()
    if spec.runtime.devices is None:
        raise ValueError("runtime.devices names no devices: one device runs with open_trainer")
    names = parse_devices(spec.runtime.devices)
    source = as_source(source)
    info, _ = trained_model(source, spec, resume)
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // len(names)) if names[0] == "cpu" else 1
    only = family(info.family).training_components(info, spec.run.expert)
    dtype = master_dtype(spec.optimizer)  # the one master's, in the optimizer's state format
    shared = share_weights(info, dtype, only=only, keep_fp32=dtype == torch.float32)
    job = _Job(source, os.fspath(data), spec, resume, export, threads, shared)

    def report(event: str, *args) -> None:
        if event == "start" and on_start is not None:
            on_start(*args)
        elif event == "plan" and on_plan is not None:
            on_plan(*args)
        elif event == "step" and progress is not None:
            progress(*args)

    output = Path(spec.run.output)
    try:
        return run_ranks(
            _train,
            job,
            names,
            preload=[__name__],
            progress=report,
            on_spawn=on_spawn,
            timeout_s=timeout_s,
        )
    finally:
        # Every rank is stopped by now: what rank 0 was writing when the run failed (a checkpoint,
        # the export) is half-written, and no one is writing it any more.
        remove_stale(output / CHECKPOINTS)
        remove_stale(output)


def _train(link: RankLink, job: _Job) -> dict | None:
    """One rank: join the group, open its part of the run on its device, train."""
    import torch.distributed as dist

    torch.set_num_threads(job.threads)
    join_group(link)
    # This rank's part of the placement: its device alone, streaming from the shared master.
    spec = job.spec.replace(runtime={"placement": job.spec.runtime.placement.on(str(link.device))})
    parallel = DataParallel(link.rank, link.world, job.shared)
    owner = parallel.owner
    with Trainer(job.source, job.data, spec, resume=job.resume, group=parallel) as trainer:
        if owner:
            if trainer.plan is not None:
                link.progress("plan", trainer.plan.lines())
            link.progress("start", trainer.step, trainer.total_steps)
        last = trainer.run((lambda m: link.progress("step", m)) if owner else None)
        model = None
        if owner and job.export:
            if last is not None and trainer.step % spec.run.save_every:
                trainer.save_checkpoint()  # the end of the run is always a checkpoint
            model = str(trainer.export())
        result = {"step": trainer.step, "total_steps": trainer.total_steps}
    dist.destroy_process_group()
    return {**result, "metrics": last, "model": model} if owner else None
