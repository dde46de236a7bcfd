"""Dependencies shared by the routers: the store, the workers, the settings, the data directory,
API keys, idempotency."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request

from .datadir import DataDir
from .errors import Conflict, EngineDead, InvalidRequest, QueueFull, Unauthorized
from .protocol import WorkerClient
from .settings import Settings
from .store import AsyncStore


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_store(request: Request) -> AsyncStore:
    return request.app.state.store


def get_workers(request: Request) -> WorkerClient:
    return request.app.state.workers


def get_data(request: Request) -> DataDir:
    return request.app.state.data


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[AsyncStore, Depends(get_store)]
WorkersDep = Annotated[WorkerClient, Depends(get_workers)]
DataDep = Annotated[DataDir, Depends(get_data)]


def require_api_key(request: Request, settings: SettingsDep) -> None:
    """With keys configured, every request must carry `Authorization: Bearer <one of them>`."""
    request.state.key_scope = "-"
    if not settings.api_keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("Missing bearer authentication in header (Authorization: Bearer <key>)")
    token = token.strip().encode()
    # compare_digest against every key, without stopping at a match: the time taken says nothing
    # about how much of a guess was right, nor which key matched.
    matched = [hmac.compare_digest(token, key.encode()) for key in settings.api_keys]
    if not any(matched):
        raise Unauthorized("Incorrect API key provided")
    # Idempotency keys are scoped per API key, so one client cannot replay another's job.
    request.state.key_scope = hashlib.sha256(token).hexdigest()[:16]


EVENT_SEQ_LIMIT = 2**63  # event numbers are stored as signed 64-bit integers


def event_seq(text: str, param: str) -> int:
    """An event number a client sends back (SSE's `Last-Event-ID`, a page cursor): plain decimal
    digits below 2**63, else a 400 naming `param`."""
    # isdigit() alone would take other scripts' digits ("٣", "²"); 19 digits hold any valid one.
    if not (text.isascii() and text.isdigit() and len(text) <= 19) or int(text) >= EVENT_SEQ_LIMIT:
        raise InvalidRequest(
            f"{param} must be an event number below 2**63, got {text[:40]!r}", param=param
        )
    return int(text)


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def request_hash(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


async def replayed(request: Request, store: AsyncStore, payload_hash: str) -> str | None:
    """The resource a retried POST created the first time (same `Idempotency-Key`), if any.

    Reusing a key with a different body is a client bug, answered 409 rather than guessed at.
    """
    key = idempotency(request, payload_hash)
    if key is None:
        return None
    prior = await store.idempotent(key[0], key[1])
    if prior is None:
        return None
    if prior["request_hash"] != payload_hash:
        raise Conflict(
            "Idempotency-Key was already used with a different request body",
            code="idempotency_key_reused",
        )
    return prior["resource_id"]


def idempotency(request: Request, payload_hash: str) -> tuple[str, str, str] | None:
    key = request.headers.get("idempotency-key")
    if not key:
        return None
    return (getattr(request.state, "key_scope", "-"), f"{request.url.path}:{key}", payload_hash)


async def admit(store: AsyncStore, workers: WorkerClient, settings: Settings) -> None:
    """Refuse new work when the worker is dead or the queue is full."""
    if workers.dead:
        raise EngineDead(f"the worker stopped ({workers.dead}); restart the server")
    depth = await store.queue_depth()
    if depth >= settings.max_queue:
        raise QueueFull(
            f"the queue is full ({depth} jobs waiting); retry later",
            retry_after=workers.retry_after(),
        )


async def wait_for(
    done: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.05
) -> bool:
    """Poll `await done()` without blocking the event loop; True if it became true in time."""
    deadline = time.monotonic() + timeout_s
    while not await done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval_s)
    return True
