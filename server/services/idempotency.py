"""Idempotency-Key: a mutating request is done once per key, and its retries get that outcome.

Every mutating route goes through one of two helpers: `create_once` for the routes that make a
resource (a video, a file, a fine-tuning job; a retry gets the resource as it is now), and
`answer_once` for those whose outcome is an answer (cancel, delete, an adapter upload; a retry
gets the first answer, whatever happened since). Both stand on `idempotent`, which reserves the
key in the store before the work starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

from ..errors import Conflict
from ..store import AsyncStore, Reservation

IDEMPOTENCY_WAIT_S = 30.0  # how long a retry waits for its first request to finish

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")  # a store record


@dataclass(frozen=True)
class IdempotencyKey:
    """A request's `Idempotency-Key`, scoped to the principal that sent it and the route it hit."""

    scope: str  # the principal's (auth.py): two keys' requests never share an outcome
    name: str  # "METHOD /path:key"


def request_hash(payload) -> str:
    """A digest of what a request asks for: a key reused with another payload is a client bug."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Replay:
    """What an Idempotency-Key says of a request: the work is this request's to do (`key`, to
    record its outcome under), or was done by an earlier one (`resource_id`, or `response`)."""

    reservation: Reservation | None = None
    resource_id: str | None = None
    response: dict | None = None
    store: AsyncStore | None = None

    @property
    def replayed(self) -> bool:
        return self.resource_id is not None or self.response is not None

    async def answer(self, response: M) -> M:
        """Record `response` as this request's answer, for its retries (a no-op without a
        key); returns it."""
        if self.reservation is not None:
            answer = response.model_dump(mode="json")
            await self.store.keys.record_response(self.reservation, answer)
        return response


@contextlib.asynccontextmanager
async def idempotent(
    store: AsyncStore, key: IdempotencyKey | None, payload_hash: str
) -> AsyncIterator[Replay]:
    """Run a request once per `Idempotency-Key`.

    The key is reserved before the work starts, so a retry that arrives while the first request
    is still at work (a slow upload, a client that timed out) waits for its outcome instead of
    doing the work twice. The request records its resource (`store.videos.insert(...,
    idempotency=key)` and the like) or its answer (`Replay.answer`) under the key; if it fails
    instead, the key is freed for the next retry. Reusing a key with a different body is a client bug: 409.
    """
    if key is None:
        yield Replay()
        return
    reservation = Reservation(key.scope, key.name, payload_hash)
    deadline = time.monotonic() + IDEMPOTENCY_WAIT_S
    while (prior := await store.keys.reserve(reservation)) is not None:
        if prior.request_hash != payload_hash:
            raise Conflict(
                "Idempotency-Key was already used with a different request body",
                code="idempotency_key_reused",
            )
        if prior.settled:
            yield Replay(resource_id=prior.resource_id, response=prior.response)
            return
        if time.monotonic() > deadline:
            raise Conflict(
                "a request with this Idempotency-Key is still being handled; retry shortly",
                code="idempotency_key_in_use",
            )
        await asyncio.sleep(0.1)
    try:
        yield Replay(reservation=reservation, store=store)
    finally:
        # A no-op once the outcome is recorded; otherwise the request failed: free the key.
        await store.keys.release(reservation)


async def answer_once(
    store: AsyncStore,
    key: IdempotencyKey | None,
    payload: object,
    model: type[M],
    work: Callable[[], Awaitable[M]],
) -> M:
    """`await work()`, recorded as the answer to `key`; a retry gets that first answer back (as a
    `model`), not what the work would say now (a 404 after a delete, a 409 after an upload)."""
    async with idempotent(store, key, request_hash(payload)) as replay:
        if replay.response is not None:
            return model.model_validate(replay.response)
        return await replay.answer(await work())


async def create_once(
    store: AsyncStore,
    key: IdempotencyKey | None,
    payload: object,
    find: Callable[[str], Awaitable[R | None]],
    create: Callable[[Reservation | None], Awaitable[R]],
) -> tuple[R, bool]:
    """The record an earlier request with `key` made (found by `find`) and True, or the record
    that `create(reservation)` makes now, recorded under the key, and False.

    A resource deleted since its first request is made again, for a retry means to have one.
    """
    async with idempotent(store, key, request_hash(payload)) as replay:
        if replay.replayed and (row := await find(replay.resource_id)) is not None:
            return row, True
        return await create(replay.reservation), False
