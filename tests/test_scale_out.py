"""Processes as hosts: one API process (`serve --no-worker`) and two worker processes (`worker`,
tiny preset, CPU) on one real PostgreSQL and one storage directory, killed with -9 in turn.

Leases are short here (3 s, heartbeats every 0.3 s) so a dead worker's jobs move on quickly.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megaslide.server.store import JobStore

from processes import JOB_TIMEOUT_S, TERMINAL, Child, Server, noise_dataset_archive

pytest.importorskip("uvicorn")
pytest.importorskip("av")
pytestmark = pytest.mark.slow  # servers and workers as child processes, on PostgreSQL

LEASE = {"MEGASLIDE_LEASE_S": "3", "MEGASLIDE_HEARTBEAT_S": "0.3"}
# Long enough to be caught running: 60 steps of a 64x64 clip (a few seconds on one thread).
LONG_CLIP = {"num_frames": 4, "size": "64x64", "num_inference_steps": 60}
CLIP = {"num_frames": 4, "size": "32x32", "num_inference_steps": 2}


class Cluster:
    """The API host, the worker hosts, the database and the shared storage."""

    def __init__(self, root: Path, database: str):
        self.root, self.database = root, database
        self.storage = root / "storage"
        self.store = JobStore(database)  # the tests' own look at the database
        self.workers: dict[str, Child] = {}
        self.api = self.start_api()
        for name in ("worker-a", "worker-b"):
            self.start_worker(name)
        self.wait_for_workers(2)

    def common(self) -> list[str]:
        return ["--database", self.database, "--storage", str(self.storage)]

    def start_api(self) -> Server:
        log = self.root / f"api-{time.monotonic_ns()}.log"
        env = {**LEASE, "MEGASLIDE_POLL_AFTER_MS": "100", "MEGASLIDE_FINETUNE_SAVE_EVERY": "1"}
        return Server(["--no-worker", *self.common()], log, env=env, ready_path="/healthz")

    def start_worker(self, name: str) -> Child:
        args = ["worker", *self.common(), "--preset", "tiny", "--device", "cpu", "--name", name]
        env = {**LEASE, "OMP_NUM_THREADS": "1", "MEGASLIDE_FINETUNE_SAVE_EVERY": "1"}
        self.workers[name] = Child(args, self.root / f"{name}-{time.monotonic_ns()}.log", env)
        return self.workers[name]

    def wait_for_workers(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for w in self.workers.values():
                if w.proc.returncode is None:
                    w.check_running()
            ready = self.api.http.get("/readyz")
            if ready.status_code == 200 and ready.json()["workers"]["ready"] >= n:
                return
            time.sleep(0.2)
        raise AssertionError(f"{n} workers not ready: {self.api.http.get('/readyz').text}")

    def holder(self, job_id: str, table: str = "video") -> str:
        """The worker running a job, once it has taken a step or two."""
        get = self.store.videos.get if table == "video" else self.store.fine_tunes.get
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            row = get(job_id)
            if row.worker_id and row.step >= 2:
                return row.worker_id
            time.sleep(0.05)
        raise AssertionError(f"{job_id} did not start: {row}")

    def stop(self) -> None:
        self.api.stop()
        for w in self.workers.values():
            w.stop()
        self.store.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, postgres_server):
    c = Cluster(tmp_path_factory.mktemp("cluster"), postgres_server.database())
    yield c
    c.stop()


def events(cluster: Cluster, video_id: str) -> list[str]:
    return [e.type for e in cluster.store.videos.events_after(video_id, 0, limit=10_000)]


def create(cluster: Cluster, **fields) -> str:
    r = cluster.api.http.post("/v1/videos", json={"prompt": "a clip", **fields})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_models_and_readiness_come_from_the_live_workers(cluster):
    ready = cluster.api.http.get("/readyz").json()
    assert ready["models"] == ["tiny"] and ready["workers"] == {"live": 2, "ready": 2}
    metrics = cluster.api.http.get("/metrics").text
    assert 'megaslide_workers{state="ready"} 2' in metrics


def test_a_worker_killed_mid_video_hands_it_to_the_other_exactly_once(cluster, tmp_path):
    from megaslide.engine.video import read_video

    video_id = create(cluster, seed=1, **LONG_CLIP)
    victim = cluster.holder(video_id)
    cluster.workers[victim].kill9()
    done = cluster.api.wait(video_id)
    row = cluster.store.videos.get(video_id)
    assert done["status"] == "completed" and row.worker_id != victim and row.attempts == 2
    names = events(cluster, video_id)
    assert names.count("video.completed") == 1 and names.count("video.in_progress") == 2
    mp4 = cluster.api.http.get(f"/v1/videos/{video_id}/content")
    (tmp_path / "v.mp4").write_bytes(mp4.content)
    assert read_video(tmp_path / "v.mp4").shape == (4, 64, 64, 3)
    # Back to two workers: the restart under the same name registers anew.
    cluster.start_worker(victim)
    cluster.wait_for_workers(2)


def test_a_cancel_sent_to_the_api_stops_the_job_on_its_worker_within_a_step(cluster):
    video_id = create(cluster, seed=2, **LONG_CLIP)
    cluster.holder(video_id)
    before = cluster.api.video(video_id)["step"]
    r = cluster.api.http.post(f"/v1/videos/{video_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    after = cluster.store.videos.get(video_id)
    # One step may have been running when the flag landed, and one more between our read of
    # the step and the cancel.
    assert after.status == "cancelled" and after.step <= before + 2
    time.sleep(1)
    assert cluster.store.videos.get(video_id).step == after.step


def test_killing_the_api_leaves_the_workers_working(cluster):
    ids = [create(cluster, seed=10 + i, **CLIP) for i in range(3)]
    cluster.api.kill9()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while any(cluster.store.videos.get(i).status not in TERMINAL for i in ids):
        assert time.monotonic() < deadline, "the workers stopped with the API"
        time.sleep(0.2)
    cluster.api = cluster.start_api()
    for video_id in ids:
        assert cluster.api.video(video_id)["status"] == "completed"
        assert cluster.api.http.get(f"/v1/videos/{video_id}/content").content[4:8] == b"ftyp"


def finetune(cluster: Cluster, file_id: str) -> str:
    body = {
        "model": "tiny",
        "training_file": file_id,
        "seed": 3,
        "hyperparameters": {"n_epochs": 4, "batch_size": 1, "num_frames": 4, "size": "32x32"},
    }
    r = cluster.api.http.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def finished(cluster: Cluster, job_id: str) -> dict:
    deadline = time.monotonic() + 2 * JOB_TIMEOUT_S
    while (j := cluster.api.http.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"] in (
        "queued",
        "running",
    ):
        assert time.monotonic() < deadline, j
        time.sleep(0.2)
    return j


def test_a_worker_killed_mid_finetune_is_resumed_by_the_other_to_the_same_weights(
    cluster, tmp_path
):
    from safetensors.torch import load_file

    f = cluster.api.http.post(
        "/v1/files",
        data={"purpose": "fine-tune"},
        files={"file": ("d.tgz", noise_dataset_archive(tmp_path, 3))},
    )
    assert f.status_code == 200, f.text
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while cluster.store.files.get(f.json()["id"]).status == "uploaded":  # the API validates it
        assert time.monotonic() < deadline
        time.sleep(0.1)
    killed = finetune(cluster, f.json()["id"])
    victim = cluster.holder(killed, table="fine_tune")
    cluster.workers[victim].kill9()
    interrupted = finished(cluster, killed)
    assert interrupted["status"] == "succeeded", interrupted
    assert cluster.store.fine_tunes.get(killed).attempts == 2
    messages = [e.message for e in cluster.store.fine_tunes.events(killed, None, 1000)[0]]
    assert any(m.startswith("Resumed at step") for m in messages), messages

    cluster.start_worker(victim)
    cluster.wait_for_workers(2)
    whole = finished(cluster, finetune(cluster, f.json()["id"]))
    assert whole["status"] == "succeeded" and whole["step"] == interrupted["step"] == 12

    def weights(job: dict) -> dict:
        folder = cluster.storage / "models" / job["id"]
        return {p.relative_to(folder): load_file(p) for p in sorted(folder.rglob("*.safetensors"))}

    a, b = weights(interrupted), weights(whole)
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].keys() == b[name].keys()
        for key in a[name]:
            assert a[name][key].equal(b[name][key]), f"{name}:{key} differs after the resume"
