"""Webhooks: endpoints per key, signatures as Standard Webhooks says (checked by the
`standardwebhooks` package and the SDK), the outbox's order, leases and retries, refused private
addresses, a slow receiver beside the engine, and a server killed with a delivery in flight.

In process, the API runs on the real store and worker with fake models (`make_client`) and posts
to a receiver on 127.0.0.1 (tests/support/webhook_receiver.py), which the tests allow.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from standardwebhooks.webhooks import Webhook
from webhook_receiver import Receiver

import megaslide_client
from megaslide.server import Settings, build_app
from megaslide.server.store import JobStore
from megaslide.server.store.webhooks import emit
from megaslide.server.webhooks import headers, new_secret, sign
from megaslide.server.worker import Fleet
from megaslide_client import WebhookVerificationError, verify_webhook
from megaslide_client.types import WebhookAttempt

from api_helpers import SMALL, assert_error, dataset_zip, upload, wait_status
from server_fakes import FakeBackend, live_server, until

ALL = [
    "video.completed",
    "video.failed",
    "fine_tuning.job.succeeded",
    "fine_tuning.job.failed",
    "fine_tuning.job.checkpoint.created",
]
# Retries within a test's patience; a receiver on this machine allowed.
FAST = dict(
    webhook_allow_private=True,
    webhook_poll_s=0.02,
    webhook_retry_s=[0.2, 0.4],
    webhook_timeout_s=5.0,
)


def register(c, url: str, events=ALL, **kw) -> dict:
    r = c.post("/v1/webhooks/endpoints", json={"url": url, "events": events}, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def video(c, headers=None, **fields) -> dict:
    body = {"prompt": "a red ball", **SMALL, **fields}
    r = c.post("/v1/videos", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def deliveries(c, endpoint_id: str, settled: int, **kw) -> list[dict]:
    """The endpoint's deliveries, oldest first, once `settled` of them are no longer pending."""

    def done():
        r = c.get(f"/v1/webhooks/endpoints/{endpoint_id}/deliveries", params={"limit": 100}, **kw)
        rows = r.json()["data"][::-1]
        return rows if sum(d["status"] != "pending" for d in rows) >= settled else None

    return until(done, what=f"{settled} deliveries settled")


# ---------------------------------------------------------------------------------------------
# signatures


def test_signatures_follow_standard_webhooks():
    # The specification's example, which its reference libraries test too.
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == expected

    secret = new_secret()
    assert secret.startswith("whsec_") and secret != new_secret()
    signed = headers(secret, "msg_1", int(time.time()), body)
    Webhook(secret).verify(body, signed)  # the package's check
    assert verify_webhook(body, signed, secret) == json.loads(body)  # the SDK's
    with pytest.raises(WebhookVerificationError, match="signature"):
        verify_webhook(body + b" ", signed, secret)
    with pytest.raises(WebhookVerificationError, match="signature"):
        verify_webhook(body, signed, new_secret())
    stale = headers(secret, "msg_1", int(time.time()) - 600, body)
    with pytest.raises(WebhookVerificationError, match="timestamp"):
        verify_webhook(body, stale, secret)
    # A receiver may be sent several signatures (a secret being rotated): one valid suffices.
    several = {**signed, "webhook-signature": "v1,bm9wZQ== " + signed["webhook-signature"]}
    assert verify_webhook(body, several, secret) == json.loads(body)


# ---------------------------------------------------------------------------------------------
# the outbox in the store


