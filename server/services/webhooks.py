"""Webhook endpoints: register (the URL checked, the secret made and shown once), list,
retrieve, delete, and the deliveries of one with their tries. An endpoint belongs to the key that
registered it and receives the events of that key's jobs alone."""

from __future__ import annotations

import anyio

from ..auth import Principal
from ..errors import InvalidRequest, NotFound
from ..records import WebhookEndpointRecord
from ..schemas import (
    WebhookEndpoint,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    page,
    webhook_delivery_object,
    webhook_endpoint_object,
)
from ..settings import Settings
from ..store import AsyncStore
from ..webhooks import UnsafeURL, check_url, new_secret
from .jobs import new_id


class Webhooks:
    """The webhook endpoints of one server, as its API's principals see them."""

    def __init__(self, store: AsyncStore, settings: Settings) -> None:
        self.store, self.settings = store, settings

    async def create(self, body: WebhookEndpointCreate, principal: Principal) -> WebhookEndpoint:
        """Register an endpoint; the answer holds its secret, which no later answer shows."""
        allow = self.settings.webhook_allow_private
        try:  # resolving the host may take a while: off the event loop
            await anyio.to_thread.run_sync(lambda: check_url(body.url, allow_private=allow))
        except UnsafeURL as exc:
            raise InvalidRequest(str(exc), param="url", code="invalid_url") from None
        row = await self.store.webhooks.create_endpoint(
            {
                "id": new_id("we_"),
                "owner": principal.owner,
                "url": body.url,
                "events": list(dict.fromkeys(body.events)),
                "secret": new_secret(),
                "description": body.description,
            }
        )
        return webhook_endpoint_object(row, with_secret=True)

    async def find(self, endpoint_id: str, principal: Principal) -> WebhookEndpointRecord:
        """The endpoint, if `principal` may see it; another key's answers 404 as if absent."""
        row = await self.store.webhooks.get_endpoint(endpoint_id)
        if row is None or not principal.may_see(row.owner):
            raise NotFound(f"No such webhook endpoint: {endpoint_id}", param="endpoint_id")
        return row

    async def retrieve(self, endpoint_id: str, principal: Principal) -> WebhookEndpoint:
        return webhook_endpoint_object(await self.find(endpoint_id, principal))

    async def list(self, principal: Principal, after: str | None, limit: int) -> dict:
        rows, has_more = await self.store.webhooks.page_endpoints(after, limit, principal.sees)
        return page([webhook_endpoint_object(r) for r in rows], has_more)

    async def delete(self, endpoint_id: str, principal: Principal) -> WebhookEndpointDeleted:
        """Delete an endpoint and what it is owed: nothing more is sent to it."""
        await self.find(endpoint_id, principal)
        if not await self.store.webhooks.delete_endpoint(endpoint_id):
            raise NotFound(f"No such webhook endpoint: {endpoint_id}", param="endpoint_id")
        return WebhookEndpointDeleted(id=endpoint_id, deleted=True)

    async def enable(self, endpoint_id: str, principal: Principal) -> WebhookEndpoint:
        """Send to an endpoint again after a delivery to it failed for good: what it was owed
        meanwhile goes out first, in order."""
        await self.find(endpoint_id, principal)
        if not await self.store.webhooks.enable(endpoint_id):
            raise NotFound(f"No such webhook endpoint: {endpoint_id}", param="endpoint_id")
        return await self.retrieve(endpoint_id, principal)

    async def deliveries(
        self, endpoint_id: str, principal: Principal, after: str | None, limit: int
    ) -> dict:
        """A page of the endpoint's deliveries, newest first, each with its tries."""
        await self.find(endpoint_id, principal)
        rows, has_more = await self.store.webhooks.deliveries(endpoint_id, after, limit)
        return page([webhook_delivery_object(d, tries) for d, tries in rows], has_more)
