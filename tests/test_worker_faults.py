"""What the worker does when things break: a lost device, a failing or full store, a full output disk, a
hung loop, a restart mid-job, a second worker under one name."""

from __future__ import annotations

import errno
import json
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from megaslide.engine.request import ResolvedVideo
from megaslide.server import build_app
from megaslide.server.store import JobStore, WorkerNameInUse
from megaslide.server.worker import Fleet, default_name

from api_helpers import (
    SMALL,
    assert_error,
    create,
    dataset_zip,
    processed,
    upload,
    wait_status,
)
from server_fakes import FakeBackend, until


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

    @sa.event.listens_for(store.db.engine, "before_cursor_execute")
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


def test_a_store_that_fails_as_a_clip_finishes_decoding_loses_no_job(make_client, monkeypatch):
    """The decode is done and recording it fails: the clip is given up (no encoder left waiting,
    no file) and its claim no longer renewed, so once the store is back the job is claimed again
    when its lease runs out and completes once."""
    monkeypatch.setattr("megaslide.server.worker.context.STORE_RETRY_S", (0.05, 0.2))
    backend = FakeBackend()
    c = make_client(backend, lease_s=1.0, heartbeat_s=0.2)
    failing = threading.Event()
    fail_writes(c.app.state.store.sync, failing)
    backend.decode_gate.clear()  # a "holddecode" clip's frames wait for it
    video = create(c, prompt="holddecode", seed=4)
    until(lambda: c.get(f"/v1/videos/{video['id']}").json()["progress"] >= 90, what="denoised")
    failing.set()
    backend.decode_gate.set()  # the decode ends; recording it fails
    until(lambda: c.get("/readyz").status_code == 503, what="readyz to report the failing store")
    failing.clear()
    done = wait_status(c, video["id"], timeout=30)
    assert done["status"] == "completed" and done["progress"] == 100
    mp4 = c.app.state.settings.data_dir / "videos" / f"{video['id']}.mp4"
    assert mp4.is_file()  # and nothing else of it: no temporary file left by the aborted encoder
    assert sorted(p.name for p in mp4.parent.glob(f"*{video['id']}*")) == [
        mp4.name,
        f"{video['id']}.png",
    ]


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
    monkeypatch.setattr("megaslide.server.worker.context.STORE_RETRY_S", (0.05, 0.2))
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
    assert until(lambda: store.workers.recover_expired()["videos_requeued"] == 1, timeout=10)
    assert store.videos.get(video["id"]).status == "queued"
    backend.gate.set()
    assert wait_status(c, video["id"])["status"] == "completed"
    messages = [e.message for e in store.videos.events_after(video["id"], 0)]
    assert "requeued: its worker stopped renewing its lease" in messages
    assert [e.type for e in store.videos.events_after(video["id"], 0)].count("video.completed") == 1


def killed_mid_work(data: Path) -> str:
    """The database and output folder under `data` as a kill -9 leaves them: the server's worker
    (its pid gone, its heartbeat still fresh) holds a running video and fine-tune. Its name."""
    store = JobStore(f"sqlite:///{data / 'megaslide.db'}")
    gone = subprocess.run(
        [sys.executable, "-P", "-c", "import os; print(os.getpid())"],
        capture_output=True,
        check=True,
    )
    name = default_name("cpu")
    store.workers.register(
        name,
        "killed",
        host=socket.gethostname(),
        pid=int(gone.stdout),
        device="cpu",
        capacity=8,
        cards=[],
    )
    interrupted_videos(store, name)
    interrupted_finetune(store, name, data)
    store.close()
    return name


def interrupted_videos(store: JobStore, name: str) -> None:
    """A video two steps in, one asked to cancel, one waiting: the first two held by `name`."""
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
    store.videos.insert("video_interrupted", spec)
    store.videos.insert("video_cancelling", {**spec, "seed": 10})
    claims = store.videos.claim(name, ["fake"], 2, lambda row: 0, lease_s=3600)
    token = {c.id: c.lease_token for c in claims}
    store.videos.set_progress(
        [("video_interrupted", token["video_interrupted"], 2, 60)], lease_s=3600
    )
    store.videos.insert("video_waiting", {**spec, "seed": 9})
    # Asked, not yet honoured at the kill.
    assert store.videos.cancel("video_cancelling") == "in_progress"


def interrupted_finetune(store: JobStore, name: str, data: Path) -> None:
    """A fine-tune held by `name`, reported at step 13, its last checkpoint at step 10."""
    root = data / "files" / "file-1" / "data"
    (root / "clips").mkdir(parents=True)
    (root / "metadata.jsonl").write_text(
        "".join(json.dumps({"file": f"clips/{i}", "text": "t"}) + "\n" for i in range(40))
    )
    store.files.insert(
        {
            "id": "file-1",
            "filename": "d.zip",
            "purpose": "fine-tune",
            "bytes": 1,
            "path": "files/file-1/data",
        }
    )
    store.files.finish_validation("file-1", clips=40)
    out = data / "fine_tunes" / "ftjob-1"
    store.fine_tunes.insert(
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
    tune = store.fine_tunes.claim(name, ["fake"], lease_s=3600)
    store.fine_tunes.set_progress(
        "ftjob-1", tune.lease_token, 13, 40, {"step": 13, "loss": 0.1}, lease_s=3600
    )
    out.mkdir(parents=True)
    for step in (5, 10):  # the last checkpoints the killed run saved; steps 11-13 were lost with it
        (out / f"step-{step}.ckpt").write_text("{}")


@pytest.mark.slow
def test_restart_requeues_interrupted_work_and_resumes_finetunes(make_client, tmp_path):
    name = killed_mid_work(tmp_path / "data")

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


def test_a_second_worker_of_the_same_name_is_refused(make_client):
    c = make_client()
    settings = c.app.state.settings
    other = TestClient(build_app(settings, Fleet.embedded(settings, FakeBackend())))
    with pytest.raises(WorkerNameInUse, match="already runs"):
        other.__enter__()
    assert c.get("/readyz").status_code == 200  # the first one is unaffected
