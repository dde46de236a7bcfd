"""One video on several devices: a process per device, spawned here, sampling in lock step.

`generate_on_devices(info, video, ["cuda:0", "cuda:1"])` (or `["cpu", "cpu"]`) starts one process
per device with `torch.multiprocessing` (no torchrun; forkserver, so no CUDA state is forked), joins them into a `torch.distributed` group
(NCCL on CUDA, gloo on the CPU; rendezvous through a file), and has each open the model, apply
sequence parallelism (`Pipeline.parallelize`, see parallel.py) and sample the same request. Every
rank holds the full latents and ends with the same frames; rank 0 writes them.

Weights: this process fills the streamed blocks' host buffers once, in shared memory
(`loader.share_weights`), and every rank streams from those same pages (`open_pipeline(shared=)`):
one copy of the blocks per host, not one per rank. Tensors outside the blocks (embeddings, the
final layer, an unstreamed text encoder) are small and each rank copies them to its device. On
CUDA each rank page-locks the shared buffers for its own context (`cudaHostRegister` of the same
physical pages: locked once in RAM, registered once per process), so its copies run as DMA.

A rank that fails (an exception, a signal, an exit) fails the job: the other ranks are stopped and
`RankFailed` names the rank and its device, instead of the survivors waiting forever in a
collective whose peer is gone.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np
import torch

from .family import family
from .host_store import SharedWeights
from .loader import resolve_dtype, share_weights
from .request import ResolvedVideo
from .sources import ModelInfo

STOP_GRACE_S = 5.0  # how long a stopped rank gets to exit before it is killed
COLLECTIVE_TIMEOUT_S = 600.0  # a collective waiting longer than this on a peer fails


class RankFailed(RuntimeError):
    """A rank of a multi-device job failed; the job was stopped. `rank` is the one that failed
    first, `device` its device."""

    def __init__(self, rank: int, device: str, reason: str):
        super().__init__(f"rank {rank} ({device}) failed: {reason}")
        self.rank, self.device, self.reason = rank, device, reason


def parse_devices(devices: str | Sequence[str]) -> list[str]:
    """`"cpu,cpu"` or `["cuda:0", "cuda:1"]` -> device names, checked: at least two, one kind,
    CUDA devices each named once by index and present. ValueError naming the problem."""
    names = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else list(devices)
    try:
        parsed = [torch.device(d) for d in names]
    except RuntimeError as e:
        raise ValueError(f"devices {','.join(names)}: {e}") from None
    if len(parsed) < 2:
        raise ValueError(f"devices {','.join(names)}: name two or more (one device: --device)")
    kinds = {d.type for d in parsed}
    if kinds - {"cpu", "cuda"} or len(kinds) > 1:
        raise ValueError(f"devices {','.join(names)}: all cpu, or all cuda:N")
    if kinds == {"cuda"}:
        if any(d.index is None for d in parsed):
            raise ValueError(f"devices {','.join(names)}: name CUDA devices by index (cuda:0)")
        if len({d.index for d in parsed}) != len(parsed):
            raise ValueError(f"devices {','.join(names)}: a CUDA device is named twice")
        count = torch.cuda.device_count()  # counts devices without creating a CUDA context
        missing = [str(d) for d in parsed if d.index >= count]
        if missing:
            raise ValueError(f"device {missing[0]} is not there ({count} CUDA devices)")
    return [str(d) for d in parsed]


@dataclass(frozen=True)
class _Job:
    """What every rank is handed (pickled; the shared weights travel as handles)."""

    info: ModelInfo
    video: ResolvedVideo
    devices: tuple[str, ...]
    dtype: torch.dtype
    prefetch: int
    threads: int
    rendezvous: str  # a file in a fresh directory: torch.distributed's file:// rendezvous
    frames_path: str  # rank 0 writes the frames here (.npy), for this process to return
    output: str | None  # and the MP4 here, when asked
    shared: SharedWeights


def generate_on_devices(
    info: ModelInfo,
    video: ResolvedVideo,
    devices: str | Sequence[str],
    *,
    dtype: str | torch.dtype = "auto",
    prefetch: int = 2,
    output: str | os.PathLike | None = None,
    threads: int | None = None,
    timeout_s: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_spawn: Callable[[list[int]], None] | None = None,
) -> np.ndarray:
    """Sample one clip of `video` with its tokens split over `devices`: uint8 `(F, H, W, 3)`.

    Block weights stream from one shared host store (see the module docstring); `output`: rank
    0 also writes the MP4 there. `threads`: CPU threads per rank (default: this machine's cores
    shared out). `progress(step, total)` is called here as rank 0 finishes each step;
    `on_spawn(pids)` once the ranks have started. ValueError before anything starts if the
    video cannot be split over the devices; RankFailed if a rank fails; TimeoutError (every rank
    stopped) after `timeout_s`.
    """
    names = parse_devices(devices)
    world = len(names)
    family(info.family).check_parallel(info, video.frames, video.height, video.width, world)
    dtype = resolve_dtype(dtype, torch.device(names[0]))
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world) if names[0] == "cpu" else 1
    shared = share_weights(info, dtype)
    # Fresh processes (not fork: CUDA cannot be forked into, nor this process's threads), forked
    # from a server that has imported the engine once, so a later job skips that import.
    ctx = torch.multiprocessing.get_context("forkserver")
    # (torch._dynamo: building a model on the meta device imports it, seconds per process.)
    ctx.set_forkserver_preload([__name__, "torch._dynamo"])
    with tempfile.TemporaryDirectory(prefix="megaslide-ranks-") as tmp:
        job = _Job(
            info,
            video,
            tuple(names),
            dtype,
            prefetch,
            threads,
            str(Path(tmp) / "rendezvous"),
            str(Path(tmp) / "frames.npy"),
            None if output is None else os.fspath(output),
            shared,
        )
        procs, readers = [], []
        try:
            for rank in range(world):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main, args=(rank, job, writer), name=f"megaslide-rank{rank}"
                )
                proc.start()
                writer.close()  # the child holds its own end; ours would hide its EOF
                procs.append(proc)
                readers.append(reader)
            if on_spawn is not None:
                on_spawn([p.pid for p in procs])
            _watch(procs, readers, names, progress, timeout_s)
        finally:
            _stop(procs)
        return np.load(job.frames_path)


def _watch(procs, readers: list[Connection], names, progress, timeout_s) -> None:
    """Wait for every rank to report done; raise on the first failure (or the timeout)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done: set[int] = set()
    open_readers = dict(enumerate(readers))
    while len(done) < len(procs):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"the job on {','.join(names)} ran past {timeout_s} s: stopped")
        ready = wait(list(open_readers.values()) + [p.sentinel for p in procs], timeout=left)
        for rank, reader in list(open_readers.items()):
            if reader not in ready:
                continue
            try:
                message = reader.recv()
            except EOFError:  # the rank is gone; its exit status says how (below)
                del open_readers[rank]
                continue
            if message[0] == "progress" and progress is not None:
                progress(message[1], message[2])
            elif message[0] == "error":
                raise RankFailed(rank, names[rank], message[1])
            elif message[0] == "done":
                done.add(rank)
        for rank, proc in enumerate(procs):
            if proc.sentinel in ready and rank not in done and proc.exitcode is not None:
                if rank in open_readers and open_readers[rank].poll():
                    continue  # read its last words (an error, or done) first
                raise RankFailed(rank, names[rank], _exit_reason(proc.exitcode))


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _stop(procs) -> None:
    """Stop every rank still running: SIGTERM, then SIGKILL after a grace period."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _rank_main(rank: int, job: _Job, conn: Connection) -> None:
    """One rank: join the group, open the model on its device from the shared weights, sample."""
    import torch.distributed as dist

    from .loader import open_pipeline
    from .parallel import SequenceGroup

    try:
        torch.set_num_threads(job.threads)
        device = torch.device(job.devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{job.rendezvous}",
            rank=rank,
            world_size=len(job.devices),
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        pipe = open_pipeline(
            job.info,
            device=device,
            dtype=job.dtype,
            offload="stream",
            prefetch=job.prefetch,
            shared=job.shared,
        )
        pipe.parallelize(SequenceGroup.default())
        state = pipe.prepare(job.video)
        while not state.done:
            pipe.denoise_step([state])
            if rank == 0:
                conn.send(("progress", state.step, state.num_steps))
        frames = pipe.finish(state)
        if rank == 0:
            np.save(job.frames_path, frames)
            if job.output is not None:
                from .video import write_mp4

                write_mp4(job.output, frames, fps=job.video.fps)
        pipe.close()
        dist.destroy_process_group()
        conn.send(("done",))
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the rank exits
        reason = "".join(traceback.format_exception_only(e)).strip()
        traceback.print_exc(file=sys.stderr)
        try:
            conn.send(("error", reason))
        except OSError:
            pass  # the parent is gone or stopping us already
        sys.exit(1)
