"""`/v1/fine_tuning/jobs`: create, list, retrieve, cancel, events (loss and lr as metrics),
checkpoints, and the validation videos sampled from each checkpoint."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response

from ..deps import FineTuningDep, IdempotencyKeyDep, PrincipalDep
from ..downloads import Download
from ..schemas import (
    Checkpoint,
    FineTuningEvent,
    FineTuningJob,
    FineTuningJobCreate,
    ListPage,
    error_responses,
)

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])


@router.post("", response_model=FineTuningJob, responses=error_responses(400, 404, 409, 429, 503))
async def create_job(
    body: FineTuningJobCreate,
    jobs: FineTuningDep,
    principal: PrincipalDep,
    key: IdempotencyKeyDep,
):
    return await jobs.create(body, principal, key)


@router.get("", response_model=ListPage[FineTuningJob], responses=error_responses(400))
async def list_jobs(
    jobs: FineTuningDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
):
    return await jobs.list(principal, after, limit)


@router.get("/{job_id}", response_model=FineTuningJob, responses=error_responses(404))
async def retrieve_job(job_id: str, jobs: FineTuningDep, principal: PrincipalDep):
    return await jobs.retrieve(job_id, principal)


@router.post(
    "/{job_id}/cancel", response_model=FineTuningJob, responses=error_responses(400, 404, 409)
)
async def cancel_job(
    job_id: str, jobs: FineTuningDep, principal: PrincipalDep, key: IdempotencyKeyDep
):
    """Cancel a queued job now, or a running one at its next optimizer step (the answer waits
    for it). A retry with the same Idempotency-Key gets the first answer."""
    return await jobs.cancel(job_id, principal, key)


@router.get(
    "/{job_id}/events",
    response_model=ListPage[FineTuningEvent],
    responses=error_responses(400, 404),
)
async def list_events(
    job_id: str,
    jobs: FineTuningDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=1000),
):
    """Newest first; `after` is the id of the last event of the previous page."""
    return await jobs.events(job_id, principal, after, limit)


@router.get(
    "/{job_id}/checkpoints",
    response_model=ListPage[Checkpoint],
    responses=error_responses(400, 404),
)
async def list_checkpoints(
    job_id: str,
    jobs: FineTuningDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(10, ge=1, le=100),
):
    return await jobs.checkpoints(job_id, principal, after, limit)


@router.get(
    "/{job_id}/checkpoints/{checkpoint_id}/validation/{index}/content",
    response_class=Response,
    responses={
        200: {"content": {"video/mp4": {}}, "description": "The whole file"},
        206: {"content": {"video/mp4": {}}, "description": "The range asked for"},
        **error_responses(400, 404, 416),
    },
)
async def validation_video_content(
    job_id: str,
    checkpoint_id: str,
    index: int,
    jobs: FineTuningDep,
    principal: PrincipalDep,
):
    """The MP4 of validation prompt `index` (the job's order) sampled from the checkpoint's
    weights, with Range support."""
    path = await jobs.validation_video(job_id, checkpoint_id, index, principal)
    return Download(path, "video/mp4", f"{checkpoint_id}-validation-{index}.mp4")
