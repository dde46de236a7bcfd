"""The job store, against SQLite and a real PostgreSQL alike (the `database_url` fixture runs each
test on both): schema and migrations, state machines, claims, leases and the worker registry."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from megaslide.server.records import VideoRecord
from megaslide.server.store import (
    ClaimLost,
    JobStore,
    Reservation,
    database_url,
    schema_revision,
)
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
        store.videos.insert(video_id, spec(i, **kw))
    return ids


def claim(store, worker="w1", served=("m",), room=8, lease_s=LEASE, running=None):
    return store.videos.claim(worker, list(served), room, key, running, lease_s=lease_s)


def event_types(store, job_id) -> list[str]:
    return [e.type for e in store.videos.events_after(job_id, 0, limit=1000)]


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
    assert schema_differences(store.db.engine) == []
    assert schema_revision(store.db.engine) is not None


def test_opening_twice_migrates_once(database_url):
    for _ in range(2):
        s = JobStore(database_url)
        s.videos.insert(f"video_{time.monotonic_ns()}", spec(0))
        s.close()
    s = JobStore(database_url)
    assert len(s.videos.page(None, 10, "asc")[0]) == 2
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
    diff = [d for d in schema_differences(store.db.engine) if not _rowid_nullability(d)]
    assert diff == []
    assert store.videos.get("video_done").status == "completed"
    # Running when its server died, with no lease: the first recovery pass requeues it.
    assert store.workers.recover_expired()["videos_requeued"] == 1
    assert store.videos.get("video_old").status == "queued"
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
    assert store.videos.queue_position(video_id) == 1 and store.jobs.queue_depth() == 1
    [row] = claim(store)
    token = row.lease_token
    assert row.status == "in_progress" and store.videos.queue_position(video_id) is None
    assert store.videos.set_progress([(video_id, token, 1, 45)], lease_s=LEASE) == set()
    assert store.videos.finish(video_id, token, "completed", expires_at=123) == "completed"
    row = store.videos.get(video_id)
    assert (row.status, row.progress, row.expires_at) == ("completed", 100, 123)
    assert event_types(store, video_id) == [
        "video.queued",
        "video.in_progress",
        "video.progress",
        "video.completed",
    ]
    assert store.jobs.counts_by_state() == {("video", "completed"): 1}
    assert store.videos.delete(video_id) and store.videos.events_after(video_id, 0) == []


def test_claims_follow_priority_then_arrival_and_stop_at_an_incompatible_job(store):
    store.videos.insert("low", spec(0))
    store.videos.insert("high", spec(1), priority=5)
    store.videos.insert("other_shape", spec(2, frames=8))
    store.videos.insert("after", spec(3))
    assert [store.videos.queue_position(v) for v in ("high", "low", "other_shape", "after")] == [
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
    store.videos.insert("for_a", spec(0, model="a"))
    store.videos.insert("for_b", spec(1, model="b"))
    assert [r.id for r in claim(store, served=["b"])] == ["for_b"]
    assert store.jobs.queue_depth_by_model() == {"a": 1}
    assert claim(store, served=[]) == [] and claim(store, served=["a"], room=0) == []


def test_the_queue_depth_counts_fine_tuned_models_under_their_base(store):
    from megaslide.server.store.models import register

    with store.db.tx() as conn:  # a fine-tune of "a", and a fine-tune of that one
        for name, parent in (("ft:a:x:job1", "a"), ("ft:ft:a:x:job1:y:job2", "ft:a:x:job1")):
            register(conn, {"name": name, "parent": parent, "path": "p"}, job_id="j", owner="o")
    for i, model in enumerate(("a", "ft:a:x:job1", "ft:ft:a:x:job1:y:job2", "b")):
        store.videos.insert(f"v{i}", spec(i, model=model))
    assert store.jobs.queue_depth_by_model() == {"a": 3, "b": 1}


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
    assert store.videos.cancel(running) == "cancelled"  # still queued: at once
    assert store.videos.cancel(queued) == "in_progress"  # flagged for its worker
    assert store.videos.cancel_requested([queued, running]) == {queued}
    assert store.videos.finish(queued, row.lease_token, "completed") == "cancelled"
    assert store.videos.get(queued).expires_at is None
    assert store.videos.cancel("video_none") is None


def test_an_expired_lease_requeues_the_job_and_refuses_the_old_claim(store):
    [video_id] = queue(store, 1)
    [first] = claim(store, worker="dying", lease_s=0.3)
    assert store.workers.recover_expired()["videos_requeued"] == 0  # not yet expired
    time.sleep(0.5)
    assert store.workers.recover_expired() == {"videos_requeued": 1, "fine_tunes_requeued": 0}
    [second] = claim(store, worker="alive")
    assert second.attempts == 2 and second.lease_token != first.lease_token
    # The presumed-dead worker wakes up: every write it tries is refused.
    update = [(video_id, first.lease_token, 2, 90)]
    assert store.videos.set_progress(update, lease_s=LEASE) == {video_id}
    assert store.videos.finish(video_id, first.lease_token, "completed") is None
    assert store.videos.finish(video_id, second.lease_token, "completed") == "completed"
    assert event_types(store, video_id).count("video.completed") == 1


def test_a_cancelled_job_whose_worker_died_ends_cancelled(store):
    [video_id] = queue(store, 1)
    claim(store, lease_s=0.2)
    store.videos.cancel(video_id)
    time.sleep(0.4)
    store.workers.recover_expired()
    assert store.videos.get(video_id).status == "cancelled"


def test_a_graceful_stop_requeues_only_its_own_claims(store):
    mine, theirs = queue(store, 2)
    [a] = claim(store, worker="a", room=1)
    [b] = claim(store, worker="b", room=1)
    store.videos.requeue([(mine, a.lease_token), (theirs, "not-their-token")], "stopping")
    assert store.videos.get(mine).status == "queued"
    assert store.videos.get(theirs).status == "in_progress" and b.id == theirs


# ---------------------------------------------------------------------------------------------
# the worker registry


def register(store, name="w1", token="t1", pid=1):
    return store.workers.register(
        name, token, host="h", pid=pid, device="cpu", capacity=4, cards=[{"name": "m"}]
    )


def test_heartbeats_keep_a_worker_live_and_its_leases_fresh(store):
    register(store)
    [video_id] = queue(store, 1)
    [row] = claim(store, worker="w1", lease_s=0.4)
    for _ in range(4):
        time.sleep(0.2)
        beat = dict(leases=[row.lease_token], lease_s=0.4, ready=True, metrics={"x": 1})
        assert store.workers.heartbeat("w1", "t1", **beat)
        assert store.workers.recover_expired()["videos_requeued"] == 0
    [live] = store.workers.live(ttl_s=5)
    assert live.name == "w1" and live.ready and live.models == [{"name": "m"}]
    assert live.metrics == {"x": 1}
    time.sleep(0.5)  # silent: no longer live, and its job goes back
    assert store.workers.live(ttl_s=0.4) == []
    assert store.workers.recover_expired()["videos_requeued"] == 1
    after = store.videos.get(video_id)
    assert row.worker_id == "w1" and (after.status, after.worker_id) == ("queued", None)


def test_a_heartbeat_extends_only_the_claims_it_names(store):
    register(store)
    kept, forgotten = queue(store, 2)
    rows = {r.id: r for r in claim(store, worker="w1", lease_s=0.4)}
    for _ in range(3):
        time.sleep(0.2)
        beat = dict(leases=[rows[kept].lease_token], lease_s=0.4, ready=True)
        assert store.workers.heartbeat("w1", "t1", **beat)
    # A job the worker no longer names (it lost track of it) expires and runs again.
    assert store.workers.recover_expired()["videos_requeued"] == 1
    assert store.videos.get(forgotten).status == "queued"
    assert store.videos.get(kept).status == "in_progress"


def test_old_events_of_finished_jobs_are_pruned(store):
    done, running = queue(store, 2)
    rows = {r.id: r for r in claim(store)}
    store.videos.finish(done, rows[done].lease_token, "completed")
    with store.db.tx() as conn:
        conn.execute(sa.text("UPDATE events SET created_at = created_at - 1000"))
    assert store.jobs.prune_events(older_than_s=3600) == 0
    assert store.jobs.prune_events(older_than_s=500) == 3  # queued, in progress, completed
    assert (
        store.videos.events_after(done, 0) == [] and len(store.videos.events_after(running, 0)) == 2
    )


def test_a_resumed_finetune_reports_each_step_once(store):
    store.fine_tunes.insert(finetune_row("ftjob-1"))
    first = store.fine_tunes.claim("w1", ["m"], lease_s=LEASE)
    for step in (1, 2, 3):  # step 2 was checkpointed; step 3 is lost with the worker
        metrics = {"step": step, "loss": 1.0}
        assert store.fine_tunes.set_progress(
            "ftjob-1", first.lease_token, step, 4, metrics, lease_s=LEASE
        )
    store.workers.register("w1", "restarted", host="h", pid=2, device="cpu", capacity=1, cards=[])
    again = store.fine_tunes.claim("w1", ["m"], lease_s=LEASE)
    assert store.fine_tunes.rewind("ftjob-1", again.lease_token, 2)
    for step in (3, 4):
        metrics = {"step": step, "loss": 0.5}
        store.fine_tunes.set_progress("ftjob-1", again.lease_token, step, 4, metrics, lease_s=LEASE)
    events, _ = store.fine_tunes.events("ftjob-1", None, 100)
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert steps == [4, 3, 2, 1]
    assert not store.fine_tunes.rewind("ftjob-1", first.lease_token, 0)


def test_a_restart_under_the_same_name_takes_back_its_jobs_and_retires_the_old_run(store):
    register(store, token="old")
    queue(store, 1)
    claim(store, worker="w1")
    store.fine_tunes.insert(finetune_row("ftjob-1"))
    store.fine_tunes.claim("w1", ["m"], lease_s=LEASE)
    assert register(store, token="new") == {"videos_requeued": 1, "fine_tunes_requeued": 1}
    beat = dict(leases=[], lease_s=LEASE, ready=True)
    assert not store.workers.heartbeat("w1", "old", **beat)  # the old run must stop
    assert store.workers.heartbeat("w1", "new", **beat)
    store.workers.deregister("w1", "new")
    assert store.workers.get("w1") is None


def test_a_job_that_keeps_killing_its_worker_fails_at_the_crash_limit(database_url):
    """A poison job: each death of its worker (a lease that expired, a restart under the same
    name) counts; it waits behind jobs that never crashed, and at the limit it fails with the
    reason instead of taking down another worker. A graceful stop does not count."""
    store = JobStore(database_url, crash_limit=2)
    try:
        poison, other = queue(store, 2)
        [first] = claim(store, worker="a", room=1, lease_s=0.2)
        assert first.id == poison
        store.videos.requeue([(poison, first.lease_token)], "stopping")  # graceful
        [first] = claim(store, worker="a", room=1, lease_s=0.2)
        assert first.id == poison and store.videos.get(poison).crashes == 0
        time.sleep(0.3)
        assert (
            store.workers.recover_expired()["videos_requeued"] == 1
        )  # crash 1: back, behind `other`
        assert store.videos.queue_position(other) == 1 and store.videos.queue_position(poison) == 2
        [second] = claim(store, worker="b", room=1)
        assert second.id == other
        [third] = claim(store, worker="c", room=1)
        assert third.id == poison
        assert register(store, name="c", token="restarted")["videos_requeued"] == 0  # crash 2
        failed = store.videos.get(poison)
        assert failed.status == "failed" and failed.error_code == "worker_crashed"
        assert "died 2 times" in failed.error_message, failed.error_message
        assert failed.worker_id is None and event_types(store, poison)[-1] == "video.failed"
        # Fine-tunes alike.
        store.fine_tunes.insert(finetune_row("ftjob-1"))
        for name, token in (("d", "t1"), ("d", "t2")):
            assert store.fine_tunes.claim(name, ["m"], lease_s=LEASE).id == "ftjob-1"
            register(store, name=name, token=token)
        job = store.fine_tunes.get("ftjob-1")
        assert job.status == "failed" and job.error_code == "worker_crashed"
        assert store.fine_tunes.claim("d", ["m"], lease_s=LEASE) is None
    finally:
        store.close()


def test_a_death_in_a_shared_batch_is_charged_to_the_video_that_causes_it(database_url):
    """A worker that dies running a batch does not charge its videos: they become suspect and
    each runs alone, where a death is the video's own. The innocent one completes; the poison
    one fails at the limit, having shared no pass since its first death."""
    store = JobStore(database_url, crash_limit=2)
    try:
        poison, innocent, later = queue(store, 3)
        assert [v.id for v in claim(store, worker="a", room=2)] == [poison, innocent]
        register(store, name="a", token="restarted")  # it died running both: neither counted
        for video_id in (poison, innocent):
            v = store.videos.get(video_id)
            assert (v.status, v.crashes) == ("queued", 0) and v.suspect
        assert "runs alone" in store.videos.events_after(poison, 0)[-1].message
        assert not store.videos.get(later).suspect
        # A suspect is claimed alone, nothing joins it, and it joins no other worker's batch.
        assert [v.id for v in claim(store, worker="a")] == [poison]
        assert claim(store, worker="a") == []
        assert [v.id for v in claim(store, worker="b")] == [innocent]
        assert claim(store, worker="b") == []
        register(store, name="a", token="again")  # it died running the poison alone: counted
        v = store.videos.get(poison)
        assert (v.status, v.crashes) == ("queued", 1)
        token = store.videos.get(innocent).lease_token
        assert store.videos.finish(innocent, token, "completed") == "completed"
        [third] = claim(store, worker="c")  # `later` waits behind it only while it runs
        assert third.id == later
        assert claim(store, worker="c") == []  # the suspect does not join c's batch
        assert [v.id for v in claim(store, worker="a")] == [poison]
        register(store, name="a", token="once more")
        failed = store.videos.get(poison)
        assert failed.status == "failed" and failed.error_code == "worker_crashed"
        assert "died 2 times" in failed.error_message
        assert store.videos.get(innocent).status == "completed"
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
    store.files.insert({**upload, "path": "files/file-1/data"})
    store.fine_tunes.insert(finetune_row("ftjob-1"))
    assert store.files.delete("file-1") == "in_use"
    job = store.fine_tunes.claim("w1", ["m"], lease_s=LEASE)
    token = job.lease_token
    assert job.attempts == 1 and store.fine_tunes.claim("w2", ["m"], lease_s=LEASE) is None
    assert store.fine_tunes.set_progress("ftjob-1", token, 1, 2, {"loss": 0.5}, lease_s=LEASE)
    assert store.fine_tunes.add_checkpoint(
        "ftckpt-1-1", "ftjob-1", token, 1, "fine_tunes/x", {"step": 1}
    )
    assert store.fine_tunes.add_checkpoint(
        "ftckpt-1-1", "ftjob-1", token, 1, "fine_tunes/x", {"step": 1}
    )
    assert not store.fine_tunes.set_progress("ftjob-1", "stale", 2, 2, None, lease_s=LEASE)
    assert not store.fine_tunes.add_event("ftjob-1", "from a stale claim", token="stale")
    model = {"name": "ft:m:s:1", "parent": "m", "path": "models/ftjob-1"}
    assert store.fine_tunes.finish("ftjob-1", token, "succeeded", model=model)
    assert not store.fine_tunes.finish("ftjob-1", token, "succeeded", model=model)
    assert [m.name for m in store.models.list()] == ["ft:m:s:1"]
    events, _ = store.fine_tunes.events("ftjob-1", None, 100)
    assert [e.type for e in events][:2] == ["message", "metrics"]
    assert len(store.fine_tunes.checkpoints("ftjob-1", None, 10)[0]) == 1
    assert store.files.delete("file-1") == "deleted" and store.files.delete("file-1") == "missing"


def test_a_fine_tunes_files_are_published_only_under_its_current_claim(store):
    """The fence a worker publishes checkpoints in: open while its claim holds the job, refused
    (nothing published) once another worker took it over."""
    store.fine_tunes.insert(finetune_row("ftjob-1"))
    old = store.fine_tunes.claim("w1", ["m"], lease_s=LEASE)
    with store.fine_tunes.fenced("ftjob-1", old.lease_token):
        pass
    register(store, name="w1", token="restarted")  # its claim is gone: the job is queued again
    new = store.fine_tunes.claim("w2", ["m"], lease_s=LEASE)
    published = []
    with pytest.raises(ClaimLost):
        with store.fine_tunes.fenced("ftjob-1", old.lease_token):
            published.append("old")
    with store.fine_tunes.fenced("ftjob-1", new.lease_token):
        published.append("new")
    assert published == ["new"]


def test_finetune_cancel(store):
    store.fine_tunes.insert(finetune_row("queued"))
    store.fine_tunes.insert(finetune_row("running"))
    running = store.fine_tunes.claim("w1", ["m"], lease_s=LEASE)
    assert running.id == "queued"  # oldest first
    assert store.fine_tunes.cancel("running") == "cancelled"
    assert store.fine_tunes.cancel("queued") == "running"
    assert store.fine_tunes.cancel_requested("queued")
    assert store.fine_tunes.finish("queued", running.lease_token, "cancelled")


def test_an_idempotency_key_is_reserved_before_the_work_and_answers_its_retries(store):
    key = Reservation("k", "/v1/videos:1", "hash-a")
    assert store.keys.reserve(key) is None  # ours: do the work
    pending = store.keys.reserve(key)  # a retry meanwhile: the first request is still at work
    assert not pending.settled and pending.resource_id is None
    assert pending.request_hash == "hash-a"
    store.videos.insert("video_a", spec(0), idempotency=key)
    assert store.keys.reserve(key).resource_id == "video_a"
    assert store.keys.reserve(Reservation("other-scope", "/v1/videos:1", "hash-a")) is None


def test_a_failed_request_frees_its_key_and_a_stale_one_expires(store):
    delete = Reservation("k", "DELETE /v1/videos/v:1", "h")
    assert store.keys.reserve(delete) is None
    store.keys.release(delete)  # the request failed: a retry starts over
    assert store.keys.reserve(delete) is None
    store.keys.record_response(delete, {"deleted": True})
    store.keys.release(delete)  # answered keys are never freed
    answered = store.keys.reserve(delete)
    assert answered.settled and answered.response == {"deleted": True}
    abandoned = Reservation("k", "abandoned", "h")
    assert store.keys.reserve(abandoned) is None
    with store.db.tx() as conn:
        conn.execute(sa.text("UPDATE idempotency SET created_at = created_at - 3600"))
    assert store.keys.reserve(abandoned) is None  # its request never finished
    with store.db.tx() as conn:
        conn.execute(sa.text("UPDATE idempotency SET created_at = 0"))
    assert store.keys.reserve(delete) is None  # past its lifetime
    assert store.keys.forget_expired() == 1


def test_lists_show_an_owner_its_own_rows_and_the_unowned_ones(store):
    store.videos.insert("video_a", spec(0), owner="alice")
    store.videos.insert("video_b", spec(1), owner="bob")
    store.videos.insert("video_old", spec(2))  # made before keys were owners
    ids = lambda page: [r.id for r in page[0]]  # noqa: E731
    assert ids(store.videos.page(None, 10, "asc", owner="alice")) == ["video_a", "video_old"]
    assert ids(store.videos.page(None, 10, "asc")) == ["video_a", "video_b", "video_old"]
    store.fine_tunes.insert({**finetune_row("ftjob-1"), "owner": "bob"})
    assert ids(store.fine_tunes.page(None, 10, owner="alice")) == []
    job = store.fine_tunes.claim("w1", ["m"], lease_s=LEASE)
    model = {"name": "ft:m:s:1", "parent": "m", "path": "models/ftjob-1"}
    store.fine_tunes.finish("ftjob-1", job.lease_token, "succeeded", model=model)
    assert store.models.list()[0].owner == "bob"  # the model is its job owner's


def test_an_upload_is_validated_after_it_returns_by_one_host_at_a_time(store):
    upload = {"filename": "d.zip", "purpose": "fine-tune", "bytes": 3, "owner": "alice"}
    store.files.insert({**upload, "id": "file-1", "path": "files/file-1/upload"})
    store.files.insert({**upload, "id": "file-2", "path": "files/file-2/upload"})
    assert store.files.get("file-1").status == "uploaded"
    first = store.files.claim_validation(lease_s=0.3)
    second = store.files.claim_validation(lease_s=0.3)
    assert (first.id, second.id) == ("file-1", "file-2")
    assert store.files.claim_validation(lease_s=0.3) is None  # both held
    assert store.files.finish_validation("file-1", clips=7)
    time.sleep(0.5)  # the host validating file-2 died: another takes it
    assert store.files.claim_validation(lease_s=60).id == "file-2"
    assert store.files.finish_validation("file-2", error="metadata.jsonl line 3: no file")
    assert not store.files.finish_validation("file-2", clips=1)  # validated once
    one, two = store.files.get("file-1"), store.files.get("file-2")
    assert (one.status, one.clips) == ("processed", 7)
    assert (two.status, two.status_details) == ("error", "metadata.jsonl line 3: no file")


def test_pages_in_both_orders(store):
    ids = queue(store, 5)
    first, more = store.videos.page(None, 2, "asc")
    assert [r.id for r in first] == ids[:2] and more
    rest, more = store.videos.page(first[-1].id, 10, "asc")
    assert [r.id for r in rest] == ids[2:] and not more
    newest, _ = store.videos.page(None, 2, "desc")
    assert [r.id for r in newest] == ids[::-1][:2]
