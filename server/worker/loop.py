"""The worker's loop: one thread that owns one device's models (or drives the ranks of several, see
`engine/parallel/rank_group.py`), claims jobs from the store and runs them step by step.

Scheduling happens at denoising-step boundaries. At each boundary the worker

1. drops running videos whose cancellation was requested (the model never runs another step for
   them), wherever the DELETE arrived;
2. claims queued videos into the running batch: jobs with the same batch key (model, frames, size,
   steps) share one forward pass per step, so a new request joins a running batch at the next step
   instead of waiting for it to finish. Claims follow the queue order (priority, then arrival) and
   stop at the first job that cannot join, so batching never lets a job overtake an earlier one;
3. runs one batched denoising step, records progress (which renews the jobs' leases), decodes the
   clips that finished at it together, each chunk of frames going to its clip's MP4 encoder as
   the decoder makes it, and leaves the encoders to finish on their threads (videos.py);
4. only when no video is queued or running, runs one fine-tuning step (finetunes.py). A running
   fine-tune thus yields to videos at its next step boundary and continues where it stopped once
   they are done.

Only jobs for models this worker serves are claimed: its base models and the fine-tunes of them
(models.py).

Every job runs inside its own try/except: an exception (CUDA out of memory included) fails that job
with its message, and the next boundary proceeds as usual. Only an error that leaves the device
unusable for any job (`Backend.is_fatal`), or one outside any job, kills the worker, which
`/healthz` and `/metrics` then report. When the job store itself fails (a full disk, a database
restarting), the worker keeps its jobs in memory and retries with back-off: nothing is lost, and
whatever it could not record before its leases ran out runs again elsewhere.
"""

from __future__ import annotations

import logging
import time

from ..backend import Backend
from ..protocol import ModelCard
from ..settings import Settings
from ..store import UNAVAILABLE, JobStore
from .context import WorkerContext, backoff, message
from .finetunes import FineTunes
from .heartbeat import Heartbeat
from .models import Models
from .videos import Videos

log = logging.getLogger("megaslide.server")

IDLE_WAIT_S = 0.5  # how long an idle worker sleeps before looking at the store again if not woken
HOUSEKEEPING_INTERVAL_S = 600.0  # how often an idle worker deletes expired outputs
RECOVERY_INTERVAL_S = 1.0  # how often a worker requeues jobs whose leases expired


class Worker(WorkerContext):
    """Runs the jobs of one job store on the models of one backend (one device, or a group of
    devices each video is split over): `register`, then `run` on a thread of its own until
    `stop` is set, then `close`."""

    def __init__(self, settings: Settings, backend: Backend, store: JobStore, name: str):
        super().__init__(settings, backend, store, name)
        self.models = Models(self)
        self.videos = Videos(self, self.models)
        self.finetunes = FineTunes(self, self.models)
        self.heartbeat = Heartbeat(self, self._leases)
        self._last_housekeeping = time.monotonic()
        self._last_recovery = -RECOVERY_INTERVAL_S

    @property
    def cards(self) -> dict[str, ModelCard]:
        """The base models served here, by name (with the adapters registered on them)."""
        return self.models.cards

    def register(self) -> None:
        """Enter the registry (see `Heartbeat.register`)."""
        self.heartbeat.register(self.models.published())

    def run(self) -> None:
        """Load the models, then run jobs until `stop` is set; parks unfinished work on the way
        out. Errors outside any job end the loop and are kept in `dead`."""
        try:
            self._remove_abandoned()  # what this worker's previous life was writing when killed
            self.models.load()
            self.ready = True
            self.heartbeat.send()
            log.info("worker %s ready: %s", self.name, ", ".join(self.cards))
            retries = backoff()
            while not self.stop.is_set():
                self.progress_at = time.monotonic()  # the watchdog's proof of life (heartbeat.py)
                try:
                    busy = (
                        self._tick()
                        or self._housekeeping()
                        or self.models.scan_adapters(self.videos.adapters_in_use())
                    )
                except UNAVAILABLE as exc:
                    self._store_failed(exc, next(retries))
                    continue
                if self.trouble is not None:
                    log.warning("the job store works again")
                    self.trouble, retries = None, backoff()
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
            self.heartbeat.send()

    def close(self) -> None:
        """Leave the registry and close the loaded models (after `run` returned)."""
        self.stop.set()
        self.videos.close()
        self.heartbeat.deregister()
        self.models.close()

    def _leases(self) -> list[str]:
        """The claims this worker still works on (read from the heartbeat thread)."""
        return self.videos.leases() + self.finetunes.leases()

    def _store_failed(self, exc: BaseException, wait_s: float) -> None:
        """A tick failed on the store: keep the jobs in memory and try again in `wait_s`."""
        reason = f"the job store fails: {message(exc)}"
        if self.trouble is None:
            log.error("%s; retrying with back-off", reason)
        self.trouble = reason
        self.stop.wait(wait_s)

    def _tick(self) -> bool:
        """One scheduling decision at a step boundary; False when there was nothing to do."""
        if time.monotonic() - self._last_recovery >= RECOVERY_INTERVAL_S:
            self._last_recovery = time.monotonic()
            recovered = self.store.workers.recover_expired()
            if any(recovered.values()):
                log.warning("requeued jobs whose workers went silent: %s", recovered)
                self._remove_abandoned()  # the MP4s they were writing, if they were killed
        self.videos.drop_cancelled()
        self.finetunes.cancel_if_requested()
        self.videos.claim()
        if self.videos.batch:
            self.finetunes.pause()
            self.videos.step()
            return True
        return self.finetunes.step()

    def _housekeeping(self) -> bool:
        """When idle, now and then: delete the files of videos whose `expires_at` has passed,
        old events of finished jobs, expired idempotency keys and temporary files whose writers
        died. Never counts as work done."""
        if time.monotonic() - self._last_housekeeping < HOUSEKEEPING_INTERVAL_S:
            return False
        self._last_housekeeping = time.monotonic()
        for video_id in self.store.videos.expired():
            for path in self.data.video_files(video_id):
                path.unlink(missing_ok=True)
        self.store.jobs.prune_events(self.settings.event_ttl_s)
        self.store.keys.forget_expired()
        self._remove_abandoned()
        return False

    def _remove_abandoned(self) -> None:
        """Delete the temporary files of writers that died mid-write (a live one's stay)."""
        try:
            if removed := self.data.remove_abandoned():
                log.info("removed %d temporary files that killed writers left", removed)
        except OSError as exc:  # the storage's trouble, not the worker's: the next try may do
            log.warning("could not clear temporary files: %s", exc)

    def _park(self) -> None:
        """Graceful stop: running videos go back to the queue, a running fine-tune checkpoints
        first. Whichever worker claims them next carries on. (With the store failing, their
        leases run out instead: the same outcome, later.)"""
        self.videos.park()
        self.finetunes.park()
