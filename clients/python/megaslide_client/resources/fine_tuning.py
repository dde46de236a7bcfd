"""`client.fine_tuning.jobs`: create, retrieve, list, cancel, list_events, checkpoints, wait."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .. import _base_client as base
from .._constants import DEFAULT_POLL_INTERVAL_MS
from .._pagination import AsyncCursorPage, AsyncPaginator, SyncCursorPage, list_params
from .._progress import ProgressBar
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
    extra_body: Mapping[str, Any] | None,
) -> dict[str, Any]:
    body = {
        "model": model,
        "training_file": training_file,
        "hyperparameters": hyperparameters,
        "method": method,
        "seed": seed,
        "suffix": suffix,
    }
    body = {k: v for k, v in body.items() if v is not None}
    body.update(extra_body or {})
    return body


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
        extra_body: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> FineTuningJob:
        """Start fine-tuning `model` on an uploaded file (`client.files.create(...).id`).

        `hyperparameters`: `n_epochs`, `batch_size`, `learning_rate_multiplier` (or "auto").
        A job that succeeds registers the model `ft:<model>:<suffix>:<job id>`.
        """
        body = create_body(
            model=model,
            training_file=training_file,
            hyperparameters=hyperparameters,
            method=method,
            seed=seed,
            suffix=suffix,
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

        def fetch(cursor: str | None) -> SyncCursorPage[FineTuningJob]:
            body = self._client.get(
                "/v1/fine_tuning/jobs", params=list_params(after=cursor, limit=limit)
            ).json()
            return SyncCursorPage(body, FineTuningJob, fetch)

        return fetch(after)

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

        def fetch(cursor: str | None) -> SyncCursorPage[FineTuningJobEvent]:
            params = list_params(after=cursor, limit=limit)
            body = self._client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params=params).json()
            return SyncCursorPage(body, FineTuningJobEvent, fetch)

        return fetch(after)

    def checkpoints(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> SyncCursorPage[FineTuningJobCheckpoint]:
        """The checkpoints the job has saved."""

        def fetch(cursor: str | None) -> SyncCursorPage[FineTuningJobCheckpoint]:
            params = list_params(after=cursor, limit=limit)
            body = self._client.get(
                f"/v1/fine_tuning/jobs/{job_id}/checkpoints", params=params
            ).json()
            return SyncCursorPage(body, FineTuningJobCheckpoint, fetch)

        return fetch(after)

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
        interval = (
            DEFAULT_POLL_INTERVAL_MS if poll_interval_ms is None else poll_interval_ms
        ) / 1000.0
        deadline = None if max_wait is None else time.monotonic() + max_wait
        follower = EventFollower()
        with ProgressBar(progress, total=0, desc=f"fine-tune {job_id}", unit="step") as bar:
            while True:
                job = self.retrieve(job_id)
                for page in self.list_events(job_id, limit=EVENTS_PAGE_SIZE).iter_pages():
                    if follower.take(page.data):
                        break
                fresh = follower.flush()
                for event in fresh:
                    if on_event is not None:
                        on_event(event)
                step, total = progress_of(job, fresh)
                if total:
                    bar.set_total(total)
                bar.update_to(step, job.status)
                if job.done:
                    return job
                if deadline is not None and time.monotonic() + interval > deadline:
                    raise TimeoutError(
                        f"fine-tuning job {job_id} still {job.status} after max_wait"
                    )
                base._sleep(interval)


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
        async def fetch(cursor: str | None) -> AsyncCursorPage[FineTuningJob]:
            params = list_params(after=cursor, limit=limit)
            body = (await self._client.get("/v1/fine_tuning/jobs", params=params)).json()
            return AsyncCursorPage(body, FineTuningJob, fetch)

        return AsyncPaginator(lambda: fetch(after))

    async def cancel(self, job_id: str, *, idempotency_key: str | None = None) -> FineTuningJob:
        response = await self._client.post(
            f"/v1/fine_tuning/jobs/{job_id}/cancel", idempotency_key=idempotency_key
        )
        return FineTuningJob.from_dict(response.json())

    def list_events(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> AsyncPaginator[FineTuningJobEvent]:
        async def fetch(cursor: str | None) -> AsyncCursorPage[FineTuningJobEvent]:
            params = list_params(after=cursor, limit=limit)
            body = (
                await self._client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params=params)
            ).json()
            return AsyncCursorPage(body, FineTuningJobEvent, fetch)

        return AsyncPaginator(lambda: fetch(after))

    def checkpoints(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> AsyncPaginator[FineTuningJobCheckpoint]:
        async def fetch(cursor: str | None) -> AsyncCursorPage[FineTuningJobCheckpoint]:
            params = list_params(after=cursor, limit=limit)
            body = (
                await self._client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", params=params)
            ).json()
            return AsyncCursorPage(body, FineTuningJobCheckpoint, fetch)

        return AsyncPaginator(lambda: fetch(after))

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
        interval = (
            DEFAULT_POLL_INTERVAL_MS if poll_interval_ms is None else poll_interval_ms
        ) / 1000.0
        deadline = None if max_wait is None else time.monotonic() + max_wait
        follower = EventFollower()
        with ProgressBar(progress, total=0, desc=f"fine-tune {job_id}", unit="step") as bar:
            while True:
                job = await self.retrieve(job_id)
                async for page in (
                    await self.list_events(job_id, limit=EVENTS_PAGE_SIZE)
                ).iter_pages():
                    if follower.take(page.data):
                        break
                fresh = follower.flush()
                for event in fresh:
                    if on_event is not None:
                        on_event(event)
                step, total = progress_of(job, fresh)
                if total:
                    bar.set_total(total)
                bar.update_to(step, job.status)
                if job.done:
                    return job
                if deadline is not None and time.monotonic() + interval > deadline:
                    raise TimeoutError(
                        f"fine-tuning job {job_id} still {job.status} after max_wait"
                    )
                await base._async_sleep(interval)


class FineTuning:
    """`client.fine_tuning`: holds `jobs`."""

    def __init__(self, client: SyncAPIClient) -> None:
        self.jobs = Jobs(client)


class AsyncFineTuning:
    """`client.fine_tuning` of AsyncClient: holds `jobs`."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self.jobs = AsyncJobs(client)
