"""`/v1/models`: the served base models and the fine-tuned ones, usable as soon as they are listed."""

from __future__ import annotations

from fastapi import APIRouter

from ..deps import WorkersDep
from ..errors import NotFound
from ..schemas import ListPage, Model, error_responses, model_object

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ListPage[Model])
async def list_models(workers: WorkersDep):
    return {"data": [model_object(card) for card in workers.models()]}


@router.get("/{model_id}", response_model=Model, responses=error_responses(404))
async def retrieve_model(model_id: str, workers: WorkersDep):
    card = workers.model(model_id)
    if card is None:
        raise NotFound(
            f"The model {model_id!r} does not exist", param="model", code="model_not_found"
        )
    return model_object(card)
