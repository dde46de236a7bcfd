"""The HTTP API and the scheduler, in process, on the real worker and store with fake models.

Everything except the tensor math is real here: routers, SQLite store, worker thread, batching,
cancellation, encoder thread. `FakeBackend` (tests/server_fakes.py) records every batched step.
"""

from __future__ import annotations

import concurrent.futures
import errno
import io
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
import warnings
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from megaslide.engine.request import ResolvedVideo
from megaslide.server import Settings, build_app
from megaslide.server.auth import digest
from megaslide.server.store import JobStore, WorkerNameInUse
from megaslide.server.worker import EmbeddedWorker, default_name

from server_fakes import FakeBackend, until

TERMINAL = ("completed", "failed", "cancelled")
SMALL = {"num_frames": 4, "size": "32x32", "num_inference_steps": 2}


def create(client, **fields):
    body = {"prompt": "a red ball", **SMALL, **fields}
    r = client.post("/v1/videos", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def wait_status(client, video_id, statuses=TERMINAL, timeout=10.0):
    return until(
        lambda: (v := client.get(f"/v1/videos/{video_id}").json())["status"] in statuses and v,
        timeout,
        f"{video_id} to reach {statuses}",
    )


def assert_error(r, status, param=None, fragment=None):
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if fragment is not None:
        assert fragment in err["message"], err
    return err


# ---------------------------------------------------------------------------------------------
# videos


def test_video_lifecycle_json_and_multipart(make_client):
    c = make_client(FakeBackend(encode_s=0.2))
    a = create(c, seed=7)
    assert a["object"] == "video" and a["status"] == "queued" and a["progress"] == 0
    assert (
        a["seed"] == 7 and a["size"] == "32x32" and a["seconds"] == "0.5" and a["model"] == "fake"
    )
    # The stock openai SDK sends multipart with every value a string and extra_body keys flat.
    r = c.post(
        "/v1/videos",
        data={
            "prompt": "a blue cube",
            "seconds": "0.5",
            "size": "32x32",
            "model": "fake",
            "num_inference_steps": "2",
            "fps": "8",
        },
    )
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["num_frames"] == 4 and isinstance(b["seed"], int)  # chosen and echoed when absent

    seen = []  # (status, progress, mp4 exists) while polling
    mp4 = c.app.state.settings.data_dir / "videos" / f"{a['id']}.mp4"
    while True:
        r = c.get(f"/v1/videos/{a['id']}")
        v = r.json()
        seen.append((v["status"], v["progress"], mp4.exists()))
        if v["status"] in TERMINAL:
            assert "openai-poll-after-ms" not in r.headers
            break
        assert r.headers["openai-poll-after-ms"] == "50"
        time.sleep(0.005)
    assert (
        v["status"] == "completed"
        and v["progress"] == 100
        and v["completed_at"]
        and v["expires_at"]
    )
    progress = [p for _, p, _ in seen]
    assert progress == sorted(progress), progress
    assert any(0 < p < 100 for p in progress), "progress jumped straight to 100"
    assert all(exists for _, p, exists in seen if p == 100), "100 before the MP4 existed"
    assert any(p == 95 and not exists for _, p, exists in seen), "no finalizing phase observed"

    body = c.get(f"/v1/videos/{a['id']}/content").content
    assert body.startswith(b"FAKEMP4") and len(body) == 7 + 4 * 32 * 32 * 3
    thumb = c.get(f"/v1/videos/{a['id']}/content", params={"variant": "thumbnail"})
    assert thumb.headers["content-type"] == "image/png" and thumb.content.startswith(b"\x89PNG")
    wait_status(c, b["id"])


def test_range_requests(make_client):
    c = make_client()
    v = create(c)
    wait_status(c, v["id"])
    url = f"/v1/videos/{v['id']}/content"
    full = c.get(url)
    assert full.status_code == 200 and full.headers["accept-ranges"] == "bytes"
    size = len(full.content)
    r = c.get(url, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == full.content[10:20]
    assert (
        r.headers["content-range"] == f"bytes 10-19/{size}" and r.headers["content-length"] == "10"
    )
    r = c.get(url, headers={"Range": "bytes=100-"})
    assert r.status_code == 206 and r.content == full.content[100:]
    r = c.get(url, headers={"Range": "bytes=-5"})
    assert r.status_code == 206 and r.content == full.content[-5:]
    r = c.get(url, headers={"Range": f"bytes={size - 3}-{size + 100}"})  # clamped to the end
    assert r.status_code == 206 and r.content == full.content[-3:]
    r = c.get(url, headers={"Range": f"bytes={size}-"})
    assert_error(r, 416, "range")
    assert r.headers["content-range"] == f"bytes */{size}"
    # Several ranges: one multipart/byteranges answer holding each.
    r = c.get(url, headers={"Range": "bytes=0-1,5-6"})
    assert r.status_code == 206
    assert r.headers["content-type"].startswith("multipart/byteranges")
    assert full.content[0:2] in r.content and full.content[5:7] in r.content
    # Validators: a client holding the file resumes only while it is the same file.
    assert full.headers["etag"] and full.headers["last-modified"]
    r = c.get(url, headers={"Range": "bytes=10-19", "If-Range": full.headers["etag"]})
    assert r.status_code == 206
    r = c.get(url, headers={"Range": "bytes=10-19", "If-Range": '"another"'})
    assert r.status_code == 200 and r.content == full.content


def test_signed_links_open_one_content_without_a_key(make_client, monkeypatch):
    c = make_client(api_keys=["k-one", "k-two"])
    one = {"Authorization": "Bearer k-one"}
    c.headers.update(one)
    v, other = create(c), create(c)
    wait_status(c, v["id"])
    wait_status(c, other["id"])
    del c.headers["Authorization"]  # from here on, a key only where given
    path = f"/v1/videos/{v['id']}/content"
    assert_error(c.get(path), 401)
    full = c.get(path, headers=one).content
    link = c.post(f"{path}/link", headers=one).json()
    assert link["object"] == "video.content_link" and link["expires_at"] > time.time() + 3000
    assert c.get(link["url"]).content == full  # no key
    r = c.get(link["url"], headers={"Range": "bytes=0-9"})
    assert r.status_code == 206 and r.content == full[:10]
    thumb = c.post(f"{path}/link", params={"variant": "thumbnail"}, headers=one).json()
    assert c.get(thumb["url"]).headers["content-type"] == "image/png"
    # The link opens that file only: not another variant, video or route, nor an altered expiry.
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(link["url"]).query))
    assert_error(c.get(f"/v1/videos/{other['id']}/content", params=query), 401)
    assert_error(c.get(path, params={**query, "variant": "thumbnail"}), 401)
    assert_error(c.get(path, params={**query, "expires": str(int(query["expires"]) + 1)}), 401)
    assert_error(c.get(f"/v1/videos/{v['id']}", params=query), 401)
    # Another key cannot have one made, nor can a link outlive its expiry.
    assert_error(c.post(f"{path}/link", headers={"Authorization": "Bearer k-two"}), 404)
    assert_error(c.post(f"{path}/link", params={"expires_in": 10}, headers=one), 400, "expires_in")
    monkeypatch.setattr(time, "time", lambda: int(query["expires"]) + 1)
    assert_error(c.get(link["url"]), 401, fragment="expired")


