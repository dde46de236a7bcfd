"""API keys through the HTTP API: refused without one, and each key sees only what it made."""

from __future__ import annotations

import warnings

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")

from megaslide.server import Settings
from megaslide.server.auth import digest

from api_helpers import SMALL, assert_error, dataset_zip, wait_status
from server_fakes import until


def test_auth(make_client):
    c = make_client(api_keys=["k-one", "k-two"])
    assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
    for path in ("/v1/models", "/v1/videos", "/metrics", "/v1/files", "/v1/fine_tuning/jobs"):
        assert_error(c.get(path), 401)
        assert_error(
            c.get(path, headers={"Authorization": "Bearer wrong"}),
            401,
            fragment="Incorrect API key",
        )
    assert_error(c.get("/v1/models", headers={"Authorization": "Basic k-one"}), 401)
    for key in ("k-one", "k-two"):
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert c.get("/metrics", headers={"Authorization": "Bearer k-two"}).status_code == 200
    r = c.post(
        "/v1/videos", json={"prompt": "p", **SMALL}, headers={"Authorization": "Bearer k-one"}
    )
    assert r.status_code == 200


def test_each_key_sees_only_what_it_made(make_client, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(
        f"alice {digest('alice-1')}\nalice {digest('alice-2')}\nops {digest('ops-1')} admin\n"
    )
    c = make_client(api_keys=["bob-1"], api_keys_file=keys_file)
    alice, alice2, bob, ops = (
        {"Authorization": f"Bearer {k}"} for k in ("alice-1", "alice-2", "bob-1", "ops-1")
    )
    c.headers.update(alice)  # what the helpers below send: Alice's
    mine = c.post("/v1/videos", json={"prompt": "p", **SMALL}).json()
    wait_status(c, mine["id"])
    # Bob cannot list, read, download, stream, cancel or delete it: to him it does not exist.
    assert c.get("/v1/videos", headers=bob).json()["data"] == []
    for method, path in (
        ("GET", f"/v1/videos/{mine['id']}"),
        ("GET", f"/v1/videos/{mine['id']}/content"),
        ("GET", f"/v1/videos/{mine['id']}/events"),
        ("POST", f"/v1/videos/{mine['id']}/cancel"),
        ("DELETE", f"/v1/videos/{mine['id']}"),
    ):
        assert_error(c.request(method, path, headers=bob), 404, "video_id")
    # Alice's rotated key is still Alice; the admin sees everyone's.
    assert [v["id"] for v in c.get("/v1/videos", headers=alice2).json()["data"]] == [mine["id"]]
    assert c.get(f"/v1/videos/{mine['id']}", headers=ops).status_code == 200
    # Files, fine-tuning jobs and the models they make belong to their key too.
    up = c.post(
        "/v1/files",
        data={"purpose": "fine-tune"},
        files={"file": ("d.zip", dataset_zip())},
        headers=alice,
    ).json()
    f = until(
        lambda: (
            (x := c.get(f"/v1/files/{up['id']}", headers=alice).json())["status"] == "processed"
            and x
        )
    )
    assert_error(c.get(f"/v1/files/{f['id']}", headers=bob), 404, "file_id")
    job = {"model": "fake", "training_file": f["id"], "suffix": "mine"}
    assert_error(c.post("/v1/fine_tuning/jobs", json=job, headers=bob), 404, "training_file")
    made = c.post("/v1/fine_tuning/jobs", json=job, headers=alice).json()
    done = until(
        lambda: (
            (j := c.get(f"/v1/fine_tuning/jobs/{made['id']}", headers=alice).json())["status"]
            == "succeeded"
            and j
        ),
        what="the fine-tune",
    )
    assert c.get("/v1/fine_tuning/jobs", headers=bob).json()["data"] == []
    assert_error(c.get(f"/v1/fine_tuning/jobs/{made['id']}", headers=bob), 404)
    tuned = done["fine_tuned_model"]
    assert tuned in [m["id"] for m in c.get("/v1/models", headers=alice).json()["data"]]
    assert [m["id"] for m in c.get("/v1/models", headers=bob).json()["data"]] == ["fake"]
    theirs = {"prompt": "p", "model": tuned, **SMALL}
    assert_error(c.post("/v1/videos", json=theirs, headers=bob), 404, "model")
    first = c.post("/v1/videos", json=theirs, headers=alice)
    assert first.status_code == 200
    wait_status(c, first.json()["id"])
    # The key-less readiness probe names base models only, not a tenant's fine-tunes.
    assert c.get("/readyz", headers={"Authorization": ""}).json()["models"] == ["fake"]
    # The metrics any key scrapes count Alice's queued video under the base model, never naming
    # her model or job: the worker is held in Bob's step, so hers waits in the queue.
    c.backend.gate.clear()
    held = c.post("/v1/videos", json={"prompt": "p", **SMALL}, headers=bob).json()
    until(lambda: c.get(f"/v1/videos/{held['id']}", headers=bob).json()["status"] == "in_progress")
    assert c.post("/v1/videos", json=theirs, headers=alice).status_code == 200
    scraped = c.get("/metrics", headers=bob).text
    c.backend.gate.set()
    assert tuned not in scraped and made["id"].removeprefix("ftjob-") not in scraped
    assert 'megaslide_queued_jobs{model="fake"} 1' in scraped, scraped
    # A cursor at another key's id pages as one at an unknown id: nothing tells it exists.
    bobs = c.post("/v1/videos", json={"prompt": "p", **SMALL}, headers=bob).json()
    assert bobs["id"]
    for after in (mine["id"], "video_unknown"):
        listed = c.get(f"/v1/videos?after={after}&order=asc", headers=bob).json()
        assert listed["data"] == [], after


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv("MEGASLIDE_API_KEYS", "alpha, beta")
    assert Settings().api_keys == ["alpha", "beta"]
