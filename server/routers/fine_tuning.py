"""`/v1/fine_tuning/jobs`: create, list, retrieve, cancel, events (loss and lr as metrics), checkpoints."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Query, Request

from megaslide.engine.request import RANDOM_SEED_BITS, RequestError, parse_size

from ..auth import Principal
from ..deps import (
    DataDep,
    PrincipalDep,
    SettingsDep,
    StoreDep,
    WorkersDep,
    admit,
    event_seq,
    find_model,
    idempotent,
    new_id,
    request_hash,
    wait_for,
)
from ..errors import InvalidRequest, NotFound
from ..protocol import ModelCard
from ..schemas import (
    Checkpoint,
    FineTuningEvent,
    FineTuningJob,
    FineTuningJobCreate,
    Hyperparameters,
    ListPage,
    checkpoint_object,
    error_responses,
    event_object,
    finetune_object,
    page,
)
from ..settings import Settings
from ..store import AsyncStore

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])


async def find_job(store: AsyncStore, job_id: str, principal: Principal) -> dict:
    """The job, if `principal` may see it; another key's answers 404 as if absent."""
    row = await store.get_finetune(job_id)
    if row is None or not principal.may_see(row["owner"]):
        raise NotFound(f"No fine-tuning job found with id {job_id!r}", param="fine_tuning_job_id")
    return row


def resolve_hyperparameters(h: Hyperparameters, card: ModelCard, settings: Settings) -> dict:
    """'auto' becomes the server's default; a training clip shape is checked against the model's
    limits like a video's."""
    width = height = None
    if h.size is not None:
        width, height = parse_size(h.size, "hyperparameters.size")
    limits, defaults = card.limits, card.defaults
    try:
        limits.check_clip(
            h.num_frames or defaults.frames,
            width or defaults.width,
            height or defaults.height,
            param="hyperparameters.size",
        )
    except RequestError as e:
        param = "hyperparameters.num_frames" if e.param == "num_frames" else e.param
        raise RequestError(f"training clips: {e}", param=param) from None
    if (limits.experts > 1) != (h.expert is not None):
        need = (
            "choose which expert trains: high or low" if limits.experts > 1 else "has one denoiser"
        )
        raise RequestError(f"model {card.name} {need}", param="hyperparameters.expert")
    return {
        "n_epochs": settings.finetune_epochs if h.n_epochs == "auto" else h.n_epochs,
        "batch_size": 1 if h.batch_size == "auto" else h.batch_size,
        "learning_rate_multiplier": 1.0
        if h.learning_rate_multiplier == "auto"
        else h.learning_rate_multiplier,
        "num_frames": h.num_frames,
        "width": width,
        "height": height,
        "expert": h.expert,
    }


@router.post("", response_model=FineTuningJob, responses=error_responses(400, 404, 409, 429, 503))
async def create_job(
    body: FineTuningJobCreate,
    request: Request,
    store: StoreDep,
    workers: WorkersDep,
    settings: SettingsDep,
    data: DataDep,
    principal: PrincipalDep,
):
    card = find_model(workers, body.model, principal)
    file_row = await store.get_file(body.training_file)
    if file_row is None or not principal.may_see(file_row["owner"]):
        raise NotFound(f"No such File object: {body.training_file}", param="training_file")
    if file_row["status"] == "uploaded":
        raise InvalidRequest(
            f"file {body.training_file} is still being validated; create the job once its "
            "status is processed (GET /v1/files/{id})",
            param="training_file",
            code="file_not_ready",
        )
    if file_row["status"] == "error":
        raise InvalidRequest(
            f"file {body.training_file} failed validation: {file_row['status_details']}",
            param="training_file",
            code="invalid_file",
        )
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
    hyper = resolve_hyperparameters(hyper_in, card, settings)

    payload = request_hash(body.model_dump(exclude_none=True))
    async with idempotent(request, store, payload) as replay:
        if replay.replayed and (row := await store.get_finetune(replay.resource_id)) is not None:
            return finetune_object(row)
        await admit(store, workers, settings, principal)
        job_id = new_id("ftjob-")
        seed = body.seed if body.seed is not None else secrets.randbelow(2**RANDOM_SEED_BITS)
        row = await store.insert_finetune(
            {
                "id": job_id,
                "model": body.model,
                "training_file": body.training_file,
                "hyperparameters": hyper,
                "seed": seed,
                "suffix": body.suffix,
                "output_dir": data.relative(data.fine_tune(job_id)),
                "owner": principal.owner,
            },
            idempotency=replay.key,
        )
    workers.wake()
    return finetune_object(row)


@router.get("", response_model=ListPage[FineTuningJob], responses=error_responses(400))
async def list_jobs(
    store: StoreDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
):
    rows, has_more = await store.list_finetunes(after, limit, owner=principal.sees)
    return page([finetune_object(r) for r in rows], has_more)


@router.get("/{job_id}", response_model=FineTuningJob, responses=error_responses(404))
async def retrieve_job(job_id: str, store: StoreDep, principal: PrincipalDep):
    return finetune_object(await find_job(store, job_id, principal))


@router.post(
    "/{job_id}/cancel", response_model=FineTuningJob, responses=error_responses(400, 404, 409)
)
async def cancel_job(
    job_id: str,
    request: Request,
    store: StoreDep,
    workers: WorkersDep,
    settings: SettingsDep,
    principal: PrincipalDep,
):
    """Cancel a queued job now, or a running one at its next optimizer step (the answer waits
    for it). A retry with the same Idempotency-Key gets the first answer."""
    async with idempotent(request, store, request_hash({"cancel": job_id})) as replay:
        if replay.response is not None:  # a retry: the first answer, not "already cancelled"
            return replay.response
        row = await find_job(store, job_id, principal)
        if row["status"] in ("succeeded", "failed", "cancelled"):
            raise InvalidRequest(
                f"fine-tuning job {job_id} already {row['status']}",
                param="fine_tuning_job_id",
                code="job_not_cancellable",
            )

        async def cancelled() -> bool:
            return (await store.get_finetune(job_id))["status"] == "cancelled"

        if await store.cancel_finetune(job_id) == "running":
            workers.wake()
            await wait_for(cancelled, settings.cancel_wait_s)
        answer = finetune_object(await store.get_finetune(job_id))
        await replay.answer(answer)
    return answer


@router.get(
    "/{job_id}/events",
    response_model=ListPage[FineTuningEvent],
    responses=error_responses(400, 404),
)
async def list_events(
    job_id: str,
    store: StoreDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=1000),
):
    """Newest first; `after` is the id of the last event of the previous page."""
    await find_job(store, job_id, principal)
    if after is not None:
        if not after.startswith("ftevent-"):
            raise InvalidRequest(
                f"after must be an event id (ftevent-N), got {after[:40]!r}", param="after"
            )
        event_seq(after.removeprefix("ftevent-"), "after")
    rows, has_more = await store.finetune_events(job_id, after, limit)
    return page([event_object(r) for r in rows], has_more)


@router.get(
    "/{job_id}/checkpoints",
    response_model=ListPage[Checkpoint],
    responses=error_responses(400, 404),
)
async def list_checkpoints(
    job_id: str,
    store: StoreDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(10, ge=1, le=100),
):
    job = await find_job(store, job_id, principal)
    rows, has_more = await store.checkpoints(job_id, after, limit)
    return page([checkpoint_object(r, job) for r in rows], has_more)