def test_link_signers_sharing_a_data_dir_agree(tmp_path):
    from megaslide.server.links import SECRET_FILE, LinkSigner

    first, second = LinkSigner(tmp_path), LinkSigner(tmp_path)
    assert not (tmp_path / SECRET_FILE).exists()  # made when first needed
    query, expires = first.query("video_1", "video", 60)
    signature = dict(urllib.parse.parse_qsl(query))["signature"]
    assert second.valid("video_1", "video", str(expires), signature)
    assert (tmp_path / SECRET_FILE).stat().st_mode & 0o777 == 0o600
    other = LinkSigner(tmp_path / "elsewhere")
    assert not other.valid("video_1", "video", str(expires), signature)
    for expires_text in ("", "-1", "\u0663", "9" * 40):
        assert not first.valid("video_1", "video", expires_text, signature)


def test_expired_content_is_gone(make_client):
    c = make_client()
    v = create(c)
    wait_status(c, v["id"])
    with c.app.state.store.sync._tx() as conn:  # fast-forward past the video's lifetime
        conn.exec_driver_sql("UPDATE videos SET expires_at = 1 WHERE id = ?", (v["id"],))
    assert_error(c.get(f"/v1/videos/{v['id']}/content"), 404, fragment="expired")
    assert c.get(f"/v1/videos/{v['id']}").json()["status"] == "completed"


