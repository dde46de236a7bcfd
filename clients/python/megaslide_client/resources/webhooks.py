"""`client.webhooks.endpoints`: register, list, retrieve, delete and enable webhook endpoints,
and read an endpoint's deliveries with their tries. Check what arrives with `verify_webhook`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._pagination import AsyncPaginator, SyncCursorPage
from ..types import WebhookDelivery, WebhookEndpoint, WebhookEndpointDeleted

if TYPE_CHECKING:
    from .._base_client import AsyncAPIClient, SyncAPIClient

PATH = "/v1/webhooks/endpoints"


class Endpoints:
    """Webhook endpoints of this key."""

    def __init__(self, client: SyncAPIClient) -> None:
        self._client = client

    def create(
        self, *, url: str, events: list[str], description: str | None = None
    ) -> WebhookEndpoint:
        """Send these events of this key's jobs to `url`. The result's `secret` (shown this
        once) is what `verify_webhook` checks deliveries with."""
        body = {"url": url, "events": events, "description": description}
        return WebhookEndpoint.from_dict(self._client.post(PATH, json=body).json())

    def retrieve(self, endpoint_id: str) -> WebhookEndpoint:
        return WebhookEndpoint.from_dict(self._client.get(f"{PATH}/{endpoint_id}").json())

    def list(
        self, *, after: str | None = None, limit: int | None = None
    ) -> SyncCursorPage[WebhookEndpoint]:
        """A page of endpoints, newest first; iterating over it walks the following pages."""
        return self._client.get_page(PATH, WebhookEndpoint, after=after, limit=limit)

    def delete(self, endpoint_id: str) -> WebhookEndpointDeleted:
        response = self._client.delete(f"{PATH}/{endpoint_id}")
        return WebhookEndpointDeleted.from_dict(response.json())

    def enable(self, endpoint_id: str) -> WebhookEndpoint:
        """Send to an endpoint disabled after a delivery failed for good: what it was owed
        meanwhile goes out first."""
        response = self._client.post(f"{PATH}/{endpoint_id}/enable")
        return WebhookEndpoint.from_dict(response.json())

    def deliveries(
        self, endpoint_id: str, *, after: str | None = None, limit: int | None = None
    ) -> SyncCursorPage[WebhookDelivery]:
        """The endpoint's deliveries, newest first, each with its `attempts`."""
        path = f"{PATH}/{endpoint_id}/deliveries"
        return self._client.get_page(path, WebhookDelivery, after=after, limit=limit)


class AsyncEndpoints:
    """Async twin of Endpoints."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self._client = client

    async def create(
        self, *, url: str, events: list[str], description: str | None = None
    ) -> WebhookEndpoint:
        """Register an endpoint (see `Endpoints.create`)."""
        body = {"url": url, "events": events, "description": description}
        return WebhookEndpoint.from_dict((await self._client.post(PATH, json=body)).json())

    async def retrieve(self, endpoint_id: str) -> WebhookEndpoint:
        response = await self._client.get(f"{PATH}/{endpoint_id}")
        return WebhookEndpoint.from_dict(response.json())

    def list(
        self, *, after: str | None = None, limit: int | None = None
    ) -> AsyncPaginator[WebhookEndpoint]:
        """`await` it for the first page, or `async for` over every endpoint."""
        return self._client.get_page(PATH, WebhookEndpoint, after=after, limit=limit)

    async def delete(self, endpoint_id: str) -> WebhookEndpointDeleted:
        response = await self._client.delete(f"{PATH}/{endpoint_id}")
        return WebhookEndpointDeleted.from_dict(response.json())

    async def enable(self, endpoint_id: str) -> WebhookEndpoint:
        """Send to a disabled endpoint again (see `Endpoints.enable`)."""
        response = await self._client.post(f"{PATH}/{endpoint_id}/enable")
        return WebhookEndpoint.from_dict(response.json())

    def deliveries(
        self, endpoint_id: str, *, after: str | None = None, limit: int | None = None
    ) -> AsyncPaginator[WebhookDelivery]:
        """The endpoint's deliveries (see `Endpoints.deliveries`)."""
        path = f"{PATH}/{endpoint_id}/deliveries"
        return self._client.get_page(path, WebhookDelivery, after=after, limit=limit)


class Webhooks:
    """`client.webhooks`: holds `endpoints`."""

    def __init__(self, client: SyncAPIClient) -> None:
        self.endpoints = Endpoints(client)


class AsyncWebhooks:
    """`client.webhooks` of AsyncClient: holds `endpoints`."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self.endpoints = AsyncEndpoints(client)
