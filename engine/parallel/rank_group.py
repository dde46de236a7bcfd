"""A model held open on several devices: a process per device, driven step by step.

`RankGroup(info, ["cuda:0", "cuda:1"])` starts the ranks once, has each open the model from one
shared host copy of the weights (multidevice.py; in the placement's format and tier) and apply
sequence parallelism, and keeps them waiting for commands: a server samples video after video on
it, and `generate_on_devices` drives one video on it and closes it; `stats()` gathers each rank's
streamer accounting. Its `prepare_batch`, `denoise_step`
and `finish_batch` are a `Pipeline`'s step-wise interface: each sends the same command to every
rank, every rank runs it on its own copy of the states (collectives pair up by call order, so
all ranks see the same calls in the same order), and this process keeps a `RankState` per state
with the counters a scheduler reads. A scheduler that batches at step boundaries drives it as it
drives one device: requests join a running batch between steps, and a request it stops stepping
(cancelled) is forgotten by the ranks once its `RankState` is garbage.

Only rank 0 decodes (the decoder is not split); the others hold the same latents and skip it.

LoRA adapters are a Pipeline's: `register_adapter` (or `add_adapter`, a file) sends the converted
adapter to every rank, which registers it on its own pipeline; this process keeps the adapters
for the cards and defaults it answers, and registers them again on ranks started again. Every
other lever (a first-frame image, a step cache) travels in the request and runs on the ranks as
on one device (step_cache.py says how the first-block cache decides alike on every rank).

Failures: a rank that exits, is killed, or raises inside a step (where its peers may already
wait in a collective for it) fails the call with `RankFailed` naming it, and every rank is
stopped. States of that group raise the same failure if stepped again; the next `prepare_batch`
starts the ranks again from the shared weights still held here (no read from disk), and
`RanksDown` says that restart failed. An error every rank raises alike while preparing (a
request the model refuses) or registering an adapter, or rank 0 raises while decoding, touches
no collective: it is raised here as the rank raised it and the group goes on.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from ..delta_format import ModelDelta
from ..deltas import DeltaError, base_digests
from ..family import family
from ..interfaces import VideoModel
from ..loader import load_adapter, resolve_dtype, share_weights
from ..lora import Adapter, AdapterError
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
    and `finish_batch` and its adapters' methods; `close` stops the ranks."""

    def __init__(
        self,
        info: ModelInfo,
        devices: str | Sequence[str] | Placement,
        *,
        dtype: str | torch.dtype = "auto",
        prefetch: int = 2,
        threads: int | None = None,
        on_spawn: Callable[[list[int]], None] | None = None,
        timeout_s: float | None = None,
    ):
        """`devices` names the devices, or is a whole `Placement` with `devices` (then its
        `prefetch` is the one used); ValueError for one its rules refuse. `on_spawn(pids)` is
        called each time the ranks have started. `timeout_s`: a group for one job; a call still
        waiting for the ranks `timeout_s` after the group was made stops them all and raises
        TimeoutError (None: calls wait as long as the ranks take)."""
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
        self._adapters: dict[str, Adapter] = {}  # registered on every rank, in order
        self._cards: dict[str, dict] = {}  # each one's card, as rank 0 registered it
        self.fine_tunes: dict[str, ModelDelta] = {}  # registered on every rank, in order
        self._digests: dict | None = None  # the base's tensors' SHA-256, once a delta needs them
        self._on_spawn = on_spawn
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._timeout_s = timeout_s
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

    # -- LoRA adapters: a Pipeline's, registered on every rank --------------------------------------

    def add_adapter(self, name: str, path, *, replace: bool = False) -> dict:
        """Register the LoRA file at `path` under `name` on every rank: converted and checked
        here, once (`loader.load_adapter`; AdapterError naming the first key that does not fit).
        Returns its card."""
        return self.register_adapter(load_adapter(self.info, name, path), replace=replace)

    def register_adapter(self, adapter: Adapter, *, replace: bool = False) -> dict:
        """Register an adapter already converted on every rank; returns its card."""
        if adapter.name in self._adapters and not replace:
            raise AdapterError(f"an adapter named {adapter.name!r} is already registered")
        if not self._procs:
            self._restart()  # which registers the others again
        card = self._call("adapter", adapter, replace)[0]
        self._adapters[adapter.name], self._cards[adapter.name] = adapter, card
        return dict(card)

    def remove_adapter(self, name: str) -> None:
        """Unregister adapter `name` on every rank (ranks stopped forget it as they restart)."""
        self._adapters.pop(name, None)
        self._cards.pop(name, None)
        if self._procs:
            self._call("remove", name)

    def adapter_cards(self) -> list[dict]:
        return [dict(card) for card in self._cards.values()]

    def adapter_defaults(self) -> dict[str, dict]:
        """Registered adapters by name, each with the sampling defaults it carries."""
        return {n: dict(a.defaults) for n, a in self._adapters.items()}

    # -- fine-tunes kept as deltas: a Pipeline's, registered on every rank ------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    def add_fine_tune(self, name: str, delta: ModelDelta) -> dict:
        """Register the fine-tune `delta` under `name` on every rank (`Pipeline.add_fine_tune`),
        checked against the base here, once. Each rank holds its own copy of the deltas."""
        if name in self.fine_tunes:
            raise DeltaError(f"{self.name} already has a fine-tune {name!r}")
        if self._digests is None:
            self._digests = base_digests(self.info, self.dtype)
        delta.check(self._digests, self.name)
        if not self._procs:
            self._restart()
        card = self._call("fine_tune", name, delta)[0]
        self.fine_tunes[name] = delta
        return dict(card)

    def remove_fine_tune(self, name: str) -> None:
        """Unregister fine-tune `name` on every rank."""
        if self.fine_tunes.pop(name, None) is not None and self._procs:
            self._call("remove_fine_tune", name)

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
        if self._on_spawn is not None:
            self._on_spawn(self.pids)
        self._gather("ready")

    def _restart(self) -> None:
        if self._shared is None:
            raise RuntimeError(f"the ranks of {self.name} were closed")
        try:
            self._start()
            for adapter in self._adapters.values():  # what the stopped ranks had registered
                self._call("adapter", adapter, True)
            for name, delta in self.fine_tunes.items():
                self._call("fine_tune", name, delta)
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
            left = None if self._deadline is None else self._deadline - time.monotonic()
            if left is not None and left <= 0:
                _stop_all(self._procs)
                self._conns = []
                raise TimeoutError(
                    f"the job on {','.join(self.devices)} ran past {self._timeout_s} s: stopped"
                )
            waited = list(pending.values()) + [self._procs[r].sentinel for r in pending]
            ready = wait(waited, timeout=left)
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
                        # Its peers may wait for it in a collective: stop them all. A peer
                        # that ended with an error of its own unread (`pending`) is not blamed.
                        text = _error_text(answers[rank])
                        failure = blame(self._procs, self.devices, rank, text, pending)
                        self._down(failure.rank, failure.reason)
                elif proc.sentinel in ready and not conn.poll():  # gone without a word
                    proc.join()
                    self._down(rank, exit_reason(proc.exitcode))
        errors = {r: a for r, a in answers.items() if a[0] == "error"}
        if errors and len(errors) < len(answers) and command in ("prepare", "adapter", "remove"):
            # The ranks disagree about the same requests (their states too), or hold different
            # adapters: the next step would not be the same model on every rank.
            rank = min(errors)
            self._down(rank, _error_text(errors[rank]))
        if 0 in errors:
            _, kind, text, param, code = errors[0]
            if kind == "RequestError":
                raise RequestError(text, param=param, code=code)
            if kind == "AdapterError":
                raise AdapterError(text)
            raise RuntimeError(_error_text(errors[0]))
        return [answers[r][1] for r in range(len(answers))]

    def _down(self, rank: int, reason: str):
        """Stop every rank; raise `RankFailed` for `rank`, and for the states stepped later."""
        _stop_all(self._procs)
        self._conns = []
        self._failure = RankFailed(rank, self.devices[rank], reason)
        raise self._failure


def check_video(info: ModelInfo, video: ResolvedVideo, devices: Sequence[str]) -> None:
    """RequestError naming the field if `video` cannot run split over `devices`: a token grid
    that does not split (`Family.check_parallel`)."""
    world = len(devices)
    where = f"on {world} devices ({','.join(devices)})"
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
            elif command == "adapter":
                adapter, replace = args
                answer = pipe.register_adapter(adapter, replace=replace)
            elif command == "remove":
                pipe.remove_adapter(args[0])
                answer = None
            elif command == "fine_tune":
                name, delta = args
                answer = pipe.add_fine_tune(name, delta, checked=True)  # by the parent, once
            elif command == "remove_fine_tune":
                pipe.remove_fine_tune(args[0])
                answer = None
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
