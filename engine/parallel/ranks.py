"""A process per device, spawned and watched: what every multi-device job shares.

`run_ranks(target, job, devices)` starts `target(rank, job, link)` in one fresh process per device
with `torch.multiprocessing` (no torchrun; forkserver, so no CUDA state is forked) and waits for
each to report done. A rank joins the `torch.distributed` group with `join_group` (NCCL on CUDA,
gloo on the CPU; rendezvous through a file in a fresh directory) and talks to this process through
its `RankLink`: progress, its result, or its error.

A rank that fails (an exception, a signal, an exit) fails the job: the other ranks are stopped and
`RankFailed` names the rank and its device, instead of the survivors waiting forever in a
collective whose peer is gone. Sequence-parallel sampling (rank_group.py: its joining, blame and
stopping) and data-parallel fine-tuning (data_parallel.py) both run on it.
"""

from __future__ import annotations

import datetime
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from ..placement import Placement

STOP_GRACE_S = 5.0  # how long a stopped rank gets to exit before it is killed
COLLECTIVE_TIMEOUT_S = 600.0  # a collective waiting longer than this on a peer fails
CAUSE_GRACE_S = 1.0  # how long a rank's error waits for a peer's death it may be the echo of


class RankFailed(RuntimeError):
    """A rank of a multi-device job failed; the job was stopped. `rank` is the one that failed
    first, `device` its device."""

    def __init__(self, rank: int, device: str, reason: str):
        super().__init__(f"rank {rank} ({device}) failed: {reason}")
        self.rank, self.device, self.reason = rank, device, reason


def ranks_placement(devices: str | Sequence[str] | Placement, prefetch: int = 2) -> Placement:
    """The placement of a job over several devices: `devices` as a whole `Placement` (its
    `devices` set), or device names that stream every block (`prefetch` slots each). Its devices
    are checked (`parse_devices`) and its rules too: PlacementError naming the one it breaks."""
    if not isinstance(devices, Placement):
        devices = Placement(
            devices=tuple(parse_devices(devices)), offload="stream", prefetch=prefetch
        )
    if devices.devices is None:
        raise ValueError("a job over several devices needs a placement with devices")
    placement = devices.replace(devices=tuple(parse_devices(devices.devices)))
    return placement.validate()


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


class RankLink:
    """A rank's end of its pipe to the launching process, and its place in the group."""

    def __init__(self, rank: int, devices: Sequence[str], rendezvous: str, conn: Connection):
        self.rank, self.devices, self.rendezvous = rank, tuple(devices), rendezvous
        self.conn = conn

    @property
    def device(self) -> torch.device:
        return torch.device(self.devices[self.rank])

    @property
    def world(self) -> int:
        return len(self.devices)

    def progress(self, *args: Any) -> None:
        """Hand `args` to the launcher's `progress` callback."""
        self.conn.send(("progress", *args))


def join_group(link: RankLink) -> None:
    """Join this job's process group on the rank's device (NCCL on CUDA, gloo on the CPU)."""
    import torch.distributed as dist

    device = link.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{link.rendezvous}",
        rank=link.rank,
        world_size=link.world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def run_ranks(
    target: Callable[[RankLink, Any], Any],
    job: Any,
    devices: Sequence[str],
    *,
    preload: Sequence[str] = (),
    progress: Callable[..., None] | None = None,
    on_spawn: Callable[[list[int]], None] | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Run `target(link, job)` in one process per device; returns what rank 0's target returned.

    `target` must be importable by name (a module-level function) and `job` picklable. `preload`:
    modules the forkserver imports once. `progress(*args)` is called here for each
    `link.progress(*args)` of any rank; `on_spawn(pids)` once the ranks have started. RankFailed if
    a rank fails, TimeoutError after `timeout_s`; either way, and on success, every rank has been
    stopped when this returns.
    """
    names = list(devices)
    # Fresh processes (not fork: CUDA cannot be forked into, nor this process's threads), forked
    # from a server that has imported the engine once, so a later job skips that import.
    ctx = torch.multiprocessing.get_context("forkserver")
    # (torch._dynamo: building a model on the meta device imports it, seconds per process.)
    ctx.set_forkserver_preload([__name__, "torch._dynamo", *preload])
    with tempfile.TemporaryDirectory(prefix="megaslide-ranks-") as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs, readers = [], []
        try:
            for rank in range(len(names)):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(target, job, rank, names, rendezvous, writer),
                    name=f"megaslide-rank{rank}",
                )
                proc.start()
                writer.close()  # the child holds its own end; ours would hide its EOF
                procs.append(proc)
                readers.append(reader)
            if on_spawn is not None:
                on_spawn([p.pid for p in procs])
            return _watch(procs, readers, names, progress, timeout_s)
        finally:
            stop_ranks(procs)


def _rank_main(target, job, rank: int, names, rendezvous: str, conn: Connection) -> None:
    """One rank: run the target, then report its result (rank 0) or its failure."""
    try:
        result = target(RankLink(rank, names, rendezvous, conn), job)
        conn.send(("done", result if rank == 0 else None))
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the rank exits
        reason = "".join(traceback.format_exception_only(e)).strip()
        traceback.print_exc(file=sys.stderr)
        try:
            conn.send(("error", reason))
        except OSError:
            pass  # the parent is gone or stopping us already
        sys.exit(1)


def _watch(procs, readers: list[Connection], names, progress, timeout_s) -> Any:
    """Wait for every rank to report done; raise on the first failure (or the timeout)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done: set[int] = set()
    result = None
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
                progress(*message[1:])
            elif message[0] == "error":
                raise blame(procs, names, rank, message[1], open_readers)
            elif message[0] == "done":
                done.add(rank)
                if rank == 0:
                    result = message[1]
        for rank, proc in enumerate(procs):
            if proc.sentinel in ready and rank not in done and proc.exitcode is not None:
                if rank in open_readers and open_readers[rank].poll():
                    continue  # read its last words (an error, or done) first
                raise RankFailed(rank, names[rank], exit_reason(proc.exitcode))
    return result


def blame(
    procs, names, rank: int, reason: str, readers: dict[int, Connection] | None = None
) -> RankFailed:
    """The failure to report for rank `rank`'s error: a peer that ended without a word (killed,
    or exited) at about the same time, if any, since a collective fails on every rank once one
    of them is gone, and the survivors' errors (a closed connection) only echo it. `readers`:
    the pipes of ranks whose unread words may say they failed on their own."""
    running = [p.sentinel for r, p in enumerate(procs) if r != rank and p.exitcode is None]
    if running:
        wait(running, timeout=CAUSE_GRACE_S)
    for r, proc in enumerate(procs):
        if r == rank or proc.exitcode in (None, 0):
            continue
        if not any(m[0] == "error" for m in _last_words((readers or {}).get(r))):
            return RankFailed(r, names[r], exit_reason(proc.exitcode))
    return RankFailed(rank, names[rank], reason)


def _last_words(reader: Connection | None) -> list[tuple]:
    """What an ended rank sent that was not read yet."""
    words = []
    while reader is not None and reader.poll():
        try:
            words.append(reader.recv())
        except EOFError:
            break
    return words


def exit_reason(code: int) -> str:
    """How a rank process ended, from its exit code ("killed by SIGKILL")."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def stop_ranks(procs) -> None:
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