def test_the_outbox_keeps_each_jobs_order_and_a_lost_claim_comes_back(database_url):
    store = JobStore(database_url)
    try:
        hooks = store.webhooks
        row = dict(owner="alice", url="http://x/", events=["video.completed"], description=None)
        hooks.create_endpoint({"id": "we_a", "secret": new_secret(), **row})
        hooks.create_endpoint({"id": "we_other", "secret": new_secret(), **row, "owner": "bob"})
        with store.db.tx() as conn:
            for job, n in (("video_a", 1), ("video_a", 2), ("video_b", 1), ("video_a", 3)):
                emit(store.db, conn, "video.completed", job, "alice", lambda n=n: {"n": n})
            emit(
                store.db, conn, "video.failed", "video_a", "alice", lambda: {"n": 4}
            )  # not subscribed

        def claim(lease_s=30.0):
            claimed = hooks.claim(10, lease_s=lease_s)
            assert all(e.id == "we_a" and e.owner == "alice" for _, e in claimed)
            return [(d.job_id, d.snapshot["n"], d) for d, _ in claimed]

        first = claim()
        assert [(j, n) for j, n, _ in first] == [("video_a", 1), ("video_b", 1)]
        assert claim() == []  # held
        a1, b1 = first[0][2], first[1][2]
        retry = dict(status_code=500, error="boom", duration_ms=1, delivered=False)
        assert hooks.record_attempt(a1, **retry, retry_s=[0.0]) == "pending"
        again = claim(lease_s=0.05)
        assert [(j, n) for j, n, _ in again] == [("video_a", 1)]  # not its successor
        time.sleep(0.1)  # the claim runs out, as when its sender was killed
        taken = claim()
        assert [(j, n) for j, n, _ in taken] == [("video_a", 1)]
        assert taken[0][2].id == a1.id  # the same message id: the receiver can dedup it
        ok = dict(status_code=200, error=None, duration_ms=1, delivered=True)
        assert hooks.record_attempt(again[0][2], **ok, retry_s=[0.0]) is None  # lost claim
        assert hooks.record_attempt(taken[0][2], **ok, retry_s=[0.0]) == "delivered"
        assert hooks.record_attempt(b1, **ok, retry_s=[0.0]) == "delivered"
        [(_, _, a2)] = claim()
        assert a2.job_id == "video_a" and a2.snapshot["n"] == 2
        rows, more = hooks.deliveries("we_a", None, 10)
        tries = {
            d.snapshot["n"]: [a.status_code for a in t] for d, t in rows if d.job_id == "video_a"
        }
        assert tries == {1: [500, 200], 2: [], 3: []} and not more
        assert hooks.deliveries("we_other", None, 10) == ([], False)  # bob's saw nothing

        # Failed for good: the endpoint is disabled, and what it is owed waits for it.
        assert hooks.record_attempt(a2, **retry, retry_s=[]) == "failed"
        assert hooks.get_endpoint("we_a").disabled
        with store.db.tx() as conn:
            emit(store.db, conn, "video.completed", "video_b", "alice", lambda: {"n": 5})
        assert claim() == []
        assert hooks.enable("we_a") and not hooks.get_endpoint("we_a").disabled
        assert [(j, n) for j, n, _ in claim()] == [("video_a", 3), ("video_b", 5)]
        assert hooks.prune(older_than_s=-1) == 3  # the settled ones: a1, b1, a2
        assert len(hooks.deliveries("we_a", None, 10)[0]) == 2
        assert hooks.delete_endpoint("we_a") and hooks.deliveries("we_a", None, 10)[0] == []
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------
# through the API


