"""A model held open on several devices between videos: a process per device, driven step by step.

`generate_on_devices` (multidevice.py) starts its ranks for one video and stops them after it.
A server samples video after video, so `RankGroup(info, ["cuda:0", "cuda:1"])` starts the ranks
once, has each open the model from one shared host copy of the weights (as there, in the
placement's format and tier) and apply sequence parallelism, and keeps them waiting for commands;
`stats()` gathers each rank's streamer accounting. Its `prepare_batch`, `denoise_step`
and `finish_batch` are a `Pipeline`'s step-wise interface: each sends the same command to every
rank, every rank runs it on its own copy of the states (collectives pair up by call order, so
all ranks see the same calls in the same order), and this process keeps a `RankState` per state
with the counters a scheduler reads. A scheduler that batches at step boundaries drives it as it
drives one device: requests join a running batch between steps, and a request it stops stepping
(cancelled) is forgotten by the ranks once its `RankState` is garbage.

Only rank 0 decodes (the decoder is not split); the others hold the same latents and skip it.

Failures: a rank that exits, is killed, or raises inside a step (where its peers may already
wait in a collective for it) fails the call with `RankFailed` naming it, and every rank is
stopped. States of that group raise the same failure if stepped again; the next `prepare_batch`
starts the ranks again from the shared weights still held here (no read from disk), and
`RanksDown` says that restart failed. An error every rank raises alike while preparing (a
request the model refuses), or rank 0 raises while decoding, touches no collective: it is raised
here as the rank raised it and the group goes on.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from ..family import family
from ..interfaces import VideoModel
from ..loader import resolve_dtype, share_weights
from ..placement import Placement
from ..request import RequestError, ResolvedVideo
from ..sources import ModelInfo
from ..streaming.host_store import SharedWeights
from .ranks import (
    STOP_GRACE_S,
    RankFailed,
    RankLink,
    blame,
    exit_reason,
    join_group,
    ranks_placement,
    stop_ranks,
)


class RanksDown(RuntimeError):
    """The ranks of a `RankGroup` could not be started again after a failure: the devices are
    not usable as a group."""


@dataclass(frozen=True)
class _Spec:
    """What every rank is handed at its start (pickled; the shared weights travel as handles)."""

    info: ModelInfo
    devices: tuple[str, ...]
    placement: Placement  # each rank opens `placement.on(its device)`
    dtype: torch.dtype
    threads: int
    rendezvous: str  # a fresh file per start: torch.distributed's file:// rendezvous
    shared: SharedWeights


class RankState:
    """This process's view of one sampling state that every rank holds: its counters, as rank 0
    reported them after the last command."""

    def __init__(self, key: int, generation: int, counters: tuple[int, int, bool, int]):
        self.key, self.generation = key, generation
        self.step, self.num_steps, self.done, self.passes = counters


class RankGroup(VideoModel):
    """The model `info` opened on each of `devices` by a process of its own, its tokens split over
    them (see the module docstring). Implements the Pipeline's `prepare_batch`, `denoise_step`
    and `finish_batch`; `close` stops the ranks."""

    def __init__(
        self,
        info: ModelInfo,
        devices: str | Sequence[str] | Placement,
        *,
        dtype: str | torch.dtype = "auto",
        prefetch: int = 2,
        threads: int | None = None,
    ):
        """`devices` names the devices, or is a whole `Placement` with `devices` (then its
        `prefetch` is the one used); ValueError for one its rules refuse."""
        self.info = info
        self.placement = ranks_placement(devices, prefetch)
        self.devices = self.placement.devices
        self.dtype = resolve_dtype(dtype, torch.device(self.devices[0]))
        world = len(self.devices)
        if threads is None:
            cpu = self.devices[0] == "cpu"
            threads = max(1, (os.cpu_count() or 1) // world) if cpu else 1
        self.prefetch, self.threads = self.placement.prefetch, threads
        # One copy for the host, in the placement's format and tier ("auto" resolved here, once);
        # held for restarts.
        self._shared = share_weights(info, self.dtype, placement=self.placement)
        self._tmp = tempfile.TemporaryDirectory(prefix="megaslide-ranks-")
        self._procs: list = []
        self._conns: list[Connection] = []
        self._generation = 0
        self._failure: RankFailed | None = None  # why the last group stopped
        self._keys = itertools.count()
        # Keys of states no longer referenced here, for the ranks to drop with the next command
        # (appended by finalizers, on whichever thread drops the last reference).
        self._forgotten: collections.deque[int] = collections.deque()
        self._finalizer = weakref.finalize(self, _stop_all, self._procs)
        self._start()

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, rank order (empty while stopped)."""
        return [p.pid for p in self._procs]

    # -- the Pipeline's step-wise interface -------------------------------------------------------

    def check(self, video: ResolvedVideo) -> None:
        """RequestError naming the field if `video` cannot run split over these devices."""
        check_video(self.info, video, self.devices)

    def prepare_batch(self, videos: list[ResolvedVideo]) -> list[RankState]:
        """Every rank prepares the same states (prompts encoded, noise drawn from each seed)."""
        for video in videos:
            self.check(video)
        if not self._procs:
            self._restart()
        keys = [next(self._keys) for _ in videos]
        counters = self._call("prepare", keys, videos)[0]
        states = [RankState(k, self._generation, c) for k, c in zip(keys, counters, strict=True)]
        for state in states:
            weakref.finalize(state, self._forgotten.append, state.key)
        return states

    def denoise_step(self, states: list[RankState]) -> dict[str, int]:
        """One step of every unfinished state, on every rank together; the bytes the ranks'
        streamers moved (summed over the devices)."""
        answers = self._call("step", self._keys_of(states))
        for state, c in zip(states, answers[0][1], strict=True):
            state.step, state.num_steps, state.done, state.passes = c
        transfers: dict[str, int] = {}
        for rank_transfers, _ in answers:
            for name, count in rank_transfers.items():
                transfers[name] = transfers.get(name, 0) + count
        return transfers

    def finish_batch(self, states: list[RankState]) -> list:
        """Rank 0 decodes the finished states to uint8 frames `(F, H, W, 3)` each."""
        return self._call("finish", self._keys_of(states))[0]

    def stats(self) -> list[dict[str, dict]]:
        """Each rank's streamer accounting (`Pipeline.stats()`: by streamed component, with
        per-block copy and compute times when the placement has `timing`), rank order. Timing
        figures wait for each rank's queued work, as on one device."""
        if not self._procs:
            raise RuntimeError(f"the ranks of {self.name} are not running")
        return self._call("stats")

    def close(self) -> None:
        """Stop the ranks (they leave their group) and free the shared weights."""
        for conn in self._conns:
            try:
                conn.send(("close", []))
            except OSError:
                pass  # that rank is gone already
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self._procs:  # each leaves the group; the stragglers are stopped below
            proc.join(max(0.0, deadline - time.monotonic()))
        _stop_all(self._procs)
        self._conns = []
        self._shared = None  # its pages go with the last process that maps them
        self._tmp.cleanup()

    # -- the ranks ------------------------------------------------------------------------------

    def _keys_of(self, states: list[RankState]) -> list[int]:
        stale = [s for s in states if s.generation != self._generation or not self._procs]
        if stale:
            f = self._failure
            raise RankFailed(f.rank, f.device, f.reason) if f else RuntimeError("ranks stopped")
        return [s.key for s in states]

    def _start(self) -> None:
        """Start one process per device and wait until each has opened the model."""
        ctx = torch.multiprocessing.get_context("forkserver")
        # (torch._dynamo: building a model on the meta device imports it, seconds per process.)
        ctx.set_forkserver_preload([__name__, "torch._dynamo"])
        self._generation += 1
        spec = _Spec(
            self.info,
            self.devices,
            self.placement,
            self.dtype,
            self.threads,
            str(Path(self._tmp.name) / f"rendezvous-{self._generation}"),
            self._shared,
        )
        for rank in range(len(self.devices)):
            ours, theirs = ctx.Pipe(duplex=True)
            # Daemonic: a server that exits without `close` takes its ranks along.
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, spec, theirs),
                name=f"megaslide-rank{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()  # the child holds its own end; ours would hide its EOF
            self._procs.append(proc)
            self._conns.append(ours)
        self._gather("ready")

    def _restart(self) -> None:
        if self._shared is None:
            raise RuntimeError(f"the ranks of {self.name} were closed")
        try:
            self._start()
        except RankFailed as e:
            raise RanksDown(
                f"the ranks on {','.join(self.devices)} could not start again: {e}"
            ) from e

    def _call(self, command: str, *args) -> list:
        """Send `command` to every rank; their answers, rank order (see the module docstring
        for which errors stop the group)."""
        forgotten = []
        while self._forgotten:
            forgotten.append(self._forgotten.popleft())
        for conn in self._conns:
            try:
                conn.send((command, forgotten, *args))
            except OSError:  # that rank is gone: its exit status says how (in `_gather`)
                pass
        return self._gather(command)

    def _gather(self, command: str) -> list:
        """Wait for every rank's answer to `command`; raise as the module docstring says."""
        answers: dict[int, tuple] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            ready = wait(list(pending.values()) + [self._procs[r].sentinel for r in pending])
            for rank, conn in list(pending.items()):
                proc = self._procs[rank]
                if conn in ready:
                    try:
                        answers[rank] = conn.recv()
                    except (EOFError, OSError):  # it exited: its status says how
                        proc.join(STOP_GRACE_S)
                        code = proc.exitcode
                        self._down(rank, "closed its pipe" if code is None else exit_reason(code))
                    del pending[rank]
                    if answers[rank][0] == "error" and command in ("ready", "step"):
                        # Its peers may wait for it in a collective: stop them all.
                        failure = blame(self._procs, self.devices, rank, _error_text(answers[rank]))
                        self._down(failure.rank, failure.reason)
                elif proc.sentinel in ready and not conn.poll():  # gone without a word
                    proc.join()
                    self._down(rank, exit_reason(proc.exitcode))
        errors = {r: a for r, a in answers.items() if a[0] == "error"}
        if errors and len(errors) < len(answers) and command == "prepare":
            rank = min(errors)  # the ranks disagree about the same requests: their states too
            self._down(rank, _error_text(errors[rank]))
        if 0 in errors:
            _, kind, text, param, code = errors[0]
            if kind == "RequestError":
                raise RequestError(text, param=param, code=code)
            raise RuntimeError(_error_text(errors[0]))
        return [answers[r][1] for r in range(len(answers))]

    def _down(self, rank: int, reason: str):
        """Stop every rank; raise `RankFailed` for `rank`, and for the states stepped later."""
        _stop_all(self._procs)
        self._conns = []
        self._failure = RankFailed(rank, self.devices[rank], reason)
        raise self._failure


