"""The durable job store: jobs, files, events, idempotency keys and the worker registry, in SQLite
(the embedded default: a file in the data directory) or PostgreSQL (many hosts), through one
SQLAlchemy Core description of the tables (tables.py) and Alembic migrations.

Every state change is one transaction. SQLite commits with `synchronous=FULL` in WAL mode and takes
its write lock at BEGIN (IMMEDIATE), so writers queue instead of deadlocking; PostgreSQL locks the
rows a transition reads (`FOR UPDATE`), and workers claim queued jobs with `FOR UPDATE SKIP
LOCKED`, so two workers never take the same job and never wait on each other's claims.

State machines (a transition is a conditional UPDATE, so the API and the workers cannot both win):

    video:     queued -> in_progress -> completed | failed | cancelled;  queued -> cancelled
    fine-tune: queued -> running -> succeeded | failed | cancelled;      queued -> cancelled

Leases. A worker that claims a job writes its name, a fresh `lease_token` and an expiry into the
row; every write it makes afterwards (progress, events, the outcome) names that token and is
refused once the token changed. Its heartbeat (for the claims it still works on) and every
denoising step extend the expiry. A worker that dies stops extending it: once it passes, `recover_expired` (any worker runs it) puts the job
back in the queue with a new claim to come, so a video re-runs and a fine-tune resumes from its
last checkpoint, and a late write from the presumed-dead worker finds a token that is no longer
there. Each job thus completes exactly once. Lease times come from the database's clock, so hosts
with skewed clocks agree on them.

Events of one job keep their order across hosts: every transaction that appends one first writes
(and so locks) the job's row, so two writers to one job commit one after the other and its event
numbers grow in commit order, which is what a reader resuming "after event N" relies on.

Async routes reach the store through `AsyncStore`, which runs each call it lists in a worker
thread: a slow disk or a busy lock never stalls the event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator
from pathlib import Path
from typing import Concatenate, Generic, ParamSpec, TypeVar

import anyio
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.dialects import postgresql, sqlite

from .records import FileRecord, FineTuneRecord, ModelRecord, VideoRecord, WorkerRecord
from .settings import DEFAULT_CRASH_LIMIT
from .tables import checkpoints, events, files, fine_tunes, idempotency, models, videos, workers

VIDEO_ACTIVE = ("queued", "in_progress")
CLAIM_LOOKAHEAD = 32  # queued videos a worker looks past for ones it can run
# The status poll's read, built once: building a select costs more than running it on SQLite.
GET_VIDEO = sa.select(videos).where(videos.c.id == sa.bindparam("video_id"))
VIDEO_TERMINAL = ("completed", "failed", "cancelled")
FINETUNE_ACTIVE = ("queued", "running")
IDEMPOTENCY_TTL_S = 24 * 3600
ABANDONED_KEY_S = 600  # a reserved key whose request did not finish in this long was abandoned
MIGRATIONS = Path(__file__).parent / "migrations"
BASELINE = "0001"  # the schema data directories had before migrations existed
MIGRATION_LOCK = 0x6D6567615F6462  # PostgreSQL advisory lock: one migrating process at a time


P = ParamSpec("P")
R = TypeVar("R")


def now() -> int:
    return int(time.time())


def new_token() -> str:
    return secrets.token_hex(8)


class ClaimLost(RuntimeError):
    """A job's claim (lease token) is no longer the caller's: another worker holds it now."""


class WorkerNameInUse(RuntimeError):
    """Another live worker registered under this name."""


# What a store call raises when the database cannot be reached or written (a full disk, a lock
# held too long, a dropped connection): conditions that pass, unlike a bug in a query.
UNAVAILABLE = (sa.exc.OperationalError, sa.exc.InterfaceError)


def is_disk_full(exc: BaseException) -> bool:
    """Whether a store error (or a file write) failed for want of space."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    orig = getattr(exc, "orig", None)
    if orig is not None and getattr(orig, "sqlstate", None) == "53100":  # PostgreSQL disk_full
        return True
    return "database or disk is full" in str(orig or exc)


# ---------------------------------------------------------------------------------------------
# Opening and migrating


def database_url(url: str) -> sa.URL:
    """`sqlite:///path` or `postgresql://...` (psycopg 3 is the driver PostgreSQL gets)."""
    parsed = sa.make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ValueError(f"unsupported database {url!r}: use sqlite:///PATH or postgresql://...")
    return parsed


