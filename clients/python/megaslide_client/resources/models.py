"""`client.models`: the base and fine-tuned models the server can generate with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._pagination import AsyncCursorPage, AsyncPaginator, SyncCursorPage
from ..types import Model

if TYPE_CHECKING:
    from .._base_client import AsyncAPIClient, SyncAPIClient


def _no_next_page(cursor):
    raise RuntimeError("the model list has a single page")


async def _no_next_page_async(cursor):
    raise RuntimeError("the model list has a single page")


class Models:
    """Models served."""

    def __init__(self, client: SyncAPIClient) -> None:
        self._client = client

    def list(self) -> SyncCursorPage[Model]:
        """Every model (a single page; iterate over it or read `.data`)."""
        return SyncCursorPage(self._client.get("/v1/models").json(), Model, _no_next_page)

    def retrieve(self, model: str) -> Model:
        return Model.from_dict(self._client.get(f"/v1/models/{model}").json())


class AsyncModels:
    """Async twin of Models."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self._client = client

    def list(self) -> AsyncPaginator[Model]:
        """Every model: `await` it for the page, or `async for` over the models."""

        async def fetch() -> AsyncCursorPage[Model]:
            return AsyncCursorPage(
                (await self._client.get("/v1/models")).json(), Model, _no_next_page_async
            )

        return AsyncPaginator(fetch)

    async def retrieve(self, model: str) -> Model:
        return Model.from_dict((await self._client.get(f"/v1/models/{model}")).json())