def check_video(info: ModelInfo, video: ResolvedVideo, devices: Sequence[str]) -> None:
    """RequestError naming the field if `video` cannot run split over `devices`: what the ranks
    do not take yet (LoRA adapters, a first frame, a step cache), or a token grid that does not
    split (`Family.check_parallel`)."""
    world = len(devices)
    where = f"on {world} devices ({','.join(devices)})"
    if video.loras:
        raise RequestError(f"LoRA adapters do not run {where} yet", param="loras")
    if video.image is not None:
        raise RequestError(f"image-to-video does not run {where} yet", param="input_reference")
    if video.cache is not None:
        raise RequestError(f"step caches do not run {where} yet", param="cache")
    try:
        family(info.family).check_parallel(info, video.frames, video.height, video.width, world)
    except ValueError as e:
        size = f"{video.width}x{video.height}, {video.frames} frames"
        raise RequestError(f"{size} does not split {where}: {e}", param="size") from None


def _stop_all(procs: list) -> None:
    """Stop every rank still running (`ranks.stop_ranks`) and forget them."""
    stop_ranks(procs)
    procs.clear()


def _rank_main(rank: int, spec: _Spec, conn: Connection) -> None:
    """One rank: join the group, open the model on its device from the shared weights, then run
    the commands it is sent until told to close (or this end of the pipe closes)."""
    import torch.distributed as dist

    from ..loader import open_pipeline
    from .sequence import SequenceGroup

    states: dict[int, object] = {}
    try:
        torch.set_num_threads(spec.threads)
        link = RankLink(rank, spec.devices, spec.rendezvous, conn)
        join_group(link)
        device = link.device
        pipe = open_pipeline(
            spec.info, spec.placement.on(str(device)), dtype=spec.dtype, shared=spec.shared
        )
        pipe.parallelize(SequenceGroup.default())
    except BaseException as e:  # noqa: BLE001 - reported, then the rank exits
        _report(conn, e)
        sys.exit(1)
    conn.send(("ok", "ready"))
    while True:
        try:
            command, forgotten, *args = conn.recv()
        except EOFError:  # the parent is gone
            break
        for key in forgotten:
            states.pop(key, None)
        if command == "close":
            break
        try:
            if command == "prepare":
                keys, videos = args
                prepared = pipe.prepare_batch(videos)
                states.update(zip(keys, prepared, strict=True))
                answer = [_counters(s) for s in prepared]
            elif command == "step":
                chosen = [states[k] for k in args[0]]
                transfers = pipe.denoise_step(chosen)
                answer = (transfers, [_counters(s) for s in chosen])
            elif command == "stats":
                answer = pipe.stats()
            elif command == "finish":
                # The decoder is not split: rank 0 alone decodes, the others hold no frames.
                answer = pipe.finish_batch([states[k] for k in args[0]]) if rank == 0 else None
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception as e:  # noqa: BLE001 - the parent decides whether the group goes on
            _report(conn, e)
            continue
        conn.send(("ok", answer))
    pipe.close()
    dist.destroy_process_group()


def _error_text(answer: tuple) -> str:
    """A rank's ("error", kind, text, ...) answer as one line: "ValueError: no such thing"."""
    kind, text = answer[1], answer[2]
    return f"{kind}: {text}" if text else kind


def _counters(state) -> tuple[int, int, bool, int]:
    return state.step, state.num_steps, state.done, state.passes


def _report(conn: Connection, e: BaseException) -> None:
    traceback.print_exc(file=sys.stderr)
    text = str(e).strip()
    try:
        conn.send(
            ("error", type(e).__name__, text, getattr(e, "param", None), getattr(e, "code", None))
        )
    except OSError:
        pass  # the parent is gone or stopping us already
