"""The job store's rows as typed, frozen records, decoded once where the store reads them.

A record is what a row holds, with its JSON text columns (a video's resolved request, a
fine-tune's hyperparameters, a worker's model cards and metrics, an event's data, a checkpoint's
metrics, an idempotency key's recorded answer) parsed and its 0/1 flags made booleans; callers
read attributes, never keys. Videos and fine-tunes share their lease's fields (`LeasedRecord`).
What the API shows of a record is made in one place, the response schemas (schemas.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Self


def _decode(cls: type, row: Mapping[str, Any], **decoded: Any) -> Any:
    """`cls` from a row's columns (extra columns are ignored), `decoded` overriding the raw ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in row.items() if k in names and k not in decoded}, **decoded)


def _json(text: str | None) -> Any:
    return json.loads(text) if text else None


@dataclasses.dataclass(frozen=True, slots=True)
class LeasedRecord:
    """A job's lease: which worker holds it, under which claim, and until when (see store/)."""

    worker_id: str | None
    lease_token: str | None
    lease_expires_at: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class VideoRecord(LeasedRecord):
    """A video job (the `videos` table)."""

    seq: int
    id: str
    created_at: int
    status: str  # queued -> in_progress -> completed | failed | cancelled
    progress: int
    step: int
    passes: int | None  # steps that ran a pass of the model; None: as many as `step`
    model: str
    priority: int
    spec: dict[str, Any]  # the resolved request, `ResolvedVideo.to_dict()`
    cancel_requested: bool
    attempts: int
    crashes: int
    suspect: bool  # a worker died while it shared it with others: it runs alone (store/videos.py)
    started_at: int | None
    completed_at: int | None
    expires_at: int | None
    error_code: str | None
    error_message: str | None
    owner: str | None
    pixel_key: str | None = None  # what decides its pixels (services/repeats.py)
    cached_from: str | None = None  # the finished video whose MP4 answered it; None: its own

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(
            cls,
            row,
            spec=json.loads(row["spec"]),
            cancel_requested=bool(row["cancel_requested"]),
            suspect=bool(row["suspect"]),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class FineTuneRecord(LeasedRecord):
    """A fine-tuning job (the `fine_tunes` table)."""

    seq: int
    id: str
    created_at: int
    status: str  # queued -> running -> succeeded | failed | cancelled
    model: str
    training_file: str
    hyperparameters: dict[str, Any]  # as resolved at creation (services/fine_tuning.py)
    seed: int
    suffix: str | None
    output_dir: str
    fine_tuned_model: str | None
    step: int
    total_steps: int | None
    cancel_requested: bool
    attempts: int  # claims so far: more than one means a resume from a checkpoint
    crashes: int
    finished_at: int | None
    error_code: str | None
    error_message: str | None
    owner: str | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(
            cls,
            row,
            hyperparameters=json.loads(row["hyperparameters"]),
            cancel_requested=bool(row["cancel_requested"]),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class EventRecord:
    """An event of a video or a fine-tune (the `events` table), in the order jobs wrote them."""

    seq: int  # grows in commit order per job: SSE's event id, a fine-tune event's `ftevent-<seq>`
    job_id: str
    created_at: int
    type: str
    level: str
    message: str
    data: dict[str, Any] | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(cls, row, data=_json(row["data"]))


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """A fine-tune's checkpoint (the `checkpoints` table)."""

    seq: int
    id: str
    job_id: str
    created_at: int
    step: int
    path: str  # relative to the storage
    metrics: dict[str, Any] | None  # the step's loss and learning rate, where known
    # The validation videos sampled from it, one per prompt of the job (paths relative to the
    # storage); None without validation prompts.
    validation: list[dict[str, Any]] | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(
            cls, row, metrics=_json(row["metrics"]), validation=_json(row.get("validation"))
        )


@dataclasses.dataclass(frozen=True, slots=True)
class FileRecord:
    """An uploaded file (the `files` table)."""

    seq: int
    id: str
    created_at: int
    filename: str
    purpose: str
    bytes: int
    path: str  # relative to the storage (DataDir.relative)
    clips: int
    owner: str | None
    status: str  # uploaded -> processed | error
    status_details: str | None
    validating_until: float | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(cls, row)


@dataclasses.dataclass(frozen=True, slots=True)
class IdempotencyRecord:
    """What an Idempotency-Key holds (the `idempotency` table): the request it was first used
    with, and that request's outcome once there is one."""

    scope: str  # the principal's: two principals' keys never meet
    key: str  # "METHOD /path:key"
    request_hash: str  # a digest of the first request's body
    resource_id: str | None  # what the first request made (videos, files, fine-tunes)
    response: dict[str, Any] | None  # or what it answered (cancel, delete, an adapter upload)
    created_at: int

    @property
    def settled(self) -> bool:
        """Whether the first request's outcome is recorded (False: it is still at work)."""
        return self.resource_id is not None or self.response is not None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(cls, row, response=_json(row["response"]))


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRecord:
    """A fine-tuned model (the `models` table), registered when its job succeeded."""

    seq: int
    name: str
    parent: str
    path: str  # relative to the storage
    job_id: str
    created_at: int
    owner: str | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(cls, row)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker process in the registry (the `workers` table)."""

    name: str
    token: str  # this incarnation
    host: str
    pid: int
    device: str
    capacity: int
    models: list[dict[str, Any]]  # the model cards it serves (protocol.card_to_dict)
    started_at: float
    heartbeat_at: float
    ready: bool
    dead: str | None
    metrics: dict[str, Any] | None
    age_s: float | None = None  # seconds since its last heartbeat, where the read asked

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(
            cls,
            row,
            models=json.loads(row["models"]),
            ready=bool(row["ready"]),
            metrics=_json(row["metrics"]),
        )


__all__ = [
    "CheckpointRecord",
    "EventRecord",
    "FileRecord",
    "FineTuneRecord",
    "LeasedRecord",
    "ModelRecord",
    "VideoRecord",
    "WorkerRecord",
]


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookEndpointRecord:
    """A key's webhook endpoint (the `webhook_endpoints` table)."""

    seq: int
    id: str
    created_at: int
    owner: str | None
    url: str
    events: list[str]  # the event types it receives
    secret: str  # whsec_<base64>: what its deliveries are signed with
    description: str | None
    disabled: bool

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(cls, row, events=json.loads(row["events"]), disabled=bool(row["disabled"]))


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookAttemptRecord:
    """One try of a delivery (the `webhook_attempts` table)."""

    seq: int
    delivery_id: str
    created_at: int
    status_code: int | None  # the receiver's answer; None when there was none
    error: str | None
    duration_ms: int

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(cls, row)


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookDeliveryRecord:
    """A message owed to an endpoint (the `webhook_deliveries` table, the outbox)."""

    seq: int
    id: str  # the message id, sent as `webhook-id` on every try
    endpoint_id: str
    job_id: str
    type: str
    created_at: int
    snapshot: dict[str, Any]  # the rows its payload is made from, as they were at the event
    status: str  # pending -> delivered | failed
    attempts: int
    next_attempt_at: float
    lease_token: str | None
    delivered_at: int | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return _decode(cls, row, snapshot=json.loads(row["snapshot"]))
