"""Validation videos and the held-out loss through `/v1/fine_tuning/jobs` (fake training runs):
checked like video requests, listed per checkpoint, downloadable like a video's content."""

from __future__ import annotations

from api_helpers import assert_error, dataset_zip, processed, upload
from server_fakes import FakeBackend, until

PROMPTS = [
    {"prompt": "a red circle", "seed": 7, "size": "16x16", "num_inference_steps": 2},
    {"prompt": "this one will fail", "size": "16x16"},
    {"prompt": "a blue square", "seed": 1, "num_frames": 2, "guidance_scale": 3.0},
]


def finished(c, job_id: str) -> dict:
    return until(
        lambda: (
            (j := c.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"]
            in ("succeeded", "failed", "cancelled")
            and j
        ),
        what="fine-tune",
    )


def test_every_checkpoint_lists_its_validation_videos_and_serves_them(make_client):
    backend = FakeBackend(train_step_s=0.01)
    c = make_client(backend, finetune_save_every=2, api_keys=["k-one", "k-two"])
    c.headers.update({"Authorization": "Bearer k-one"})
    trained, trainer = [], backend.trainer
    backend.trainer = lambda job: trained.append(job.spec) or trainer(job)
    f = processed(c, upload(c, dataset_zip(clips=4)).json())
    hyper = {"n_epochs": 1, "batch_size": 1, "validation_split": 1}
    body = {"model": "fake", "training_file": f["id"], "hyperparameters": hyper}
    job = c.post("/v1/fine_tuning/jobs", json={**body, "validation": PROMPTS}).json()
    assert job["hyperparameters"]["validation_split"] == 1
    # Resolved against the model once: its defaults fill what a prompt leaves out.
    assert job["validation"][2] == {
        "prompt": "a blue square",
        "seed": 1,
        "size": "32x32",
        "num_frames": 2,
        "num_inference_steps": 2,
        "guidance_scale": 3.0,
    }
    assert finished(c, job["id"])["status"] == "succeeded"
    spec = trained[0].validation
    assert spec.split == 1 and [p.prompt for p in spec.prompts] == [p["prompt"] for p in PROMPTS]
    assert (spec.prompts[0].width, spec.prompts[0].steps, spec.prompts[0].seed) == (16, 2, 7)

    checkpoints = c.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    assert [k["step_number"] for k in checkpoints] == [4, 2]
    for k in checkpoints:
        assert k["metrics"]["validation_loss"] == 2.0 / k["step_number"]
        videos = k["validation"]
        assert [v["index"] for v in videos] == [0, 1, 2]
        assert [v["status"] for v in videos] == ["succeeded", "failed", "succeeded"]
        assert videos[1]["error"] == "sampling failed" and videos[1]["content_url"] is None
        assert videos[0]["size"] == "16x16" and videos[0]["seed"] == 7
        for v in (videos[0], videos[2]):
            got = c.get(v["content_url"])
            assert got.status_code == 200 and got.headers["content-type"] == "video/mp4"
            assert got.content == b"FAKEMP4" + f"{k['step_number']}:{v['index']}".encode()
        ranged = c.get(videos[0]["content_url"], headers={"Range": "bytes=0-6"})
        assert ranged.status_code == 206 and ranged.content == b"FAKEMP4"
    base = f"/v1/fine_tuning/jobs/{job['id']}/checkpoints/{checkpoints[0]['id']}/validation"
    assert_error(c.get(f"{base}/1/content"), 400, "index", fragment="sampling failed")
    assert_error(c.get(f"{base}/3/content"), 404, "index")
    missing = f"/v1/fine_tuning/jobs/{job['id']}/checkpoints/ftckpt-nope/validation/0/content"
    assert_error(c.get(missing), 404, "checkpoint_id")
    # Another key sees neither the job nor its videos.
    other = {"Authorization": "Bearer k-two"}
    assert_error(c.get(f"{base}/0/content", headers=other), 404, "fine_tuning_job_id")
    # The metrics events carry the held-out loss at the checkpoints' steps.
    events = c.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 100}).json()
    held = {
        e["data"]["step"]: e["data"].get("validation_loss")
        for e in events["data"]
        if e["type"] == "metrics"
    }
    assert held == {1: None, 2: 1.0, 3: None, 4: 0.5}
    messages = [e["message"] for e in events["data"]]
    assert "Validation videos sampled at step 4: 2 of 3" in messages


def test_validation_prompts_are_checked_like_video_requests(make_client):
    c = make_client()
    f = processed(c, upload(c, dataset_zip()).json())
    base = {"model": "fake", "training_file": f["id"]}

    def refused(validation, param, fragment=None, hyper=None):
        body = {**base, "validation": validation}
        if hyper is not None:
            body = {**base, "hyperparameters": hyper}
        assert_error(c.post("/v1/fine_tuning/jobs", json=body), 400, param, fragment=fragment)

    refused([{"prompt": "a", "size": "15x16"}], "validation[0].size")
    refused([{"prompt": "a"}, {"prompt": "b", "size": "512x512"}], "validation[1].size")
    refused([{"prompt": "a", "num_inference_steps": 1000}], "validation[0].num_inference_steps")
    refused([{"prompt": " "}], "validation[0].prompt")
    refused([{"prompt": "a", "num_frames": 40}], "validation[0].num_frames")
    refused([{"prompt": "a", "steps": 2}], "validation.0.steps")
    refused([{"prompt": "a"}] * 9, "validation")
    refused(None, "hyperparameters.validation_split", hyper={"validation_split": 1.5})
    refused(None, "hyperparameters.validation_split", hyper={"validation_split": -1})
    job = c.post("/v1/fine_tuning/jobs", json=base).json()
    assert job["validation"] == [] and "validation_split" not in job["hyperparameters"]
