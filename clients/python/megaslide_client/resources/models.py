"""`client.models`: the base and fine-tuned models the server can generate with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._pagination import AsyncPaginator, SyncCursorPage
from ..types import Model

if TYPE_CHECKING:
    from .._base_client import AsyncAPIClient, SyncAPIClient


class Models:
    """Models served."""

    def __init__(self, client: SyncAPIClient) -> None:
        self._client = client

    def list(self) -> SyncCursorPage[Model]:
        """Every model (a single page; iterate over it or read `.data`)."""
        return self._client.get_page("/v1/models", Model)

    def retrieve(self, model: str) -> Model:
        return Model.from_dict(self._client.get(f"/v1/models/{model}").json())


class AsyncModels:
    """Async twin of Models."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self._client = client

    def list(self) -> AsyncPaginator[Model]:
        """Every model: `await` it for the page, or `async for` over the models."""
        return self._client.get_page("/v1/models", Model)

    async def retrieve(self, model: str) -> Model:
        return Model.from_dict((await self._client.get(f"/v1/models/{model}")).json())
