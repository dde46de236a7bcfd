"""The job store, against SQLite and a real PostgreSQL alike (the `database_url` fixture runs each
test on both): schema and migrations, state machines, claims, leases and the worker registry."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from megaslide.server.records import VideoRecord
from megaslide.server.store import ClaimLost, JobStore, database_url, schema_revision
from megaslide.server.tables import metadata

LEASE = 60.0


@pytest.fixture
def store(database_url):
    s = JobStore(database_url)
    yield s
    s.close()


def spec(seed: int, model: str = "m", frames: int = 4) -> dict:
    return {"model": model, "seed": seed, "frames": frames}


def key(row: VideoRecord) -> tuple:
    return (row.spec["model"], row.spec["frames"])


def queue(store: JobStore, n: int, **kw) -> list[str]:
    ids = [f"video_{i}" for i in range(n)]
    for i, video_id in enumerate(ids):
        store.insert_video(video_id, spec(i, **kw))
    return ids


def claim(store, worker="w1", served=("m",), room=8, lease_s=LEASE, running=None):
    return store.claim_videos(worker, list(served), room, key, running, lease_s=lease_s)


def event_types(store, job_id) -> list[str]:
    return [e["type"] for e in store.events_after(job_id, 0, limit=1000)]


# ---------------------------------------------------------------------------------------------
# schema


def schema_differences(engine: sa.Engine) -> list:
    """What differs between the database and tables.py; the one index on an expression (priority
    DESC), which the comparison cannot read back, is checked by name instead."""
    expression_index = "videos_by_status"

    def compared(obj, name, type_, reflected, compare_to):
        return not (type_ == "index" and name == expression_index)

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_object": compared})
        diff = compare_metadata(context, metadata)
        indexes = {i["name"] for i in sa.inspect(conn).get_indexes("videos")}
    assert expression_index in indexes
    return diff


def test_migrations_build_exactly_the_described_schema(store):
    assert schema_differences(store.engine) == []
    assert schema_revision(store.engine) is not None


def test_opening_twice_migrates_once(database_url):
    for _ in range(2):
        s = JobStore(database_url)
        s.insert_video(f"video_{time.monotonic_ns()}", spec(0))
        s.close()
    s = JobStore(database_url)
    assert len(s.list_videos(None, 10, "asc")[0]) == 2
    s.close()


# The schema of data directories from before migrations existed, with a video that was running
# when its server was killed and a finished one.
LEGACY = """
CREATE TABLE videos (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
  created_at INTEGER NOT NULL, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0,
  step INTEGER NOT NULL DEFAULT 0, model TEXT NOT NULL, priority INTEGER NOT NULL DEFAULT 0,
  spec TEXT NOT NULL, cancel_requested INTEGER NOT NULL DEFAULT 0,
  attempts INTEGER NOT NULL DEFAULT 0, started_at INTEGER, completed_at INTEGER,
  expires_at INTEGER, error_code TEXT, error_message TEXT);
CREATE INDEX videos_by_status ON videos (status, priority DESC, seq);
CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
  created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
  bytes INTEGER NOT NULL, path TEXT NOT NULL, clips INTEGER NOT NULL);
CREATE TABLE fine_tunes (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
  created_at INTEGER NOT NULL, status TEXT NOT NULL, model TEXT NOT NULL,
  training_file TEXT NOT NULL, hyperparameters TEXT NOT NULL, seed INTEGER NOT NULL, suffix TEXT,
  output_dir TEXT NOT NULL, fine_tuned_model TEXT, step INTEGER NOT NULL DEFAULT 0,
  total_steps INTEGER, cancel_requested INTEGER NOT NULL DEFAULT 0,
  attempts INTEGER NOT NULL DEFAULT 0, finished_at INTEGER, error_code TEXT, error_message TEXT);
CREATE INDEX fine_tunes_by_status ON fine_tunes (status, seq);
CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL,
  created_at INTEGER NOT NULL, type TEXT NOT NULL, level TEXT NOT NULL DEFAULT 'info',
  message TEXT NOT NULL DEFAULT '', data TEXT);
CREATE INDEX events_by_job ON events (job_id, seq);
CREATE TABLE checkpoints (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
  job_id TEXT NOT NULL, created_at INTEGER NOT NULL, step INTEGER NOT NULL, path TEXT NOT NULL,
  metrics TEXT);
