"""`/v1/fine_tuning/jobs`: create, list, retrieve, cancel, events (loss and lr as metrics), checkpoints."""

from __future__ import annotations

import secrets
from pathlib import Path

from fastapi import APIRouter, Query, Request

from ..deps import (
    EngineDep,
    SettingsDep,
    StoreDep,
    admit,
    idempotency,
    new_id,
    replayed,
    request_hash,
    wait_for,
)
from ..errors import InvalidRequest, NotFound
from ..schemas import (
    Checkpoint,
    FineTuningEvent,
    FineTuningJob,
    FineTuningJobCreate,
    Hyperparameters,
    ListPage,
    checkpoint_object,
    event_object,
    finetune_object,
    page,
)
from ..validation import resolve_hyperparameters

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])


def find_job(store, job_id: str) -> dict:
    row = store.get_finetune(job_id)
    if row is None:
        raise NotFound(f"No fine-tuning job found with id {job_id!r}", param="fine_tuning_job_id")
    return row


@router.post("", response_model=FineTuningJob)
async def create_job(
    body: FineTuningJobCreate,
    request: Request,
    store: StoreDep,
    engine: EngineDep,
    settings: SettingsDep,
):
    if engine.model(body.model) is None:
        raise NotFound(
            f"The model {body.model!r} does not exist; see GET /v1/models",
            param="model",
            code="model_not_found",
        )
    file_row = store.get_file(body.training_file)
    if file_row is None:
        raise NotFound(f"No such File object: {body.training_file}", param="training_file")
    if file_row["purpose"] != "fine-tune":
        raise InvalidRequest(
            f"file {body.training_file} was uploaded with purpose {file_row['purpose']!r}, "
            "not 'fine-tune'",
            param="training_file",
        )
    if body.validation_file is not None:
        raise InvalidRequest(
            "validation_file is not supported",
            param="validation_file",
            code="unsupported_parameter",
        )
    if body.integrations:
        raise InvalidRequest(
            "integrations are not supported", param="integrations", code="unsupported_parameter"
        )
    if body.hyperparameters is not None and body.method is not None:
        raise InvalidRequest(
            "give hyperparameters either at the top level or in method.supervised, not both",
            param="hyperparameters",
        )
    hyper_in = body.hyperparameters or (
        body.method.supervised.hyperparameters if body.method else Hyperparameters()
    )
    hyper = resolve_hyperparameters(hyper_in, settings)

    payload = request_hash(body.model_dump(exclude_none=True))
    prior = replayed(request, store, payload)
    if prior is not None and (row := store.get_finetune(prior)) is not None:
        return finetune_object(row)
    admit(store, engine, settings)
    job_id = new_id("ftjob-")
    row = store.insert_finetune(
        {
            "id": job_id,
            "model": body.model,
            "training_file": body.training_file,
            "hyperparameters": hyper,
            "seed": body.seed if body.seed is not None else secrets.randbelow(2**31),
            "suffix": body.suffix,
            "output_dir": str(Path(settings.data_dir) / "fine_tunes" / job_id),
        },
        idempotency=idempotency(request, payload),
    )
    engine.wake()
    return finetune_object(row)


@router.get("", response_model=ListPage[FineTuningJob])
async def list_jobs(
    store: StoreDep, after: str | None = None, limit: int = Query(20, ge=1, le=100)
):
    rows, has_more = store.list_finetunes(after, limit)
    return page([finetune_object(r) for r in rows], has_more)


@router.get("/{job_id}", response_model=FineTuningJob)
async def retrieve_job(job_id: str, store: StoreDep):
    return finetune_object(find_job(store, job_id))


@router.post("/{job_id}/cancel", response_model=FineTuningJob)
async def cancel_job(job_id: str, store: StoreDep, engine: EngineDep, settings: SettingsDep):
    """Cancel a queued job now, or a running one at its next optimizer step (the answer waits for it)."""
    row = find_job(store, job_id)
    if row["status"] in ("succeeded", "failed", "cancelled"):
        raise InvalidRequest(
            f"fine-tuning job {job_id} already {row['status']}",
            param="fine_tuning_job_id",
            code="job_not_cancellable",
        )
    if store.cancel_finetune(job_id) == "running":
        engine.wake()
        await wait_for(
            lambda: store.get_finetune(job_id)["status"] == "cancelled", settings.cancel_wait_s
        )
    return finetune_object(store.get_finetune(job_id))


@router.get("/{job_id}/events", response_model=ListPage[FineTuningEvent])
async def list_events(
    job_id: str, store: StoreDep, after: str | None = None, limit: int = Query(20, ge=1, le=1000)
):
    """Newest first; `after` is the id of the last event of the previous page."""
    find_job(store, job_id)
    if after is not None and not after.removeprefix("ftevent-").isdigit():
        raise InvalidRequest(f"after must be an event id (ftevent-N), got {after!r}", param="after")
    rows, has_more = store.finetune_events(job_id, after, limit)
    return page([event_object(r) for r in rows], has_more)


@router.get("/{job_id}/checkpoints", response_model=ListPage[Checkpoint])
async def list_checkpoints(
    job_id: str, store: StoreDep, after: str | None = None, limit: int = Query(10, ge=1, le=100)
):
    job = find_job(store, job_id)
    rows, has_more = store.checkpoints(job_id, after, limit)
    return page([checkpoint_object(r, job) for r in rows], has_more)