def test_pagination(make_client):
    c = make_client()
    ids = [create(c, seed=i)["id"] for i in range(5)]
    page = c.get("/v1/videos", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [v["id"] for v in page["data"]] == ids[::-1][:2]
    assert page["first_id"] == ids[4] and page["last_id"] == ids[3]
    walked, after = [], None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = c.get("/v1/videos", params=params).json()
        walked += [v["id"] for v in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert walked == ids[::-1]
    asc = c.get("/v1/videos", params={"order": "asc", "after": ids[1], "limit": 10}).json()
    assert [v["id"] for v in asc["data"]] == ids[2:] and asc["has_more"] is False
    assert_error(c.get("/v1/videos", params={"limit": 0}), 400, param="limit")
    assert_error(c.get("/v1/videos", params={"order": "sideways"}), 400, param="order")


def test_cancelling_a_running_job_stops_its_steps(make_client):
    c = make_client(FakeBackend(step_s=0.02))
    long = create(c, num_inference_steps=150, seed=11)
    after = create(c, num_inference_steps=2, seed=12, size="64x64")  # waits for the first
    until(lambda: c.get(f"/v1/videos/{long['id']}").json()["step"] >= 3, what="a few steps")
    r = c.post(f"/v1/videos/{long['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    steps_at_cancel = c.backend.seeds_run().count(11)
    v = c.get(f"/v1/videos/{long['id']}").json()
    assert v["status"] == "cancelled" and v["progress"] < 100 and v["step"] == steps_at_cancel
    assert wait_status(c, after["id"])["status"] == "completed"  # the worker went on
    time.sleep(0.1)
    assert c.backend.seeds_run().count(11) == steps_at_cancel < 150, "it kept stepping"
    assert_error(c.get(f"/v1/videos/{long['id']}/content"), 400, fragment="cancelled")
    # Cancelling again answers the video as it is; it never deletes it.
    assert c.post(f"/v1/videos/{long['id']}/cancel").json()["status"] == "cancelled"
    assert c.get(f"/v1/videos/{long['id']}").json()["status"] == "cancelled"
    done = wait_status(c, after["id"])
    assert_error(c.post(f"/v1/videos/{done['id']}/cancel"), 400, fragment="already completed")


def test_cancelling_a_queued_job_runs_none_of_it(make_client):
    c = make_client(FakeBackend(step_s=0.02))
    first = create(c, num_inference_steps=20, seed=1)
    queued = create(c, seed=2, size="64x64")
    r = c.post(f"/v1/videos/{queued['id']}/cancel")
    assert r.json()["status"] == "cancelled"
    wait_status(c, first["id"])
    time.sleep(0.05)
    assert 2 not in c.backend.seeds_run()


def test_deleting_a_video_stops_it_and_removes_it(make_client):
    c = make_client(FakeBackend(step_s=0.02))
    running = create(c, num_inference_steps=150, seed=1)
    until(lambda: c.get(f"/v1/videos/{running['id']}").json()["step"] >= 2, what="a few steps")
    r = c.delete(f"/v1/videos/{running['id']}")
    assert r.json() == {
        "id": running["id"],
        "object": "video.deleted",
        "deleted": True,
        "status": "deleted",
    }
    assert_error(c.get(f"/v1/videos/{running['id']}"), 404)
    steps = c.backend.seeds_run().count(1)
    time.sleep(0.1)
    assert c.backend.seeds_run().count(1) == steps < 150


def test_deleting_a_finished_video_removes_its_files(make_client):
    c = make_client()
    v = create(c)
    wait_status(c, v["id"])
    mp4 = c.app.state.settings.data_dir / "videos" / f"{v['id']}.mp4"
    assert mp4.exists()
    assert c.delete(f"/v1/videos/{v['id']}").json() == {
        "id": v["id"],
        "object": "video.deleted",
        "deleted": True,
        "status": "deleted",
    }
    assert not mp4.exists()
    assert_error(c.get(f"/v1/videos/{v['id']}"), 404)
    assert_error(c.delete(f"/v1/videos/{v['id']}"), 404)


def test_a_retried_delete_or_cancel_gets_the_first_answer(make_client):
    c = make_client()
    done = wait_status(c, create(c, seed=1)["id"])
    # The answer to the first DELETE was lost; the SDK retries with the same key.
    key = {"Idempotency-Key": "delete-1"}
    first = c.delete(f"/v1/videos/{done['id']}", headers=key).json()
    assert first["deleted"] is True
    assert c.delete(f"/v1/videos/{done['id']}", headers=key).json() == first  # not a 404
    c.backend.gate.clear()  # the worker holds one video inside a step; the next one waits
    held = create(c, seed=2)
    until(lambda: c.get(f"/v1/videos/{held['id']}").json()["status"] == "in_progress")
    queued = create(c, seed=3)
    key = {"Idempotency-Key": "cancel-1"}
    cancelled = c.post(f"/v1/videos/{queued['id']}/cancel", headers=key).json()
    assert cancelled["status"] == "cancelled"
    again = c.post(f"/v1/videos/{queued['id']}/cancel", headers=key)
    assert again.status_code == 200 and again.json() == cancelled
    assert c.get(f"/v1/videos/{queued['id']}").json()["status"] == "cancelled"  # not purged
    c.backend.gate.set()
    # A fine-tuning job's cancel: the retry gets the job, not "already cancelled".
    file_id = processed(c, upload(c, dataset_zip()).json())["id"]
    job = c.post("/v1/fine_tuning/jobs", json={"model": "fake", "training_file": file_id}).json()
    key = {"Idempotency-Key": "ft-cancel-1"}
    first = c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=key)
    again = c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=key)
    assert first.status_code == again.status_code == 200 and again.json() == first.json()
    assert_error(c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel"), 400, fragment="already")


def test_compatible_jobs_share_steps_and_never_overtake(make_client):
    backend = FakeBackend(step_s=0.03)
    c = make_client(backend)
    a = create(c, num_inference_steps=12, seed=1)
    until(lambda: backend.seeds_run().count(1) >= 2, what="A to run")
    b = create(c, num_inference_steps=12, seed=2)  # same model/shape/steps: joins A's batch
    other = create(
        c, num_inference_steps=12, seed=3, size="64x64"
    )  # different shape: its own batch
    d = create(c, num_inference_steps=12, seed=4)  # compatible with A, but queued after `other`
    for v in (a, b, other, d):
        wait_status(c, v["id"], timeout=20)
    passes = [seeds for _, seeds in backend.passes]
    assert any(set(p) == {1, 2} for p in passes), passes
    assert 2 in passes[backend.first_pass_of(2)] and backend.first_pass_of(
        2
    ) > backend.first_pass_of(1)
    assert not any(3 in p and (1 in p or 4 in p) for p in passes), "incompatible jobs shared a pass"
    assert backend.first_pass_of(4) > backend.first_pass_of(3), (
        "a compatible job overtook an earlier one"
    )
    assert sum(len(p) for p in passes) == 4 * 12  # every job got exactly its steps


def test_priority_orders_the_queue(make_client):
    backend = FakeBackend(step_s=0.01)
    c = make_client(backend, max_batch=1)
    backend.gate.clear()  # hold the worker inside the first step while the queue fills
    blocker = create(c, seed=1)
    until(
        lambda: c.get(f"/v1/videos/{blocker['id']}").json()["status"] == "in_progress",
        what="blocker",
    )
    low = create(c, seed=2, priority=-5)
    mid = create(c, seed=3)
    high = create(c, seed=4, priority=10)
    backend.gate.set()
    for v in (blocker, low, mid, high):
        wait_status(c, v["id"])
    order = [backend.first_pass_of(seed) for seed in (4, 3, 2)]
    assert order == sorted(order), backend.passes


def test_a_failed_job_is_isolated(make_client):
    backend = FakeBackend()
    c = make_client(backend)
    boom = create(c, prompt="explode please", seed=1)
    oom = create(c, prompt="nomem please", seed=2)
    bad = create(c, prompt="badprep", seed=3)
    fine = create(c, prompt="a fine clip", seed=4)
    assert wait_status(c, boom["id"])["error"] == {
        "code": "generation_failed",
        "message": "RuntimeError: the denoiser exploded",
    }
    err = wait_status(c, oom["id"])["error"]
    assert err["code"] == "out_of_memory" and "CUDA out of memory" in err["message"]
    assert wait_status(c, bad["id"])["status"] == "failed"
    good = wait_status(c, fine["id"])
    assert good["status"] == "completed", good
    # The four jobs were one batch: the failing pass was retried job by job, so the good job never
    # lost a step and the failing ones got none.
    assert backend.seeds_run().count(4) == 2 and 1 not in backend.seeds_run()
    assert backend.released >= 2
    assert c.get("/healthz").json() == {"status": "ok"}
    assert wait_status(c, create(c, seed=5)["id"])["status"] == "completed"
    # A decode that fails after every step ran: that job only.
    decode = wait_status(c, create(c, prompt="baddecode", seed=6)["id"])
    assert decode["error"]["message"] == "ValueError: the decoder met a NaN"
    assert wait_status(c, create(c, seed=7)["id"])["status"] == "completed"


def test_jobs_claimed_together_encode_and_decode_together_and_fail_alone(make_client):
    """Jobs that reach the worker together are prepared in one call and, finishing at one step,
    decoded in one; when a call raises it runs again for each job alone, so only the job at
    fault fails."""
    backend = FakeBackend()
    c = make_client(backend)
    backend.gate.clear()  # hold the worker on another shape while five jobs of one shape queue
    first = create(c, seed=0, num_frames=8)
    until(lambda: c.get(f"/v1/videos/{first['id']}").json()["status"] == "in_progress")
    prompts = {11: "a", 12: "badprep", 13: "b", 14: "baddecode", 15: "c"}
    jobs = {seed: create(c, prompt=p, seed=seed) for seed, p in prompts.items()}
    backend.gate.set()
    done = {seed: wait_status(c, job["id"]) for seed, job in jobs.items()}
    assert {seed: v["status"] for seed, v in done.items()} == {
        11: "completed",
        12: "failed",
        13: "completed",
        14: "failed",
        15: "completed",
    }
    assert done[12]["error"]["message"] == "ValueError: cannot prepare this prompt"
    assert done[14]["error"]["message"] == "ValueError: the decoder met a NaN"
    together = [11, 12, 13, 14, 15]
    assert backend.prepared == [[0], together, *([s] for s in together)]
    survivors = [11, 13, 14, 15]
    assert backend.decoded == [[0], survivors, *([s] for s in survivors)]
    # The survivors of the prepare shared every denoising pass.
    assert [seeds for _, seeds in backend.passes[-2:]] == [survivors, survivors]
    assert c.get("/healthz").json() == {"status": "ok"}


def test_an_error_that_loses_the_device_stops_the_worker_and_says_so(make_client):
    backend = FakeBackend()
    c = make_client(backend)
    backend.gate.clear()  # hold the worker on another job while both queue, so they share a pass
    first = create(c, seed=0, num_frames=8)
    until(lambda: c.get(f"/v1/videos/{first['id']}").json()["status"] == "in_progress")
    poisoned = create(c, prompt="poison", seed=1)
    bystander = create(c, seed=2)
    backend.gate.set()
    assert wait_status(c, first["id"])["status"] == "completed"
    err = wait_status(c, poisoned["id"])["error"]
    assert err["code"] == "generation_failed" and "illegal memory access" in err["message"]
    until(lambda: c.get("/healthz").status_code == 503, what="healthz to report the lost device")
    assert_error(c.get("/healthz"), 503, fragment="the device is unusable")
    # The job that shared the pass was not failed with it: it waits for a working device.
    wait_status(c, bystander["id"], statuses=("queued",))
    until(lambda: 'megaslide_workers{state="dead"} 1' in c.get("/metrics").text, what="metrics")


def fail_writes(store: JobStore, failing: threading.Event) -> None:
    """While `failing` is set, every write to `store` fails as on a full disk."""

    @sa.event.listens_for(store.engine, "before_cursor_execute")
    def _full(conn, cursor, statement, params, context, executemany):
        if failing.is_set() and statement.lstrip().upper().startswith(WRITES):
            orig = sqlite3.OperationalError("database or disk is full")
            raise sa.exc.OperationalError(statement, params, orig)


WRITES = ("INSERT", "UPDATE", "DELETE")


def test_a_failing_store_holds_the_worker_back_without_losing_a_job(make_client):
    backend = FakeBackend()
    c = make_client(backend)
    failing = threading.Event()
    fail_writes(c.app.state.store.sync, failing)
    backend.gate.clear()
    video = create(c, seed=1)
    until(lambda: c.get(f"/v1/videos/{video['id']}").json()["status"] == "in_progress")
    failing.set()
    backend.gate.set()  # the step ends; recording it fails, and so does every write after
    until(lambda: c.get("/readyz").status_code == 503, what="readyz to report the failing store")
    assert_error(c.get("/readyz"), 503, fragment="database or disk is full")
    assert c.get("/healthz").status_code == 200  # a full disk is not a dead worker
    time.sleep(0.5)
    failing.clear()  # space again
    done = wait_status(c, video["id"])
    assert done["status"] == "completed" and done["progress"] == 100
    with c.stream("GET", f"/v1/videos/{video['id']}/events") as r:
        assert "".join(r.iter_text()).count("event: video.completed") == 1
    until(lambda: c.get("/readyz").status_code == 200, what="readyz to recover")
    assert wait_status(c, create(c, seed=2)["id"])["status"] == "completed"


def test_a_full_disk_answers_507_and_the_server_recovers_by_itself(make_client, monkeypatch):
    c = make_client()
    failing = threading.Event()
    fail_writes(c.app.state.store.sync, failing)
    failing.set()
    assert_error(c.post("/v1/videos", json={"prompt": "p", **SMALL}), 507, fragment="disk is full")
    failing.clear()

    def no_space(src, dst, max_bytes):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr("megaslide.server.routers.files.save_upload", no_space)
    err = assert_error(upload(c, dataset_zip()), 507)
    assert err["code"] == "insufficient_storage" and err["type"] == "server_error"
    files_dir = c.app.state.settings.data_dir / "files"
    assert not any(files_dir.iterdir())  # the half-written upload went with the failure
    monkeypatch.undo()
    # Space again: the same requests go through, on the same server.
    assert wait_status(c, create(c)["id"])["status"] == "completed"
    assert processed(c, upload(c, dataset_zip()).json())["status"] == "processed"
    assert c.get("/healthz").status_code == 200


class FullDiskBackend(FakeBackend):
    """Writing an MP4 fails for want of space while `full` is set."""

    def __init__(self):
        super().__init__()
        self.full = threading.Event()
        self.refused = 0

    def save_video(self, frames, fps, mp4_path, thumbnail_path):
        if self.full.is_set():
            self.refused += 1
            raise OSError(errno.ENOSPC, "No space left on device", str(mp4_path))
        super().save_video(frames, fps, mp4_path, thumbnail_path)


def test_a_full_output_disk_holds_finished_videos_until_space_returns(make_client, monkeypatch):
    """Like a full database disk: the MP4 waits (frames kept, claim renewed) and is written once
    there is room; a video cancelled meanwhile ends cancelled."""
    monkeypatch.setattr("megaslide.server.worker.STORE_RETRY_S", (0.05, 0.2))
    backend = FullDiskBackend()
    c = make_client(backend)
    backend.full.set()
    kept, dropped = create(c, seed=1), create(c, seed=2)
    until(lambda: backend.refused >= 3, what="writes refused for want of space")
    assert c.get(f"/v1/videos/{kept['id']}").json()["status"] == "in_progress"
    c.post(f"/v1/videos/{dropped['id']}/cancel")
    time.sleep(0.5)
    backend.full.clear()
    assert wait_status(c, kept["id"])["status"] == "completed"
    assert c.get(f"/v1/videos/{kept['id']}/content").status_code == 200
    assert wait_status(c, dropped["id"])["status"] == "cancelled"


def test_a_hung_worker_loop_lets_its_leases_expire(make_client):
    """The heartbeat thread stops renewing a worker's claims once its loop has been stuck in one
    step for stall_s: the job's lease expires and it is requeued; when the loop comes back, its
    stale claim is refused and the job completes once, from the queue."""
    backend = FakeBackend()
    c = make_client(backend, heartbeat_s=0.05, lease_s=0.6, stall_s=0.3)
    store = c.app.state.store.sync
    backend.gate.clear()  # the next denoising step hangs
    video = create(c)
    wait_status(c, video["id"], statuses=("in_progress",))
    assert until(lambda: store.recover_expired()["videos_requeued"] == 1, timeout=10)
    assert store.get_video(video["id"])["status"] == "queued"
    backend.gate.set()
    assert wait_status(c, video["id"])["status"] == "completed"
    messages = [e["message"] for e in store.events_after(video["id"], 0)]
    assert "requeued: its worker stopped renewing its lease" in messages
    assert [e["type"] for e in store.events_after(video["id"], 0)].count("video.completed") == 1


def test_a_fine_tune_taken_over_cannot_publish_another_checkpoint(make_client):
    """A worker presumed dead whose fine-tune another worker took over: its next checkpoint is
    refused at the moment of writing (the claim's fence), and it drops the job."""
    # Each step sleeps 0.5 s before its gate: once step 2 is seen, clearing the gate holds
    # step 3 there.
    backend = FakeBackend(train_step_s=0.5)
    c = make_client(backend, finetune_save_every=1)
    file_id = processed(c, upload(c, dataset_zip(clips=8)).json())["id"]
    hyper = {"n_epochs": 4, "batch_size": 1}
    body = {"model": "fake", "training_file": file_id, "hyperparameters": hyper}
    job = c.post("/v1/fine_tuning/jobs", json=body).json()
    store = c.app.state.store.sync
    until(lambda: ("train", 2) in backend.timeline, what="two steps")
    backend.gate.clear()  # the worker's next step waits here
    # Step 2's checkpoint and progress are recorded before step 3 begins: take over after them.
    until(lambda: store.get_finetune(job["id"])["step"] >= 2, what="step 2 recorded")
    row = store.get_finetune(job["id"])
    output = c.app.state.data.resolve(row["output_dir"])
    store.requeue_finetune(job["id"], row["lease_token"], "taken over")
    assert store.claim_finetune("elsewhere", ["fake"], lease_s=60)["id"] == job["id"]
    written = {p.name for p in output.glob("step-*.ckpt")}
    backend.gate.set()
    until(lambda: max(s for kind, s in backend.timeline if kind == "train") > len(written))
    time.sleep(0.3)
    assert {p.name for p in output.glob("step-*.ckpt")} == written  # nothing after the takeover
    row = store.get_finetune(job["id"])
    assert row["status"] == "running" and row["worker_id"] == "elsewhere"


def test_sse_events(make_client):
    c = make_client(FakeBackend(step_s=0.02))
    v = create(c, num_inference_steps=4)
    with c.stream("GET", f"/v1/videos/{v['id']}/events") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = [
        dict(re.findall(r"^(id|event|data): (.*)$", block, re.M))
        for block in text.strip().split("\n\n")
    ]
    names = [e["event"] for e in events]
    assert (
        names[0] == "video.queued"
        and names[1] == "video.in_progress"
        and names[-1] == "video.completed"
    )
    assert names.count("video.progress") >= 4
    progress = [json.loads(e["data"])["progress"] for e in events]
    assert progress == sorted(progress) and progress[-1] == 100
    final = json.loads(events[-1]["data"])
    assert final["status"] == "completed" and final["id"] == v["id"] and final["object"] == "video"
    ids = [int(e["id"]) for e in events]
    assert ids == sorted(ids)
    # Resuming with Last-Event-ID replays only what came after it.
    with c.stream(
        "GET", f"/v1/videos/{v['id']}/events", headers={"Last-Event-ID": str(ids[-2])}
    ) as r:
        rest = "".join(r.iter_text())
    assert rest.count("event: ") == 1 and "video.completed" in rest
    assert_error(c.get("/v1/videos/video_nope/events"), 404)


def test_validation_errors_name_the_field(make_client):
    c = make_client(max_steps=50)
    cases = [
        ({"size": "33x32"}, 400, "size", "even"),
        ({"size": "512x512"}, 400, "size", "at most 256"),
        ({"size": "30x30"}, 400, "size", "multiple of 4"),
        ({"size": "big"}, 400, "size", "WIDTHxHEIGHT"),
        ({"num_frames": 64}, 400, "num_frames", "1 to 32 frames"),
        ({"num_frames": None, "seconds": "60"}, 400, "seconds", "60 s at 8 fps"),
        ({"num_frames": 8, "seconds": 2}, 400, "seconds", "disagree"),
        ({"prompt": "   "}, 400, "prompt", "must not be empty"),
        ({"prompt": "x" * 63}, 400, "prompt", "at most 62"),
        ({"negative_prompt": "y" * 100}, 400, "negative_prompt", "at most 62"),
        ({"num_inference_steps": 51}, 400, "num_inference_steps", "limit of 50"),
        ({"num_inference_steps": 0}, 400, "num_inference_steps", None),
        ({"seed": -1}, 400, "seed", None),
        ({"priority": 1000}, 400, "priority", None),
        ({"num_frames": 3}, 400, None, "autoencoder"),  # the engine's own check, mapped to 400
        ({"model": "nope"}, 404, "model", "does not exist"),
        ({"colour": "red"}, 400, "colour", "Unrecognized request argument"),
        ({"input_reference": "img.png"}, 400, "input_reference", "uploaded as multipart"),
    ]
    for fields, status, param, fragment in cases:
        body = {"prompt": "ok", **SMALL, **fields}
        body = {k: v for k, v in body.items() if v is not None}
        assert_error(c.post("/v1/videos", json=body), status, param, fragment)
    assert_error(
        c.post("/v1/videos", json={"size": "32x32"}), 400, "prompt", "Missing required parameter"
    )
    assert_error(
        c.post("/v1/videos", content=b"{not json", headers={"content-type": "application/json"}),
        400,
    )
    assert_error(
        c.post("/v1/videos", data={"prompt": "p", "num_frames": "four"}), 400, "num_frames"
    )
    for path in ("/v1/videos/video_nope", "/v1/videos/video_nope/content"):
        assert_error(c.get(path), 404, "video_id")
    assert_error(c.delete("/v1/videos/video_nope"), 404)
    v = create(c)
    assert_error(
        c.get(f"/v1/videos/{v['id']}/content", params={"variant": "spritesheet"}), 400, "variant"
    )
    assert_error(c.get("/v1/nowhere"), 404)
    assert_error(c.put("/v1/videos"), 405)


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
    assert c.post("/v1/videos", json=theirs, headers=alice).status_code == 200
    # The key-less readiness probe names base models only, not a tenant's fine-tunes.
    assert c.get("/readyz", headers={"Authorization": ""}).json()["models"] == ["fake"]
    # A cursor at another key's id pages as one at an unknown id: nothing tells it exists.
    bobs = c.post("/v1/videos", json={"prompt": "p", **SMALL}, headers=bob).json()
    assert bobs["id"]
    for after in (mine["id"], "video_unknown"):
        listed = c.get(f"/v1/videos?after={after}&order=asc", headers=bob).json()
        assert listed["data"] == [], after


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv("MEGASLIDE_API_KEYS", "alpha, beta")
    assert Settings().api_keys == ["alpha", "beta"]


def test_idempotency_key_returns_the_first_job(make_client):
    c = make_client(api_keys=["a", "b"])
    headers = {"Authorization": "Bearer a", "Idempotency-Key": "req-1"}
    first = c.post("/v1/videos", json={"prompt": "p", **SMALL}, headers=headers).json()
    again = c.post("/v1/videos", json={"prompt": "p", **SMALL}, headers=headers).json()
    assert again["id"] == first["id"] and again["seed"] == first["seed"]
    assert_error(
        c.post("/v1/videos", json={"prompt": "other", **SMALL}, headers=headers),
        409,
        fragment="different request body",
    )
    # Another key holder using the same Idempotency-Key gets a job of its own.
    other = c.post(
        "/v1/videos",
        json={"prompt": "p", **SMALL},
        headers={"Authorization": "Bearer b", "Idempotency-Key": "req-1"},
    ).json()
    assert other["id"] != first["id"]
    listed = c.get("/v1/videos", headers={"Authorization": "Bearer a"}).json()["data"]
    assert [v["id"] for v in listed] == [first["id"]]  # each key sees its own
    # No key: two posts are two jobs.
    plain = [
        c.post(
            "/v1/videos", json={"prompt": "p", **SMALL}, headers={"Authorization": "Bearer a"}
        ).json()["id"]
        for _ in range(2)
    ]
    assert plain[0] != plain[1]


def test_full_queue_answers_429_with_retry_after(make_client):
    backend = FakeBackend()
    c = make_client(backend, max_queue=2, max_batch=1)
    backend.gate.clear()
    running = create(c, seed=1)
    until(
        lambda: c.get(f"/v1/videos/{running['id']}").json()["status"] == "in_progress", what="start"
    )
    create(c, seed=2)
    create(c, seed=3)
    r = c.post("/v1/videos", json={"prompt": "p", **SMALL})
    err = assert_error(r, 429, fragment="queue is full")
    assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
    backend.gate.set()
    wait_status(c, running["id"])
    until(
        lambda: c.post("/v1/videos", json={"prompt": "p", **SMALL}).status_code == 200,
        what="room again",
    )


def test_one_key_cannot_fill_the_queue_or_jump_it(make_client):
    """Each key that is not an admin's holds at most its share of the queue (its own 429, while
    others still get in) and may not raise a job's priority above 0."""
    backend = FakeBackend()
    c = make_client(backend, api_keys=["greedy", "other"], max_queue=8, max_queue_per_key=2)
    greedy, other = ({"Authorization": f"Bearer {k}"} for k in ("greedy", "other"))
    backend.gate.clear()
    body = {"prompt": "p", **SMALL}
    c.headers.update(greedy)  # what the helpers below send
    running = create(c, seed=1)
    wait_status(c, running["id"], statuses=("in_progress",))  # held at its first step
    for seed in (2, 3):
        assert c.post("/v1/videos", json={**body, "seed": seed}, headers=greedy).status_code == 200
    r = c.post("/v1/videos", json={**body, "seed": 4}, headers=greedy)
    assert_error(r, 429, fragment="its share of the queue")
    assert c.post("/v1/videos", json=body, headers=other).status_code == 200
    err = assert_error(c.post("/v1/videos", json={**body, "priority": 5}, headers=other), 403)
    assert err["param"] == "priority" and "admin" in err["message"]
    assert c.post("/v1/videos", json={**body, "priority": -5}, headers=other).status_code == 200
    backend.gate.set()
    wait_status(c, running["id"])


def test_health_readiness_and_metrics(make_client):
    backend = FakeBackend(load_s=0.5)
    c = make_client(backend, wait_ready=False)
    assert c.get("/healthz").status_code == 200
    assert_error(c.get("/readyz"), 503, fragment="loading")
    queued = create(c)  # accepted while loading; runs once ready
    until(lambda: c.get("/readyz").status_code == 200, what="ready")
    wait_status(c, queued["id"])
    response = c.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = scrape(response.text)
    assert samples["megaslide_queue_depth"] == 0
    assert samples['megaslide_jobs{kind="video",state="completed"}'] == 1
    assert samples["megaslide_denoise_step_seconds_count"] == 2
    assert samples["megaslide_denoise_steps_total"] == 2
    assert samples["megaslide_h2d_bytes_total"] == 2000
    assert samples['megaslide_denoise_step_seconds_bucket{le="+Inf"}'] == 2
    assert samples['megaslide_jobs_finished_total{kind="video",status="completed"}'] == 1
    # A scraper asking for OpenMetrics gets it.
    openmetrics = c.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


def scrape(text: str) -> dict[str, float]:
    """A Prometheus text exposition, parsed by prometheus-client: `name{labels}` -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def test_a_dead_engine_is_reported(make_client):
    c = make_client(FakeBackend(fail_load=True), wait_ready=False)
    until(lambda: c.get("/healthz").status_code == 503, what="healthz to report the dead worker")
    assert_error(c.get("/healthz"), 503, fragment="weights are corrupt")
    assert_error(c.post("/v1/videos", json={"prompt": "p", **SMALL}), 503, fragment="restart")


def test_models_list(make_client):
    c = make_client()
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake"]
    m = c.get("/v1/models/fake").json()
    assert (
        m["object"] == "model"
        and m["defaults"]["size"] == "32x32"
        and m["limits"]["max_frames"] == 32
    )
    assert_error(c.get("/v1/models/none"), 404, "model")


# ---------------------------------------------------------------------------------------------
# files and fine-tuning


def dataset_zip(clips=2, extra: dict | None = None, wrap: str = "") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        lines = [json.dumps({"file": f"clips/{i}.mp4", "text": f"clip {i}"}) for i in range(clips)]
        zf.writestr(f"{wrap}metadata.jsonl", "\n".join(lines) + "\n")
        for i in range(clips):
            zf.writestr(f"{wrap}clips/{i}.mp4", b"not really a video")
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return buf.getvalue()


def upload(c, data: bytes, name="data.zip", purpose="fine-tune", headers=None):
    return c.post(
        "/v1/files", data={"purpose": purpose}, files={"file": (name, data)}, headers=headers or {}
    )


def processed(c, f: dict) -> dict:
    """An upload once its validation is over: `processed`, or `error`."""
    return until(
        lambda: (x := c.get(f"/v1/files/{f['id']}").json())["status"] != "uploaded" and x,
        what=f"{f['id']} to be validated",
    )


def refused(c, archive: bytes, name: str = "data.zip") -> str:
    """Upload an archive that validation refuses; what the file's status_details say."""
    r = upload(c, archive, name)
    assert r.status_code == 200 and r.json()["status"] == "uploaded", r.text
    done = processed(c, r.json())
    assert done["status"] == "error" and done["clips"] == 0, done
    return done["status_details"]


def test_file_upload_validation(make_client):
    c = make_client(max_upload_bytes=50_000)
    uploaded = upload(c, dataset_zip(wrap="mydata/")).json()  # one wrapping folder is looked into
    assert uploaded["status"] == "uploaded"  # answered before the archive is even unpacked
    f = processed(c, uploaded)
    assert (f["object"], f["purpose"], f["filename"]) == ("file", "fine-tune", "data.zip")
    assert (f["status"], f["clips"], f["status_details"]) == ("processed", 2, None)
    assert [x["id"] for x in c.get("/v1/files").json()["data"]] == [f["id"]]

    assert "'../evil.txt'" in refused(c, dataset_zip(extra={"../evil.txt": "x"}))
    assert "absolute" in refused(c, dataset_zip(extra={"/etc/passwd": "x"}))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        link = tarfile.TarInfo("data/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    assert "'data/link' is a link" in refused(c, buf.getvalue(), "d.tar.gz")
    bad_meta = io.BytesIO()
    with zipfile.ZipFile(bad_meta, "w") as zf:
        zf.writestr("metadata.jsonl", json.dumps({"file": "clips/missing.mp4", "text": "x"}) + "\n")
    assert "clips/missing.mp4" in refused(c, bad_meta.getvalue())
    assert "not a .zip" in refused(c, b"just some bytes")
    assert_error(upload(c, b"x" * 60_000), 413, "file")
    assert_error(upload(c, dataset_zip(), purpose="batch"), 400, "purpose")
    assert_error(
        c.post("/v1/files", data={"purpose": "fine-tune"}, files={"other": ("a", b"b")}),
        400,
        "file",
    )
    # Refused uploads stay listed, as errors, with nothing of them left on disk.
    statuses = [x["status"] for x in c.get("/v1/files").json()["data"]]
    assert statuses == ["error"] * 5 + ["processed"]
    files_dir = c.app.state.settings.data_dir / "files"
    assert [p.name for p in files_dir.iterdir()] == [f["id"]]
    refusal = c.get("/v1/files", params={"limit": 1}).json()["data"][0]["id"]
    job = {"model": "fake", "training_file": refusal}
    assert_error(c.post("/v1/fine_tuning/jobs", json=job), 400, "training_file", "failed valid")

    r1 = upload(c, dataset_zip(), headers={"Idempotency-Key": "u1"}).json()
    r2 = upload(c, dataset_zip(), headers={"Idempotency-Key": "u1"}).json()
    assert r1["id"] == r2["id"], (r1, r2)
    processed(c, r1)
    assert c.delete(f"/v1/files/{r1['id']}").json() == {
        "id": r1["id"],
        "object": "file",
        "deleted": True,
    }
    assert_error(c.get(f"/v1/files/{r1['id']}"), 404)


def test_a_slow_upload_retried_meanwhile_is_stored_once_and_validated_later(make_client):
    backend = FakeBackend()
    checking = threading.Event()
    check = backend.check_dataset

    def slow_check(root):
        checking.wait(10)  # validation takes as long as the test says
        return check(root)

    backend.check_dataset = slow_check
    c = make_client(backend)
    archive, key = dataset_zip(), {"Idempotency-Key": "slow-1"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: upload(c, archive, headers=key).json(), range(4)))
    assert len({a["id"] for a in answers}) == 1 and answers[0]["status"] == "uploaded"
    job = {"model": "fake", "training_file": answers[0]["id"]}
    assert_error(c.post("/v1/fine_tuning/jobs", json=job), 400, "training_file", "being valid")
    checking.set()
    assert processed(c, answers[0])["status"] == "processed"
    assert len(c.get("/v1/files").json()["data"]) == 1
    assert c.post("/v1/fine_tuning/jobs", json=job).status_code == 200


def test_finetune_produces_a_model_that_generates(make_client):
    backend = FakeBackend(train_step_s=0.01)
    c = make_client(backend, finetune_save_every=2)
    f = processed(c, upload(c, dataset_zip(clips=3)).json())
    job = c.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": "fake",
            "training_file": f["id"],
            "suffix": "cats",
            "seed": 3,
            "method": {
                "type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 1}},
            },
        },
    ).json()
    assert job["object"] == "fine_tuning.job" and job["status"] == "queued"
    assert job["hyperparameters"] == {
        "n_epochs": 2,
        "batch_size": 1,
        "learning_rate_multiplier": 1.0,
    }
    assert_error(c.delete(f"/v1/files/{f['id']}"), 409, fragment="cancel the job first")
    done = until(
        lambda: (
            (j := c.get(f"/v1/fine_tuning/jobs/{job['id']}").json())["status"]
            in ("succeeded", "failed", "cancelled")
            and j
        ),
        what="fine-tune",
    )
    assert done["status"] == "succeeded", done
    short = job["id"].removeprefix("ftjob-")
    assert (
        done["fine_tuned_model"] == f"ft:fake:cats:{short}"
        and done["step"] == done["total_steps"] == 6
    )

    events = c.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 100}).json()["data"]
    metrics = [e for e in events if e["type"] == "metrics"]
    assert [e["data"]["step"] for e in metrics] == [
        6,
        5,
        4,
        3,
        2,
        1,
    ]  # newest first, as OpenAI lists them
    assert all({"loss", "lr", "total_steps"} <= set(e["data"]) for e in metrics)
    first_page = c.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 3}).json()
    second = c.get(
        f"/v1/fine_tuning/jobs/{job['id']}/events",
        params={"limit": 3, "after": first_page["data"][-1]["id"]},
    ).json()
    assert first_page["has_more"] and [e["id"] for e in second["data"]] == [
        e["id"] for e in events[3:6]
    ]
    ckpts = c.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    assert [k["step_number"] for k in ckpts] == [6, 4, 2]
    assert ckpts[0]["fine_tuned_model_checkpoint"].endswith(":ckpt-step-6")

    names = [m["id"] for m in c.get("/v1/models").json()["data"]]
    assert names == ["fake", done["fine_tuned_model"]]
    assert c.get(f"/v1/models/{done['fine_tuned_model']}").json()["parent"] == "fake"
    v = create(c, model=done["fine_tuned_model"], seed=99)
    assert wait_status(c, v["id"])["status"] == "completed"
    assert any(name == done["fine_tuned_model"] for name, _ in backend.passes)
    listed = c.get("/v1/fine_tuning/jobs").json()
    assert [j["id"] for j in listed["data"]] == [job["id"]]