CREATE TABLE models (seq INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE,
  parent TEXT NOT NULL, path TEXT NOT NULL, job_id TEXT NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE idempotency (scope TEXT NOT NULL, key TEXT NOT NULL, request_hash TEXT NOT NULL,
  resource_id TEXT NOT NULL, created_at INTEGER NOT NULL, PRIMARY KEY (scope, key));
INSERT INTO videos (id, created_at, status, model, spec, step, progress, attempts)
  VALUES ('video_old', 1700000000, 'in_progress', 'm', '{"model": "m", "seed": 1, "frames": 4}',
  3, 40, 1);
INSERT INTO videos (id, created_at, status, model, spec, progress)
  VALUES ('video_done', 1700000000, 'completed', 'm', '{"model": "m"}', 100);
INSERT INTO events (job_id, created_at, type, data) VALUES ('video_old', 1700000000,
  'video.in_progress', '{"status": "in_progress"}');
"""


def test_a_data_directory_from_before_migrations_is_upgraded(tmp_path):
    path = tmp_path / "megaslide.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(LEGACY)
    store = JobStore(f"sqlite:///{path}")
    # Only the key columns differ, in how they were declared: an INTEGER PRIMARY KEY is the rowid
    # either way, which SQLite never lets be NULL.
    diff = [d for d in schema_differences(store.engine) if not _rowid_nullability(d)]
    assert diff == []
    assert store.get_video("video_done").status == "completed"
    # Running when its server died, with no lease: the first recovery pass requeues it.
    assert store.recover_expired()["videos_requeued"] == 1
    assert store.get_video("video_old").status == "queued"
    assert event_types(store, "video_old") == ["video.in_progress", "video.queued"]
    [row] = claim(store)
    assert row.id == "video_old" and row.attempts == 2
    store.close()


def _rowid_nullability(diff) -> bool:
    return isinstance(diff, list) and all(d[0] == "modify_nullable" and d[3] == "seq" for d in diff)


def test_urls():
    assert database_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert database_url("sqlite:///x.db").drivername == "sqlite"
    with pytest.raises(ValueError, match="unsupported database"):
        database_url("mysql://u@h/db")
    with pytest.raises(ValueError, match="must be a file"):
        JobStore("sqlite://")


# ---------------------------------------------------------------------------------------------
# videos


def test_video_lifecycle_and_its_events(store):
    [video_id] = queue(store, 1)
    assert store.queue_position(video_id) == 1 and store.queue_depth() == 1
    [row] = claim(store)
    token = row.lease_token
    assert row.status == "in_progress" and store.queue_position(video_id) is None
    assert store.set_video_progress([(video_id, token, 1, 45)], lease_s=LEASE) == set()
    assert store.finish_video(video_id, token, "completed", expires_at=123) == "completed"
    row = store.get_video(video_id)
    assert (row.status, row.progress, row.expires_at) == ("completed", 100, 123)
    assert event_types(store, video_id) == [
        "video.queued",
        "video.in_progress",
        "video.progress",
        "video.completed",
    ]
    assert store.counts_by_state() == {("video", "completed"): 1}
    assert store.delete_video(video_id) and store.events_after(video_id, 0) == []


def test_claims_follow_priority_then_arrival_and_stop_at_an_incompatible_job(store):
    store.insert_video("low", spec(0))
    store.insert_video("high", spec(1), priority=5)
    store.insert_video("other_shape", spec(2, frames=8))
    store.insert_video("after", spec(3))
    assert [store.queue_position(v) for v in ("high", "low", "other_shape", "after")] == [
        1,
        2,
        3,
        4,
    ]
    assert [r.id for r in claim(store)] == ["high", "low"]  # stops at other_shape
    # A batch of the other shape takes it, and stops at the next job of the first.
    assert [r.id for r in claim(store, running=("m", 8))] == ["other_shape"]
    assert [r.id for r in claim(store, room=1)] == ["after"]


def test_claims_take_only_the_models_a_worker_serves(store):
    store.insert_video("for_a", spec(0, model="a"))
    store.insert_video("for_b", spec(1, model="b"))
    assert [r.id for r in claim(store, served=["b"])] == ["for_b"]
    assert store.queue_depth_by_model() == {"a": 1}
    assert claim(store, served=[]) == [] and claim(store, served=["a"], room=0) == []


def test_concurrent_claims_take_each_job_exactly_once(database_url):
    stores = [JobStore(database_url) for _ in range(4)]
    jobs = set(queue(stores[0], 120))
    taken: list[str] = []
    lock = threading.Lock()

    def drain(worker: int) -> None:
        while True:
            rows = claim(stores[worker], worker=f"w{worker}", room=3)
            if not rows:
                return
            with lock:
                taken.extend(r.id for r in rows)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == sorted(jobs)  # every job once: none lost, none claimed twice
    for s in stores:
        s.close()


def test_a_cancel_waits_for_the_step_boundary_and_wins_over_completion(store):
    queued, running = queue(store, 2)
    [row] = claim(store, room=1)
    assert row.id == queued
    assert store.cancel_video(running) == "cancelled"  # still queued: at once
    assert store.cancel_video(queued) == "in_progress"  # flagged for its worker
    assert store.cancel_requested_videos([queued, running]) == {queued}
    assert store.finish_video(queued, row.lease_token, "completed") == "cancelled"
    assert store.get_video(queued).expires_at is None
    assert store.cancel_video("video_none") is None


def test_an_expired_lease_requeues_the_job_and_refuses_the_old_claim(store):
    [video_id] = queue(store, 1)
    [first] = claim(store, worker="dying", lease_s=0.3)
    assert store.recover_expired()["videos_requeued"] == 0  # not yet expired
    time.sleep(0.5)
    assert store.recover_expired() == {"videos_requeued": 1, "fine_tunes_requeued": 0}
    [second] = claim(store, worker="alive")
    assert second.attempts == 2 and second.lease_token != first.lease_token
    # The presumed-dead worker wakes up: every write it tries is refused.
    update = [(video_id, first.lease_token, 2, 90)]
    assert store.set_video_progress(update, lease_s=LEASE) == {video_id}
    assert store.finish_video(video_id, first.lease_token, "completed") is None
    assert store.finish_video(video_id, second.lease_token, "completed") == "completed"
    assert event_types(store, video_id).count("video.completed") == 1


def test_a_cancelled_job_whose_worker_died_ends_cancelled(store):
    [video_id] = queue(store, 1)
    claim(store, lease_s=0.2)
    store.cancel_video(video_id)
    time.sleep(0.4)
    store.recover_expired()
    assert store.get_video(video_id).status == "cancelled"


def test_a_graceful_stop_requeues_only_its_own_claims(store):
    mine, theirs = queue(store, 2)
    [a] = claim(store, worker="a", room=1)
    [b] = claim(store, worker="b", room=1)
    store.requeue_videos([(mine, a.lease_token), (theirs, "not-their-token")], "stopping")
    assert store.get_video(mine).status == "queued"
    assert store.get_video(theirs).status == "in_progress" and b.id == theirs


# ---------------------------------------------------------------------------------------------
# the worker registry


def register(store, name="w1", token="t1", pid=1):
    return store.register_worker(
        name, token, host="h", pid=pid, device="cpu", capacity=4, cards=[{"name": "m"}]
    )


def test_heartbeats_keep_a_worker_live_and_its_leases_fresh(store):
    register(store)
    [video_id] = queue(store, 1)
    [row] = claim(store, worker="w1", lease_s=0.4)
    for _ in range(4):
        time.sleep(0.2)
        beat = dict(leases=[row.lease_token], lease_s=0.4, ready=True, metrics={"x": 1})
        assert store.heartbeat("w1", "t1", **beat)
        assert store.recover_expired()["videos_requeued"] == 0
    [live] = store.live_workers(ttl_s=5)
    assert live.name == "w1" and live.ready and live.models == [{"name": "m"}]
    assert live.metrics == {"x": 1}
    time.sleep(0.5)  # silent: no longer live, and its job goes back
    assert store.live_workers(ttl_s=0.4) == []
    assert store.recover_expired()["videos_requeued"] == 1
    after = store.get_video(video_id)
    assert row.worker_id == "w1" and (after.status, after.worker_id) == ("queued", None)


def test_a_heartbeat_extends_only_the_claims_it_names(store):
    register(store)
    kept, forgotten = queue(store, 2)
    rows = {r.id: r for r in claim(store, worker="w1", lease_s=0.4)}
    for _ in range(3):
        time.sleep(0.2)
        beat = dict(leases=[rows[kept].lease_token], lease_s=0.4, ready=True)
        assert store.heartbeat("w1", "t1", **beat)
    # A job the worker no longer names (it lost track of it) expires and runs again.
    assert store.recover_expired()["videos_requeued"] == 1
    assert store.get_video(forgotten).status == "queued"
    assert store.get_video(kept).status == "in_progress"


def test_old_events_of_finished_jobs_are_pruned(store):
    done, running = queue(store, 2)
    rows = {r.id: r for r in claim(store)}
    store.finish_video(done, rows[done].lease_token, "completed")
    with store._tx() as conn:
        conn.execute(sa.text("UPDATE events SET created_at = created_at - 1000"))
    assert store.prune_events(older_than_s=3600) == 0
    assert store.prune_events(older_than_s=500) == 3  # queued, in progress, completed
    assert store.events_after(done, 0) == [] and len(store.events_after(running, 0)) == 2


def test_a_resumed_finetune_reports_each_step_once(store):
    store.insert_finetune(finetune_row("ftjob-1"))
    first = store.claim_finetune("w1", ["m"], lease_s=LEASE)
    for step in (1, 2, 3):  # step 2 was checkpointed; step 3 is lost with the worker
        metrics = {"step": step, "loss": 1.0}
        assert store.finetune_progress(
            "ftjob-1", first.lease_token, step, 4, metrics, lease_s=LEASE
        )
    store.register_worker("w1", "restarted", host="h", pid=2, device="cpu", capacity=1, cards=[])
    again = store.claim_finetune("w1", ["m"], lease_s=LEASE)
    assert store.rewind_finetune("ftjob-1", again.lease_token, 2)
    for step in (3, 4):
        metrics = {"step": step, "loss": 0.5}
        store.finetune_progress("ftjob-1", again.lease_token, step, 4, metrics, lease_s=LEASE)
    events, _ = store.finetune_events("ftjob-1", None, 100)
    steps = [json.loads(e["data"])["step"] for e in events if e["type"] == "metrics"]
    assert steps == [4, 3, 2, 1]
    assert not store.rewind_finetune("ftjob-1", first.lease_token, 0)


def test_a_restart_under_the_same_name_takes_back_its_jobs_and_retires_the_old_run(store):
    register(store, token="old")
    queue(store, 1)
    claim(store, worker="w1")
    store.insert_finetune(finetune_row("ftjob-1"))
    store.claim_finetune("w1", ["m"], lease_s=LEASE)
    assert register(store, token="new") == {"videos_requeued": 1, "fine_tunes_requeued": 1}
    beat = dict(leases=[], lease_s=LEASE, ready=True)
    assert not store.heartbeat("w1", "old", **beat)  # the old run must stop
    assert store.heartbeat("w1", "new", **beat)
    store.deregister_worker("w1", "new")
    assert store.worker("w1") is None


def test_a_job_that_keeps_killing_its_worker_fails_at_the_crash_limit(database_url):
    """A poison job: each death of its worker (a lease that expired, a restart under the same
    name) counts; it waits behind jobs that never crashed, and at the limit it fails with the
    reason instead of taking down another worker. A graceful stop does not count."""
    store = JobStore(database_url, crash_limit=2)
    try:
        poison, other = queue(store, 2)
        [first] = claim(store, worker="a", room=1, lease_s=0.2)
        assert first.id == poison
        store.requeue_videos([(poison, first.lease_token)], "stopping")  # graceful
        [first] = claim(store, worker="a", room=1, lease_s=0.2)
        assert first.id == poison and store.get_video(poison).crashes == 0
        time.sleep(0.3)
        assert store.recover_expired()["videos_requeued"] == 1  # crash 1: back, behind `other`
        assert store.queue_position(other) == 1 and store.queue_position(poison) == 2
        [second] = claim(store, worker="b", room=1)
        assert second.id == other
        [third] = claim(store, worker="c", room=1)
        assert third.id == poison
        assert register(store, name="c", token="restarted")["videos_requeued"] == 0  # crash 2
        failed = store.get_video(poison)
        assert failed.status == "failed" and failed.error_code == "worker_crashed"
        assert "died 2 times" in failed.error_message, failed.error_message
        assert failed.worker_id is None and event_types(store, poison)[-1] == "video.failed"
        # Fine-tunes alike.
        store.insert_finetune(finetune_row("ftjob-1"))
        for name, token in (("d", "t1"), ("d", "t2")):
            assert store.claim_finetune(name, ["m"], lease_s=LEASE).id == "ftjob-1"
            register(store, name=name, token=token)
        job = store.get_finetune("ftjob-1")
        assert job.status == "failed" and job.error_code == "worker_crashed"
        assert store.claim_finetune("d", ["m"], lease_s=LEASE) is None
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------
# fine-tunes, files, idempotency


def finetune_row(job_id: str, training_file: str = "file-1") -> dict:
    return {
        "id": job_id,
        "model": "m",
        "training_file": training_file,
        "seed": 0,
        "suffix": "s",
        "output_dir": f"fine_tunes/{job_id}",
        "hyperparameters": {"n_epochs": 1},
    }


def test_finetune_lifecycle_registers_its_model_once(store):
    upload = {"id": "file-1", "filename": "d.zip", "purpose": "fine-tune", "bytes": 3}
    store.insert_file({**upload, "path": "files/file-1/data"})
    store.insert_finetune(finetune_row("ftjob-1"))
    assert store.delete_file("file-1") == "in_use"
    job = store.claim_finetune("w1", ["m"], lease_s=LEASE)
    token = job.lease_token
    assert job.attempts == 1 and store.claim_finetune("w2", ["m"], lease_s=LEASE) is None
    assert store.finetune_progress("ftjob-1", token, 1, 2, {"loss": 0.5}, lease_s=LEASE)
    assert store.add_checkpoint("ftckpt-1-1", "ftjob-1", token, 1, "fine_tunes/x", {"step": 1})
    assert store.add_checkpoint("ftckpt-1-1", "ftjob-1", token, 1, "fine_tunes/x", {"step": 1})
    assert not store.finetune_progress("ftjob-1", "stale", 2, 2, None, lease_s=LEASE)
    assert not store.add_event("ftjob-1", "from a stale claim", token="stale")
    model = {"name": "ft:m:s:1", "parent": "m", "path": "models/ftjob-1"}
    assert store.finish_finetune("ftjob-1", token, "succeeded", model=model)
    assert not store.finish_finetune("ftjob-1", token, "succeeded", model=model)
    assert [m.name for m in store.models()] == ["ft:m:s:1"]
    events, _ = store.finetune_events("ftjob-1", None, 100)
    assert [e["type"] for e in events][:2] == ["message", "metrics"]
    assert len(store.checkpoints("ftjob-1", None, 10)[0]) == 1
    assert store.delete_file("file-1") == "deleted" and store.delete_file("file-1") == "missing"


def test_a_fine_tunes_files_are_published_only_under_its_current_claim(store):
    """The fence a worker publishes checkpoints in: open while its claim holds the job, refused
    (nothing published) once another worker took it over."""
    store.insert_finetune(finetune_row("ftjob-1"))
    old = store.claim_finetune("w1", ["m"], lease_s=LEASE)
    with store.fenced_finetune("ftjob-1", old.lease_token):
        pass
    register(store, name="w1", token="restarted")  # its claim is gone: the job is queued again
    new = store.claim_finetune("w2", ["m"], lease_s=LEASE)
    published = []
    with pytest.raises(ClaimLost):
        with store.fenced_finetune("ftjob-1", old.lease_token):
            published.append("old")
    with store.fenced_finetune("ftjob-1", new.lease_token):
        published.append("new")
    assert published == ["new"]


def test_finetune_cancel(store):
    store.insert_finetune(finetune_row("queued"))
    store.insert_finetune(finetune_row("running"))
    running = store.claim_finetune("w1", ["m"], lease_s=LEASE)
    assert running.id == "queued"  # oldest first
    assert store.cancel_finetune("running") == "cancelled"
    assert store.cancel_finetune("queued") == "running"
    assert store.finetune_cancel_requested("queued")
    assert store.finish_finetune("queued", running.lease_token, "cancelled")


def test_an_idempotency_key_is_reserved_before_the_work_and_answers_its_retries(store):
    key = ("k", "/v1/videos:1", "hash-a")
    assert store.reserve_key(*key) is None  # ours: do the work
    pending = store.reserve_key(*key)  # a retry meanwhile: the first request is still at work
    assert pending["resource_id"] is None and pending["request_hash"] == "hash-a"
    store.insert_video("video_a", spec(0), idempotency=key)
    assert store.reserve_key(*key)["resource_id"] == "video_a"
    assert store.reserve_key("other-scope", "/v1/videos:1", "hash-a") is None


def test_a_failed_request_frees_its_key_and_a_stale_one_expires(store):
    assert store.reserve_key("k", "DELETE /v1/videos/v:1", "h") is None
    store.release_key("k", "DELETE /v1/videos/v:1")  # the request failed: a retry starts over
    assert store.reserve_key("k", "DELETE /v1/videos/v:1", "h") is None
    store.record_response("k", "DELETE /v1/videos/v:1", {"deleted": True})
    store.release_key("k", "DELETE /v1/videos/v:1")  # answered keys are never freed
    assert json.loads(store.reserve_key("k", "DELETE /v1/videos/v:1", "h")["response"]) == {
        "deleted": True
    }
    assert store.reserve_key("k", "abandoned", "h") is None
    with store._tx() as conn:
        conn.execute(sa.text("UPDATE idempotency SET created_at = created_at - 3600"))
    assert store.reserve_key("k", "abandoned", "h") is None  # its request never finished
    with store._tx() as conn:
        conn.execute(sa.text("UPDATE idempotency SET created_at = 0"))
    assert store.reserve_key("k", "DELETE /v1/videos/v:1", "h") is None  # past its lifetime
    assert store.forget_idempotency_keys() == 1


def test_lists_show_an_owner_its_own_rows_and_the_unowned_ones(store):
    store.insert_video("video_a", spec(0), owner="alice")
    store.insert_video("video_b", spec(1), owner="bob")
    store.insert_video("video_old", spec(2))  # made before keys were owners
    ids = lambda page: [r.id for r in page[0]]  # noqa: E731
    assert ids(store.list_videos(None, 10, "asc", owner="alice")) == ["video_a", "video_old"]
    assert ids(store.list_videos(None, 10, "asc")) == ["video_a", "video_b", "video_old"]
    store.insert_finetune({**finetune_row("ftjob-1"), "owner": "bob"})
    assert ids(store.list_finetunes(None, 10, owner="alice")) == []
    job = store.claim_finetune("w1", ["m"], lease_s=LEASE)
    model = {"name": "ft:m:s:1", "parent": "m", "path": "models/ftjob-1"}
    store.finish_finetune("ftjob-1", job.lease_token, "succeeded", model=model)
    assert store.models()[0].owner == "bob"  # the model is its job owner's


def test_an_upload_is_validated_after_it_returns_by_one_host_at_a_time(store):
    upload = {"filename": "d.zip", "purpose": "fine-tune", "bytes": 3, "owner": "alice"}
    store.insert_file({**upload, "id": "file-1", "path": "files/file-1/upload"})
    store.insert_file({**upload, "id": "file-2", "path": "files/file-2/upload"})
    assert store.get_file("file-1").status == "uploaded"
    first = store.claim_file_validation(lease_s=0.3)
    second = store.claim_file_validation(lease_s=0.3)
    assert (first.id, second.id) == ("file-1", "file-2")
    assert store.claim_file_validation(lease_s=0.3) is None  # both held
    assert store.finish_file_validation("file-1", clips=7)
    time.sleep(0.5)  # the host validating file-2 died: another takes it
    assert store.claim_file_validation(lease_s=60).id == "file-2"
    assert store.finish_file_validation("file-2", error="metadata.jsonl line 3: no file")
    assert not store.finish_file_validation("file-2", clips=1)  # validated once
    one, two = store.get_file("file-1"), store.get_file("file-2")
    assert (one.status, one.clips) == ("processed", 7)
    assert (two.status, two.status_details) == ("error", "metadata.jsonl line 3: no file")


def test_pages_in_both_orders(store):
    ids = queue(store, 5)
    first, more = store.list_videos(None, 2, "asc")
    assert [r.id for r in first] == ids[:2] and more
    rest, more = store.list_videos(first[-1].id, 10, "asc")
    assert [r.id for r in rest] == ids[2:] and not more
    newest, _ = store.list_videos(None, 2, "desc")
    assert [r.id for r in newest] == ids[::-1][:2]
