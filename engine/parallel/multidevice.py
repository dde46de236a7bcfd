"""One video on several devices: a process per device, spawned here, sampling in lock step.

`generate_on_devices(info, video, ["cuda:0", "cuda:1"])` (or `["cpu", "cpu"]`) starts one process
per device with `torch.multiprocessing` (no torchrun; forkserver, so no CUDA state is forked),
joins them into a `torch.distributed` group (NCCL on CUDA, gloo on the CPU; rendezvous through a
file), and has each open the model, apply sequence parallelism (`Pipeline.parallelize`, see
sequence.py) and sample the same request. Every rank holds the full latents and ends with the
same frames; rank 0 writes them.

Weights: this process fills the streamed blocks' host buffers once, in shared memory
(`loader.share_weights`), and every rank streams from those same pages (`open_pipeline(shared=)`):
one copy of the blocks per host, not one per rank. Tensors outside the blocks (embeddings, the
final layer, an unstreamed text encoder) are small and each rank copies them to its device. On
CUDA each rank page-locks the shared buffers for its own context (`cudaHostRegister` of the same
physical pages: locked once in RAM, registered once per process), so its copies run as DMA.
The placement's levers apply as on one device: a coded format (`weights`) is encoded once here
and each rank decodes the shared payloads into its own slots; a budget keeps the same blocks
resident on every device (shared raw); on the disk tier each rank reads the blocks from the files
itself (the page cache is the host's one copy); "auto" is resolved here, once for the host; with
`timing` each rank's streamer stats come back (`stats=`).

A rank that fails (an exception, a signal, an exit) fails the job: the other ranks are stopped and
`RankFailed` names the rank and its device (ranks.py: the process machinery, shared with
data-parallel fine-tuning).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..family import family
from ..loader import resolve_dtype, share_weights
from ..placement import Placement
from ..request import ResolvedVideo
from ..sources import ModelInfo
from ..streaming.host_store import SharedWeights
from .ranks import RankFailed, RankLink, join_group, parse_devices, ranks_placement, run_ranks

__all__ = ["RankFailed", "generate_on_devices", "parse_devices"]


@dataclass(frozen=True)
class _Job:
    """What every rank is handed (pickled; the shared weights travel as handles)."""

    info: ModelInfo
    video: ResolvedVideo
    placement: Placement  # each rank opens `placement.on(its device)`
    dtype: torch.dtype
    threads: int
    frames_path: str  # rank 0 writes the frames here (.npy): no pickling through a pipe
    output: str | None  # and the MP4 here, when asked
    shared: SharedWeights
    stats: bool = False  # every rank reports its streamers' stats once sampled


def generate_on_devices(
    info: ModelInfo,
    video: ResolvedVideo,
    devices: str | Sequence[str] | Placement,
    *,
    dtype: str | torch.dtype = "auto",
    prefetch: int = 2,
    output: str | os.PathLike | None = None,
    threads: int | None = None,
    timeout_s: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_spawn: Callable[[list[int]], None] | None = None,
    stats: Callable[[list[dict]], None] | None = None,
) -> np.ndarray:
    """Sample one clip of `video` with its tokens split over `devices`: uint8 `(F, H, W, 3)`.

    `devices` names the devices, or is a whole `Placement` with `devices` (then its `prefetch`
    is the one used). Block weights stream from one shared host store (see the module
    docstring); `output`: rank
    0 also writes the MP4 there. `threads`: CPU threads per rank (default: this machine's cores
    shared out). `progress(step, total)` is called here as rank 0 finishes each step;
    `on_spawn(pids)` once the ranks have started; `stats(per_rank)` once sampled, with each
    rank's `Pipeline.stats()` in rank order (its streamers' timings with `timing`). ValueError before anything starts if the
    video cannot be split over the devices; RankFailed if a rank fails; TimeoutError (every rank
    stopped) after `timeout_s`.
    """
    placement = ranks_placement(devices, prefetch)
    names = placement.devices
    world = len(names)
    family(info.family).check_parallel(info, video.frames, video.height, video.width, world)
    dtype = resolve_dtype(dtype, torch.device(names[0]))
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world) if names[0] == "cpu" else 1
    # One copy for the host, in the placement's format and tier ("auto" resolved here, once).
    shared = share_weights(info, dtype, placement=placement)
    per_rank: dict[int, dict] = {}

    def report(*args) -> None:
        if args[0] == "stats":
            per_rank[args[1]] = args[2]
        elif progress is not None:
            progress(*args)

    with tempfile.TemporaryDirectory(prefix="megaslide-frames-") as tmp:
        job = _Job(
            info,
            video,
            placement,
            dtype,
            threads,
            str(Path(tmp) / "frames.npy"),
            None if output is None else os.fspath(output),
            shared,
            stats=stats is not None,
        )
        run_ranks(
            _sample,
            job,
            names,
            preload=[__name__],
            progress=report,
            on_spawn=on_spawn,
            timeout_s=timeout_s,
        )
        if stats is not None:
            stats([per_rank[rank] for rank in range(world)])
        return np.load(job.frames_path)


def _sample(link: RankLink, job: _Job) -> None:
    """One rank: join the group, open the model on its device from the shared weights, sample;
    rank 0 writes the frames."""
    import torch.distributed as dist

    from ..loader import open_pipeline
    from .sequence import SequenceGroup

    torch.set_num_threads(job.threads)
    join_group(link)
    pipe = open_pipeline(
        job.info, job.placement.on(str(link.device)), dtype=job.dtype, shared=job.shared
    )
    pipe.parallelize(SequenceGroup.default())
    state = pipe.prepare(job.video)
    while not state.done:
        pipe.denoise_step([state])
        if link.rank == 0:
            link.progress(state.step, state.num_steps)
    if job.stats:  # before "done": the launcher reads a rank's messages in order
        link.progress("stats", link.rank, pipe.stats())
    frames = pipe.finish(state)
    if link.rank == 0:
        np.save(job.frames_path, frames)
        if job.output is not None:
            from ..video import write_mp4

            write_mp4(job.output, frames, fps=job.video.fps)
    pipe.close()
    dist.destroy_process_group()
