"""`megaslide serve --preset tiny` as a real uvicorn process on 127.0.0.1, driven over HTTP.

Clips are 4 frames of 32x32 with 2 denoising steps, so each job takes a few seconds on two CPU cores.
The kill -9 test starts its own server twice on one data directory.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest

from processes import JOB_TIMEOUT_S, TERMINAL, Child, Server, noise_dataset_archive

pytest.importorskip("uvicorn")
pytest.importorskip("av")
pytestmark = pytest.mark.slow  # `megaslide serve` as a child process

CLIP = {"num_frames": 4, "size": "32x32", "num_inference_steps": 2}


def serve(data_dir: Path) -> Server:
    """`megaslide serve --preset tiny` on `data_dir`."""
    log = data_dir.parent / f"{data_dir.name}-{time.monotonic_ns()}.log"
    args = ["--preset", "tiny", "--data-dir", str(data_dir)]
    return Server(args, log, env={"MEGASLIDE_POLL_AFTER_MS": "100"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve(tmp_path_factory.mktemp("serve") / "data")
    yield srv
    srv.stop()


def sse_events(srv: Server, video_id: str) -> list[tuple[str, dict]]:
    with srv.http.stream("GET", f"/v1/videos/{video_id}/events", timeout=JOB_TIMEOUT_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    blocks = [
        dict(re.findall(r"^(event|data): (.*)$", b, re.M)) for b in text.strip().split("\n\n")
    ]
    return [(b["event"], json.loads(b["data"])) for b in blocks]


def test_video_lifecycle_over_http(server, tmp_path):
    from megaslide.engine.loader import open_pipeline
    from megaslide.engine.request import VideoRequest
    from megaslide.engine.sources import resolve_source
    from megaslide.engine.video import read_video, write_mp4

    r = server.http.post("/v1/videos", json={"prompt": "a red ball", "seed": 42, **CLIP})
    assert r.status_code == 200, r.text
    video = r.json()
    assert video["status"] == "queued" and r.headers["openai-poll-after-ms"] == "100"
    events = sse_events(server, video["id"])  # follows the job to its end
    names = [name for name, _ in events]
    assert (
        names[0] == "video.queued"
        and names[-1] == "video.completed"
        and "video.in_progress" in names
    )
    progress = [data["progress"] for _, data in events]
    assert (
        progress == sorted(progress) and progress[-1] == 100 and any(0 < p < 100 for p in progress)
    )
    done = server.video(video["id"])
    assert done["status"] == "completed" and done["progress"] == 100 and done["step"] == 2

    mp4 = server.http.get(f"/v1/videos/{video['id']}/content")
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
    (tmp_path / "served.mp4").write_bytes(mp4.content)
    served = read_video(tmp_path / "served.mp4")
    assert served.shape == (4, 32, 32, 3)
    # The server's clip is the library's clip: same weights (preset, seed 0), same request.
    pipe = open_pipeline(resolve_source(preset="tiny"))
    local = pipe.generate(
        VideoRequest(prompt="a red ball", frames=4, height=32, width=32, steps=2, seed=42)
    )
    write_mp4(tmp_path / "local.mp4", local, fps=8)
    assert np.array_equal(read_video(tmp_path / "local.mp4"), served)

    part = server.http.get(f"/v1/videos/{video['id']}/content", headers={"Range": "bytes=0-99"})
    assert part.status_code == 206 and part.content == mp4.content[:100]
    assert part.headers["content-range"] == f"bytes 0-99/{len(mp4.content)}"
    thumb = server.http.get(f"/v1/videos/{video['id']}/content", params={"variant": "thumbnail"})
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(thumb.content)))
    assert thumb.headers["content-type"] == "image/png" and np.array_equal(image, local[0])

    # What the stock openai SDK sends: multipart, every value a string, extra_body keys as fields.
    fields = {
        "prompt": "a blue cube",
        "model": "tiny",
        "seconds": "0.5",
        "size": "32x32",
        "num_inference_steps": "2",
        "seed": "7",
    }
    r = server.http.post("/v1/videos", files={k: (None, v) for k, v in fields.items()})
    assert r.status_code == 200, r.text
    assert r.json()["num_frames"] == 4 and r.json()["seed"] == 7
    assert server.wait(r.json()["id"])["status"] == "completed"
    listed = server.http.get("/v1/videos", params={"limit": 1}).json()
    assert listed["data"][0]["id"] == r.json()["id"] and listed["has_more"] is True


def test_cancelling_a_running_job_stops_the_model(server):
    v = server.http.post(
        "/v1/videos", json={"prompt": "long", **CLIP, "num_inference_steps": 60}
    ).json()
    server.wait(v["id"], statuses=("in_progress",))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while server.video(v["id"])["step"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = server.http.post(f"/v1/videos/{v['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    steps = server.metric("megaslide_denoise_steps_total")
    time.sleep(1.5)  # several step times of this model: a job still stepping would show
    assert server.metric("megaslide_denoise_steps_total") == steps
    after = server.video(v["id"])
    assert after["status"] == "cancelled" and after["step"] < 60 and after["progress"] < 100


def test_finetune_through_the_files_api_yields_a_servable_model(server, tmp_path):
    pytest.importorskip("megaslide.engine.training.finetune")
    archive = noise_dataset_archive(tmp_path, 2)
    f = server.http.post(
        "/v1/files", data={"purpose": "fine-tune"}, files={"file": ("data.tar.gz", archive)}
    )
    assert f.status_code == 200, f.text
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (checked := server.http.get(f"/v1/files/{f.json()['id']}").json())[
        "status"
    ] == "uploaded":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert checked["status"] == "processed" and checked["clips"] == 2, checked
    job = server.http.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": "tiny",
            "training_file": f.json()["id"],
            "suffix": "e2e",
            "seed": 1,
            "hyperparameters": {"n_epochs": 1, "batch_size": 1, "num_frames": 4, "size": "32x32"},
        },
    )
    assert job.status_code == 200, job.text
    job_id = job.json()["id"]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (j := server.http.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"] not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        assert time.monotonic() < deadline, f"fine-tune still {j['status']}"
        time.sleep(0.2)
    assert j["status"] == "succeeded", j
    assert (
        j["fine_tuned_model"] == f"ft:tiny:e2e:{job_id.removeprefix('ftjob-')}" and j["step"] == 2
    )
    events = server.http.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"]
    metrics = [e["data"] for e in events if e["type"] == "metrics"]
    assert [m["step"] for m in metrics] == [2, 1] and all(
        np.isfinite(m["loss"]) and m["lr"] > 0 for m in metrics
    )

    assert j["fine_tuned_model"] in [m["id"] for m in server.http.get("/v1/models").json()["data"]]
    v = server.http.post(
        "/v1/videos", json={"prompt": "a tuned clip", "model": j["fine_tuned_model"], **CLIP}
    )
    assert v.status_code == 200, v.text
    assert server.wait(v.json()["id"])["status"] == "completed"
    assert server.http.get(f"/v1/videos/{v.json()['id']}/content").content[4:8] == b"ftyp"


def test_kill_9_then_restart_completes_every_job_exactly_once(tmp_path):
    data = tmp_path / "data"
    first = serve(data)
    ids = []
    for seed in range(5):
        r = first.http.post(
            "/v1/videos", json={"prompt": f"clip {seed}", "seed": seed, "guidance_scale": 1, **CLIP}
        )
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    first.wait(ids[0], statuses=("in_progress",) + TERMINAL)
    first.kill9()

    second = serve(data)
    try:
        for video_id in ids:
            v = second.wait(video_id)
            assert v["status"] == "completed" and v["progress"] == 100, v
        listed = second.http.get("/v1/videos", params={"limit": 100}).json()["data"]
        assert sorted(v["id"] for v in listed) == sorted(ids)  # no job lost, none duplicated
        requeued = 0
        for video_id in ids:
            names = [name for name, _ in sse_events(second, video_id)]
            assert names.count("video.completed") == 1 and names[-1] == "video.completed"
            requeued += names.count("video.queued") - 1
            assert second.http.get(f"/v1/videos/{video_id}/content").content[4:8] == b"ftyp"
        assert requeued >= 1, "the kill landed after every job finished; nothing was tested"
        assert second.metric("megaslide_queue_depth") == 0
    finally:
        second.stop()


def worker_pid(data: Path) -> int:
    """The process of the one worker registered in the store under `data`."""
    with sqlite3.connect(data / "megaslide.db") as db:
        return db.execute("SELECT pid FROM workers").fetchone()[0]


def test_a_worker_process_killed_mid_video_is_restarted_and_finishes_it(tmp_path):
    data = tmp_path / "data"
    srv = Server(
        ["--preset", "tiny", "--data-dir", str(data), "--worker-process"], tmp_path / "log"
    )
    try:
        first = worker_pid(data)
        assert first != srv.proc.pid  # the engine is not in the API's process
        r = srv.http.post("/v1/videos", json={"prompt": "p", **CLIP, "num_inference_steps": 60})
        video_id = r.json()["id"]
        srv.wait(video_id, statuses=("in_progress",))
        os.kill(first, signal.SIGKILL)
        v = srv.wait(video_id)
        assert v["status"] == "completed", srv.output()
        second = worker_pid(data)
        assert second != first and "exited with -9; restarting it" in srv.output()
        names = [name for name, _ in sse_events(srv, video_id)]
        assert names.count("video.completed") == 1 and names.count("video.queued") == 2
        srv.stop()
        with pytest.raises(ProcessLookupError):  # the server took its worker with it
            os.kill(second, 0)
    finally:
        srv.stop()


def test_a_worker_process_stops_when_its_server_is_killed(tmp_path):
    data = tmp_path / "data"
    srv = Server(
        ["--preset", "tiny", "--data-dir", str(data), "--worker-process"], tmp_path / "log"
    )
    try:
        worker = worker_pid(data)
        srv.kill9()
        deadline = time.monotonic() + 30
        while Path(f"/proc/{worker}").exists() and "zombie" not in _state(worker):
            assert time.monotonic() < deadline, "the worker process outlived its server"
            time.sleep(0.1)
    finally:
        srv.stop()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


def test_serve_stops_with_status_0_and_refuses_a_second_worker_of_its_name(tmp_path):
    srv = serve(tmp_path / "data")
    try:
        # `megaslide worker` on the same host and device: the same default name as the server's.
        args = [
            "worker",
            "--preset",
            "tiny",
            "--data-dir",
            str(tmp_path / "data"),
            "--device",
            "cpu",
        ]
        twin = Child(args, tmp_path / "twin.log")
        assert twin.proc.wait(timeout=120) == 2, twin.output()
        assert "is already running" in twin.output() and "another name" in twin.output()
        srv.check_running()
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=60)
    assert srv.proc.returncode == 0, srv.output()
