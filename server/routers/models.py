"""`/v1/models`: the base models live workers serve, and the caller's fine-tuned ones, usable as
soon as they are listed."""

from __future__ import annotations

from fastapi import APIRouter

from ..deps import PrincipalDep, WorkersDep
from ..schemas import ListPage, Model, error_responses
from ..services import models

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ListPage[Model])
async def list_models(workers: WorkersDep, principal: PrincipalDep):
    return {"data": models.list_models(workers, principal)}


@router.get("/{model_id}", response_model=Model, responses=error_responses(404))
async def retrieve_model(model_id: str, workers: WorkersDep, principal: PrincipalDep):
    return models.retrieve_model(workers, model_id, principal)
