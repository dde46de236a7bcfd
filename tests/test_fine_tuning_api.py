"""`/v1/fine_tuning/jobs` with fake training runs: a fine-tune that yields a servable model, its
validation, yielding to videos, cancelling, fencing after a takeover."""

from __future__ import annotations

import time
import warnings

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")


from api_helpers import assert_error, create, dataset_zip, processed, upload, wait_status
from server_fakes import FakeBackend, until


def test_a_fine_tune_taken_over_cannot_publish_another_checkpoint(make_client):
    """A worker presumed dead whose fine-tune another worker took over: its next checkpoint is
    refused at the moment of writing (the claim's fence), and it drops the job."""
    backend = FakeBackend(train_step_s=0.05)
    backend.hold_from = 3  # the worker's step 3 waits for the takeover
    c = make_client(backend, finetune_save_every=1)
    file_id = processed(c, upload(c, dataset_zip(clips=8)).json())["id"]
    hyper = {"n_epochs": 4, "batch_size": 1}
    body = {"model": "fake", "training_file": file_id, "hyperparameters": hyper}
    job = c.post("/v1/fine_tuning/jobs", json=body).json()
    store = c.app.state.store.sync
    # Step 2's checkpoint and progress are recorded before step 3 begins: take over once step 3
    # waits (after the progress alone, the worker may still be recording step 2's checkpoint,
    # and would find its claim gone there, before step 3).
    until(backend.held.is_set, what="step 3 to wait")
    assert store.fine_tunes.get(job["id"]).step == 2
    row = store.fine_tunes.get(job["id"])
    output = c.app.state.data.resolve(row.output_dir)
    store.fine_tunes.requeue(job["id"], row.lease_token, "taken over")
    assert store.fine_tunes.claim("elsewhere", ["fake"], lease_s=60).id == job["id"]
    written = {p.name for p in output.glob("step-*.ckpt")}
    assert written == {"step-1.ckpt", "step-2.ckpt"}
    backend.train_gate.set()
    until(lambda: max(s for kind, s in backend.timeline if kind == "train") > len(written))
    time.sleep(0.3)
    assert {p.name for p in output.glob("step-*.ckpt")} == written  # nothing after the takeover
    row = store.fine_tunes.get(job["id"])
    assert row.status == "running" and row.worker_id == "elsewhere"


def test_finetune_produces_a_model_that_generates(make_client):
    backend = FakeBackend(train_step_s=0.01)
    c = make_client(backend, finetune_save_every=2)
    trained, trainer = [], backend.trainer
    backend.trainer = lambda job: trained.append(job.spec) or trainer(job)
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
                "supervised": {
                    "hyperparameters": {
                        "n_epochs": 2,
                        "batch_size": 1,
                        "optimizer_state": "bf16-sr/8bit",
                        "optimizer_state_tier": "disk",
                    }
                },
            },
        },
    ).json()
    assert job["object"] == "fine_tuning.job" and job["status"] == "queued"
    assert job["hyperparameters"] == {
        "n_epochs": 2,
        "batch_size": 1,
        "learning_rate_multiplier": 1.0,
        "optimizer_state": "bf16-sr/8bit",
        "optimizer_state_tier": "disk",
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
    assert [(s.optimizer.state, s.optimizer.state_tier) for s in trained] == [
        ("bf16-sr/8bit", "disk")
    ]
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
    for state in ("bf16", "bf16/8bit", "fp16/fp32"):
        assert_error(
            c.post(
                "/v1/fine_tuning/jobs", json={**base, "hyperparameters": {"optimizer_state": state}}
            ),
            400,
            "hyperparameters.optimizer_state",
        )
    assert_error(
        c.post(
            "/v1/fine_tuning/jobs",
            json={**base, "hyperparameters": {"optimizer_state_tier": "ssd"}},
        ),
        400,
        "hyperparameters.optimizer_state_tier",
    )
    assert_error(
        c.post("/v1/fine_tuning/jobs", json={**base, "suffix": "no spaces"}), 400, "suffix"
    )
    assert_error(
        c.post("/v1/fine_tuning/jobs", json={**base, "validation_file": f["id"]}),
        400,
        "validation_file",
    )
    job = c.post("/v1/fine_tuning/jobs", json=base).json()
    assert job["hyperparameters"]["optimizer_state"] == "fp32"  # "auto"
    assert job["hyperparameters"]["optimizer_state_tier"] == "ram"  # "auto"
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


def test_a_job_asks_for_buckets_and_its_log_shows_the_plan(make_client):
    backend = FakeBackend(train_step_s=0.01)
    c = make_client(backend)
    trained, trainer = [], backend.trainer
    backend.trainer = lambda job: trained.append(job.spec) or trainer(job)
    f = processed(c, upload(c, dataset_zip(clips=2)).json())
    base = {"model": "fake", "training_file": f["id"]}
    for hyper, fragment in (
        ({"token_budget": 0}, "greater than or equal to 1"),
        ({"buckets": False, "token_budget": 100}, "bounds buckets"),
    ):
        assert_error(
            c.post("/v1/fine_tuning/jobs", json={**base, "hyperparameters": hyper}),
            400,
            "hyperparameters.token_budget",
            fragment=fragment,
        )
    hyper = {"n_epochs": 1, "buckets": True, "token_budget": 500}
    job = c.post("/v1/fine_tuning/jobs", json={**base, "hyperparameters": hyper}).json()
    assert job["hyperparameters"]["buckets"] is True
    assert job["hyperparameters"]["token_budget"] == 500
    done = until(
        lambda: (
            (j := c.get(f"/v1/fine_tuning/jobs/{job['id']}").json())["status"] == "succeeded" and j
        ),
        what="fine-tune",
    )
    assert [(s.clips.buckets, s.clips.token_budget) for s in trained] == [(True, 500)]
    events = c.get(f"/v1/fine_tuning/jobs/{done['id']}/events", params={"limit": 100}).json()
    messages = [e["message"] for e in events["data"]]
    assert "Clips in aspect and length buckets: 1 bucket(s) of at most 500 tokens" in messages