def test_each_key_receives_its_own_jobs_events_signed_and_in_order(make_client):
    c = make_client(
        FakeBackend(train_step_s=0.01),
        api_keys=["alice-key", "bob-key"],
        finetune_save_every=1,
        **FAST,
    )
    c.headers["authorization"] = "Bearer alice-key"
    bob = {"headers": {"authorization": "Bearer bob-key"}}
    with Receiver() as ra, Receiver() as rb:
        ea, eb = register(c, ra.url), register(c, rb.url, events=["video.completed"], **bob)
        assert ea["object"] == "webhook_endpoint" and ea["secret"].startswith("whsec_")
        assert c.get(f"/v1/webhooks/endpoints/{ea['id']}").json()["secret"] is None  # once
        assert_error(c.get(f"/v1/webhooks/endpoints/{ea['id']}", **bob), 404, "endpoint_id")
        assert_error(c.delete(f"/v1/webhooks/endpoints/{ea['id']}", **bob), 404)
        listed = c.get("/v1/webhooks/endpoints", **bob).json()["data"]
        assert [e["id"] for e in listed] == [eb["id"]]

        done, failed = video(c, seed=1), video(c, prompt="explode", seed=2)
        theirs = video(c, seed=3, **bob)
        f = upload(c, dataset_zip(clips=2)).json()
        until(lambda: c.get(f"/v1/files/{f['id']}").json()["status"] == "processed")
        hyper = {"n_epochs": 1, "batch_size": 1}
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "fake",
                "training_file": f["id"],
                "method": {"type": "supervised", "supervised": {"hyperparameters": hyper}},
            },
        ).json()

        until(lambda: len(ra.unique(ea["secret"])) == 5, what="alice's 5 events")
        until(lambda: len(rb.unique(eb["secret"])) == 1, what="bob's event")
        events = ra.unique(ea["secret"])
        by_job: dict[str, list[dict]] = {}
        for e in events:
            owner = e["data"].get("fine_tuning_job_id") or e["data"]["id"]
            by_job.setdefault(owner, []).append(e)
        assert [e["type"] for e in by_job[done["id"]]] == ["video.completed"]
        assert [e["type"] for e in by_job[failed["id"]]] == ["video.failed"]
        assert by_job[failed["id"]][0]["data"]["error"]["code"] == "generation_failed"
        tuned = by_job[job["id"]]
        assert [e["type"] for e in tuned] == [
            "fine_tuning.job.checkpoint.created",
            "fine_tuning.job.checkpoint.created",
            "fine_tuning.job.succeeded",
        ]
        assert [e["data"]["step_number"] for e in tuned[:2]] == [1, 2]  # in order of occurrence
        assert tuned[2]["data"]["fine_tuned_model"]
        # `data` is the object the API returns for the job.
        now = c.get(f"/v1/videos/{done['id']}").json()
        data = by_job[done["id"]][0]["data"]
        assert data["status"] == "completed" and data == {k: now[k] for k in data}
        assert tuned[2]["data"] == c.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
        assert all(e["timestamp"].endswith("+00:00") for e in events)
        # Another key's events never reach alice's endpoint, nor hers bob's.
        assert [e["data"]["id"] for e in rb.unique(eb["secret"])] == [theirs["id"]]

        rows = deliveries(c, ea["id"], settled=5)
        assert {d["status"] for d in rows} == {"delivered"}
        assert all([a["status_code"] for a in d["attempts"]] == [200] for d in rows)
        assert {d["id"] for d in rows} == {e["id"] for e in events}
        assert_error(c.get(f"/v1/webhooks/endpoints/{ea['id']}/deliveries", **bob), 404)
        assert c.delete(f"/v1/webhooks/endpoints/{ea['id']}").json()["deleted"] is True
        assert_error(c.get(f"/v1/webhooks/endpoints/{ea['id']}"), 404)


REFUSED = [
    "http://127.0.0.1:8000/hook",
    "http://localhost/hook",  # a name that resolves to loopback
    "http://10.1.2.3/hook",
    "http://192.168.0.7/hook",
    "http://169.254.169.254/latest/meta-data",  # a cloud's metadata service
    "http://[::1]/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "http://0.0.0.0/hook",
    "ftp://example.com/hook",
    "http://user:pw@example.com/hook",
    "not a url",
]


def test_urls_into_the_servers_own_network_are_refused(make_client):
    c = make_client()
    for url in REFUSED:
        r = c.post("/v1/webhooks/endpoints", json={"url": url, "events": ALL})
        assert assert_error(r, 400, "url")["code"] == "invalid_url", url
    assert c.get("/v1/webhooks/endpoints").json()["data"] == []


def test_a_public_address_is_accepted_and_events_are_validated(make_client):
    c = make_client()
    assert register(c, "https://93.184.216.34/hook")["url"] == "https://93.184.216.34/hook"
    r = c.post("/v1/webhooks/endpoints", json={"url": "https://93.184.216.34/", "events": ["x"]})
    assert_error(r, 400, "events.0")
    assert_error(c.post("/v1/webhooks/endpoints", json={"url": "https://93.184.216.34/"}), 400)


