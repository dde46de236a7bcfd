"""The server serves Wan models by name: JSON and multipart requests, a first-frame image for a
TI2V model, each model's own limits, and the stock openai SDK's `videos.create_and_poll`."""

from __future__ import annotations

import io
import time
import warnings

import numpy as np
import pytest

from megaslide.server import Settings

from server_fakes import live_server, torch_app
from wan_fixtures import build_tiny_wan

pytest.importorskip("diffusers")
with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-serve")
    t2v, ti2v = build_tiny_wan(root / "t2v", experts=2), build_tiny_wan(root / "ti2v", ti2v=True)
    settings = Settings(
        data_dir=root / "data",
        models=[f"wan-t2v={t2v}", f"wan-ti2v={ti2v}"],
        device="cpu",
        poll_after_ms=50,
    )
    return torch_app(settings)


def wait(client, video_id, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        video = client.get(f"/v1/videos/{video_id}").json()
        if video["status"] in ("completed", "failed", "cancelled"):
            return video
        time.sleep(0.05)
    raise AssertionError(f"{video_id} did not finish")


def png(width=40, height=48) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(1).random((height, width, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_models_are_listed_with_their_own_limits(app):
    with TestClient(app) as c:
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert set(models) == {"wan-t2v", "wan-ti2v"}
        t2v, ti2v = models["wan-t2v"]["limits"], models["wan-ti2v"]["limits"]
        assert (t2v["frames_multiple"], t2v["frames_offset"], t2v["size_multiple"]) == (
            4,
            1,
            [16, 16],
        )
        assert ti2v["size_multiple"] == [32, 32] and ti2v["image_input"] and not t2v["image_input"]
        bad = c.post("/v1/videos", json={"model": "wan-t2v", "prompt": "a cat", "num_frames": 8})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_frames"
        assert "4k + 1" in bad.json()["error"]["message"]
        bad = c.post("/v1/videos", json={"model": "wan-ti2v", "prompt": "a cat", "size": "48x48"})
        assert bad.status_code == 400 and "multiple of 32" in bad.json()["error"]["message"]


def test_json_and_multipart_with_a_first_frame(app):
    with TestClient(app) as c:
        v = c.post("/v1/videos", json={"model": "wan-t2v", "prompt": "a red circle", "seed": 1})
        assert v.status_code == 200, v.text
        assert wait(c, v.json()["id"])["status"] == "completed"
        mp4 = c.get(f"/v1/videos/{v.json()['id']}/content")
        assert mp4.headers["content-type"] == "video/mp4" and len(mp4.content) > 100
        form = {"model": "wan-ti2v", "prompt": "a red circle", "seed": "2", "num_frames": "9"}
        v = c.post(
            "/v1/videos", data=form, files={"input_reference": ("f.png", png(), "image/png")}
        )
        assert v.status_code == 200, v.text
        assert wait(c, v.json()["id"])["status"] == "completed"
        refused = c.post(
            "/v1/videos",
            data={"model": "wan-t2v", "prompt": "x"},
            files={"input_reference": ("f.png", png(), "image/png")},
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_reference"
        junk = c.post(
            "/v1/videos",
            data={"model": "wan-ti2v", "prompt": "x"},
            files={"input_reference": ("f.png", b"not an image", "image/png")},
        )
        assert junk.status_code == 400 and "not a readable image" in junk.json()["error"]["message"]


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_the_openai_sdk_creates_and_polls(app):
    openai = pytest.importorskip("openai")
    with live_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        video = client.videos.create_and_poll(
            model="wan-ti2v",
            prompt="a blue square moving up",
            seconds="1.125",  # 9 frames at the model's 8 fps
            size="64x64",
            input_reference=("first.png", png(), "image/png"),
            poll_interval_ms=50,
            extra_body={"seed": 4},
        )
        assert video.status == "completed", video
        content = client.videos.download_content(video.id)
        assert content.read()[4:8] == b"ftyp"  # an MP4


def test_a_fine_tuning_job_on_a_wan_base_is_served_at_once(app, tmp_path):
    import tarfile

    from megaslide.engine.native.world import write_dataset

    data = write_dataset(tmp_path / "world", 4, seed=1, frames=9, height=32, width=32)
    archive = tmp_path / "world.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(data.rglob("*")):
            tar.add(path, arcname=path.relative_to(data).as_posix(), recursive=False)
    with TestClient(app) as c:
        with open(archive, "rb") as f:
            uploaded = c.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": f})
        assert uploaded.status_code == 200, uploaded.text
        file_url = f"/v1/files/{uploaded.json()['id']}"
        deadline = time.monotonic() + 60
        while c.get(file_url).json()["status"] == "uploaded":  # validated after the upload
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.get(file_url).json()["status"] == "processed", c.get(file_url).text
        body = {"model": "wan-t2v", "training_file": uploaded.json()["id"]}
        refused = c.post(  # one transformer: no experts to choose from
            "/v1/fine_tuning/jobs",
            json={**body, "model": "wan-ti2v", "hyperparameters": {"expert": "both"}},
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "hyperparameters.expert"
        assert "has one denoiser" in refused.json()["error"]["message"]
        # Two experts: both train in one job unless one is named.
        job = c.post("/v1/fine_tuning/jobs", json={**body, "hyperparameters": {"batch_size": 2}})
        assert job.status_code == 200, job.text
        assert job.json()["hyperparameters"]["expert"] == "both"
        deadline = time.monotonic() + 120
        job_url = f"/v1/fine_tuning/jobs/{job.json()['id']}"
        while (status := c.get(job_url).json())["status"] not in (
            "succeeded",
            "failed",
            "cancelled",
        ):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert status["status"] == "succeeded", status
        name = status["fine_tuned_model"]
        assert name in {m["id"] for m in c.get("/v1/models").json()["data"]}
        v = c.post("/v1/videos", json={"model": name, "prompt": "a red circle", "seed": 5})
        assert wait(c, v.json()["id"])["status"] == "completed"