def test_finetune_requests_are_validated(make_client):
    c = make_client()
    f = processed(c, upload(c, dataset_zip()).json())
    base = {"model": "fake", "training_file": f["id"]}
    assert_error(c.post("/v1/fine_tuning/jobs", json={**base, "model": "nope"}), 404, "model")
    assert_error(
        c.post("/v1/fine_tuning/jobs", json={**base, "training_file": "file-x"}),
        404,
        "training_file",
    )
    assert_error(
        c.post("/v1/fine_tuning/jobs", json={**base, "hyperparameters": {"n_epochs": 0}}),
        400,
        "hyperparameters.n_epochs",
    )
    assert_error(
        c.post("/v1/fine_tuning/jobs", json={**base, "suffix": "no spaces"}), 400, "suffix"
    )
    assert_error(
        c.post("/v1/fine_tuning/jobs", json={**base, "validation_file": f["id"]}),
        400,
        "validation_file",
    )
    assert_error(c.get("/v1/fine_tuning/jobs/ftjob-none"), 404)
    assert_error(c.post("/v1/fine_tuning/jobs/ftjob-none/cancel"), 404)


def test_running_finetune_yields_to_videos_and_can_be_cancelled(make_client):
    backend = FakeBackend(step_s=0.01, train_step_s=0.02)
    c = make_client(backend)
    f = processed(c, upload(c, dataset_zip(clips=200)).json())
    job = c.post("/v1/fine_tuning/jobs", json={"model": "fake", "training_file": f["id"]}).json()
    until(
        lambda: c.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["step"] >= 3,
        what="training to start",
    )
    v = create(c, num_inference_steps=5, seed=5)
    wait_status(c, v["id"])
    until(
        lambda: sum(1 for kind, _ in backend.timeline if kind == "train") >= 10,
        what="training to resume",
    )
    with backend.lock:
        kinds = [kind for kind, _ in backend.timeline]
    first_video, last_video = kinds.index("video"), len(kinds) - 1 - kinds[::-1].index("video")
    assert "train" not in kinds[first_video : last_video + 1], (
        "training ran while a video was in progress"
    )
    assert kinds[last_video + 1 :].count("train") > 0
    messages = [
        e["message"]
        for e in c.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 1000}).json()[
            "data"
        ]
    ]
    assert any(m.startswith("Paused") for m in messages) and any(
        m.startswith("Resumed") for m in messages
    )

    r = c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel").json()
    assert r["status"] == "cancelled"
    steps = sum(1 for kind, _ in backend.timeline if kind == "train")
    time.sleep(0.1)
    assert sum(1 for kind, _ in backend.timeline if kind == "train") == steps
    assert_error(
        c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel"), 400, fragment="already cancelled"
    )


