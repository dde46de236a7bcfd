"""One video on several devices: a process per device, spawned here, sampling in lock step.

`generate_on_devices(info, video, ["cuda:0", "cuda:1"])` (or `["cpu", "cpu"]`) starts one process
per device with `torch.multiprocessing` (no torchrun; forkserver, so no CUDA state is forked),
joins them into a `torch.distributed` group (NCCL on CUDA, gloo on the CPU; rendezvous through a
file), and has each open the model, apply sequence parallelism (`Pipeline.parallelize`, see
sequence.py) and sample the same request. Every rank holds the full latents and ends with the
same latents; rank 0 decodes them. The ranks are a `RankGroup` (rank_group.py), started for this
one video and closed after it: the server's model on several devices is the same group kept up,
so one piece of code drives ranks, and every lever of a request (LoRA adapters, a first-frame
image, a step cache) runs here as it runs there.

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
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..family import family
from ..lora import Adapter
from ..placement import Placement
from ..request import ResolvedVideo
from ..sources import ModelInfo
from .rank_group import RankGroup
from .ranks import RankFailed, parse_devices, ranks_placement

__all__ = ["RankFailed", "generate_on_devices", "parse_devices"]


def generate_on_devices(
    info: ModelInfo,
    video: ResolvedVideo,
    devices: str | Sequence[str] | Placement,
    *,
    dtype: str | torch.dtype = "auto",
    prefetch: int = 2,
    adapters: Sequence[Adapter] = (),
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
    docstring). `adapters`: LoRA adapters (converted, `loader.load_adapter`) registered on every
    rank before sampling, for the ones `video.loras` names. `output`: the MP4 is also written
    there. `threads`: CPU threads per rank (default: this machine's cores shared out).
    `progress(step, total)` is called here after each step; `on_spawn(pids)` once the ranks have
    started; `stats(per_rank)` once sampled, with each rank's `Pipeline.stats()` in rank order
    (its streamers' timings with `timing`). ValueError before anything starts if the video cannot
    be split over the devices; RankFailed if a rank fails; TimeoutError (every rank stopped)
    after `timeout_s`.
    """
    placement = ranks_placement(devices, prefetch)
    world = len(placement.devices)
    family(info.family).check_parallel(info, video.frames, video.height, video.width, world)
    group = RankGroup(
        info, placement, dtype=dtype, threads=threads, on_spawn=on_spawn, timeout_s=timeout_s
    )
    try:
        for adapter in adapters:
            group.register_adapter(adapter)
        (state,) = group.prepare_batch([video])
        while not state.done:
            group.denoise_step([state])
            if progress is not None:
                progress(state.step, state.num_steps)
        if stats is not None:
            stats(group.stats())
        (frames,) = group.finish_batch([state])
    finally:
        group.close()
    if output is not None:
        from ..video import write_mp4

        write_mp4(output, frames, fps=video.fps)
    return frames
