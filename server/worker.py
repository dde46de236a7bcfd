"""A worker: one thread that owns one device's models, claims jobs from the store and runs them step
by step. `megaslide serve` runs one inside the API's process (`EmbeddedWorker`); `megaslide worker`
runs one per device on any host that reaches the store (`run_worker`).

Scheduling happens at denoising-step boundaries. At each boundary the worker

1. drops running videos whose cancellation was requested (the model never runs another step for
   them), wherever the DELETE arrived;
2. claims queued videos into the running batch: jobs with the same batch key (model, frames, size,
   steps) share one forward pass per step, so a new request joins a running batch at the next step
   instead of waiting for it to finish. Claims follow the queue order (priority, then arrival) and
   stop at the first job that cannot join, so batching never lets a job overtake an earlier one;
3. runs one batched denoising step, records progress (which renews the jobs' leases), and hands
   finished clips to the encoder thread;
4. only when no video is queued or running, runs one fine-tuning step. A running fine-tune thus
   yields to videos at its next step boundary and continues where it stopped once they are done.

Only jobs for models this worker serves are claimed: its base models and the fine-tunes of them.

Every job runs inside its own try/except: an exception (CUDA out of memory included) fails that job
with its message, and the next boundary proceeds as usual. Only an error that leaves the device
unusable for any job (`Backend.is_fatal`), or one outside any job, kills the worker, which
`/healthz` and `/metrics` then report. When the job store itself fails (a full disk, a database
restarting), the worker keeps its jobs in memory and retries with back-off: nothing is lost, and
whatever it could not record before its leases ran out runs again elsewhere.

A second thread sends the heartbeat: it proves the worker alive in the registry, publishes its
metrics, and extends the leases of the jobs it holds. When a write comes back refused (the lease
went to another worker while this one was silent), the job is dropped here without a trace: its
outcome belongs to the new holder.

The models sit behind the `Backend` it is given (backend.py), so this module, like the routers,
never imports torch. A stored request (`engine.request.ResolvedVideo`) goes to the model as stored.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import math
import os
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megaslide.engine.request import RequestError, ResolvedVideo

from .backend import Backend, FinetuneJob, TrainingRun, VideoModel, finetune_spec
from .datadir import DataDir
from .metrics import PUBLISH_INTERVAL_S, Registry, Totals
from .protocol import ModelCard, card_to_dict
from .settings import Settings
from .store import (
    UNAVAILABLE,
    ClaimLost,
    JobStore,
    WorkerNameInUse,
    is_disk_full,
    new_token,
    now,
)
from .workers import Fleet, fine_tuned_card

log = logging.getLogger("megaslide.server")

IDLE_WAIT_S = 0.5  # how long an idle worker sleeps before looking at the store again if not woken
MAX_LOADED_FINE_TUNES = 2  # fine-tuned models kept loaded beside the base ones (LRU)
DENOISE_SHARE = 90  # progress points for denoising; decoding and encoding the MP4 take the rest
DECODED_PROGRESS = 95  # clip decoded, MP4 being written; 100 only once the file is in place
HOUSEKEEPING_INTERVAL_S = 600.0  # how often an idle worker deletes expired outputs
ADAPTER_SCAN_S = 1.0  # how often a worker looks for uploaded LoRA adapters
RECOVERY_INTERVAL_S = 1.0  # how often a worker requeues jobs whose leases expired
STORE_RETRY_S = (0.2, 5.0)  # back-off while the job store fails: first wait, longest wait


@dataclass
class _Running:
    """A video in the running batch, under the claim `token`."""

    id: str
    token: str
    video: ResolvedVideo
    state: Any
    started: float


@dataclass
class _Tuning:
    """The fine-tune the worker is driving (kept in memory while it yields to videos)."""

    id: str
    token: str
    trainer: TrainingRun
    parent: str
    suffix: str
    paused: bool = False
    known_checkpoints: set = field(default_factory=set)


class DeviceLost(Exception):
    """An error inside a job left the device unusable (`Backend.is_fatal`): the worker stops."""


def default_name(device: str) -> str:
    """One worker per device slot of a host: a restart under the same name takes its jobs back."""
    return f"{socket.gethostname()}/{device}"


# (database, name) of the workers running in this process: a second one of a name on one store is
# refused here, whatever the registry's heartbeat says.
_RUNNING_HERE: set[tuple[str, str]] = set()
_RUNNING_LOCK = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


class Worker:
    """Runs the jobs of one job store on the models of one backend (one device)."""

    def __init__(self, settings: Settings, backend: Backend, store: JobStore, name: str):
        self.settings, self.backend, self.store, self.name = settings, backend, store, name
        self.data = DataDir(settings.storage_dir)
        self.token = new_token()
        self.metrics = Registry()
        self._published_at = 0.0
        self.cards = {card.name: card for card in backend.cards()}
        self.ready = False
        self.dead: str | None = None
        self.trouble: str | None = None  # why the job store fails, while it does
        self.stop = threading.Event()
        self.wake = threading.Event()
        self._loaded: dict[str, VideoModel] = {}
        self._loaded_ft: OrderedDict[str, VideoModel] = OrderedDict()
        self._ft_cards: dict[str, ModelCard] = {}
        self._encoder = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="megaslide-encode"
        )  # MP4 writing overlaps the next denoising steps instead of delaying them
        self._heartbeat: threading.Thread | None = None
        self._batch: list[_Running] = []
        self._encoding: dict[str, str] = {}  # video id -> claim token, while its MP4 is written
        self._tuning: _Tuning | None = None
        self._last_housekeeping = time.monotonic()
        self._last_adapter_scan = -ADAPTER_SCAN_S
        self._last_recovery = -RECOVERY_INTERVAL_S
        self._progress_at = time.monotonic()  # when the main loop last began a tick

    # --- life cycle --------------------------------------------------------------------------

    def register(self) -> None:
        """Enter the registry; jobs a previous incarnation of this name held come back now.

        A live worker of the same name is refused (`WorkerNameInUse`): one on another host that
        was heard from within the lease, or a process of this host that still runs.
        """
        row = self.store.worker(self.name)
        if row is not None and row["age_s"] < self.settings.lease_s:
            if row["host"] != socket.gethostname() or (
                row["pid"] != os.getpid() and _alive(row["pid"])
            ):
                raise WorkerNameInUse(
                    f"a worker named {self.name!r} is already running (pid {row['pid']} on "
                    f"{row['host']}); give this one another name"
                )
        with _RUNNING_LOCK:
            if (self.store.url, self.name) in _RUNNING_HERE:
                raise WorkerNameInUse(f"a worker named {self.name!r} already runs in this process")
            _RUNNING_HERE.add((self.store.url, self.name))
        requeued = self.store.register_worker(
            self.name,
            self.token,
            host=socket.gethostname(),
            pid=os.getpid(),
            device=self.backend.device_name,
            capacity=self.settings.max_batch,
            cards=[card_to_dict(c) for c in self.cards.values()],
        )
        if any(requeued.values()):
            log.warning("worker %s took back what its last run held: %s", self.name, requeued)
        self._heartbeat = threading.Thread(
            target=self._beat, name="megaslide-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def run(self) -> None:
        """Load the models, then run jobs until `stop` is set; parks unfinished work on the way
        out. Errors outside any job end the loop and are kept in `dead`."""
        try:
            for name, card in self.cards.items():
                log.info("loading model %s (%s)", name, card.source)
                self._loaded[name] = self.backend.load(card)
            self.ready = True
            self._send_heartbeat()
            log.info("worker %s ready: %s", self.name, ", ".join(self.cards))
            retries = _backoff()
            while not self.stop.is_set():
                self._progress_at = time.monotonic()  # the watchdog's proof of life (_beat)
                try:
                    busy = self._tick() or self._housekeeping() or self._scan_adapters()
                except UNAVAILABLE as exc:
                    self._store_failed(exc, next(retries))
                    continue
                if self.trouble is not None:
                    log.warning("the job store works again")
                    self.trouble, retries = None, _backoff()
                if not busy:
                    self.wake.wait(IDLE_WAIT_S)
                    self.wake.clear()
            self._park()
        except BaseException as exc:  # noqa: BLE001 - outside any job, or the device is lost: the worker is dead
            self.dead = f"{type(exc).__name__}: {exc}"
            log.exception("worker died")
            try:  # nothing may show as running without a live worker: back to the queue
                self._park()
            except Exception:  # noqa: BLE001 - their leases expire instead
                log.exception("could not requeue the running jobs")
            self._send_heartbeat()

    def _store_failed(self, exc: BaseException, wait_s: float) -> None:
        """A tick failed on the store: keep the jobs in memory and try again in `wait_s`."""
        reason = f"the job store fails: {_message(exc)}"
        if self.trouble is None:
            log.error("%s; retrying with back-off", reason)
        self.trouble = reason
        self.stop.wait(wait_s)

    def _retrying(self, call, *args, **kwargs):
        """`call(*args, **kwargs)`, retried with back-off while the store fails; None if the
        worker stops first (the job's lease then runs out and it runs again elsewhere)."""
        for wait_s in _backoff():
            try:
                return call(*args, **kwargs)
            except UNAVAILABLE as exc:
                log.warning("job store write failed, retrying in %.1f s: %s", wait_s, exc)
                if self.stop.wait(wait_s):
                    return None
        return None

    def close(self) -> None:
        """Leave the registry (after `run` returned)."""
        self.stop.set()
        self._encoder.shutdown(wait=True)
        if self._heartbeat is not None:
            self._heartbeat.join()
        self.store.deregister_worker(self.name, self.token)
        with _RUNNING_LOCK:
            _RUNNING_HERE.discard((self.store.url, self.name))

    def _beat(self) -> None:
        withheld = False
        while not self.stop.wait(self.settings.heartbeat_s):
            # A watchdog: a main loop stuck in one step for `stall_s` (a hung kernel, a deadlock)
            # must not keep its jobs' leases alive from this thread. Without a beat the leases
            # expire and the jobs run elsewhere; should the loop come back, its writes are
            # refused (each claim's token) and it drops them.
            stalled_s = time.monotonic() - self._progress_at
            if self.ready and stalled_s > self.settings.stall_s:
                if not withheld:
                    log.error(
                        "worker %s: its loop made no progress for %.0f s; withholding the "
                        "heartbeat so that its jobs' leases expire",
                        self.name,
                        stalled_s,
                    )
                withheld = True
                continue
            if withheld:
                log.warning("worker %s: its loop moves again; heartbeat resumed", self.name)
                withheld = False
            try:
                self._send_heartbeat()
            except Exception:  # noqa: BLE001 - the store may be back at the next beat
                log.exception("heartbeat failed")

    def _leases(self) -> list[str]:
        """The claims this worker still works on (read from the heartbeat thread)."""
        tokens = [r.token for r in list(self._batch)] + list(self._encoding.values())
        tuning = self._tuning
        return tokens + ([tuning.token] if tuning is not None else [])

    def _send_heartbeat(self) -> None:
        alive = self.store.heartbeat(
            self.name,
            self.token,
            leases=self._leases(),
            lease_s=self.settings.lease_s,
            ready=self.ready,
            dead=self.dead,
            metrics=self.metrics.snapshot(),
        )
        if not alive:
            log.error("worker %s was registered again elsewhere; stopping", self.name)
            self.stop.set()
            self.wake.set()

    def _count_finished(self, kind: str, status: str) -> None:
        self.metrics.jobs_finished.labels(kind=kind, status=status).inc()
        self._publish_metrics(force=True)

    def _publish_metrics(self, force: bool = False) -> None:
        """Show the API hosts this worker's counters now rather than at the next heartbeat, at
        most every `PUBLISH_INTERVAL_S` unless `force`d (a job ended)."""
        now = time.monotonic()
        if not force and now - self._published_at < PUBLISH_INTERVAL_S:
            return
        self._published_at = now
        try:
            self.store.publish_metrics(self.name, self.token, self.metrics.snapshot())
        except Exception:  # noqa: BLE001 - the next heartbeat publishes them again
            log.debug("publishing metrics failed", exc_info=True)

    # --- the loop ----------------------------------------------------------------------------

    def _tick(self) -> bool:
        """One scheduling decision at a step boundary; False when there was nothing to do."""
        if time.monotonic() - self._last_recovery >= RECOVERY_INTERVAL_S:
            self._last_recovery = time.monotonic()
            recovered = self.store.recover_expired()
            if any(recovered.values()):
                log.warning("requeued jobs whose workers went silent: %s", recovered)
        self._drop_cancelled()
        # Checked here, not only when it trains: a fine-tune paused for videos is cancelled at once.
        if self._tuning is not None and self.store.finetune_cancel_requested(self._tuning.id):
            self._end_finetune("cancelled")
        self._claim_videos()
        if self._batch:
            if self._tuning is not None and not self._tuning.paused:
                self._tuning.paused = True
                self._finetune_event("Paused at a step boundary: video jobs are waiting")
            self._step_videos()
            return True
        return self._step_finetune()

    def served(self) -> list[str]:
        """The model names this worker runs jobs for: its own, and fine-tunes made from them."""
        names = list(self.cards)
        for row in self.store.models():
            if row["parent"] in names:
                names.append(row["name"])
        return names

    def _housekeeping(self) -> bool:
        """When idle, now and then: delete the files of videos whose `expires_at` has passed,
        old events of finished jobs and expired idempotency keys. Never counts as work done."""
        if time.monotonic() - self._last_housekeeping < HOUSEKEEPING_INTERVAL_S:
            return False
        self._last_housekeeping = time.monotonic()
        for video_id in self.store.expired_videos():
            for path in self.data.video_files(video_id):
                path.unlink(missing_ok=True)
        self.store.prune_events(self.settings.event_ttl_s)
        self.store.forget_idempotency_keys()
        return False

    def _scan_adapters(self) -> bool:
        """Now and then, at a step boundary: register the LoRA adapters uploaded for the base
        models served here (`DataDir.adapters`), unregister those deleted (once no running
        video applies them), and publish the cards when they changed. A file that does not
        fit gets its refusal written beside it. Never counts as work done."""
        if time.monotonic() - self._last_adapter_scan < ADAPTER_SCAN_S:
            return False
        self._last_adapter_scan = time.monotonic()
        changed = False
        for model, card in list(self.cards.items()):
            folder = self.data.adapters(model)
            uploaded = {name: folder.record(name) for name in folder.names()}
            in_use = {c.name for r in self._batch for c in r.video.loras}
            for entry in card.adapters:
                name = entry["name"]
                if "sha256" not in entry or name in in_use:  # registered at start, or in use
                    continue
                if name not in uploaded or uploaded[name]["sha256"] != entry["sha256"]:
                    # Deleted, or deleted and uploaded again under the name.
                    self.backend.remove_adapter(card, self._loaded.get(model), name)
                    card = card.replace(adapters=tuple(a for a in card.adapters if a is not entry))
                    changed = True
                    log.info("adapter %s removed from %s", name, model)
            known = {a["name"] for a in card.adapters}
            for name, record in uploaded.items():
                if name in known or folder.error(name) is not None:
                    continue
                try:
                    entry = self.backend.add_adapter(
                        card, self._loaded.get(model), name, folder.file(name)
                    )
                except (ValueError, OSError) as exc:
                    folder.refuse(name, str(exc))
                    log.warning("adapter %s for %s refused: %s", name, model, exc)
                    continue
                card = card.replace(adapters=(*card.adapters, {**entry, **record}))
                changed = True
                log.info("adapter %s registered on %s", name, model)
            self.cards[model] = card
        if changed:
            self.store.publish_cards(
                self.name, self.token, [card_to_dict(c) for c in self.cards.values()]
            )
        return False

    def _runnable(self, row: dict) -> bool:
        """Whether this worker can take the queued video `row` now: not while it names an
        adapter uploaded here but not yet taken up (the scan runs at the next tick), or one
        another live worker has and this one does not. One that no worker has is taken, to
        fail naming the adapter."""
        names = {c["name"] for c in json.loads(row["spec"]).get("loras") or ()}
        card = self.cards.get(row["model"])
        missing = names - {a["name"] for a in card.adapters} if card is not None else set()
        if not missing:
            return True
        folder = self.data.adapters(row["model"])
        if any(folder.file(n).exists() and folder.error(n) is None for n in missing):
            self._last_adapter_scan = -math.inf  # take it up at once
            return False
        elsewhere = {
            a["name"]
            for w in self.store.live_workers(self.settings.lease_s)
            if w["name"] != self.name and not w["dead"]
            for c in w["models"]
            if c["name"] == row["model"]
            for a in c.get("adapters") or ()
        }
        return not missing & elsewhere

    def _park(self) -> None:
        """Graceful stop: running videos go back to the queue, a running fine-tune checkpoints
        first. Whichever worker claims them next carries on. (With the store failing, their
        leases run out instead: the same outcome, later.)"""
        claims = [(r.id, r.token) for r in self._batch]
        self._batch = []
        try:
            self.store.requeue_videos(claims, f"requeued: worker {self.name} stopped while it ran")
        except UNAVAILABLE:
            log.exception("could not requeue the running videos; their leases will expire")
        if self._tuning is not None:
            t, self._tuning = self._tuning, None
            try:
                path = t.trainer.save_checkpoint()
                self._record_checkpoints(t)
                reason = f"requeued: worker {self.name} stopped; will resume from {Path(path).name}"
            except Exception as exc:  # noqa: BLE001 - the last automatic checkpoint still stands
                reason = f"requeued: worker {self.name} stopped; checkpoint on stop failed ({exc})"
            t.trainer.close()
            try:
                self.store.requeue_finetune(t.id, t.token, reason)
            except UNAVAILABLE:
                log.exception("could not requeue fine-tune %s; its lease will expire", t.id)

    # --- videos ------------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        cancelled = self.store.cancel_requested_videos([r.id for r in self._batch])
        for run in [r for r in self._batch if r.id in cancelled]:
            self._batch.remove(run)
            if self.store.finish_video(run.id, run.token, "cancelled"):
                self._count_finished("video", "cancelled")

    def _claim_videos(self) -> None:
        room = self.settings.max_batch - len(self._batch)
        running = self._batch[0].video.batch_key if self._batch else None
        rows = self.store.claim_videos(
            self.name,
            self.served(),
            room,
            lambda row: ResolvedVideo.from_dict(json.loads(row["spec"])).batch_key,
            running,
            lease_s=self.settings.lease_s,
            runnable=self._runnable,
        )
        for row in rows:
            video = ResolvedVideo.from_dict(json.loads(row["spec"]))
            if video.image is not None:  # stored relative to the storage (see the videos router)
                video = dataclasses.replace(video, image=str(self.data.resolve(video.image)))
            try:
                model = self._video_model(video.model)
                self._check(video)
                state = model.prepare(video)
            except Exception as exc:  # noqa: BLE001 - this job fails, the batch goes on
                self._fail_video(row["id"], row["lease_token"], exc)
                continue
            run = _Running(row["id"], row["lease_token"], video, state, time.perf_counter())
            self._batch.append(run)

    def _check(self, video: ResolvedVideo) -> None:
        """The model's own rules, once more: an API host may have checked the request against
        published numbers only (see `protocol.card_from_dict`)."""
        limits = self._card(video.model).limits
        limits.check_clip(video.frames, video.width, video.height)
        limits.check_prompt(video.prompt, "prompt")
        limits.check_prompt(video.negative_prompt, "negative_prompt")

    def _card(self, name: str) -> ModelCard:
        if name in self.cards:
            return self.cards[name]
        if name not in self._ft_cards:
            row = next((r for r in self.store.models() if r["name"] == name), None)
            if row is None or row["parent"] not in self.cards:
                raise ValueError(f"model {name!r} is not served by worker {self.name}")
            parent = self.cards[row["parent"]]
            card = fine_tuned_card({**row, "path": str(self.data.resolve(row["path"]))}, parent)
            self._ft_cards[name] = self.backend.fine_tuned_card(name, parent, Path(card.source))
        return self._ft_cards[name]

    def _video_model(self, name: str) -> VideoModel:
        if name in self._loaded:
            return self._loaded[name]
        if name in self._loaded_ft:
            self._loaded_ft.move_to_end(name)
            return self._loaded_ft[name]
        model = self.backend.load(self._card(name))
        self._loaded_ft[name] = model
        while len(self._loaded_ft) > MAX_LOADED_FINE_TUNES:
            self._loaded_ft.popitem(last=False)
        return model

    def _step_videos(self) -> None:
        model = self._video_model(self._batch[0].video.model)
        start = time.perf_counter()
        joined = sum(r.state.passes for r in self._batch)
        try:
            transfers = model.denoise_step([r.state for r in self._batch])
            advanced = list(self._batch)
            # No pass ran when every request's step cache reused an earlier output.
            passes = int(sum(r.state.passes for r in advanced) > joined)
        except Exception as exc:  # noqa: BLE001
            # The batched pass raised before any state moved (the update follows the forward
            # pass), so each job is retried alone: one bad or oversized job fails without taking
            # the others along.
            self.backend.release_memory()
            if len(self._batch) == 1:
                run = self._batch.pop()
                self._fail_video(run.id, run.token, exc)
                return
            transfers, advanced, passes = {}, [], len(self._batch)
            for run in list(self._batch):
                try:
                    model.denoise_step([run.state])
                    advanced.append(run)
                except Exception as single_exc:  # noqa: BLE001
                    self.backend.release_memory()
                    self._batch.remove(run)
                    self._fail_video(run.id, run.token, single_exc)
        if not advanced:
            return
        elapsed = time.perf_counter() - start
        self.metrics.passes.inc(passes)
        self.metrics.steps.inc(len(advanced))
        self.metrics.step_seconds.observe(elapsed)
        self.metrics.batch_size.observe(len(advanced))
        self.metrics.h2d_bytes.inc(transfers.get("h2d_bytes", 0))
        self.metrics.d2h_bytes.inc(transfers.get("d2h_bytes", 0))
        self._publish_metrics()
        lost = self.store.set_video_progress(
            [
                (
                    r.id,
                    r.token,
                    r.state.step,
                    DENOISE_SHARE * r.state.step // r.state.num_steps,
                    r.state.passes,
                )
                for r in advanced
            ],
            lease_s=self.settings.lease_s,
        )
        for run in [r for r in self._batch if r.id in lost or r.state.done]:
            self._batch.remove(run)
            if run.id not in lost:
                self._finish_video(model, run)

    def _finish_video(self, model: VideoModel, run: _Running) -> None:
        try:
            frames = model.finish(run.state)  # decoding needs the device: it stays on this thread
        except Exception as exc:  # noqa: BLE001
            self.backend.release_memory()
            self._fail_video(run.id, run.token, exc)
            return
        update = [(run.id, run.token, run.state.step, DECODED_PROGRESS)]
        if not self.store.set_video_progress(update, lease_s=self.settings.lease_s):
            self._encoding[run.id] = run.token
            self._encoder.submit(self._encode, run, frames)

    def _encode(self, run: _Running, frames) -> None:
        """On the encoder thread: write the MP4 and thumbnail, then mark the job completed."""
        try:
            self._write_video(run, frames)
        finally:
            self._encoding.pop(run.id, None)

    def _write_video(self, run: _Running, frames) -> None:
        mp4, png = self.data.video(run.id)
        for wait_s in _backoff():
            try:
                self.backend.save_video(frames, run.video.fps, mp4, png)
                break
            except Exception as exc:  # noqa: BLE001
                if not is_disk_full(exc):
                    self._fail_video(run.id, run.token, exc)
                    return
            # A full disk is the operator's to fix, not the video's fault: keep the frames, keep
            # the claim (the heartbeat renews it while the MP4 is pending), write again later.
            log.warning("video %s: the disk is full; writing it again in %.1f s", run.id, wait_s)
            if self.stop.wait(wait_s) or self._given_up(run):
                return  # stopping (its lease decides where it runs again), cancelled, or not ours
        expires_at = now() + self.settings.video_ttl_s
        status = self._retrying(
            self.store.finish_video, run.id, run.token, "completed", expires_at=expires_at
        )
        if status == "completed":
            self.metrics.video_seconds.observe(time.perf_counter() - run.started)
        if status is not None:
            self._count_finished("video", status)
        if status == "cancelled":  # cancelled while it was being encoded: nobody will fetch it
            for path in (mp4, png):
                path.unlink(missing_ok=True)

    def _given_up(self, run: _Running) -> bool:
        """While `run`'s MP4 waits for disk space: True once it was cancelled (recorded so) or
        its claim is no longer this worker's."""
        update = [(run.id, run.token, run.state.step, DECODED_PROGRESS)]
        try:
            if self.store.set_video_progress(update, lease_s=self.settings.lease_s):
                return True
            if self.store.cancel_requested_videos([run.id]):
                self._retrying(self.store.finish_video, run.id, run.token, "cancelled")
                self._count_finished("video", "cancelled")
                return True
        except UNAVAILABLE:
            pass  # the store is down too: keep trying both
        return False

    def _fail_video(self, video_id: str, token: str, exc: BaseException) -> None:
        """Record a failed video; stop the worker when the failure took the device with it."""
        log.warning("video %s failed: %s: %s", video_id, type(exc).__name__, exc)
        code = _request_code(exc) or self.backend.error_code(exc) or "generation_failed"
        failed = (code, _message(exc))
        if self._retrying(self.store.finish_video, video_id, token, "failed", error=failed):
            self._count_finished("video", "failed")
        self._check_device(exc)

    def _check_device(self, exc: BaseException) -> None:
        if self.backend.is_fatal(exc):
            raise DeviceLost(f"the device is unusable after {_message(exc)}") from exc

    # --- fine-tunes --------------------------------------------------------------------------

    def _finetune_event(self, message: str) -> None:
        t = self._tuning
        if not self.store.add_event(t.id, message, token=t.token):
            raise ClaimLost(t.id)

    def _step_finetune(self) -> bool:
        if self._tuning is None:
            row = self.store.claim_finetune(self.name, self.served(), lease_s=self.settings.lease_s)
            if row is None:
                return False
            self._start_finetune(row)
            return True
        t = self._tuning
        try:
            if t.paused:
                t.paused = False
                self._finetune_event(f"Resumed at step {t.trainer.step}")
            # A run resumed from its final checkpoint has no step left to take.
            if t.trainer.step < t.trainer.total_steps:
                metrics = _plain(t.trainer.train_step())
                self.metrics.train_steps.inc()
                self.metrics.h2d_bytes.inc(metrics.get("h2d_bytes") or 0)
                self.metrics.d2h_bytes.inc(metrics.get("d2h_bytes") or 0)
                self._publish_metrics()
                total = t.trainer.total_steps
                if not self.store.finetune_progress(
                    t.id,
                    t.token,
                    t.trainer.step,
                    total,
                    {**metrics, "total_steps": total},
                    lease_s=self.settings.lease_s,
                ):
                    raise ClaimLost(t.id)
                self._record_checkpoints(t, metrics)
            if t.trainer.step >= t.trainer.total_steps:
                name = f"ft:{t.parent}:{t.suffix}:{t.id.removeprefix('ftjob-')}"
                path = t.trainer.export(self.data.fine_tuned_model(t.id))
                model = {"name": name, "parent": t.parent, "path": self.data.relative(path)}
                self._end_finetune("succeeded", model=model)
        except ClaimLost:
            log.warning("fine-tune %s: another worker holds it now; dropping it here", t.id)
            self._tuning = None
            t.trainer.close()
        except UNAVAILABLE:
            raise  # the store, not the job: the run loop retries
        except Exception as exc:  # noqa: BLE001 - the job fails; videos and later jobs go on
            self.backend.release_memory()
            code = self.backend.error_code(exc) or "training_failed"
            self._end_finetune("failed", error=(code, _message(exc)))
            self._check_device(exc)
        return True

    def _start_finetune(self, row: dict) -> None:
        token, attempt = row["lease_token"], row["attempts"]
        hyper = json.loads(row["hyperparameters"])
        try:
            base = self._card(row["model"])
            file_row = self.store.get_file(row["training_file"])
            if file_row is None:
                raise ValueError(f"training file {row['training_file']} was deleted")
            job = FinetuneJob(
                base=base,
                data_dir=self.data.resolve(file_row["path"]),
                spec=finetune_spec(
                    hyper,
                    output=self.data.resolve(row["output_dir"]),
                    seed=row["seed"],
                    settings=self.settings,
                ),
                resume=attempt > 1,
            )
            trainer = self.backend.trainer(job)
        except UNAVAILABLE:
            raise
        except Exception as exc:  # noqa: BLE001
            code = self.backend.error_code(exc) or "training_failed"
            failed = (code, _message(exc))
            if self.store.finish_finetune(row["id"], token, "failed", error=failed):
                self._count_finished("fine_tune", "failed")
            self._check_device(exc)
            return
        # Checkpoints and the exported model are published only while this claim holds the job.
        trainer.fence = functools.partial(self.store.fenced_finetune, row["id"], token)
        t = _Tuning(row["id"], token, trainer, row["model"], row["suffix"] or "")
        self._tuning = t
        try:
            self._record_checkpoints(t)  # those of an earlier attempt, without events
            if attempt > 1 and not self.store.rewind_finetune(t.id, token, trainer.step):
                raise ClaimLost(t.id)
            verb = f"Resumed at step {trainer.step}" if attempt > 1 else "Fine-tuning job started"
            self._finetune_event(f"{verb} ({trainer.total_steps} steps)")
            if not self.store.finetune_progress(
                t.id, token, trainer.step, trainer.total_steps, None, lease_s=self.settings.lease_s
            ):
                raise ClaimLost(t.id)
        except ClaimLost:
            self._tuning = None
            trainer.close()

    def _record_checkpoints(self, t: _Tuning, metrics: dict | None = None) -> None:
        """Store checkpoints the trainer wrote since the last look (with the metrics of their
        step)."""
        for ckpt in t.trainer.checkpoints():
            path = self.data.relative(ckpt["path"])
            if path in t.known_checkpoints:
                continue
            t.known_checkpoints.add(path)
            summary = {"step": ckpt["step"]}
            if metrics is not None and metrics.get("step") == ckpt["step"]:
                summary.update(loss=metrics.get("loss"), lr=metrics.get("lr"))
            checkpoint_id = f"ftckpt-{t.id.removeprefix('ftjob-')}-{ckpt['step']}"
            if not self.store.add_checkpoint(
                checkpoint_id, t.id, t.token, ckpt["step"], path, summary
            ):
                raise ClaimLost(t.id)
            if metrics is not None:
                self._finetune_event(f"Checkpoint saved at step {ckpt['step']}")

    def _end_finetune(self, status: str, error=None, model: dict | None = None) -> None:
        """Close the trainer and record the outcome; a success registers its model in the same
        write."""
        t, self._tuning = self._tuning, None
        try:
            t.trainer.close()
        finally:
            recorded = self._retrying(
                self.store.finish_finetune, t.id, t.token, status, error=error, model=model
            )
            if recorded:
                self._count_finished("fine_tune", status)


# ---------------------------------------------------------------------------------------------
# In the API's process


class EmbeddedWorker(Fleet):
    """`megaslide serve`: a worker in a thread of the API's process, on the models `backend`
    provides, beside any other workers of the same store."""

    def __init__(self, settings: Settings, backend: Backend):
        super().__init__(settings, backend.check_dataset)
        self.backend = backend
        self.worker: Worker | None = None
        self._thread: threading.Thread | None = None

    async def start(self, store: JobStore) -> None:
        await super().start(store)
        # A worker can start again after a shutdown (an app's lifespan run twice): a new one.
        name = self.settings.worker_name or default_name(self.backend.device_name)
        self.worker = Worker(self.settings, self.backend, store, name)
        self.worker.register()
        self._thread = threading.Thread(
            target=self.worker.run, name="megaslide-worker", daemon=True
        )
        self._thread.start()

    async def shutdown(self) -> None:
        import anyio

        if self.worker is None:
            return
        self.worker.stop.set()
        self.worker.wake.set()
        await anyio.to_thread.run_sync(self._thread.join)
        await anyio.to_thread.run_sync(self.worker.close)

    @property
    def ready(self) -> bool:
        w = self.worker
        return w is not None and w.ready and w.dead is None and w.trouble is None

    @property
    def dead(self) -> str | None:
        return self.worker.dead if self.worker is not None else None

    @property
    def trouble(self) -> str | None:
        return self.worker.trouble if self.worker is not None else None

    @property
    def metrics(self) -> Totals:
        """This process's worker live, plus what the others last published."""
        others = [
            row["metrics"]
            for row in self._view()
            if row["metrics"] and row["name"] != self.worker.name
        ]
        return Totals([*others, self.worker.metrics.snapshot()])

    def base_cards(self, fresh: bool = False) -> list[ModelCard]:
        # This process's own cards first, exact (with the model's own rules), even before the
        # first heartbeat says they are ready.
        own = list(self.worker.cards.values()) if self.worker is not None else []
        names = {c.name for c in own}
        return [*own, *(c for c in super().base_cards(fresh) if c.name not in names)]

    def wake(self) -> None:
        if self.worker is not None:
            self.worker.wake.set()


# ---------------------------------------------------------------------------------------------
# helpers


def _backoff():
    """Waits in seconds: doubling from STORE_RETRY_S[0] up to STORE_RETRY_S[1], for ever."""
    wait_s, longest = STORE_RETRY_S
    while True:
        yield wait_s
        wait_s = min(2 * wait_s, longest)


def _request_code(exc: BaseException) -> str | None:
    return "invalid_request" if isinstance(exc, RequestError) else None


def _message(exc: BaseException) -> str:
    text = str(exc).strip() or "no message"
    return f"{type(exc).__name__}: {text}"


def _plain(metrics: dict) -> dict:
    """Trainer metrics as JSON-safe numbers (tensors and numpy scalars become floats)."""
    out = {}
    for k, v in metrics.items():
        out[k] = v if isinstance(v, (int, str)) or v is None else float(v)
    return out
