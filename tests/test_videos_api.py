"""`/v1/videos` through the real routers, store and worker with fake models: the life cycle, content and
links, cancelling and deleting, batching and priority, events, validation, idempotency, queue limits."""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import warnings

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")


from api_helpers import (
    SMALL,
    TERMINAL,
    assert_error,
    create,
    dataset_zip,
    processed,
    upload,
    wait_status,
)
from server_fakes import FakeBackend, until


def test_video_lifecycle_json_and_multipart(make_client):
    backend = FakeBackend()
    backend.encode_gate.clear()  # the MP4s wait until the poll below has seen 95
    c = make_client(backend)
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
        if v["progress"] == 95:
            backend.encode_gate.set()
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


def test_deleting_the_signing_key_revokes_links_on_every_host(make_client, tmp_path):
    from megaslide.server.links import SECRET_FILE

    one, two = make_client(), make_client(worker_name="two")  # two hosts, one data directory
    v = create(one)
    wait_status(one, v["id"])
    path = f"/v1/videos/{v['id']}/content"
    old = one.post(f"{path}/link").json()["url"]
    assert one.get(old).status_code == 200 and two.get(old).status_code == 200
    (tmp_path / "data" / SECRET_FILE).unlink()
    assert_error(one.get(old), 401)
    assert_error(two.get(old), 401)
    new = two.post(f"{path}/link").json()["url"]  # a new secret, which both hosts then share
    assert one.get(new).status_code == 200 and two.get(new).status_code == 200
    assert_error(one.get(old), 401)


def test_expired_content_is_gone(make_client):
    c = make_client()
    v = create(c)
    wait_status(c, v["id"])
    with c.app.state.store.sync.db.tx() as conn:  # fast-forward past the video's lifetime
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


def sse_events(c, video_id: str) -> list[dict]:
    with c.stream("GET", f"/v1/videos/{video_id}/events") as r:
        text = "".join(r.iter_text())
    return [
        {**dict(re.findall(r"^(id|event): (.*)$", block, re.M)), "data": json.loads(data)}
        for block in text.strip().split("\n\n")
        for data in re.findall(r"^data: (.*)$", block, re.M)
    ]


def test_previews_come_every_few_steps_while_a_video_renders(make_client):
    """Every `preview_every` steps before the last, a `video.preview` event after the step's
    progress: a JPEG data URI no larger than `preview_size`. A preview that fails is skipped and
    the video completes."""
    import base64
    import io

    from PIL import Image

    c = make_client(FakeBackend(step_s=0.01), preview_every=2, preview_size=16)
    v = create(c, num_inference_steps=5)
    events = sse_events(c, v["id"])
    previews = [e["data"] for e in events if e["event"] == "video.preview"]
    assert [p["step"] for p in previews] == [2, 4] and events[-1]["event"] == "video.completed"
    names = [e["event"] for e in events]
    assert names[names.index("video.preview") - 1] == "video.progress"
    head, _, data = previews[0]["preview"].partition(",")
    assert head == "data:image/jpeg;base64"
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        assert image.format == "JPEG" and image.size == (16, 16)
        assert abs(image.getpixel((8, 8))[0] - 80) <= 2  # the fake's step 2 colour
    broken = create(c, prompt="badpreview", num_inference_steps=3)
    events = sse_events(c, broken["id"])
    assert "video.preview" not in [e["event"] for e in events]
    assert events[-1]["data"]["status"] == "completed"


def test_a_sampler_and_guidance_interval_reach_the_stored_request(make_client):
    """JSON and multipart (lists as JSON text) alike; echoed as resolved."""
    c = make_client()
    v = create(c, sampler="consistency", timesteps=[1000, 500], shift=5, guidance_interval=[0, 0.5])
    assert (v["sampler"], v["timesteps"], v["shift"]) == ("consistency", [1000, 500], 5.0)
    assert v["num_inference_steps"] == 2 and v["guidance_interval"] == [0.0, 0.5]
    fields = {"prompt": "p", "model": "fake", "sampler": "euler", "timesteps": "[1000, 750, 500]"}
    r = c.post("/v1/videos", data={**fields, "guidance_interval": "[0, 0.75]"})
    assert r.status_code == 200, r.text
    assert r.json()["timesteps"] == [1000, 750, 500] and r.json()["guidance_interval"] == [0, 0.75]
    plain = create(c)
    assert (plain["sampler"], plain["timesteps"], plain["guidance_interval"]) == (
        "scheduler",
        None,
        None,
    )
    for video in (v, r.json(), plain):
        wait_status(c, video["id"])


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
        ({"sampler": "ddim"}, 400, "sampler", None),
        ({"timesteps": [1000, 500]}, 400, "timesteps", "euler or consistency"),
        ({"sampler": "euler", "timesteps": [500, 1000]}, 400, "timesteps", "decreasing"),
        ({"guidance_interval": [0.5, 0.2]}, 400, "guidance_interval", "start < end"),
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
