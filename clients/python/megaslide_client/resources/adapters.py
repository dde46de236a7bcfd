"""`client.adapters`: upload LoRA adapters for a served base model, list, retrieve and delete them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx

from .._pagination import AsyncPaginator, SyncCursorPage
from .._polling import Watch
from .._progress import ProgressBar
from ..types import Adapter, AdapterDeleted
from .files import FileInput, Upload

if TYPE_CHECKING:
    from .._base_client import AsyncAPIClient, SyncAPIClient


class AdapterWatch(Watch[Adapter]):
    """Polls an adapter until the workers have registered it (`ready`) or refused it (`error`)."""

    def __init__(self, name: str, *, poll_interval_ms: int | None, max_wait: float | None):
        bar = ProgressBar(False, total=1, desc=f"adapter {name}")
        super().__init__(bar, poll_interval_ms=poll_interval_ms, max_wait=max_wait)

    def observe(self, response: httpx.Response) -> bool:
        self.result = Adapter.from_dict(response.json())
        return self.result.status != "uploaded"

    def still(self) -> str:
        return f"adapter {self.result.id} still waiting for the workers"


class Adapters:
    """LoRA adapters of the served base models."""

    def __init__(self, client: SyncAPIClient) -> None:
        self._client = client

    def create(self, *, file: FileInput, model: str, name: str) -> Adapter:
        """Upload a LoRA file (safetensors, any Wan key layout) for `model` under `name`;
        returns at once with `status="uploaded"` (see `wait_until_ready`)."""
        with Upload(file) as upload:
            response = self._client.post(
                "/v1/adapters", data={"model": model, "name": name}, files=upload
            )
        return Adapter.from_dict(response.json())

    def retrieve(self, model: str, name: str) -> Adapter:
        return Adapter.from_dict(self._client.get(f"/v1/adapters/{model}/{name}").json())

    def list(self, *, model: str | None = None) -> SyncCursorPage[Adapter]:
        """Every adapter (a single page), or `model`'s."""
        return self._client.get_page("/v1/adapters", Adapter, model=model)

    def delete(self, model: str, name: str) -> AdapterDeleted:
        """Delete an uploaded adapter (refused while a queued or running video applies it)."""
        return AdapterDeleted.from_dict(self._client.delete(f"/v1/adapters/{model}/{name}").json())

    def wait_until_ready(
        self,
        model: str,
        name: str,
        *,
        poll_interval_ms: int | None = 500,
        max_wait: float | None = None,
    ) -> Adapter:
        """Wait until the workers have taken the adapter: `ready`, or `error` with
        `status_details` naming the first key that does not fit."""
        url = f"/v1/adapters/{model}/{name}"
        with AdapterWatch(name, poll_interval_ms=poll_interval_ms, max_wait=max_wait) as watch:
            return self._client.poll(lambda: self._client.get(url), watch)


class AsyncAdapters:
    """Async twin of Adapters."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self._client = client

    async def create(self, *, file: FileInput, model: str, name: str) -> Adapter:
        with Upload(file) as upload:
            response = await self._client.post(
                "/v1/adapters", data={"model": model, "name": name}, files=upload
            )
        return Adapter.from_dict(response.json())

    async def retrieve(self, model: str, name: str) -> Adapter:
        return Adapter.from_dict((await self._client.get(f"/v1/adapters/{model}/{name}")).json())

    def list(self, *, model: str | None = None) -> AsyncPaginator[Adapter]:
        return self._client.get_page("/v1/adapters", Adapter, model=model)

    async def delete(self, model: str, name: str) -> AdapterDeleted:
        response = await self._client.delete(f"/v1/adapters/{model}/{name}")
        return AdapterDeleted.from_dict(response.json())

    async def wait_until_ready(
        self,
        model: str,
        name: str,
        *,
        poll_interval_ms: int | None = 500,
        max_wait: float | None = None,
    ) -> Adapter:
        url = f"/v1/adapters/{model}/{name}"
        with AdapterWatch(name, poll_interval_ms=poll_interval_ms, max_wait=max_wait) as watch:
            return await self._client.poll(lambda: self._client.get(url), watch)
