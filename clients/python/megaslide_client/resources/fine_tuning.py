"""`client.fine_tuning.jobs`: create, retrieve, list, cancel, list_events, checkpoints, wait,
and download_validation_video."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._pagination import AsyncPaginator, SyncCursorPage
from .._polling import Watch
from .._progress import ProgressBar
from .._streaming import PathLike
from ..types import FineTuningJob, FineTuningJobCheckpoint, FineTuningJobEvent

if TYPE_CHECKING:
    from .._base_client import AsyncAPIClient, SyncAPIClient

EventCallback = Callable[[FineTuningJobEvent], Any]


def create_body(
    *,
    model: str,
    training_file: str,
    hyperparameters: Mapping[str, Any] | None,
    method: Mapping[str, Any] | None,
    seed: int | None,
    suffix: str | None,
    validation: Sequence[Mapping[str, Any]] | None,
    extra_body: Mapping[str, Any] | None,
) -> dict[str, Any]:
    body = {
        "model": model,
        "training_file": training_file,
        "hyperparameters": hyperparameters,
        "method": method,
        "seed": seed,
        "suffix": suffix,
        "validation": [dict(v) for v in validation] if validation is not None else None,
    }
    body = {k: v for k, v in body.items() if v is not None}
    body.update(extra_body or {})
    return body


def validation_video_path(job_id: str, checkpoint_id: str, index: int) -> str:
    return f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/validation/{index}/content"


# Events fetched per page while following a job: enough that one poll rarely needs a second page.
EVENTS_PAGE_SIZE = 100


class EventFollower:
    """Picks a job's events not seen before out of event pages, and hands them back oldest first.

    The server lists events newest first (as OpenAI's API does), so the new events are the head
    of the list: take them page by page until the first one already seen, then reverse.
    """

    def __init__(self) -> None:
        self.seen: set = set()
        self._fresh: list[FineTuningJobEvent] = []

    def take(self, events: list[FineTuningJobEvent]) -> bool:
        """Collect the unseen head of one page; True once an old event was reached (stop paging)."""
        for event in events:
            if event.id in self.seen:
                return True
            self._fresh.append(event)
        return False

    def flush(self) -> list[FineTuningJobEvent]:
        fresh, self._fresh = self._fresh[::-1], []
        self.seen.update(e.id for e in fresh)
        return fresh


def progress_of(
    job: FineTuningJob, events: list[FineTuningJobEvent]
) -> tuple[float | None, float | None]:
    """(steps done, total steps): from the job when it reports them, else its latest metrics event."""
    step, total = job.step, job.total_steps
    if step is not None:
        return step, total
    for event in reversed(events):
        data = event.data or {}
        if event.type == "metrics" and "step" in data:
            return data.get("step"), data.get("total_steps")
    return None, None


class JobWatch(Watch[FineTuningJob]):
    """Polls a fine-tuning job: hands each new event to `on_event` once, oldest first, and draws
    a bar of optimizer steps. The caller's interval sets the pace (the default when not given)."""

    def __init__(
        self,
        job_id: str,
        *,
        on_event: EventCallback | None,
        progress: bool,
        poll_interval_ms: int | None,
        max_wait: float | None,
    ) -> None:
        bar = ProgressBar(progress, total=0, desc=f"fine-tune {job_id}", unit="step")
        super().__init__(bar, poll_interval_ms=poll_interval_ms, max_wait=max_wait)
        self.job_id = job_id
        self.on_event = on_event
        self.events = EventFollower()

    def observe(self, job: FineTuningJob) -> bool:
        """Take in the job, after its new event pages went to `self.events.take`."""
        self.result = job
        fresh = self.events.flush()
        for event in fresh:
            if self.on_event is not None:
                self.on_event(event)
        step, total = progress_of(job, fresh)
        if total:
            self.bar.set_total(total)
        self.bar.update_to(step, job.status)
        return job.done

    def still(self) -> str:
        return f"fine-tuning job {self.job_id} still {self.result.status}"


class Jobs:
    """Fine-tuning jobs."""

    def __init__(self, client: SyncAPIClient) -> None:
        self._client = client

    def create(
        self,
        *,
        model: str,
        training_file: str,
        hyperparameters: Mapping[str, Any] | None = None,
        method: Mapping[str, Any] | None = None,
        seed: int | None = None,
        suffix: str | None = None,
        validation: Sequence[Mapping[str, Any]] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> FineTuningJob:
        """Start fine-tuning `model` on an uploaded file (`client.files.create(...).id`).

        `hyperparameters`: `n_epochs`, `batch_size`, `learning_rate_multiplier` (or "auto"),
        and `optimizer_state`: how the server's optimizer keeps the weights and moments in host
        RAM ("fp32", or e.g. "bf16-sr/8bit": about a third of the bytes; "auto": the server's),
        and `optimizer_state_tier`: "ram", or "disk" to keep the moments in files on the
        server's local disk ("auto": ram); `buckets` (true: clips of different sizes and
        lengths train as they come, each batch one aspect and length bucket) and
        `token_budget` (a bucketed clip's most tokens); on a two-expert base (Wan2.2-A14B)
        `expert`: "high" or "low" to train one, or "both" (the default: each on its own noise
        levels); `validation_split` (clips held out of training for a validation loss at every
        checkpoint: a fraction, or a count).
        `validation`: up to 8 prompts (`{"prompt", "seed", "size", "num_frames",
        "num_inference_steps", "guidance_scale"}`) sampled with every checkpoint's weights; each
        checkpoint lists them (`checkpoints`), `download_validation_video` fetches one.
        A job that succeeds registers the model `ft:<model>:<suffix>:<job id>`.
        """
        body = create_body(
            model=model,
            training_file=training_file,
            hyperparameters=hyperparameters,
            method=method,
            seed=seed,
            suffix=suffix,
            validation=validation,
            extra_body=extra_body,
        )
        response = self._client.post(
            "/v1/fine_tuning/jobs", json=body, idempotency_key=idempotency_key
        )
        return FineTuningJob.from_dict(response.json())

    def retrieve(self, job_id: str) -> FineTuningJob:
        return FineTuningJob.from_dict(self._client.get(f"/v1/fine_tuning/jobs/{job_id}").json())

    def list(
        self, *, after: str | None = None, limit: int | None = None
    ) -> SyncCursorPage[FineTuningJob]:
        """A page of jobs; iterating over it walks every following page too."""
        return self._client.get_page(
            "/v1/fine_tuning/jobs", FineTuningJob, after=after, limit=limit
        )

    def cancel(self, job_id: str, *, idempotency_key: str | None = None) -> FineTuningJob:
        """Stop the job at its next step boundary."""
        response = self._client.post(
            f"/v1/fine_tuning/jobs/{job_id}/cancel", idempotency_key=idempotency_key
        )
        return FineTuningJob.from_dict(response.json())

    def list_events(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> SyncCursorPage[FineTuningJobEvent]:
        """The job's events (messages, and `type == "metrics"` events with loss and lr)."""
        path = f"/v1/fine_tuning/jobs/{job_id}/events"
        return self._client.get_page(path, FineTuningJobEvent, after=after, limit=limit)

    def checkpoints(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> SyncCursorPage[FineTuningJobCheckpoint]:
        """The checkpoints the job has saved, newest first, each with its `validation` videos."""
        path = f"/v1/fine_tuning/jobs/{job_id}/checkpoints"
        return self._client.get_page(path, FineTuningJobCheckpoint, after=after, limit=limit)

    def download_validation_video(
        self,
        job_id: str,
        checkpoint_id: str,
        index: int,
        *,
        path: PathLike | None = None,
    ) -> Path | bytes:
        """The MP4 of validation prompt `index` sampled from a checkpoint: into `path` (written
        whole, resumed with a Range request if the connection breaks) and that Path returned,
        or as bytes."""
        url = validation_video_path(job_id, checkpoint_id, index)
        return self._client.download(url, to=path)

    def wait(
        self,
        job_id: str,
        *,
        poll_interval_ms: int | None = None,
        progress: bool = False,
        on_event: EventCallback | None = None,
        max_wait: float | None = None,
    ) -> FineTuningJob:
        """Wait until the job succeeded, failed or was cancelled, and return it.

        `on_event` is called once per new event, oldest first. `progress=True` draws a tqdm bar
        of optimizer steps (from the metrics events) when tqdm is installed.
        """
        with JobWatch(
            job_id,
            on_event=on_event,
            progress=progress,
            poll_interval_ms=poll_interval_ms,
            max_wait=max_wait,
        ) as watch:
            return self._client.poll(lambda: self._look(job_id, watch.events), watch)

    def _look(self, job_id: str, events: EventFollower) -> FineTuningJob:
        """The job, after handing the pages of events it logged since the last look to `events`."""
        job = self.retrieve(job_id)
        for page in self.list_events(job_id, limit=EVENTS_PAGE_SIZE).iter_pages():
            if events.take(page.data):
                break
        return job


class AsyncJobs:
    """Async twin of Jobs."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self._client = client

    async def create(
        self,
        *,
        model: str,
        training_file: str,
        hyperparameters: Mapping[str, Any] | None = None,
        method: Mapping[str, Any] | None = None,
        seed: int | None = None,
        suffix: str | None = None,
        validation: Sequence[Mapping[str, Any]] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> FineTuningJob:
        """Start fine-tuning (see `Jobs.create`)."""
        body = create_body(
            model=model,
            training_file=training_file,
            hyperparameters=hyperparameters,
            method=method,
            seed=seed,
            suffix=suffix,
            validation=validation,
            extra_body=extra_body,
        )
        response = await self._client.post(
            "/v1/fine_tuning/jobs", json=body, idempotency_key=idempotency_key
        )
        return FineTuningJob.from_dict(response.json())

    async def retrieve(self, job_id: str) -> FineTuningJob:
        return FineTuningJob.from_dict(
            (await self._client.get(f"/v1/fine_tuning/jobs/{job_id}")).json()
        )

    def list(
        self, *, after: str | None = None, limit: int | None = None
    ) -> AsyncPaginator[FineTuningJob]:
        return self._client.get_page(
            "/v1/fine_tuning/jobs", FineTuningJob, after=after, limit=limit
        )

    async def cancel(self, job_id: str, *, idempotency_key: str | None = None) -> FineTuningJob:
        response = await self._client.post(
            f"/v1/fine_tuning/jobs/{job_id}/cancel", idempotency_key=idempotency_key
        )
        return FineTuningJob.from_dict(response.json())

    def list_events(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> AsyncPaginator[FineTuningJobEvent]:
        path = f"/v1/fine_tuning/jobs/{job_id}/events"
        return self._client.get_page(path, FineTuningJobEvent, after=after, limit=limit)

    def checkpoints(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> AsyncPaginator[FineTuningJobCheckpoint]:
        path = f"/v1/fine_tuning/jobs/{job_id}/checkpoints"
        return self._client.get_page(path, FineTuningJobCheckpoint, after=after, limit=limit)

    async def download_validation_video(
        self,
        job_id: str,
        checkpoint_id: str,
        index: int,
        *,
        path: PathLike | None = None,
    ) -> Path | bytes:
        """The MP4 of one validation video (see `Jobs.download_validation_video`)."""
        url = validation_video_path(job_id, checkpoint_id, index)
        return await self._client.download(url, to=path)

    async def wait(
        self,
        job_id: str,
        *,
        poll_interval_ms: int | None = None,
        progress: bool = False,
        on_event: EventCallback | None = None,
        max_wait: float | None = None,
    ) -> FineTuningJob:
        """Wait until the job ends (see `Jobs.wait`)."""
        with JobWatch(
            job_id,
            on_event=on_event,
            progress=progress,
            poll_interval_ms=poll_interval_ms,
            max_wait=max_wait,
        ) as watch:
            return await self._client.poll(lambda: self._look(job_id, watch.events), watch)

    async def _look(self, job_id: str, events: EventFollower) -> FineTuningJob:
        """The job, after handing the pages of events it logged since the last look to `events`."""
        job = await self.retrieve(job_id)
        async for page in (await self.list_events(job_id, limit=EVENTS_PAGE_SIZE)).iter_pages():
            if events.take(page.data):
                break
        return job


class FineTuning:
    """`client.fine_tuning`: holds `jobs`."""

    def __init__(self, client: SyncAPIClient) -> None:
        self.jobs = Jobs(client)


class AsyncFineTuning:
    """`client.fine_tuning` of AsyncClient: holds `jobs`."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self.jobs = AsyncJobs(client)
