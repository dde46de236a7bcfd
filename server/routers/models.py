"""`/v1/models`: the base models live workers serve, and the caller's fine-tuned ones, usable as
soon as they are listed."""

from __future__ import annotations

from fastapi import APIRouter

from ..deps import PrincipalDep, WorkersDep, find_model
from ..schemas import ListPage, Model, error_responses, model_object

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ListPage[Model])
async def list_models(workers: WorkersDep, principal: PrincipalDep):
    cards = [c.seen_by(principal.may_see) for c in workers.models() if principal.may_see(c.owner)]
    return {"data": [model_object(card) for card in cards]}


@router.get("/{model_id}", response_model=Model, responses=error_responses(404))
async def retrieve_model(model_id: str, workers: WorkersDep, principal: PrincipalDep):
    return model_object(find_model(workers, model_id, principal))
