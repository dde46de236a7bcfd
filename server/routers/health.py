"""`/healthz` (this process and its worker live), `/readyz` (some worker can run jobs) and
`/metrics` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse, Response

from ..deps import StoreDep, WorkersDep, require_api_key
from ..errors import EngineDead, NotReady
from ..metrics import Gauge, render
from ..schemas import error_responses

router = APIRouter(tags=["health"], responses=error_responses(413, 500))

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/healthz", responses=error_responses(503))
async def healthz(workers: WorkersDep):
    if workers.dead:
        raise EngineDead(f"the worker stopped: {workers.dead}")
    return {"status": "ok"}


@router.get("/readyz", responses=error_responses(503))
async def readyz(workers: WorkersDep):
    if workers.dead:
        raise EngineDead(f"the worker stopped: {workers.dead}")
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
async def metrics(workers: WorkersDep, store: StoreDep):
    # Gauges about jobs are read from the store at scrape time, so they always agree with the API.
    depth = Gauge("megaslide_queue_depth", "Jobs waiting for a worker (videos and fine-tunes)")
    by_model = await store.queue_depth_by_model()
    depth.set(sum(by_model.values()))
    queued = Gauge("megaslide_queued_jobs", "Jobs waiting for a worker, by the model they need")
    for model, n in sorted(by_model.items()):
        queued.set(n, model=model)
    live = workers.live_workers()
    counted = Gauge("megaslide_workers", "Workers heard from within the lease, by state")
    for state in ("ready", "loading", "dead"):
        counted.set(sum(1 for w in live if worker_state(w) == state), state=state)
    jobs = Gauge("megaslide_jobs", "Jobs in the store by kind and state")
    for (kind, state), n in sorted((await store.counts_by_state()).items()):
        jobs.set(n, kind=kind, state=state)
    ready = Gauge("megaslide_ready", "1 once some worker has its models loaded and runs jobs")
    ready.set(1 if workers.ready else 0)
    body = render([depth, queued, counted, jobs, ready, *workers.metrics.all()])
    return PlainTextResponse(body, media_type=PROMETHEUS_TEXT)


def worker_state(worker: dict) -> str:
    if worker["dead"]:
        return "dead"
    return "ready" if worker["ready"] else "loading"