def test_a_url_is_checked_again_before_each_try(make_client):
    # As if the name resolved elsewhere when registered: the sender refuses it all the same.
    c = make_client(**{**FAST, "webhook_allow_private": False})
    with Receiver() as r:
        endpoint = {"id": "we_rebound", "owner": None, "url": r.url, "events": ALL}
        c.app.state.store.sync.webhooks.create_endpoint(
            {**endpoint, "secret": new_secret(), "description": None}
        )
        wait_status(c, video(c)["id"])
        [d] = deliveries(c, "we_rebound", settled=1)
        assert d["status"] == "failed" and len(d["attempts"]) == 3  # once, then each retry
        assert all(a["error"].startswith("refused:") for a in d["attempts"])
        assert r.all() == []
        assert c.get("/v1/webhooks/endpoints/we_rebound").json()["disabled"] is True
        enabled = c.post("/v1/webhooks/endpoints/we_rebound/enable")
        assert enabled.status_code == 200 and enabled.json()["disabled"] is False
        assert_error(c.post("/v1/webhooks/endpoints/we_none/enable"), 404, "endpoint_id")


def test_a_failing_receiver_is_retried_with_back_off(make_client):
    c = make_client(**FAST)
    with Receiver(statuses=(500, 503)) as r:
        endpoint = register(c, r.url, events=["video.completed"])
        wait_status(c, video(c)["id"])
        [d] = deliveries(c, endpoint["id"], settled=1)
        assert d["status"] == "delivered" and d["delivered_at"] is not None
        assert [a["status_code"] for a in d["attempts"]] == [500, 503, 200]
        assert [a["error"] for a in d["attempts"]] == [
            "the receiver answered 500",
            "the receiver answered 503",
            None,
        ]
        tries = r.all()
        assert {t.id for t in tries} == {d["id"]}  # one message, under one id
        gaps = [b.at - a.at for a, b in zip(tries, tries[1:], strict=False)]
        assert gaps[0] >= 0.2 and gaps[1] >= 0.4, gaps  # webhook_retry_s
        assert len(r.unique(endpoint["secret"])) == 1


def test_a_receiver_that_does_not_answer_in_time_is_a_failed_try(make_client):
    c = make_client(**{**FAST, "webhook_timeout_s": 0.3, "webhook_retry_s": [0.1]})
    with Receiver() as r:
        # No answer while the test runs: a late one could still win a race with the deadline on
        # a machine busy enough to stall the sender's loop past it.
        r.hold.clear()
        endpoint = register(c, r.url, events=["video.completed"])
        wait_status(c, video(c)["id"])
        [d] = deliveries(c, endpoint["id"], settled=1)
        assert d["status"] == "failed" and len(r.all()) == 2
        assert [a["error"] for a in d["attempts"]] == ["no answer within 0.3 s"] * 2
        # Cut at the deadline, not at the receiver's 60 s (the slack: a busy machine's stalls).
        assert all(a["status_code"] is None and a["duration_ms"] < 5000 for a in d["attempts"])


def test_a_slow_receiver_holds_up_neither_videos_nor_other_jobs_deliveries(make_client):
    c = make_client(**FAST)
    with Receiver(delay_s=2.0) as r:
        register(c, r.url)
        first = video(c, seed=1)
        wait_status(c, first["id"])
        until(lambda: len(r.all()) == 1, what="the first delivery to arrive")
        started = time.monotonic()
        later = [video(c, seed=s) for s in (2, 3)]
        for v in later:
            assert wait_status(c, v["id"])["status"] == "completed"
        # Both videos ran and their events were sent while the first answer was still awaited.
        until(lambda: len(r.all()) == 3, timeout=1.5, what="the other jobs' deliveries")
        assert time.monotonic() - started < 1.8


