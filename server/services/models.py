"""The served models a principal may use: every base model, and its own fine-tunes."""

from __future__ import annotations

from ..auth import Principal
from ..errors import NotFound
from ..protocol import ModelCard, WorkerClient
from ..schemas import Model, model_object


def find_model(workers: WorkerClient, name: str, principal: Principal) -> ModelCard:
    """A served model `principal` may use: any base model, its own fine-tunes (and those made
    before keys were owners); another key's fine-tune answers 404 as if absent."""
    card = workers.model(name)
    if card is None or not principal.may_see(card.owner):
        raise NotFound(
            f"The model {name!r} does not exist; see GET /v1/models",
            param="model",
            code="model_not_found",
        )
    return card.seen_by(principal.may_see, principal.owner)


def list_models(workers: WorkerClient, principal: Principal) -> list[Model]:
    """The models `principal` may use, each with only the adapters it may see."""
    cards = [
        c.seen_by(principal.may_see, principal.owner)
        for c in workers.models()
        if principal.may_see(c.owner)
    ]
    return [model_object(card) for card in cards]


def retrieve_model(workers: WorkerClient, name: str, principal: Principal) -> Model:
    return model_object(find_model(workers, name, principal))
