"""The durable job store: one SQLite database (WAL) holding jobs, files, events and idempotency keys.

Every state change is one transaction, committed with `synchronous=FULL`, so a `kill -9` (or a power
cut) loses nothing that was acknowledged to a client. Outputs live on disk beside the database; rows
only point at them.

State machines (a transition is a conditional UPDATE, so the HTTP side and the worker cannot both win):

    video:     queued -> in_progress -> completed | failed | cancelled;  queued -> cancelled
    fine-tune: queued -> running -> succeeded | failed | cancelled;      queued -> cancelled

`reconcile()` runs once at start-up, before the worker: nothing can be running then, so in-progress
videos are queued again (they restart from noise) and running fine-tunes are queued to resume from
their last checkpoint.

One connection is shared by the worker thread and the API behind a lock; every call is a few indexed
statements. Async routes reach the store through `AsyncStore`, which runs each call in a worker
thread: a slow disk (an fsync, a busy lock) never stalls the event loop.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
import threading
import time
from pathlib import Path

import anyio

VIDEO_ACTIVE = ("queued", "in_progress")
VIDEO_TERMINAL = ("completed", "failed", "cancelled")
FINETUNE_ACTIVE = ("queued", "running")
IDEMPOTENCY_TTL_S = 24 * 3600

SCHEMA = """
CREATE TABLE IF NOT EXISTS videos (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    step INTEGER NOT NULL DEFAULT 0,
    model TEXT NOT NULL,
    priority INTEGER NOT NULL DEFAULT 0,
    spec TEXT NOT NULL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    started_at INTEGER,
    completed_at INTEGER,
    expires_at INTEGER,
    error_code TEXT,
    error_message TEXT
);
CREATE INDEX IF NOT EXISTS videos_by_status ON videos (status, priority DESC, seq);
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    path TEXT NOT NULL,
    clips INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS fine_tunes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    model TEXT NOT NULL,
    training_file TEXT NOT NULL,
    hyperparameters TEXT NOT NULL,
    seed INTEGER NOT NULL,
    suffix TEXT,
    output_dir TEXT NOT NULL,
    fine_tuned_model TEXT,
    step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    finished_at INTEGER,
    error_code TEXT,
    error_message TEXT
);
CREATE INDEX IF NOT EXISTS fine_tunes_by_status ON fine_tunes (status, seq);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    type TEXT NOT NULL,
    level TEXT NOT NULL DEFAULT 'info',
    message TEXT NOT NULL DEFAULT '',
    data TEXT
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, seq);
CREATE TABLE IF NOT EXISTS checkpoints (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    metrics TEXT
);
CREATE TABLE IF NOT EXISTS models (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    parent TEXT NOT NULL,
    path TEXT NOT NULL,
    job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency (
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    resource_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (scope, key)
);
"""


def now() -> int:
    return int(time.time())


class JobStore:
    """Jobs, files, events, checkpoints, fine-tuned models and idempotency keys in one database."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per state change.
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a COMMIT returns only once the WAL is on disk, so an acknowledged job survives
            # a power cut as well as a kill -9.
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA busy_timeout=5000")
            self._conn.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextlib.contextmanager
    def _tx(self):
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _one(self, sql: str, args=()) -> dict | None:
        with self._lock:
            row = self._conn.execute(sql, args).fetchone()
        return dict(row) if row is not None else None

    def _all(self, sql: str, args=()) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._conn.execute(sql, args).fetchall()]

    @staticmethod
    def _event(
        conn, job_id: str, type_: str, message: str = "", data: dict | None = None, level="info"
    ):
        conn.execute(
            "INSERT INTO events (job_id, created_at, type, level, message, data) VALUES (?, ?, ?, ?, ?, ?)",
            (job_id, now(), type_, level, message, json.dumps(data) if data is not None else None),
        )

    # -----------------------------------------------------------------------------------------
    # start-up

    def reconcile(self) -> dict[str, int]:
        """Put work that was running when the last process died back in the queue.

        A cancellation that was asked for but not yet honoured is honoured now instead.
        """
        with self._tx() as c:
            cancelled = [
                r["id"]
                for r in c.execute(
                    "SELECT id FROM videos WHERE status = 'in_progress' AND cancel_requested = 1"
                )
            ]
            for vid in cancelled:
                c.execute(
                    "UPDATE videos SET status = 'cancelled', completed_at = ? WHERE id = ?",
                    (now(), vid),
                )
                self._event(
                    c,
                    vid,
                    "video.cancelled",
                    data={"status": "cancelled", "progress": 0, "step": 0},
                )
            videos = [
                r["id"] for r in c.execute("SELECT id FROM videos WHERE status = 'in_progress'")
            ]
            for vid in videos:
                c.execute(
                    "UPDATE videos SET status = 'queued', progress = 0, step = 0 WHERE id = ?",
                    (vid,),
                )
                self._event(
                    c,
                    vid,
                    "video.queued",
                    "requeued: the server restarted while it ran",
                    {"status": "queued", "progress": 0, "step": 0},
                )
            c.execute(
                "UPDATE fine_tunes SET status = 'cancelled', finished_at = ? "
                "WHERE status = 'running' AND cancel_requested = 1",
                (now(),),
            )
            tunes = [
                r["id"] for r in c.execute("SELECT id FROM fine_tunes WHERE status = 'running'")
            ]
            for job in tunes:
                c.execute("UPDATE fine_tunes SET status = 'queued' WHERE id = ?", (job,))
                self._event(
                    c,
                    job,
                    "message",
                    "requeued: the server restarted; resuming from the last checkpoint",
                )
            c.execute("DELETE FROM idempotency WHERE created_at < ?", (now() - IDEMPOTENCY_TTL_S,))
        return {
            "videos_requeued": len(videos),
            "videos_cancelled": len(cancelled),
            "fine_tunes_requeued": len(tunes),
        }

    # -----------------------------------------------------------------------------------------
    # idempotency

    def idempotent(self, scope: str, key: str) -> dict | None:
        """The `(request_hash, resource_id)` a key was first used with, if within its lifetime."""
        return self._one(
            "SELECT request_hash, resource_id FROM idempotency WHERE scope = ? AND key = ? AND created_at >= ?",
            (scope, key, now() - IDEMPOTENCY_TTL_S),
        )

    @staticmethod
    def _remember(c, idempotency: tuple[str, str, str] | None, resource_id: str) -> None:
        if idempotency is not None:
            scope, key, request_hash = idempotency
            c.execute(
                "INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, ?, ?)",
                (scope, key, request_hash, resource_id, now()),
            )

    def queue_depth(self) -> int:
        """Jobs waiting for the worker: queued videos and queued fine-tunes."""
        row = self._one(
            "SELECT (SELECT COUNT(*) FROM videos WHERE status = 'queued') + "
            "(SELECT COUNT(*) FROM fine_tunes WHERE status = 'queued') AS n"
        )
        return row["n"]

    def counts_by_state(self) -> dict[tuple[str, str], int]:
        out = {}
        for kind, table in (("video", "videos"), ("fine_tune", "fine_tunes")):
            for r in self._all(f"SELECT status, COUNT(*) AS n FROM {table} GROUP BY status"):
                out[(kind, r["status"])] = r["n"]
        return out

    # -----------------------------------------------------------------------------------------
    # videos

    def insert_video(self, video_id: str, spec: dict, priority: int = 0, idempotency=None) -> dict:
        """Queue a resolved video request (`ResolvedVideo.to_dict()`)."""
        with self._tx() as c:
            c.execute(
                "INSERT INTO videos (id, created_at, status, model, priority, spec) VALUES (?, ?, 'queued', ?, ?, ?)",
                (video_id, now(), spec["model"], priority, json.dumps(spec)),
            )
            self._event(
                c, video_id, "video.queued", data={"status": "queued", "progress": 0, "step": 0}
            )
            self._remember(c, idempotency, video_id)
        return self.get_video(video_id)

    def get_video(self, video_id: str) -> dict | None:
        return self._one("SELECT * FROM videos WHERE id = ?", (video_id,))

    def list_videos(self, after: str | None, limit: int, order: str) -> tuple[list[dict], bool]:
        """A page of videos in creation order and whether more follow; `after` is an id cursor."""
        return self._page("videos", after, limit, order)

    def _page(
        self, table: str, after, limit, order, where: str = "1", args=()
    ) -> tuple[list[dict], bool]:
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        if after is not None:
            where += f" AND seq {op} (SELECT seq FROM {table} WHERE id = ?)"
            args = (*args, after)
        rows = self._all(
            f"SELECT * FROM {table} WHERE {where} ORDER BY seq {direction} LIMIT ?",
            (*args, limit + 1),
        )
        return rows[:limit], len(rows) > limit

    def queued_videos(self, limit: int) -> list[dict]:
        """Queued videos in the order they should run: higher priority first, then first come."""
        return self._all(
            "SELECT * FROM videos WHERE status = 'queued' ORDER BY priority DESC, seq ASC LIMIT ?",
            (limit,),
        )

    def queue_position(self, video_id: str) -> int | None:
        """Where a queued video stands in `queued_videos`' order (1 = next), None unless queued."""
        row = self._one(
            "SELECT 1 + (SELECT COUNT(*) FROM videos o WHERE o.status = 'queued' AND "
            "(o.priority > v.priority OR (o.priority = v.priority AND o.seq < v.seq))) AS position "
            "FROM videos v WHERE v.id = ? AND v.status = 'queued'",
            (video_id,),
        )
        return row["position"] if row is not None else None

    def start_video(self, video_id: str) -> bool:
        """queued -> in_progress; False if it was cancelled meanwhile."""
        with self._tx() as c:
            n = c.execute(
                "UPDATE videos SET status = 'in_progress', progress = 0, step = 0, started_at = ?, "
                "attempts = attempts + 1 WHERE id = ? AND status = 'queued'",
                (now(), video_id),
            ).rowcount
            if n:
                self._event(
                    c,
                    video_id,
                    "video.in_progress",
                    data={"status": "in_progress", "progress": 0, "step": 0},
                )
        return bool(n)

    def set_video_progress(self, updates: list[tuple[str, int, int]]) -> None:
        """`(id, step, progress)` for each running video, in one transaction."""
        with self._tx() as c:
            for video_id, step, progress in updates:
                c.execute(
                    "UPDATE videos SET step = ?, progress = ? WHERE id = ? AND status = 'in_progress'",
                    (step, progress, video_id),
                )
                self._event(
                    c,
                    video_id,
                    "video.progress",
                    data={"status": "in_progress", "progress": progress, "step": step},
                )

    def finish_video(self, video_id: str, status: str, *, expires_at=None, error=None) -> bool:
        """in_progress -> completed | failed | cancelled. A pending cancel wins over completion."""
        code, message = error if error else (None, None)
        with self._tx() as c:
            row = c.execute(
                "SELECT status, cancel_requested, progress, step FROM videos WHERE id = ?",
                (video_id,),
            ).fetchone()
            if row is None or row["status"] != "in_progress":
                return False
            if row["cancel_requested"] and status == "completed":
                status, expires_at = "cancelled", None
            progress = 100 if status == "completed" else row["progress"]
            c.execute(
                "UPDATE videos SET status = ?, progress = ?, completed_at = ?, expires_at = ?, error_code = ?, "
                "error_message = ? WHERE id = ?",
                (status, progress, now(), expires_at, code, message, video_id),
            )
            data = {"status": status, "progress": progress, "step": row["step"]}
            if error:
                data["error"] = {"code": code, "message": message}
            self._event(
                c,
                video_id,
                f"video.{status}",
                message or "",
                data,
                level="error" if error else "info",
            )
        return status == "completed"

    def cancel_video(self, video_id: str) -> str | None:
        """Cancel a queued video now, or flag a running one for the worker. Returns the status after."""
        with self._tx() as c:
            row = c.execute("SELECT status FROM videos WHERE id = ?", (video_id,)).fetchone()
            if row is None:
                return None
            if row["status"] == "queued":
                c.execute(
                    "UPDATE videos SET status = 'cancelled', completed_at = ? WHERE id = ?",
                    (now(), video_id),
                )
                self._event(
                    c,
                    video_id,
                    "video.cancelled",
                    data={"status": "cancelled", "progress": 0, "step": 0},
                )
                return "cancelled"
            if row["status"] == "in_progress":
                c.execute("UPDATE videos SET cancel_requested = 1 WHERE id = ?", (video_id,))
            return row["status"]

    def cancel_requested_videos(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        marks = ",".join("?" * len(ids))
        return {
            r["id"]
            for r in self._all(
                f"SELECT id FROM videos WHERE cancel_requested = 1 AND id IN ({marks})", tuple(ids)
            )
        }

    def requeue_videos(self, ids: list[str], reason: str) -> None:
        """in_progress -> queued (a graceful shutdown): the job runs again from noise next time."""
        with self._tx() as c:
            for video_id in ids:
                n = c.execute(
                    "UPDATE videos SET status = 'queued', progress = 0, step = 0 "
                    "WHERE id = ? AND status = 'in_progress'",
                    (video_id,),
                ).rowcount
                if n:
                    self._event(
                        c,
                        video_id,
                        "video.queued",
                        reason,
                        {"status": "queued", "progress": 0, "step": 0},
                    )

    def delete_video(self, video_id: str) -> bool:
        with self._tx() as c:
            n = c.execute(
                "DELETE FROM videos WHERE id = ? AND status IN ('completed', 'failed', 'cancelled')",
                (video_id,),
            ).rowcount
            if n:
                c.execute("DELETE FROM events WHERE job_id = ?", (video_id,))
        return n > 0

    def expired_videos(self) -> list[str]:
        return [
            r["id"]
            for r in self._all(
                "SELECT id FROM videos WHERE expires_at IS NOT NULL AND expires_at < ?", (now(),)
            )
        ]

    def file_ids(self) -> set[str]:
        return {r["id"] for r in self._all("SELECT id FROM files")}

    def events_after(self, job_id: str, after_seq: int, limit: int = 100) -> list[dict]:
        """A job's events in order, starting after `after_seq` (for SSE and its Last-Event-ID)."""
        return self._all(
            "SELECT * FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after_seq, limit),
        )

    # -----------------------------------------------------------------------------------------
    # files

    def insert_file(self, row: dict, idempotency=None) -> dict:
        with self._tx() as c:
            c.execute(
                "INSERT INTO files (id, created_at, filename, purpose, bytes, path, clips) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    row["id"],
                    now(),
                    row["filename"],
                    row["purpose"],
                    row["bytes"],
                    row["path"],
                    row["clips"],
                ),
            )
            self._remember(c, idempotency, row["id"])
        return self.get_file(row["id"])

    def get_file(self, file_id: str) -> dict | None:
        return self._one("SELECT * FROM files WHERE id = ?", (file_id,))

    def list_files(self, after, limit, order, purpose=None) -> tuple[list[dict], bool]:
        if purpose:
            return self._page("files", after, limit, order, "purpose = ?", (purpose,))
        return self._page("files", after, limit, order)

    def delete_file(self, file_id: str) -> str:
        """'deleted', 'missing', or 'in_use' when an active fine-tune still reads it."""
        with self._tx() as c:
            placeholders = ",".join("?" * len(FINETUNE_ACTIVE))
            busy = c.execute(
                f"SELECT 1 FROM fine_tunes WHERE training_file = ? AND status IN ({placeholders})",
                (file_id, *FINETUNE_ACTIVE),
            ).fetchone()
            if busy:
                return "in_use"
            return (
                "deleted"
                if c.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
                else "missing"
            )

    # -----------------------------------------------------------------------------------------
    # fine-tunes

    def insert_finetune(self, row: dict, idempotency=None) -> dict:
        with self._tx() as c:
            c.execute(
                "INSERT INTO fine_tunes (id, created_at, status, model, training_file, hyperparameters, seed, "
                "suffix, output_dir) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                (
                    row["id"],
                    now(),
                    row["model"],
                    row["training_file"],
                    json.dumps(row["hyperparameters"]),
                    row["seed"],
                    row["suffix"],
                    row["output_dir"],
                ),
            )
            self._event(c, row["id"], "message", f"Created fine-tuning job: {row['id']}")
            self._remember(c, idempotency, row["id"])
        return self.get_finetune(row["id"])

    def get_finetune(self, job_id: str) -> dict | None:
        return self._one("SELECT * FROM fine_tunes WHERE id = ?", (job_id,))

    def list_finetunes(self, after, limit, order="desc") -> tuple[list[dict], bool]:
        return self._page("fine_tunes", after, limit, order)

    def next_finetune(self) -> dict | None:
        return self._one("SELECT * FROM fine_tunes WHERE status = 'queued' ORDER BY seq LIMIT 1")

    def start_finetune(self, job_id: str) -> int | None:
        """queued -> running; returns the attempt number (1 = first run), None if cancelled meanwhile."""
        with self._tx() as c:
            n = c.execute(
                "UPDATE fine_tunes SET status = 'running', attempts = attempts + 1 "
                "WHERE id = ? AND status = 'queued'",
                (job_id,),
            ).rowcount
            if not n:
                return None
            return c.execute("SELECT attempts FROM fine_tunes WHERE id = ?", (job_id,)).fetchone()[
                "attempts"
            ]

    def finetune_progress(
        self, job_id: str, step: int, total_steps: int, metrics: dict | None
    ) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE fine_tunes SET step = ?, total_steps = ? WHERE id = ?",
                (step, total_steps, job_id),
            )
            if metrics is not None:
                self._event(
                    c,
                    job_id,
                    "metrics",
                    f"Step {step}/{total_steps}: training loss={metrics['loss']:.4f}",
                    metrics,
                )

    def add_event(
        self, job_id: str, message: str, type_: str = "message", data=None, level="info"
    ) -> None:
        with self._tx() as c:
            self._event(c, job_id, type_, message, data, level)

    def finetune_events(
        self, job_id: str, after: str | None, limit: int
    ) -> tuple[list[dict], bool]:
        """Newest first, as the OpenAI API pages them; `after` is an event id (`ftevent-<seq>`)."""
        where, args = "job_id = ?", (job_id,)
        if after is not None:
            where += " AND seq < ?"
            args = (*args, int(after.removeprefix("ftevent-")))
        rows = self._all(
            f"SELECT * FROM events WHERE {where} ORDER BY seq DESC LIMIT ?", (*args, limit + 1)
        )
        return rows[:limit], len(rows) > limit

    def finish_finetune(
        self, job_id: str, status: str, *, error=None, model: dict | None = None
    ) -> bool:
        """running -> succeeded | failed | cancelled; a success registers its model in the same transaction."""
        code, message = error if error else (None, None)
        with self._tx() as c:
            n = c.execute(
                "UPDATE fine_tunes SET status = ?, finished_at = ?, error_code = ?, error_message = ?, "
                "fine_tuned_model = ? WHERE id = ? AND status IN ('queued', 'running')",
                (status, now(), code, message, model["name"] if model else None, job_id),
            ).rowcount
            if not n:
                return False
            if model is not None:
                c.execute(
                    "INSERT INTO models (name, parent, path, job_id, created_at) VALUES (?, ?, ?, ?, ?)",
                    (model["name"], model["parent"], model["path"], job_id, now()),
                )
            text = {
                "succeeded": "The job has successfully completed",
                "cancelled": "The job was cancelled",
            }
            self._event(
                c,
                job_id,
                "message",
                message or text.get(status, status),
                level="error" if error else "info",
            )
        return True

    def cancel_finetune(self, job_id: str) -> str | None:
        """Cancel a queued job now or flag a running one; returns the status after."""
        with self._tx() as c:
            row = c.execute("SELECT status FROM fine_tunes WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            if row["status"] == "queued":
                c.execute(
                    "UPDATE fine_tunes SET status = 'cancelled', finished_at = ? WHERE id = ?",
                    (now(), job_id),
                )
                self._event(c, job_id, "message", "The job was cancelled")
                return "cancelled"
            if row["status"] == "running":
                c.execute("UPDATE fine_tunes SET cancel_requested = 1 WHERE id = ?", (job_id,))
            return row["status"]

    def finetune_cancel_requested(self, job_id: str) -> bool:
        row = self._one("SELECT cancel_requested FROM fine_tunes WHERE id = ?", (job_id,))
        return bool(row and row["cancel_requested"])

    def requeue_finetune(self, job_id: str, reason: str) -> None:
        with self._tx() as c:
            if c.execute(
                "UPDATE fine_tunes SET status = 'queued' WHERE id = ? AND status = 'running'",
                (job_id,),
            ).rowcount:
                self._event(c, job_id, "message", reason)

    def add_checkpoint(
        self, checkpoint_id: str, job_id: str, step: int, path: str, metrics: dict | None
    ) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT OR IGNORE INTO checkpoints (id, job_id, created_at, step, path, metrics) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (
                    checkpoint_id,
                    job_id,
                    now(),
                    step,
                    path,
                    json.dumps(metrics) if metrics else None,
                ),
            )

    def checkpoints(self, job_id: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        return self._page("checkpoints", after, limit, "desc", "job_id = ?", (job_id,))

    # -----------------------------------------------------------------------------------------
    # fine-tuned models

    def models(self) -> list[dict]:
        return self._all("SELECT * FROM models ORDER BY seq")


class AsyncStore:
    """The job store for async code: `await store.get_video(id)` runs `JobStore.get_video` in a
    worker thread, so the event loop goes on serving other requests meanwhile."""

    def __init__(self, store: JobStore):
        self.sync = store

    def __getattr__(self, name: str):
        method = getattr(self.sync, name)

        async def call(*args, **kwargs):
            return await anyio.to_thread.run_sync(functools.partial(method, *args, **kwargs))

        return call
