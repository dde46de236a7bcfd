"""An API-only app (`Fleet`, as `megaslide serve --no-worker` builds it) beside workers that run
in threads of this process on the same SQLite store: what the API knows of workers it only sees
through the registry."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import warnings

import pytest

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from megaslide.server import Settings, build_app
from megaslide.server.datadir import DataDir
from megaslide.server.protocol import card_from_dict, card_to_dict
from megaslide.server.store import JobStore
from megaslide.server.worker import Fleet, Worker, WorkerProcess

from api_helpers import SMALL, assert_error, scrape, wait_status
from server_fakes import FAKE_CARD, FakeBackend, serve_fake_jobs, until


@pytest.fixture
def settings(tmp_path, monkeypatch):
    for var in ("MEGASLIDE_API_KEYS", "MEGASLIDE_MODELS", "MEGASLIDE_PRESET"):
        monkeypatch.delenv(var, raising=False)
    return Settings(data_dir=tmp_path / "data", heartbeat_s=0.1, lease_s=1.0, sse_interval_s=0.02)


class Running:
    """A worker in a thread of this process, as `megaslide worker` runs one."""

    def __init__(self, settings: Settings, name: str):
        self.store = JobStore(settings.database_url)
        self.worker = Worker(settings, FakeBackend(), self.store, name)
        self.worker.register()
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.worker.stop.set()
        self.worker.wake.set()
        self.thread.join(30)
        self.worker.close()
        self.store.close()


@pytest.fixture
def api(settings):
    with TestClient(build_app(settings, Fleet(settings, FakeBackend().check_dataset))) as c:
        yield c


def test_the_api_knows_models_only_from_live_workers(api, settings):
    assert_error(api.get("/readyz"), 503, fragment="no worker is live")
    assert api.get("/v1/models").json()["data"] == []
    assert_error(api.post("/v1/videos", json={"prompt": "p"}), 503, fragment="no live worker")
    worker = Running(settings, "w1")
    until(lambda: api.get("/readyz").status_code == 200, what="the worker's heartbeat")
    ready = api.get("/readyz").json()
    assert ready["models"] == ["fake"] and ready["workers"] == {"live": 1, "ready": 1}
    video = api.post("/v1/videos", json={"prompt": "p", **SMALL}).json()
    assert wait_status(api, video["id"])["status"] == "completed"
    until(lambda: "megaslide_denoise_steps_total 2" in api.get("/metrics").text, what="metrics")
    worker.stop()  # leaves the registry: its models go with it
    until(lambda: api.get("/readyz").status_code == 503, what="the worker to leave")
    assert api.get("/v1/models").json()["data"] == []


def test_a_worker_counters_reach_the_api_before_its_next_heartbeat(settings, tmp_path):
    slow = settings.model_copy(update={"heartbeat_s": 30.0, "lease_s": 90.0})
    with TestClient(build_app(slow, Fleet(slow, FakeBackend().check_dataset))) as api:
        worker = Running(slow, "w1")
        try:
            until(lambda: api.get("/readyz").status_code == 200, what="the worker's heartbeat")
            before = scrape(api.get("/metrics").text)
            assert before["megaslide_denoise_steps_total"] == 0
            video = api.post("/v1/videos", json={"prompt": "p", **SMALL}).json()
            assert wait_status(api, video["id"])["status"] == "completed"
            done = 'megaslide_jobs_finished_total{kind="video",status="completed"}'
            # Published after the step and the job, not 30 s later with the next heartbeat.
            samples = until(
                lambda: (m := scrape(api.get("/metrics").text)).get(done) and m,
                timeout=5,
                what="the worker's published metrics",
            )
            assert samples["megaslide_denoise_steps_total"] == 2
            assert samples["megaslide_denoise_step_seconds_count"] == 2
        finally:
            worker.stop()


def test_a_request_the_model_refuses_fails_on_the_worker_not_silently(api, settings):
    worker = Running(settings, "w1")
    until(lambda: api.get("/readyz").status_code == 200, what="ready")
    # The fake model's own shape rule (no 3-frame clips) does not travel with its published
    # card: the API accepts, the worker checks again and fails the job, naming the field.
    video = api.post("/v1/videos", json={"prompt": "p", **SMALL, "num_frames": 3}).json()
    failed = wait_status(api, video["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "invalid_request"
    assert "frames (3): this model's autoencoder" in failed["error"]["message"]
    worker.stop()


def test_a_published_card_keeps_its_numbers():
    card = card_from_dict(card_to_dict(FAKE_CARD))
    assert card.name == FAKE_CARD.name and card.limits.to_dict() == FAKE_CARD.limits.to_dict()
    assert card.defaults == FAKE_CARD.defaults
    # A card published before defaults were apart from limits carried them among the limits.
    old = card_to_dict(FAKE_CARD)
    old["limits"] |= {k: v for k, v in old.pop("defaults").items() if k != "shift"}
    assert card_from_dict(old).defaults == FAKE_CARD.defaults
    assert card.limits.check_shape is None  # the model's own rule stays with the model
    preset = card_from_dict({**card_to_dict(FAKE_CARD), "source": "tiny", "name": "tiny"})
    assert preset.limits.check_shape is not None  # a preset this host knows: exact limits


def test_a_silent_worker_drops_out_and_its_job_moves_to_another(api, settings):
    first = Running(settings, "w1")
    until(lambda: api.get("/readyz").status_code == 200, what="ready")
    first.worker.backend.gate.clear()  # hold the first worker inside a step
    video = api.post("/v1/videos", json={"prompt": "p", **SMALL}).json()
    until(lambda: first.store.videos.get(video["id"]).worker_id == "w1", what="the claim")
    first.worker.stop.set()  # its heartbeat stops too: it is silent from now on
    # What a writer killed mid-MP4 leaves (no process holds it), a minute old: it goes as soon
    # as the job moves on, not an hour later.
    left = DataDir(settings.storage_dir).videos / f".{video['id']}.mp4.k1ll3d.tmp"
    left.write_bytes(b"half an mp4")
    os.utime(left, (time.time() - 60, time.time() - 60))
    second = Running(settings, "w2")
    assert wait_status(api, video["id"], timeout=15)["status"] == "completed"
    assert first.store.videos.get(video["id"]).worker_id == "w2"
    assert not left.exists()
    first.worker.backend.gate.set()  # the first one wakes: its late outcome is refused
    first.thread.join(30)
    time.sleep(0.2)
    assert api.get(f"/v1/videos/{video['id']}").json()["status"] == "completed"
    events = api.get(f"/v1/videos/{video['id']}/events")
    assert events.text.count("event: video.completed") == 1
    first.worker.close()
    first.store.close()
    second.stop()


@pytest.mark.slow
def test_a_worker_process_that_keeps_dying_is_restarted_ever_more_slowly(
    settings, monkeypatch, caplog
):
    monkeypatch.setattr(WorkerProcess, "RESTART_DELAY_S", 0.1)
    monkeypatch.setattr(WorkerProcess, "MAX_RESTART_DELAY_S", 0.4)
    fleet = Fleet(settings, lambda root: 0, WorkerProcess(functools.partial(os._exit, 3)))
    with caplog.at_level(logging.WARNING, logger="megaslide.server"):
        asyncio.run(fleet.start(None))
        until(lambda: len(caplog.records) >= 4, timeout=60)
        asyncio.run(fleet.shutdown())
    delays = [r.getMessage() for r in caplog.records][:4]
    assert delays == [
        f"the worker process exited with 3; restarting it in {d} s" for d in (0.1, 0.2, 0.4, 0.4)
    ]


@pytest.mark.slow
def test_a_worker_process_that_stops_by_itself_is_left_down(settings):
    child = WorkerProcess(functools.partial(os._exit, 2), keep_down=(0, 2))
    fleet = Fleet(settings, lambda root: 0, child)
    asyncio.run(fleet.start(None))
    until(lambda: not child.watcher.is_alive(), timeout=60)
    assert child.process.exitcode == 2
    asyncio.run(fleet.shutdown())


class NoAdapters(FakeBackend):
    """A backend that takes no LoRA adapters (a worker of several devices)."""

    takes_adapters = False


def test_a_worker_that_takes_no_adapters_leaves_them_to_the_others(settings):
    """It never registers (or refuses, for all) an uploaded adapter, and passes over a video
    naming one while another live worker serves its model; with none, it takes it to fail."""
    store = JobStore(settings.database_url)
    split = Worker(settings, NoAdapters(), store, "split")
    split.register()
    try:
        folder = split.data.adapters("fake")
        folder.path.mkdir(parents=True)
        folder.file("style").write_bytes(b"not a safetensors file")
        split.models.last_adapter_scan = float("-inf")
        split.models.scan_adapters(set())
        assert folder.error("style") is None and split.cards["fake"].adapters == ()

        def row(*names):
            spec = {"model": "fake", "loras": [{"name": n, "scale": 1.0} for n in names]}
            return store.videos.insert(f"video_{'_'.join(names)}_{time.monotonic_ns()}", spec)

        assert split.models.runnable(row()) and split.models.runnable(row("style"))
        other = Worker(settings, FakeBackend(), store, "other")
        other.register()
        try:
            assert split.models.runnable(row())
            assert not split.models.runnable(row("style"))
        finally:
            other.close()
    finally:
        split.close()
        store.close()


def test_a_job_naming_an_adapter_waits_for_a_worker_that_has_it(settings):
    """Routing by adapter: a worker passes over a queued video naming an adapter uploaded but
    not yet taken up here (and scans at once), or one that only another live worker has; one
    that no worker has it takes, to fail naming the adapter."""
    store = JobStore(settings.database_url)
    here, there = (Worker(settings, FakeBackend(), store, name) for name in ("here", "there"))
    here.register()
    there.cards["fake"] = FAKE_CARD.replace(adapters=({"name": "elsewhere"},))
    there.register()
    try:
        here.cards["fake"] = FAKE_CARD.replace(adapters=({"name": "mine"},))
        folder = here.data.adapters("fake")
        folder.path.mkdir(parents=True)

        def row(*names):
            spec = {"model": "fake", "loras": [{"name": n, "scale": 1.0} for n in names]}
            return store.videos.insert(f"video_{'_'.join(names)}_{time.monotonic_ns()}", spec)

        assert here.models.runnable(row()) and here.models.runnable(row("mine"))
        assert not here.models.runnable(row("mine", "elsewhere"))
        assert here.models.runnable(row("nowhere"))  # taken, to fail saying so
        folder.file("fresh").write_bytes(b"")
        here.models.last_adapter_scan = time.monotonic()
        assert not here.models.runnable(row("fresh"))
        assert here.models.last_adapter_scan == float("-inf")  # the next tick scans
        folder.refuse("fresh", "does not fit")
        assert here.models.runnable(row("fresh"))  # refused here: fails with the refusal
    finally:
        for worker in (here, there):
            worker.close()
        store.close()


@pytest.mark.slow
def test_a_video_that_kills_its_worker_process_is_the_only_one_charged(tmp_path, monkeypatch):
    """A worker process killed (SIGKILL) in a pass two videos share charges neither: each runs
    alone next, the innocent one completes, and the one that kills fails at the crash limit (one
    death here, so a charge for the shared pass would have failed both)."""
    for var in ("MEGASLIDE_API_KEYS", "MEGASLIDE_MODELS", "MEGASLIDE_PRESET"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(WorkerProcess, "RESTART_DELAY_S", 0.05)
    settings = Settings(data_dir=tmp_path / "data", heartbeat_s=0.1, lease_s=2.0, crash_limit=1)
    go = tmp_path / "go"
    child = WorkerProcess(functools.partial(serve_fake_jobs, settings, "child", go))
    with TestClient(build_app(settings, Fleet(settings, lambda root: 0, child))) as api:
        until(lambda: api.get("/v1/models").json()["data"], timeout=30, what="the child's card")
        poison = api.post("/v1/videos", json={"prompt": "kill9", **SMALL}).json()
        innocent = api.post("/v1/videos", json={"prompt": "p", **SMALL}).json()
        go.touch()  # both are queued: the child claims them into one pass
        assert wait_status(api, innocent["id"], timeout=60)["status"] == "completed"
        failed = wait_status(api, poison["id"], timeout=60)
        assert failed["error"]["code"] == "worker_crashed", failed
        assert "died once" in failed["error"]["message"]
    store = JobStore(settings.database_url)
    try:  # they did share the first pass, and its death was charged to neither
        shared = [e.message for e in store.videos.events_after(innocent["id"], 0)]
        assert any("runs alone next" in m for m in shared), shared
        assert store.videos.get(innocent["id"]).crashes == 0
    finally:
        store.close()