# ---------------------------------------------------------------------------------------------
# durability (the kill -9 test against a real process is in test_server_e2e.py)


def test_restart_requeues_interrupted_work_and_resumes_finetunes(make_client, tmp_path):
    # The database and output folder as a kill -9 leaves them: the server's worker (its pid gone,
    # its heartbeat still fresh) holds a running video and fine-tune.
    data = tmp_path / "data"
    store = JobStore(f"sqlite:///{data / 'megaslide.db'}")
    gone = subprocess.run(
        [sys.executable, "-P", "-c", "import os; print(os.getpid())"],
        capture_output=True,
        check=True,
    )
    name = default_name("cpu")
    store.register_worker(
        name,
        "killed",
        host=socket.gethostname(),
        pid=int(gone.stdout),
        device="cpu",
        capacity=8,
        cards=[],
    )
    spec = ResolvedVideo(
        model="fake",
        prompt="p",
        negative_prompt="",
        frames=4,
        width=32,
        height=32,
        fps=8,
        steps=3,
        guidance=1.0,
        seed=8,
    ).to_dict()
    store.insert_video("video_interrupted", spec)
    store.insert_video("video_cancelling", {**spec, "seed": 10})
    claims = store.claim_videos(name, ["fake"], 2, lambda row: 0, lease_s=3600)
    token = {c["id"]: c["lease_token"] for c in claims}
    store.set_video_progress(
        [("video_interrupted", token["video_interrupted"], 2, 60)], lease_s=3600
    )
    store.insert_video("video_waiting", {**spec, "seed": 9})
    # Asked, not yet honoured at the kill.
    assert store.cancel_video("video_cancelling") == "in_progress"
    root = data / "files" / "file-1" / "data"
    (root / "clips").mkdir(parents=True)
    (root / "metadata.jsonl").write_text(
        "".join(json.dumps({"file": f"clips/{i}", "text": "t"}) + "\n" for i in range(40))
    )
    store.insert_file(
        {
            "id": "file-1",
            "filename": "d.zip",
            "purpose": "fine-tune",
            "bytes": 1,
            "path": "files/file-1/data",
        }
    )
    store.finish_file_validation("file-1", clips=40)
    out = data / "fine_tunes" / "ftjob-1"
    store.insert_finetune(
        {
            "id": "ftjob-1",
            "model": "fake",
            "training_file": "file-1",
            "seed": 0,
            "suffix": "s",
            "output_dir": "fine_tunes/ftjob-1",
            "hyperparameters": {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0},
        }
    )
    tune = store.claim_finetune(name, ["fake"], lease_s=3600)
    store.finetune_progress(
        "ftjob-1", tune["lease_token"], 13, 40, {"step": 13, "loss": 0.1}, lease_s=3600
    )
    out.mkdir(parents=True)
    for step in (5, 10):  # the last checkpoints the killed run saved; steps 11-13 were lost with it
        (out / f"step-{step}.ckpt").write_text("{}")
    store.close()

    backend = FakeBackend()
    c = make_client(backend, finetune_save_every=5)
    for video_id in ("video_interrupted", "video_waiting"):
        assert wait_status(c, video_id)["status"] == "completed"
    with c.stream("GET", "/v1/videos/video_interrupted/events") as r:
        events = re.findall(r"^event: (.*)$", "".join(r.iter_text()), re.M)
    # Started, requeued by the restart, started again, completed once.
    assert events.count("video.queued") == 2 and events.count("video.in_progress") == 2
    assert events.count("video.completed") == 1 and events[-1] == "video.completed"
    assert backend.seeds_run().count(8) == 3  # rerun from noise: all three steps
    assert (
        c.get("/v1/videos/video_cancelling").json()["status"] == "cancelled"
        and 10 not in backend.seeds_run()
    )
    done = until(
        lambda: (j := c.get("/v1/fine_tuning/jobs/ftjob-1").json())["status"] == "succeeded" and j,
        what="fine-tune after restart",
    )
    train_steps = [step for kind, step in backend.timeline if kind == "train"]
    assert train_steps == list(range(11, 41)), "did not resume right after the last checkpoint"
    assert done["step"] == 40 and done["fine_tuned_model"] == "ft:fake:s:1"
    events = c.get("/v1/fine_tuning/jobs/ftjob-1/events", params={"limit": 1000}).json()["data"]
    messages = [e["message"] for e in events]
    assert any(f"requeued: worker {name} restarted" in m for m in messages)
    # Step 13's metrics from the killed run went with the rewind: each step is reported once.
    steps = [e["data"]["step"] for e in events if e["type"] == "metrics"]
    assert sorted(steps) == list(range(11, 41))
    assert any(m.startswith("Resumed at step 10") for m in messages)


def test_routers_never_import_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from megaslide.server import build_app, Settings\n"
        "from megaslide.server.worker import EmbeddedWorker\n"
        "from server_fakes import FakeBackend\n"
        "import megaslide.server.routers.videos, megaslide.server.routers.files\n"
        "build_app(Settings(data_dir='unused'), EmbeddedWorker(Settings(), FakeBackend()))\n"
        "assert 'megaslide.server.torch_backend' not in sys.modules\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))  # for server_fakes
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=60, env=env)


def test_a_second_worker_of_the_same_name_is_refused(make_client):
    c = make_client()
    settings = c.app.state.settings
    other = TestClient(build_app(settings, EmbeddedWorker(settings, FakeBackend())))
    with pytest.raises(WorkerNameInUse, match="already runs"):
        other.__enter__()
    assert c.get("/readyz").status_code == 200  # the first one is unaffected