def test_the_sdk_registers_endpoints_and_reads_deliveries(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", poll_after_ms=50, **FAST)
    app = build_app(settings, Fleet.embedded(settings, FakeBackend()))
    with live_server(app, settings) as url, Receiver() as r:
        sdk = megaslide_client.Client(base_url=url)
        endpoint = sdk.webhooks.endpoints.create(url=r.url, events=["video.completed"])
        assert endpoint.secret.startswith("whsec_") and endpoint.events == ["video.completed"]
        assert [e.id for e in sdk.webhooks.endpoints.list()] == [endpoint.id]
        assert sdk.webhooks.endpoints.retrieve(endpoint.id).secret is None
        assert sdk.webhooks.endpoints.enable(endpoint.id).disabled is False
        sdk.videos.create_and_poll(prompt="a red ball", size="32x32", num_frames=4)
        until(lambda: r.all(), what="a delivery")
        got = r.all()[0]
        assert verify_webhook(got.body, got.headers, endpoint.secret)["type"] == "video.completed"

        def delivered():
            rows = list(sdk.webhooks.endpoints.deliveries(endpoint.id))
            return rows if rows and rows[0].status == "delivered" else None

        [d] = until(delivered, what="the delivery recorded")
        assert d.id == got.id and isinstance(d.attempts[0], WebhookAttempt)
        assert d.attempts[0].status_code == 200
        sdk.close()

        async def twin():
            async with megaslide_client.AsyncClient(base_url=url) as a:
                page = await a.webhooks.endpoints.deliveries(endpoint.id)
                assert [x.id for x in page.data] == [d.id]
                assert (await a.webhooks.endpoints.retrieve(endpoint.id)).url == r.url
                assert (await a.webhooks.endpoints.delete(endpoint.id)).deleted is True
                assert [e async for e in a.webhooks.endpoints.list()] == []

        asyncio.run(twin())


# ---------------------------------------------------------------------------------------------
# kill -9


@pytest.mark.slow  # `megaslide serve` as a child process, twice
def test_a_server_killed_mid_delivery_delivers_every_event_once_after_restart(tmp_path):
    from processes import Server

    env = {
        "MEGASLIDE_WEBHOOK_ALLOW_PRIVATE": "1",
        "MEGASLIDE_WEBHOOK_TIMEOUT_S": "1",
        "MEGASLIDE_WEBHOOK_POLL_S": "0.1",
        "MEGASLIDE_WEBHOOK_RETRY_S": "0.5,0.5,0.5,0.5,0.5",
    }
    data = tmp_path / "data"
    args = ["--preset", "tiny", "--data-dir", str(data)]
    clip = {"num_frames": 4, "size": "32x32", "num_inference_steps": 2, "guidance_scale": 1}
    with Receiver() as r:
        r.hold.clear()  # the first delivery waits for an answer its sender never reads
        first = Server(args, tmp_path / "first.log", env=env)
        try:
            endpoint = first.http.post(
                "/v1/webhooks/endpoints", json={"url": r.url, "events": ALL}
            ).json()
            ids = [
                first.http.post(
                    "/v1/videos", json={"prompt": f"clip {s}", "seed": s, **clip}
                ).json()["id"]
                for s in range(3)
            ]
            until(lambda: len(r.all()) >= 1, timeout=120, what="a delivery in flight")
        finally:
            first.kill9()
        r.hold.set()
        second = Server(args, tmp_path / "second.log", env=env)
        try:
            for video_id in ids:
                assert second.wait(video_id)["status"] == "completed"
            secret = endpoint["secret"]

            def deliveries() -> list[dict]:
                url = f"/v1/webhooks/endpoints/{endpoint['id']}/deliveries"
                return second.http.get(url, params={"limit": 100}).json()["data"]

            # Every delivery settled: the one the kill interrupted comes again once its claim's
            # lease runs out, which may be after the other jobs' deliveries have arrived.
            until(
                lambda: [d["status"] for d in deliveries()] == ["delivered"] * len(ids),
                timeout=60,
                what="every delivery settled",
            )
            time.sleep(0.5)  # nothing more arrives
            events = r.unique(secret)  # each signature checked
            assert sorted(e["data"]["id"] for e in events) == sorted(ids)  # each once
            assert {e["type"] for e in events} == {"video.completed"}
            assert len(r.all()) > len(events), "the kill interrupted no delivery"
        finally:
            second.stop()
