"""`/healthz` (the process and its worker live), `/readyz` (models loaded) and `/metrics` (Prometheus)."""

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
    if not workers.ready:
        raise NotReady("the models are still loading")
    return {"status": "ready", "models": [card.name for card in workers.models()]}


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
    depth = Gauge("megaslide_queue_depth", "Jobs waiting for the worker (videos and fine-tunes)")
    depth.set(await store.queue_depth())
    jobs = Gauge("megaslide_jobs", "Jobs in the store by kind and state")
    for (kind, state), n in sorted((await store.counts_by_state()).items()):
        jobs.set(n, kind=kind, state=state)
    ready = Gauge("megaslide_ready", "1 once the models are loaded and the worker runs")
    ready.set(1 if workers.ready else 0)
    body = render([depth, jobs, ready, *workers.metrics.all()])
    return PlainTextResponse(body, media_type=PROMETHEUS_TEXT)
