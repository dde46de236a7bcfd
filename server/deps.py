"""Dependencies shared by the routers: the store, the workers, the settings, the data directory,
the principal an API key stands for, idempotency."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from .auth import ANONYMOUS, Keyring, Principal
from .datadir import DataDir
from .errors import (
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    QueueFull,
    Unauthorized,
    WorkerDead,
)
from .links import LinkSigner
from .protocol import ModelCard, WorkerClient
from .settings import Settings
from .store import AsyncStore

# The dependencies are coroutines, though none awaits: FastAPI runs a plain function in its
# thread pool, one hop per dependency per request, which is most of a status poll's cost.


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> AsyncStore:
    return request.app.state.store


async def get_workers(request: Request) -> WorkerClient:
    return request.app.state.workers


async def get_data(request: Request) -> DataDir:
    return request.app.state.data


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[AsyncStore, Depends(get_store)]
WorkersDep = Annotated[WorkerClient, Depends(get_workers)]
DataDep = Annotated[DataDir, Depends(get_data)]


# Declares the bearer scheme in the OpenAPI schema; the header is read below, so that a missing
# or wrong key gets the envelope 401 (and no key is needed when none are configured).
bearer = HTTPBearer(
    auto_error=False,
    description="an API key, when the server has keys (`--api-keys`, `--api-keys-file`)",
)


async def require_api_key(
    request: Request, _declared: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """With keys configured, every request must carry `Authorization: Bearer <key>`; the key's
    principal (auth.py) is what the request acts for."""
    keyring: Keyring = request.app.state.keyring
    request.state.principal = ANONYMOUS
    if not keyring.enabled:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("Missing bearer authentication in header (Authorization: Bearer <key>)")
    principal = keyring.principal(token.strip())
    if principal is None:
        raise Unauthorized("Incorrect API key provided")
    request.state.principal = principal


async def require_key_or_link(
    request: Request, declared: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """A video's content: a key, as everywhere, or a signed link to it (links.py), which a
    `<video src>` can follow."""
    query = request.query_params
    if "signature" not in query:
        await require_api_key(request, declared)
        return
    links: LinkSigner = request.app.state.links
    video_id = request.path_params["video_id"]
    if not links.valid(
        video_id, query.get("variant", "video"), query.get("expires", ""), query["signature"]
    ):
        raise Unauthorized("The link is not valid for this content or has expired")
    request.state.principal = ANONYMOUS  # the link stands for the key that asked for it


def principal_of(request: Request) -> Principal:
    return getattr(request.state, "principal", ANONYMOUS)


async def get_principal(request: Request) -> Principal:
    return principal_of(request)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


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


IDEMPOTENCY_WAIT_S = 30.0  # how long a retry waits for its first request to finish


@dataclass(frozen=True)
class Replay:
    """What an Idempotency-Key says of a request: the work is this request's to do (`key`, to
    record its outcome under), or was done by an earlier one (`resource_id`, or `response`)."""

    key: tuple[str, str, str] | None = None
    resource_id: str | None = None
    response: dict | None = None
    store: AsyncStore | None = None

    @property
    def replayed(self) -> bool:
        return self.resource_id is not None or self.response is not None

    async def answer(self, response: BaseModel) -> BaseModel:
        """Record `response` as this request's answer, for its retries (a no-op without a
        key); returns it. Routes whose work makes no resource (cancel, delete) end with it."""
        if self.key is not None:
            await self.store.record_response(*self.key[:2], response.model_dump(mode="json"))
        return response


@contextlib.asynccontextmanager
async def idempotent(
    request: Request, store: AsyncStore, payload_hash: str
) -> AsyncIterator[Replay]:
    """Run a request once per `Idempotency-Key`.

    The key is reserved before the work starts, so a retry that arrives while the first request
    is still at work (a slow upload, a client that timed out) waits for its outcome instead of
    doing the work twice. The request records its resource (`store.insert_*(idempotency=key)`)
    or its answer (`Replay.answer`) under the key; if it fails instead, the key is freed
    for the next retry. Reusing a key with a different body is a client bug: 409.
    """
    key = request.headers.get("idempotency-key")
    if not key:
        yield Replay()
        return
    principal = principal_of(request)
    reservation = (principal.scope, f"{request.method} {request.url.path}:{key}", payload_hash)
    deadline = time.monotonic() + IDEMPOTENCY_WAIT_S
    while (prior := await store.reserve_key(*reservation)) is not None:
        if prior["request_hash"] != payload_hash:
            raise Conflict(
                "Idempotency-Key was already used with a different request body",
                code="idempotency_key_reused",
            )
        if prior["resource_id"] is not None or prior["response"] is not None:
            response = json.loads(prior["response"]) if prior["response"] else None
            yield Replay(resource_id=prior["resource_id"], response=response)
            return
        if time.monotonic() > deadline:
            raise Conflict(
                "a request with this Idempotency-Key is still being handled; retry shortly",
                code="idempotency_key_in_use",
            )
        await asyncio.sleep(0.1)
    try:
        yield Replay(key=reservation, store=store)
    finally:
        # A no-op once the outcome is recorded; otherwise the request failed: free the key.
        await store.release_key(*reservation[:2])


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
    return card.seen_by(principal.may_see)


async def admit(
    store: AsyncStore, workers: WorkerClient, settings: Settings, principal: Principal
) -> None:
    """Refuse new work when the worker is dead, the queue is full, or the principal (a key that
    is not an admin's) already holds its share of the queue."""
    if workers.dead:
        raise WorkerDead(f"the worker stopped ({workers.dead}); restart the server")
    depth = await store.queue_depth()
    if depth >= settings.max_queue:
        raise QueueFull(
            f"the queue is full ({depth} jobs waiting); retry later",
            retry_after=workers.retry_after(),
        )
    if principal.admin:
        return
    mine = await store.queue_depth(owner=principal.owner)
    if mine >= settings.max_queue_per_key:
        raise QueueFull(
            f"this API key has {mine} jobs waiting, its share of the queue; retry when one "
            "has started",
            retry_after=workers.retry_after(),
        )


def check_priority(priority: int, principal: Principal) -> None:
    """Only an admin (or a server without keys) may put a job ahead of others."""
    if priority > 0 and not principal.admin:
        raise Forbidden(
            f"priority {priority} needs an admin key; other keys may use 0 or less",
            param="priority",
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