def open_engine(url: str) -> sa.Engine:
    """An engine for the store's database, with SQLite set up for durability and concurrency."""
    parsed = database_url(url)
    if parsed.get_backend_name() == "postgresql":
        return sa.create_engine(parsed, pool_pre_ping=True, pool_size=8, max_overflow=32)
    if not parsed.database or parsed.database == ":memory:":
        raise ValueError("the SQLite store must be a file: sqlite:///PATH")
    Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(
        parsed, connect_args={"check_same_thread": False}, pool_size=8, max_overflow=32
    )

    @sa.event.listens_for(engine, "connect")
    def _configure(dbapi_conn, _record):
        # Transactions are ours (the "begin" hook below), not the driver's implicit ones.
        dbapi_conn.isolation_level = None
        for pragma in (
            "journal_mode=WAL",  # readers never block the writer, nor it them
            # FULL: a COMMIT returns only once the WAL is on disk, so an acknowledged job
            # survives a power cut as well as a kill -9.
            "synchronous=FULL",
            "busy_timeout=30000",
        ):
            dbapi_conn.execute(f"PRAGMA {pragma}")

    @sa.event.listens_for(engine, "begin")
    def _begin(conn):
        # IMMEDIATE takes the write lock at once: a read-then-write transaction that had to
        # upgrade its lock later could deadlock against another one doing the same.
        read_only = conn.get_execution_options().get("read_only", False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _alembic(connection: sa.Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def migrate(engine: sa.Engine) -> None:
    """Bring the database to the newest schema: create it, or upgrade what an older server left
    (a data directory from before migrations is stamped at the baseline first)."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Several hosts starting at once: the first migrates, the others wait and find it done.
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(MIGRATION_LOCK)))
        current = MigrationContext.configure(conn).get_current_revision()
        config = _alembic(conn)
        if current is None and sa.inspect(conn).has_table("videos"):
            command.stamp(config, BASELINE)
        command.upgrade(config, "head")


def schema_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


# ---------------------------------------------------------------------------------------------
# The store


class JobStore:
    """Jobs, files, events, checkpoints, fine-tuned models, idempotency keys and workers."""

    def __init__(self, url: str, *, crash_limit: int = DEFAULT_CRASH_LIMIT):
        if crash_limit < 1:
            raise ValueError(f"crash_limit must be at least 1, got {crash_limit}")
        self.url = url
        self.crash_limit = crash_limit
        self.engine = open_engine(url)
        self._reader = self.engine.execution_options(read_only=True)
        self.dialect = self.engine.dialect.name
        migrate(self.engine)
        self._insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert

    def close(self) -> None:
        self.engine.dispose()

    # --- plumbing ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sa.Connection]:
        with self.engine.begin() as conn:
            yield conn

    def _one(self, stmt, params: dict | None = None) -> dict | None:
        with self._reader.connect() as conn:
            row = conn.execute(stmt, params).mappings().first()
        return dict(row) if row is not None else None

    def _all(self, stmt) -> list[dict]:
        with self._reader.connect() as conn:
            return [dict(r) for r in conn.execute(stmt).mappings()]

    def db_now(self) -> sa.ColumnElement:
        """The database's clock in seconds since the epoch: the one clock every host shares."""
        if self.dialect == "postgresql":
            return sa.func.extract("epoch", sa.func.clock_timestamp())
        return (sa.func.julianday("now") - 2440587.5) * 86400.0

    def _locked(self, conn: sa.Connection, table: sa.Table, key) -> dict | None:
        """A row read for a transition: locked until the transaction ends (SQLite locks the
        whole database at BEGIN IMMEDIATE already)."""
        column = table.c.name if table is workers else table.c.id
        stmt = sa.select(table).where(column == key).with_for_update()
        row = conn.execute(stmt).mappings().first()
        return dict(row) if row is not None else None

    @staticmethod
    def _event(
        conn: sa.Connection,
        job_id: str,
        type_: str,
        message: str = "",
        data: dict | None = None,
        level: str = "info",
    ) -> None:
        """Append an event; the caller has written or locked the job's row in this transaction."""
        conn.execute(
            events.insert().values(
                job_id=job_id,
                created_at=now(),
                type=type_,
                level=level,
                message=message,
                data=json.dumps(data) if data is not None else None,
            )
        )

    def _insert_ignore(self, conn: sa.Connection, table: sa.Table, **values) -> None:
        conn.execute(self._insert(table).values(**values).on_conflict_do_nothing())

    # --- workers -----------------------------------------------------------------------------

    def worker(self, name: str) -> WorkerRecord | None:
        """A worker's registration, with `age_s`: seconds since its last heartbeat."""
        age = (self.db_now() - workers.c.heartbeat_at).label("age_s")
        return _record(
            WorkerRecord, self._one(sa.select(workers, age).where(workers.c.name == name))
        )

    def register_worker(
        self,
        name: str,
        token: str,
        *,
        host: str,
        pid: int,
        device: str,
        capacity: int,
        cards: list[dict],
    ) -> dict[str, int]:
        """Register (or re-register) the worker `name` as incarnation `token`.

        Jobs still held under this name belong to a previous incarnation of the same worker,
        which is gone (the caller checked, see `Worker.start`): they return to the queue now
        rather than when their leases expire. Returns how many did.
        """
        with self._tx() as conn:
            row = dict(
                token=token,
                host=host,
                pid=pid,
                device=device,
                capacity=capacity,
                models=json.dumps(cards),
                started_at=self.db_now(),
                heartbeat_at=self.db_now(),
                ready=0,
                dead=None,
                metrics=None,
            )
            stmt = self._insert(workers).values(name=name, **row)
            conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_=row))
            reason = f"requeued: worker {name} restarted while it ran"
            held_v, held_f = videos.c.worker_id == name, fine_tunes.c.worker_id == name
            videos_back = self._requeue_videos(conn, held_v, reason, crashed=True)
            tunes_back = self._requeue_finetunes(conn, held_f, reason, crashed=True)
        return {"videos_requeued": videos_back, "fine_tunes_requeued": tunes_back}

    def publish_cards(self, name: str, token: str, cards: list[dict]) -> bool:
        """Replace the model cards worker `name` (incarnation `token`) serves, e.g. once it has
        registered an uploaded adapter; False when another incarnation holds the name."""
        with self._tx() as conn:
            n = conn.execute(
                workers.update()
                .where(workers.c.name == name, workers.c.token == token)
                .values(models=json.dumps(cards))
            ).rowcount
        return n == 1

    def heartbeat(
        self,
        name: str,
        token: str,
        *,
        leases: list[str],
        lease_s: float,
        ready: bool,
        dead: str | None = None,
        metrics: dict | None = None,
    ) -> bool:
        """Prove `name` alive and extend the `leases` (claim tokens) it still works on; False
        when another incarnation registered under the name since (this one must stop). A job
        the worker no longer names, whatever the reason, is left to expire and run again."""
        with self._tx() as conn:
            n = conn.execute(
                workers.update()
                .where(workers.c.name == name, workers.c.token == token)
                .values(
                    heartbeat_at=self.db_now(),
                    ready=int(ready),
                    dead=dead,
                    metrics=json.dumps(metrics) if metrics is not None else None,
                )
            ).rowcount
            if not n:
                return False
            if leases:
                expiry = self.db_now() + lease_s
                for table in (videos, fine_tunes):
                    conn.execute(
                        table.update()
                        .where(table.c.lease_token.in_(leases), table.c.worker_id == name)
                        .values(lease_expires_at=expiry)
                    )
        return True

    def publish_metrics(self, name: str, token: str, metrics: dict) -> None:
        """Replace the metrics snapshot `name` shows (between heartbeats, after a step)."""
        with self._tx() as conn:
            conn.execute(
                workers.update()
                .where(workers.c.name == name, workers.c.token == token)
                .values(metrics=json.dumps(metrics))
            )

    def deregister_worker(self, name: str, token: str) -> None:
        with self._tx() as conn:
            conn.execute(workers.delete().where(workers.c.name == name, workers.c.token == token))

    def live_workers(self, ttl_s: float) -> list[WorkerRecord]:
        """Workers heard from within `ttl_s` seconds, oldest registration first."""
        fresh = workers.c.heartbeat_at >= self.db_now() - ttl_s
        rows = self._all(sa.select(workers).where(fresh).order_by(workers.c.started_at))
        return [WorkerRecord.from_row(row) for row in rows]

    def recover_expired(self) -> dict[str, int]:
        """Requeue running jobs whose lease expired (their worker stopped renewing it); a job
        whose cancellation was pending is cancelled instead."""
        expired = sa.or_(
            videos.c.lease_expires_at.is_(None), videos.c.lease_expires_at < self.db_now()
        )
        reason = "requeued: its worker stopped renewing its lease"
        with self._tx() as conn:
            videos_back = self._requeue_videos(
                conn, expired, reason, crashed=True, skip_locked=True
            )
            expired = sa.or_(
                fine_tunes.c.lease_expires_at.is_(None),
                fine_tunes.c.lease_expires_at < self.db_now(),
            )
            tunes_back = self._requeue_finetunes(
                conn, expired, reason, crashed=True, skip_locked=True
            )
        return {"videos_requeued": videos_back, "fine_tunes_requeued": tunes_back}

    @staticmethod
    def _crashed_out(crashes: int, reason: str, finished_at: str) -> dict:
        """A job's row changes when it fails at the crash limit (`finished_at`: the column its
        kind records the end in)."""
        times = "once" if crashes == 1 else f"{crashes} times"
        message = f"its worker died {times} while running it ({reason}); not run again"
        return {
            "status": "failed",
            finished_at: now(),
            "error_code": "worker_crashed",
            "error_message": message,
        }

    def _requeue_videos(
        self,
        conn: sa.Connection,
        where,
        reason: str,
        *,
        crashed: bool = False,
        skip_locked: bool = False,
    ) -> int:
        """Running videos matching `where` back to the queue (from noise), or to cancelled.
        `crashed`: their worker died under them; that counts, and at `crash_limit` a video fails
        instead. `skip_locked`: leave rows another transaction holds (a recovery pass racing
        another)."""
        stmt = (
            sa.select(videos.c.id, videos.c.cancel_requested, videos.c.crashes)
            .where(videos.c.status == "in_progress", where)
            .with_for_update(skip_locked=skip_locked)
        )
        requeued = 0
        for row in conn.execute(stmt).mappings().all():
            released = dict(worker_id=None, lease_token=None, lease_expires_at=None)
            crashes = row["crashes"] + int(crashed)
            data = {"status": "queued", "progress": 0, "step": 0}
            if row["cancel_requested"]:
                status, message = "cancelled", ""
                changes = dict(status=status, completed_at=now(), **released)
            elif crashes >= self.crash_limit:
                changes = {**self._crashed_out(crashes, reason, "completed_at"), **released}
                status, message = "failed", changes["error_message"]
                data["error"] = {"code": changes["error_code"], "message": message}
            else:
                status, message = "queued", reason
                changes = dict(status=status, progress=0, step=0, **released)
                requeued += 1
            changes["crashes"] = crashes
            conn.execute(videos.update().where(videos.c.id == row["id"]).values(**changes))
            data["status"] = status
            level = "error" if status == "failed" else "info"
            self._event(conn, row["id"], f"video.{status}", message, data, level=level)
        return requeued

    def _requeue_finetunes(
        self,
        conn: sa.Connection,
        where,
        reason: str,
        *,
        crashed: bool = False,
        skip_locked: bool = False,
    ) -> int:
        """Running fine-tunes matching `where` back to the queue, to resume from their last
        checkpoint; or to cancelled when that was pending; or, `crashed` for the
        `crash_limit`-th time, to failed."""
        stmt = (
            sa.select(fine_tunes.c.id, fine_tunes.c.cancel_requested, fine_tunes.c.crashes)
            .where(fine_tunes.c.status == "running", where)
            .with_for_update(skip_locked=skip_locked)
        )
        requeued = 0
        for row in conn.execute(stmt).mappings().all():
            released = dict(worker_id=None, lease_token=None, lease_expires_at=None)
            crashes = row["crashes"] + int(crashed)
            level = "info"
            if row["cancel_requested"]:
                changes = dict(status="cancelled", finished_at=now(), **released)
                message = "The job was cancelled"
            elif crashes >= self.crash_limit:
                changes = {**self._crashed_out(crashes, reason, "finished_at"), **released}
                message, level = changes["error_message"], "error"
            else:
                changes = dict(status="queued", **released)
                message = f"{reason}; resuming from the last checkpoint"
                requeued += 1
            changes["crashes"] = crashes
            conn.execute(fine_tunes.update().where(fine_tunes.c.id == row["id"]).values(**changes))
            self._event(conn, row["id"], "message", message, level=level)
        return requeued

    # --- idempotency and housekeeping ----------------------------------------------------------

    def reserve_key(self, scope: str, key: str, request_hash: str) -> dict | None:
        """Reserve an Idempotency-Key for a request about to do its work: None when this call
        reserved it (the work then records its outcome under it, or `release_key` frees it);
        otherwise what the key holds: `request_hash`, `resource_id` (None while the first
        request is still at work) and `response`. A key past its lifetime, or one whose first
        request never finished (its process died), is reserved afresh."""
        t = idempotency
        mine = dict(request_hash=request_hash, resource_id=None, response=None, created_at=now())
        with self._tx() as conn:
            stmt = self._insert(t).values(scope=scope, key=key, **mine).on_conflict_do_nothing()
            if conn.execute(stmt.returning(t.c.key)).first() is not None:  # inserted: ours
                return None
            held = sa.and_(t.c.scope == scope, t.c.key == key)
            row = dict(conn.execute(sa.select(t).where(held).with_for_update()).mappings().one())
            expired = row["created_at"] < now() - IDEMPOTENCY_TTL_S
            abandoned = row["resource_id"] is None and row["response"] is None
            abandoned = abandoned and row["created_at"] < now() - ABANDONED_KEY_S
            if expired or abandoned:
                conn.execute(t.update().where(held).values(**mine))
                return None
            return row

    def release_key(self, scope: str, key: str) -> None:
        """Free a reservation whose request failed, so a retry does the work anew."""
        t = idempotency
        pending = sa.and_(
            t.c.scope == scope, t.c.key == key, t.c.resource_id.is_(None), t.c.response.is_(None)
        )
        with self._tx() as conn:
            conn.execute(t.delete().where(pending))

    def record_response(self, scope: str, key: str, response: dict) -> None:
        """Keep the first answer of a request (a DELETE, a cancel) for its retries."""
        t = idempotency
        with self._tx() as conn:
            conn.execute(
                t.update()
                .where(t.c.scope == scope, t.c.key == key)
                .values(response=json.dumps(response))
            )

    @staticmethod
    def _remember(conn: sa.Connection, key: tuple[str, str, str] | None, resource_id: str) -> None:
        """Record the resource a reserved key's request created, in the transaction creating it."""
        if key is None:
            return
        scope, name, _ = key
        t = idempotency
        conn.execute(
            t.update().where(t.c.scope == scope, t.c.key == name).values(resource_id=resource_id)
        )

    def prune_events(self, older_than_s: float) -> int:
        """Delete events older than `older_than_s` of jobs that are over (or gone); returns how
        many. The events of queued and running jobs stay, however old."""
        active = sa.union_all(
            sa.select(videos.c.id).where(videos.c.status.in_(VIDEO_ACTIVE)),
            sa.select(fine_tunes.c.id).where(fine_tunes.c.status.in_(FINETUNE_ACTIVE)),
        )
        stale = sa.and_(events.c.created_at < now() - older_than_s, events.c.job_id.not_in(active))
        with self._tx() as conn:
            return conn.execute(events.delete().where(stale)).rowcount

    def forget_idempotency_keys(self) -> int:
        """Delete keys past their lifetime."""
        with self._tx() as conn:
            stale = idempotency.c.created_at < now() - IDEMPOTENCY_TTL_S
            return conn.execute(idempotency.delete().where(stale)).rowcount

    def queue_depth(self, owner: str | None = None) -> int:
        """Jobs waiting for a worker: queued videos and queued fine-tunes (of `owner` alone, when
        given)."""
        if owner is None:
            return sum(self.queue_depth_by_model().values())
        total = 0
        for table in (videos, fine_tunes):
            mine = sa.and_(table.c.status == "queued", table.c.owner == owner)
            total += self._one(sa.select(sa.func.count().label("n")).where(mine))["n"]
        return total

    def queue_depth_by_model(self) -> dict[str, int]:
        """Queued jobs (videos and fine-tunes) per model they need."""
        out: dict[str, int] = {}
        for table in (videos, fine_tunes):
            stmt = (
                sa.select(table.c.model, sa.func.count().label("n"))
                .where(table.c.status == "queued")
                .group_by(table.c.model)
            )
            for row in self._all(stmt):
                out[row["model"]] = out.get(row["model"], 0) + row["n"]
        return out

    def counts_by_state(self) -> dict[tuple[str, str], int]:
        out = {}
        for kind, table in (("video", videos), ("fine_tune", fine_tunes)):
            stmt = sa.select(table.c.status, sa.func.count().label("n")).group_by(table.c.status)
            for row in self._all(stmt):
                out[(kind, row["status"])] = row["n"]
        return out

    def _page(
        self, table: sa.Table, after: str | None, limit: int, order: str, *where, decode=dict
    ) -> tuple[list, bool]:
        """A page of `table` in creation order and whether more follow; `after` is an id, found
        among the rows `where` allows only (another owner's id pages like an unknown one, so a
        cursor cannot tell whether it exists)."""
        descending = order == "desc"
        stmt = sa.select(table).where(*where)
        if after is not None:
            cursor = sa.select(table.c.seq).where(table.c.id == after, *where).scalar_subquery()
            stmt = stmt.where(table.c.seq < cursor if descending else table.c.seq > cursor)
        stmt = stmt.order_by(table.c.seq.desc() if descending else table.c.seq).limit(limit + 1)
        rows = self._all(stmt)
        return [decode(r) for r in rows[:limit]], len(rows) > limit

    # --- videos: the API's side --------------------------------------------------------------

    def insert_video(
        self,
        video_id: str,
        spec: dict,
        priority: int = 0,
        idempotency=None,
        owner: str | None = None,
    ) -> VideoRecord:
        """Queue a resolved video request (`ResolvedVideo.to_dict()`) for `owner`."""
        with self._tx() as conn:
            conn.execute(
                videos.insert().values(
                    id=video_id,
                    created_at=now(),
                    status="queued",
                    model=spec["model"],
                    priority=priority,
                    spec=json.dumps(spec),
                    owner=owner,
                )
            )
            data = {"status": "queued", "progress": 0, "step": 0}
            self._event(conn, video_id, "video.queued", data=data)
            self._remember(conn, idempotency, video_id)
        return self.get_video(video_id)

    def get_video(self, video_id: str) -> VideoRecord | None:
        return _record(VideoRecord, self._one(GET_VIDEO, {"video_id": video_id}))

    def list_videos(
        self, after: str | None, limit: int, order: str, owner: str | None = None
    ) -> tuple[list[VideoRecord], bool]:
        visible = _visible_to(videos, owner)
        return self._page(videos, after, limit, order, *visible, decode=VideoRecord.from_row)

    @staticmethod
    def _queue_order(stmt: sa.Select) -> sa.Select:
        stmt = stmt.where(videos.c.status == "queued")
        # Within a priority, a video whose worker died under it waits behind those that never
        # crashed one: a poison job cannot hold the head of the queue.
        return stmt.order_by(videos.c.priority.desc(), videos.c.crashes, videos.c.seq)

    def queue_position(self, video_id: str) -> int | None:
        """Where a queued video stands in the queue's order (1 = next), None unless queued."""
        v, o = videos.alias("v"), videos.alias("o")
        ahead = (
            sa.select(sa.func.count())
            .where(
                o.c.status == "queued",
                sa.or_(  # the order of `_queue_order`
                    o.c.priority > v.c.priority,
                    sa.and_(o.c.priority == v.c.priority, o.c.crashes < v.c.crashes),
                    sa.and_(
                        o.c.priority == v.c.priority,
                        o.c.crashes == v.c.crashes,
                        o.c.seq < v.c.seq,
                    ),
                ),
            )
            .scalar_subquery()
        )
        stmt = sa.select((ahead + 1).label("position")).where(
            v.c.id == video_id, v.c.status == "queued"
        )
        row = self._one(stmt)
        return row["position"] if row is not None else None

    def cancel_video(self, video_id: str) -> str | None:
        """Cancel a queued video now, or flag a running one for its worker. Returns the status
        after, None if there is no such video."""
        with self._tx() as conn:
            row = self._locked(conn, videos, video_id)
            if row is None:
                return None
            if row["status"] == "queued":
                conn.execute(
                    videos.update()
                    .where(videos.c.id == video_id)
                    .values(status="cancelled", completed_at=now())
                )
                data = {"status": "cancelled", "progress": 0, "step": 0}
                self._event(conn, video_id, "video.cancelled", data=data)
                return "cancelled"
            if row["status"] == "in_progress":
                conn.execute(
                    videos.update().where(videos.c.id == video_id).values(cancel_requested=1)
                )
            return row["status"]

    def delete_video(self, video_id: str) -> bool:
        with self._tx() as conn:
            finished = sa.and_(videos.c.id == video_id, videos.c.status.in_(VIDEO_TERMINAL))
            n = conn.execute(videos.delete().where(finished)).rowcount
            if n:
                conn.execute(events.delete().where(events.c.job_id == video_id))
        return n > 0

    def expired_videos(self) -> list[str]:
        stmt = sa.select(videos.c.id).where(
            videos.c.expires_at.is_not(None), videos.c.expires_at < now()
        )
        return [r["id"] for r in self._all(stmt)]

    def events_after(self, job_id: str, after_seq: int, limit: int = 100) -> list[dict]:
        """A job's events in order, starting after `after_seq` (for SSE and its Last-Event-ID)."""
        stmt = (
            sa.select(events)
            .where(events.c.job_id == job_id, events.c.seq > after_seq)
            .order_by(events.c.seq)
            .limit(limit)
        )
        return self._all(stmt)

    def events_since(self, after_seq: int | None, limit: int = 1000) -> list[dict]:
        """Every job's events after `after_seq`, in order (None: none, only where the log ends:
        `[{"seq": newest}]`). One query feeds every SSE stream of an API process (feed.py)."""
        if after_seq is None:
            newest = self._one(sa.select(sa.func.max(events.c.seq).label("seq")))
            return [{"seq": (newest or {}).get("seq") or 0}]
        stmt = sa.select(events).where(events.c.seq > after_seq).order_by(events.c.seq)
        return self._all(stmt.limit(limit))

    def queue_positions(self) -> dict[str, int]:
        """Every queued video's place in the queue (1 = next), in one query."""
        stmt = self._queue_order(sa.select(videos.c.id))
        return {row["id"]: n for n, row in enumerate(self._all(stmt), start=1)}

    # --- videos: a worker's side -------------------------------------------------------------

    def claim_videos(
        self,
        worker: str,
        served: list[str],
        room: int,
        batch_key: Callable[[VideoRecord], Hashable],
        running_key: Hashable | None = None,
        *,
        lease_s: float,
        runnable: Callable[[VideoRecord], bool] | None = None,
    ) -> list[VideoRecord]:
        """Claim up to `room` queued videos of the `served` models, in queue order, that can
        share a pass with the running batch (`batch_key(row) == running_key`, or with the first
        claimed when nothing runs). Stops at the first that cannot: a later compatible job never
        overtakes an earlier one. Rows `runnable` refuses (jobs this worker cannot run yet, such
        as one naming an adapter it has not registered) are passed over, left to other workers,
        among the next `CLAIM_LOOKAHEAD`. Each video comes back in progress, with its
        `lease_token`."""
        if room <= 0 or not served:
            return []
        stmt = self._queue_order(sa.select(videos).where(videos.c.model.in_(served)))
        lookahead = CLAIM_LOOKAHEAD if runnable is not None else 0
        stmt = stmt.limit(room + lookahead).with_for_update(skip_locked=True)
        claimed = []
        with self._tx() as conn:
            for row in conn.execute(stmt).mappings().all():
                if len(claimed) == room:
                    break
                video = VideoRecord.from_row(row)
                if runnable is not None and not runnable(video):
                    continue
                key = batch_key(video)
                if running_key is None:
                    running_key = key
                elif key != running_key:
                    break
                token = new_token()
                conn.execute(
                    videos.update()
                    .where(videos.c.id == video.id)
                    .values(
                        status="in_progress",
                        progress=0,
                        step=0,
                        started_at=now(),
                        attempts=videos.c.attempts + 1,
                        worker_id=worker,
                        lease_token=token,
                        lease_expires_at=self.db_now() + lease_s,
                    )
                )
                data = {"status": "in_progress", "progress": 0, "step": 0}
                self._event(conn, video.id, "video.in_progress", data=data)
                claimed.append(
                    dataclasses.replace(
                        video,
                        status="in_progress",
                        progress=0,
                        step=0,
                        attempts=video.attempts + 1,
                        worker_id=worker,
                        lease_token=token,
                    )
                )
        return claimed

    def set_video_progress(self, updates: list[tuple], *, lease_s: float) -> set[str]:
        """`(id, lease_token, step, progress)` or `(id, lease_token, step, progress, passes)` for
        running videos, in one transaction; extends their leases. `passes`: the steps that ran a
        pass of the model (fewer than `step` when a step cache reused). Returns the ids whose
        lease is no longer this claim's (stop working on them: another worker has them, or they
        ended)."""
        lost = set()
        with self._tx() as conn:
            for video_id, token, step, progress, *rest in updates:
                values = {"step": step, "progress": progress}
                if rest:
                    values["passes"] = rest[0]
                n = conn.execute(
                    videos.update()
                    .where(
                        videos.c.id == video_id,
                        videos.c.lease_token == token,
                        videos.c.status == "in_progress",
                    )
                    .values(**values, lease_expires_at=self.db_now() + lease_s)
                ).rowcount
                if not n:
                    lost.add(video_id)
                    continue
                data = {"status": "in_progress", **values}
                self._event(conn, video_id, "video.progress", data=data)
        return lost

    def finish_video(
        self, video_id: str, token: str, status: str, *, expires_at=None, error=None
    ) -> str | None:
        """in_progress -> completed | failed | cancelled under claim `token`. A pending cancel
        wins over completion. Returns the status written, or None when the claim is no longer
        this one (the outcome belongs to whoever holds the job now)."""
        code, message = error if error else (None, None)
        with self._tx() as conn:
            row = self._locked(conn, videos, video_id)
            if row is None or row["status"] != "in_progress" or row["lease_token"] != token:
                return None
            if row["cancel_requested"] and status == "completed":
                status, expires_at = "cancelled", None
            progress = 100 if status == "completed" else row["progress"]
            conn.execute(
                videos.update()
                .where(videos.c.id == video_id)
                .values(
                    status=status,
                    progress=progress,
                    completed_at=now(),
                    expires_at=expires_at,
                    error_code=code,
                    error_message=message,
                    lease_expires_at=None,
                )
            )
            data = {"status": status, "progress": progress, "step": row["step"]}
            if error:
                data["error"] = {"code": code, "message": message}
            level = "error" if error else "info"
            self._event(conn, video_id, f"video.{status}", message or "", data, level=level)
        return status

    def cancel_requested_videos(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        stmt = sa.select(videos.c.id).where(videos.c.cancel_requested == 1, videos.c.id.in_(ids))
        return {r["id"] for r in self._all(stmt)}

    def requeue_videos(self, claims: list[tuple[str, str]], reason: str) -> None:
        """`(id, lease_token)` claims back to the queue (a graceful stop): each runs again from
        noise, on whichever worker claims it next."""
        if not claims:
            return
        with self._tx() as conn:
            held = sa.or_(
                *(sa.and_(videos.c.id == i, videos.c.lease_token == t) for i, t in claims)
            )
            self._requeue_videos(conn, held, reason)

    # --- files -------------------------------------------------------------------------------

    def insert_file(self, row: dict, idempotency=None) -> FileRecord:
        """An upload, `uploaded` until validated (`claim_file_validation`)."""
        keys = ("id", "filename", "purpose", "bytes", "path")
        with self._tx() as conn:
            conn.execute(
                files.insert().values(
                    created_at=now(),
                    clips=0,
                    status="uploaded",
                    owner=row.get("owner"),
                    **{k: row[k] for k in keys},
                )
            )
            self._remember(conn, idempotency, row["id"])
        return self.get_file(row["id"])

    def claim_file_validation(self, lease_s: float) -> FileRecord | None:
        """An upload waiting for validation, now this caller's for `lease_s` seconds (an API
        host that dies meanwhile leaves it to another, or to its own restart)."""
        free = sa.or_(files.c.validating_until.is_(None), files.c.validating_until < self.db_now())
        stmt = (
            sa.select(files)
            .where(files.c.status == "uploaded", free)
            .order_by(files.c.seq)
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        with self._tx() as conn:
            row = conn.execute(stmt).mappings().first()
            if row is None:
                return None
            conn.execute(
                files.update()
                .where(files.c.id == row["id"])
                .values(validating_until=self.db_now() + lease_s)
            )
        return FileRecord.from_row(row)

    def finish_file_validation(
        self,
        file_id: str,
        *,
        clips: int | None = None,
        path: str | None = None,
        error: str | None = None,
    ) -> bool:
        """uploaded -> processed (its clip count, and the dataset's `path` once unpacked) |
        error (with why)."""
        changes = dict(status="processed", clips=clips or 0, validating_until=None)
        if error is not None:
            changes.update(status="error", status_details=error)
        if path is not None:
            changes.update(path=path)
        with self._tx() as conn:
            pending = sa.and_(files.c.id == file_id, files.c.status == "uploaded")
            return bool(conn.execute(files.update().where(pending).values(**changes)).rowcount)

    def get_file(self, file_id: str) -> FileRecord | None:
        return _record(FileRecord, self._one(sa.select(files).where(files.c.id == file_id)))

    def file_ids(self) -> set[str]:
        return {r["id"] for r in self._all(sa.select(files.c.id))}

    def list_files(
        self, after, limit, order, purpose=None, owner: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        where = [files.c.purpose == purpose] if purpose else []
        visible = _visible_to(files, owner)
        return self._page(files, after, limit, order, *where, *visible, decode=FileRecord.from_row)

    def delete_file(self, file_id: str) -> str:
        """'deleted', 'missing', or 'in_use' when an active fine-tune still reads it."""
        with self._tx() as conn:
            busy = conn.execute(
                sa.select(fine_tunes.c.id)
                .where(
                    fine_tunes.c.training_file == file_id,
                    fine_tunes.c.status.in_(FINETUNE_ACTIVE),
                )
                .limit(1)
            ).first()
            if busy:
                return "in_use"
            n = conn.execute(files.delete().where(files.c.id == file_id)).rowcount
            return "deleted" if n else "missing"

    def videos_naming_adapter(self, model: str, name: str) -> list[str]:
        """The queued or running videos of base model `model` that apply adapter `name`."""
        stmt = sa.select(videos.c.id, videos.c.spec).where(
            videos.c.model == model, videos.c.status.in_(VIDEO_ACTIVE)
        )
        with self._tx() as conn:
            rows = conn.execute(stmt).all()
        return [
            video_id
            for video_id, spec in rows
            if any(c["name"] == name for c in json.loads(spec).get("loras") or ())
        ]

    # --- fine-tunes: the API's side ----------------------------------------------------------

    def insert_finetune(self, row: dict, idempotency=None) -> FineTuneRecord:
        keys = ("id", "model", "training_file", "seed", "suffix", "output_dir")
        with self._tx() as conn:
            conn.execute(
                fine_tunes.insert().values(
                    created_at=now(),
                    status="queued",
                    hyperparameters=json.dumps(row["hyperparameters"]),
                    owner=row.get("owner"),
                    **{k: row[k] for k in keys},
                )
            )
            self._event(conn, row["id"], "message", f"Created fine-tuning job: {row['id']}")
            self._remember(conn, idempotency, row["id"])
        return self.get_finetune(row["id"])

    def get_finetune(self, job_id: str) -> FineTuneRecord | None:
        row = self._one(sa.select(fine_tunes).where(fine_tunes.c.id == job_id))
        return _record(FineTuneRecord, row)

    def list_finetunes(
        self, after, limit, order="desc", owner: str | None = None
    ) -> tuple[list[FineTuneRecord], bool]:
        visible = _visible_to(fine_tunes, owner)
        return self._page(fine_tunes, after, limit, order, *visible, decode=FineTuneRecord.from_row)

    def cancel_finetune(self, job_id: str) -> str | None:
        """Cancel a queued job now or flag a running one; returns the status after."""
        with self._tx() as conn:
            row = self._locked(conn, fine_tunes, job_id)
            if row is None:
                return None
            if row["status"] == "queued":
                conn.execute(
                    fine_tunes.update()
                    .where(fine_tunes.c.id == job_id)
                    .values(status="cancelled", finished_at=now())
                )
                self._event(conn, job_id, "message", "The job was cancelled")
                return "cancelled"
            if row["status"] == "running":
                conn.execute(
                    fine_tunes.update().where(fine_tunes.c.id == job_id).values(cancel_requested=1)
                )
            return row["status"]

    def finetune_events(
        self, job_id: str, after: str | None, limit: int
    ) -> tuple[list[dict], bool]:
        """Newest first, as the OpenAI API pages them; `after` is an event id (`ftevent-<seq>`)."""
        stmt = sa.select(events).where(events.c.job_id == job_id)
        if after is not None:
            stmt = stmt.where(events.c.seq < int(after.removeprefix("ftevent-")))
        rows = self._all(stmt.order_by(events.c.seq.desc()).limit(limit + 1))
        return rows[:limit], len(rows) > limit

    def checkpoints(self, job_id: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        return self._page(checkpoints, after, limit, "desc", checkpoints.c.job_id == job_id)

    def models(self) -> list[ModelRecord]:
        """Fine-tuned models, in the order they were made."""
        return [
            ModelRecord.from_row(r) for r in self._all(sa.select(models).order_by(models.c.seq))
        ]

    # --- fine-tunes: a worker's side ---------------------------------------------------------

    def claim_finetune(
        self, worker: str, served: list[str], *, lease_s: float
    ) -> FineTuneRecord | None:
        """Claim the oldest queued fine-tune of a `served` model: the job, running, with its
        `lease_token` and `attempts` (1 = a first run, more = resume from a checkpoint)."""
        if not served:
            return None
        stmt = (
            sa.select(fine_tunes)
            .where(fine_tunes.c.status == "queued", fine_tunes.c.model.in_(served))
            .order_by(fine_tunes.c.crashes, fine_tunes.c.seq)  # crashed ones after the others
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        with self._tx() as conn:
            row = conn.execute(stmt).mappings().first()
            if row is None:
                return None
            token = new_token()
            conn.execute(
                fine_tunes.update()
                .where(fine_tunes.c.id == row["id"])
                .values(
                    status="running",
                    attempts=fine_tunes.c.attempts + 1,
                    worker_id=worker,
                    lease_token=token,
                    lease_expires_at=self.db_now() + lease_s,
                )
            )
        job = FineTuneRecord.from_row(row)
        return dataclasses.replace(
            job, status="running", attempts=job.attempts + 1, worker_id=worker, lease_token=token
        )

    @contextlib.contextmanager
    def fenced_finetune(self, job_id: str, token: str) -> Iterator[None]:
        """A context in which a fine-tune's files may be published under claim `token`: the
        job's row is write-locked while it lasts (a takeover waits), and `ClaimLost` is raised
        at once when the claim is no longer this one."""
        with self._tx() as conn:
            # A no-op write, not a SELECT: it takes the row's lock on PostgreSQL and the
            # database's write lock on SQLite, which a plain read does not.
            held = conn.execute(
                fine_tunes.update()
                .where(
                    fine_tunes.c.id == job_id,
                    fine_tunes.c.lease_token == token,
                    fine_tunes.c.status == "running",
                )
                .values(lease_token=fine_tunes.c.lease_token)
            ).rowcount
            if not held:
                raise ClaimLost(f"{job_id} is no longer held by this claim")
            yield

    def _holds_finetune(self, conn: sa.Connection, job_id: str, token: str) -> dict | None:
        """The job's row while claim `token` still runs it (else None); locked for this
        transaction."""
        row = self._locked(conn, fine_tunes, job_id)
        held = row is not None and row["status"] == "running" and row["lease_token"] == token
        return row if held else None

    def finetune_progress(
        self,
        job_id: str,
        token: str,
        step: int,
        total_steps: int,
        metrics: dict | None,
        *,
        lease_s: float,
    ) -> bool:
        """Record a fine-tune's step (and its metrics as an event); extends the lease. False
        when the claim is no longer this one."""
        with self._tx() as conn:
            if not self._holds_finetune(conn, job_id, token):
                return False
            conn.execute(
                fine_tunes.update()
                .where(fine_tunes.c.id == job_id)
                .values(
                    step=step, total_steps=total_steps, lease_expires_at=self.db_now() + lease_s
                )
            )
            if metrics is not None:
                message = f"Step {step}/{total_steps}: training loss={metrics['loss']:.4f}"
                self._event(conn, job_id, "metrics", message, metrics)
        return True

    def rewind_finetune(self, job_id: str, token: str, step: int) -> bool:
        """A fine-tune resumed at `step`: the metrics its lost run recorded past that step are
        deleted, so the steps it runs again are reported once."""
        with self._tx() as conn:
            if not self._holds_finetune(conn, job_id, token):
                return False
            stmt = sa.select(events.c.seq, events.c.data).where(
                events.c.job_id == job_id, events.c.type == "metrics"
            )
            lost = [r.seq for r in conn.execute(stmt) if json.loads(r.data)["step"] > step]
            if lost:
                conn.execute(events.delete().where(events.c.seq.in_(lost)))
            conn.execute(fine_tunes.update().where(fine_tunes.c.id == job_id).values(step=step))
        return True

    def add_event(
        self,
        job_id: str,
        message: str,
        type_: str = "message",
        data=None,
        level="info",
        *,
        token: str | None = None,
    ) -> bool:
        """Append an event to a fine-tune; with `token`, only while that claim runs it."""
        with self._tx() as conn:
            if token is not None and not self._holds_finetune(conn, job_id, token):
                return False
            if token is None:
                self._locked(conn, fine_tunes, job_id)  # orders it after the job's other events
            self._event(conn, job_id, type_, message, data, level)
        return True

    def add_checkpoint(
        self,
        checkpoint_id: str,
        job_id: str,
        token: str,
        step: int,
        path: str,
        metrics: dict | None,
    ) -> bool:
        with self._tx() as conn:
            if not self._holds_finetune(conn, job_id, token):
                return False
            self._insert_ignore(
                conn,
                checkpoints,
                id=checkpoint_id,
                job_id=job_id,
                created_at=now(),
                step=step,
                path=path,
                metrics=json.dumps(metrics) if metrics else None,
            )
        return True

    def finetune_cancel_requested(self, job_id: str) -> bool:
        row = self._one(sa.select(fine_tunes.c.cancel_requested).where(fine_tunes.c.id == job_id))
        return bool(row and row["cancel_requested"])

    def finish_finetune(
        self, job_id: str, token: str, status: str, *, error=None, model: dict | None = None
    ) -> bool:
        """running -> succeeded | failed | cancelled under claim `token`; a success registers
        its model in the same transaction. False when the claim is no longer this one."""
        code, message = error if error else (None, None)
        with self._tx() as conn:
            job = self._holds_finetune(conn, job_id, token)
            if job is None:
                return False
            conn.execute(
                fine_tunes.update()
                .where(fine_tunes.c.id == job_id)
                .values(
                    status=status,
                    finished_at=now(),
                    error_code=code,
                    error_message=message,
                    fine_tuned_model=model["name"] if model else None,
                    lease_expires_at=None,
                )
            )
            if model is not None:
                conn.execute(
                    models.insert().values(
                        name=model["name"],
                        parent=model["parent"],
                        path=model["path"],
                        job_id=job_id,
                        created_at=now(),
                        owner=job["owner"],  # a fine-tuned model is its job owner's
                    )
                )
            text = {
                "succeeded": "The job has successfully completed",
                "cancelled": "The job was cancelled",
            }
            level = "error" if error else "info"
            self._event(conn, job_id, "message", message or text.get(status, status), level=level)
        return True

    def requeue_finetune(self, job_id: str, token: str, reason: str) -> None:
        """A graceful stop: the fine-tune returns to the queue, to resume from its checkpoint."""
        with self._tx() as conn:
            held = sa.and_(fine_tunes.c.id == job_id, fine_tunes.c.lease_token == token)
            self._requeue_finetunes(conn, held, reason)


def _record(cls, row: dict | None):
    """`cls.from_row(row)`, or None for no row."""
    return cls.from_row(row) if row is not None else None


def _visible_to(table: sa.Table, owner: str | None) -> list:
    """Rows `owner` may see: its own, and those made before keys were owners. None: all."""
    if owner is None:
        return []
    return [sa.or_(table.c.owner == owner, table.c.owner.is_(None))]


class _InThread(Generic[P, R]):
    """`AsyncStore.<name>`: `await`s `JobStore.<name>` run in a worker thread, with the sync
    method's signature (the ParamSpec carries it to type checkers)."""

    def __init__(self, method: Callable[Concatenate[JobStore, P], R]):
        self.name = method.__name__

    def __get__(self, store: AsyncStore, owner: type) -> Callable[P, Awaitable[R]]:
        # Looked up on the instance at each call, so a method patched on it (a test's) is used.
        method = getattr(store.sync, self.name)

        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return await anyio.to_thread.run_sync(functools.partial(method, *args, **kwargs))

        return call


class AsyncStore:
    """The job store for async code: `await store.get_file(id)` runs `JobStore.get_file` in a
    worker thread, so the event loop goes on serving other requests meanwhile. The calls async
    code makes are listed here, each once.

    Except a video's status read on SQLite, the one read clients repeat back to back: it runs
    on the event loop itself. A WAL-mode reader never waits for the writer, and the read takes
    about 30 us where handing it to a thread and back costs 150-300 us of the loop's time
    (benchmarks/api_load.py: status polls while a video generates)."""

    def __init__(self, store: JobStore):
        self.sync = store
        self._inline_reads = store.dialect == "sqlite"

    async def get_video(self, video_id: str) -> VideoRecord | None:
        if self._inline_reads:
            return self.sync.get_video(video_id)
        return await anyio.to_thread.run_sync(self.sync.get_video, video_id)

    # videos
    insert_video = _InThread(JobStore.insert_video)
    list_videos = _InThread(JobStore.list_videos)
    cancel_video = _InThread(JobStore.cancel_video)
    delete_video = _InThread(JobStore.delete_video)
    queue_position = _InThread(JobStore.queue_position)
    queue_positions = _InThread(JobStore.queue_positions)
    videos_naming_adapter = _InThread(JobStore.videos_naming_adapter)
    # events
    events_after = _InThread(JobStore.events_after)
    events_since = _InThread(JobStore.events_since)
    # fine-tunes
    insert_finetune = _InThread(JobStore.insert_finetune)
    get_finetune = _InThread(JobStore.get_finetune)
    list_finetunes = _InThread(JobStore.list_finetunes)
    cancel_finetune = _InThread(JobStore.cancel_finetune)
    finetune_events = _InThread(JobStore.finetune_events)
    checkpoints = _InThread(JobStore.checkpoints)
    # files
    insert_file = _InThread(JobStore.insert_file)
    get_file = _InThread(JobStore.get_file)
    list_files = _InThread(JobStore.list_files)
    delete_file = _InThread(JobStore.delete_file)
    # queue and idempotency keys
    queue_depth = _InThread(JobStore.queue_depth)
    queue_depth_by_model = _InThread(JobStore.queue_depth_by_model)
    counts_by_state = _InThread(JobStore.counts_by_state)
    reserve_key = _InThread(JobStore.reserve_key)
    release_key = _InThread(JobStore.release_key)
    record_response = _InThread(JobStore.record_response)


__all__ = [
    "UNAVAILABLE",
    "AsyncStore",
    "JobStore",
    "WorkerNameInUse",
    "database_url",
    "is_disk_full",
    "migrate",
    "new_token",
    "now",
]
