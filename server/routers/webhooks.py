"""`/v1/webhooks/endpoints`: register, list, retrieve, delete and enable a key's webhook
endpoints, and read the deliveries of one with their tries (webhooks.py says what is sent, and
how)."""

from __future__ import annotations

from fastapi import APIRouter, Query

from ..deps import PrincipalDep, WebhooksDep
from ..schemas import (
    ListPage,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    error_responses,
)

router = APIRouter(prefix="/v1/webhooks/endpoints", tags=["webhooks"])


@router.post("", response_model=WebhookEndpoint, responses=error_responses(400))
async def create_endpoint(
    body: WebhookEndpointCreate, webhooks: WebhooksDep, principal: PrincipalDep
):
    """Send these events of this key's jobs to `url`. The answer holds the endpoint's `secret`,
    shown this once: deliveries are signed with it (Standard Webhooks). A URL whose host
    resolves to a loopback, private or link-local address is refused unless the server allows
    such endpoints."""
    return await webhooks.create(body, principal)


@router.get("", response_model=ListPage[WebhookEndpoint], responses=error_responses(400))
async def list_endpoints(
    webhooks: WebhooksDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
):
    return await webhooks.list(principal, after, limit)


@router.get("/{endpoint_id}", response_model=WebhookEndpoint, responses=error_responses(404))
async def retrieve_endpoint(endpoint_id: str, webhooks: WebhooksDep, principal: PrincipalDep):
    return await webhooks.retrieve(endpoint_id, principal)


@router.delete(
    "/{endpoint_id}", response_model=WebhookEndpointDeleted, responses=error_responses(404)
)
async def delete_endpoint(endpoint_id: str, webhooks: WebhooksDep, principal: PrincipalDep):
    """Delete the endpoint; what it is still owed is dropped."""
    return await webhooks.delete(endpoint_id, principal)


@router.post(
    "/{endpoint_id}/enable", response_model=WebhookEndpoint, responses=error_responses(404)
)
async def enable_endpoint(endpoint_id: str, webhooks: WebhooksDep, principal: PrincipalDep):
    """An endpoint is disabled once a delivery to it fails for good (its retries spent); its
    events are still kept for it. Enabling it sends them, each job's in order."""
    return await webhooks.enable(endpoint_id, principal)


@router.get(
    "/{endpoint_id}/deliveries",
    response_model=ListPage[WebhookDelivery],
    responses=error_responses(400, 404),
)
async def list_deliveries(
    endpoint_id: str,
    webhooks: WebhooksDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
):
    """The endpoint's deliveries, newest first, each with its tries: `pending` (tried again at
    `next_attempt_at`), `delivered`, or `failed` once its retries are spent."""
    return await webhooks.deliveries(endpoint_id, principal, after, limit)
