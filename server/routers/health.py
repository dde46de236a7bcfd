"""`/healthz` (this process and its worker live), `/readyz` (some worker can run jobs) and
`/metrics` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..deps import StoreDep, WorkersDep, require_api_key
from ..errors import NotReady, WorkerDead
from ..metrics import Gauges, exposition
from ..schemas import error_responses

# 400: a NUL in the query is refused before any route runs (RefuseNul), even here.
router = APIRouter(tags=["health"], responses=error_responses(400, 413, 500))


@router.get("/healthz", responses=error_responses(503))
async def healthz(workers: WorkersDep):
    if workers.dead:
        raise WorkerDead(f"the worker stopped: {workers.dead}")
    return {"status": "ok"}


@router.get("/readyz", responses=error_responses(503))
async def readyz(workers: WorkersDep):
    if workers.dead:
        raise WorkerDead(f"the worker stopped: {workers.dead}")
    if workers.trouble:
        raise NotReady(workers.trouble)
    if not workers.ready:
        raise NotReady("the models are still loading, or no worker is live")
    live = workers.live_workers()
    return {
        "status": "ready",
        # Base models only: the probe needs no key, and fine-tunes belong to their tenants.
        "models": [card.name for card in workers.models() if card.kind != "fine-tune"],
        "workers": {"live": len(live), "ready": sum(1 for w in live if worker_state(w) == "ready")},
    }


@router.get(
    "/metrics",
    response_class=Response,  # not PlainTextResponse, whose media type the errors would inherit
    dependencies=[Depends(require_api_key)],
    responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
        **error_responses(401),
    },
)
async def metrics(request: Request, workers: WorkersDep, store: StoreDep):
    # Gauges about jobs are read from the store at scrape time, so they always agree with the API.
    gauges = Gauges()
    by_model = await store.jobs.queue_depth_by_model()
    gauges.set(
        "megaslide_queue_depth",
        "Jobs waiting for a worker (videos and fine-tunes)",
        sum(by_model.values()),
    )
    for model, n in sorted(by_model.items()):
        gauges.set(
            "megaslide_queued_jobs",
            "Jobs waiting for a worker, by the base model they need (fine-tunes under theirs)",
            n,
            model=model,
        )
    live = workers.live_workers()
    for state in ("ready", "loading", "dead"):
        n = sum(1 for w in live if worker_state(w) == state)
        gauges.set(
            "megaslide_workers", "Workers heard from within the lease, by state", n, state=state
        )
    for (kind, state), n in sorted((await store.jobs.counts_by_state()).items()):
        gauges.set(
            "megaslide_jobs", "Jobs in the store by kind and state", n, kind=kind, state=state
        )
    gauges.set(
        "megaslide_video_repeats",
        "Videos in the store answered with the MP4 of an earlier one they repeat (no pass ran)",
        await store.videos.repeats(),
    )
    gauges.set(
        "megaslide_ready",
        "1 once some worker has its models loaded and runs jobs",
        1 if workers.ready else 0,
    )
    body, content_type = exposition(request.headers.get("accept"), gauges, workers.metrics)
    return Response(body, media_type=content_type)


def worker_state(worker: dict) -> str:
    if worker["dead"]:
        return "dead"
    return "ready" if worker["ready"] else "loading"
