"""Idempotency-Key handling (server/services/idempotency.py): the helpers on their own, over a real
store, and a replayed answer byte for byte through the API."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

from megaslide.server.errors import Conflict
from megaslide.server.services.idempotency import IdempotencyKey, answer_once, create_once
from megaslide.server.store import AsyncStore, JobStore

from api_helpers import create, dataset_zip, processed, upload
from server_fakes import until


class Answer(BaseModel):
    n: int
    note: str | None = None


@pytest.fixture
def store(tmp_path):
    sync = JobStore(f"sqlite:///{tmp_path / 'megaslide.db'}")
    yield AsyncStore(sync)
    sync.close()


def test_answer_once_does_the_work_once_per_key_and_replays_the_first_answer(store):
    key = IdempotencyKey("scope", "DELETE /v1/things/t:1")
    calls = []

    async def work() -> Answer:
        calls.append(1)
        return Answer(n=len(calls))

    async def scenario():
        first = await answer_once(store, key, {"delete": "t"}, Answer, work)
        again = await answer_once(store, key, {"delete": "t"}, Answer, work)
        other_scope = IdempotencyKey("another", key.name)
        theirs = await answer_once(store, other_scope, {"delete": "t"}, Answer, work)
        keyless = [await answer_once(store, None, {"delete": "t"}, Answer, work) for _ in range(2)]
        with pytest.raises(Conflict) as reused:
            await answer_once(store, key, {"delete": "u"}, Answer, work)
        return first, again, theirs, keyless, reused.value

    first, again, theirs, keyless, reused = asyncio.run(scenario())
    assert first == again == Answer(n=1) and isinstance(again, Answer)
    assert theirs == Answer(n=2)  # keys are scoped to the principal that sent them
    assert keyless == [Answer(n=3), Answer(n=4)]  # no key: no memory
    assert reused.code == "idempotency_key_reused"


def test_a_failed_request_frees_its_key_for_the_retry(store):
    key = IdempotencyKey("scope", "POST /v1/things/t/cancel:1")

    async def fails() -> Answer:
        raise Conflict("not now")

    async def works() -> Answer:
        return Answer(n=7)

    async def scenario():
        with pytest.raises(Conflict):
            await answer_once(store, key, {"cancel": "t"}, Answer, fails)
        return await answer_once(store, key, {"cancel": "t"}, Answer, works)

    assert asyncio.run(scenario()) == Answer(n=7)


def test_create_once_finds_the_first_resource_and_makes_a_deleted_one_again(store):
    key = IdempotencyKey("scope", "POST /v1/things:1")
    rows: dict[str, dict] = {}
    reservations = []

    async def find(resource_id: str) -> dict | None:
        return rows.get(resource_id)

    async def make(reservation) -> dict:
        reservations.append(reservation)
        resource_id = f"video_{len(reservations)}"
        rows[resource_id] = {"id": resource_id}
        # Records the key the way the store's insert_* do, in the resource's own transaction.
        await store.videos.insert(resource_id, _spec(), idempotency=reservation)
        return rows[resource_id]

    async def scenario():
        first = await create_once(store, key, {"prompt": "p"}, find, make)
        again = await create_once(store, key, {"prompt": "p"}, find, make)
        rows.clear()  # the resource was deleted since: a retry means to have one
        remade = await create_once(store, key, {"prompt": "p"}, find, make)
        return first, again, remade

    first, again, remade = asyncio.run(scenario())
    assert first == ({"id": "video_1"}, False) and again == ({"id": "video_1"}, True)
    assert remade == ({"id": "video_2"}, False)
    assert (reservations[0].scope, reservations[0].key) == ("scope", key.name)
    assert reservations[1] is None
    assert len(reservations) == 2


def _spec() -> dict:
    return {"model": "m", "seed": 0, "frames": 4}


def test_a_replayed_answer_is_byte_for_byte_the_first(make_client):
    c = make_client()
    c.backend.gate.clear()  # the first video holds the worker, so the second stays queued
    held = create(c, seed=1)
    # Until the worker has claimed the first, the two could be claimed together as one batch.
    until(lambda: c.get(f"/v1/videos/{held['id']}").json()["status"] == "in_progress")
    queued = create(c, seed=2)
    key = {"Idempotency-Key": "cancel-bytes"}
    first = c.post(f"/v1/videos/{queued['id']}/cancel", headers=key)
    again = c.post(f"/v1/videos/{queued['id']}/cancel", headers=key)
    c.backend.gate.set()
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and first.json()["status"] == "cancelled"
    file_id = processed(c, upload(c, dataset_zip()).json())["id"]
    key = {"Idempotency-Key": "delete-bytes"}
    first = c.delete(f"/v1/files/{file_id}", headers=key)
    again = c.delete(f"/v1/files/{file_id}", headers=key)
    assert first.status_code == again.status_code == 200 and again.content == first.content
