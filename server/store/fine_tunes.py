"""Fine-tuning jobs: the API's side (create, read, list, cancel, events, checkpoints) and a
worker's side (claim, progress, checkpoints and events under its claim, finish, requeue).

    fine-tune: queued -> running -> succeeded | failed | cancelled;  queued -> cancelled

A worker's writes name its claim (`lease_token`) and lock the job's row; a fine-tune requeued
resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Iterator

import sqlalchemy as sa

from ..records import CheckpointRecord, EventRecord, FineTuneRecord
from ..tables import checkpoints, events, fine_tunes
from . import models
from .database import (
    RELEASED,
    ClaimLost,
    Database,
    append_event,
    crashed_out,
    new_token,
    now,
    record,
    visible_to,
)
from .keys import Reservation, remember
from .webhooks import emit, row_of


class FineTuneStore:
    """The `fine_tunes` table, with its jobs' checkpoints and events."""

    def __init__(self, db: Database, *, crash_limit: int):
        self.db = db
        self.crash_limit = crash_limit

    # --- the API's side ----------------------------------------------------------------------

    def insert(self, row: dict, idempotency: Reservation | None = None) -> FineTuneRecord:
        """Queue a fine-tune (`row`: its columns, hyperparameters resolved)."""
        keys = ("id", "model", "training_file", "seed", "suffix", "output_dir")
        with self.db.tx() as conn:
            conn.execute(
                fine_tunes.insert().values(
                    created_at=now(),
                    status="queued",
                    hyperparameters=json.dumps(row["hyperparameters"]),
                    owner=row.get("owner"),
                    **{k: row[k] for k in keys},
                )
            )
            append_event(conn, row["id"], "message", f"Created fine-tuning job: {row['id']}")
            remember(conn, idempotency, row["id"])
        return self.get(row["id"])

    def get(self, job_id: str) -> FineTuneRecord | None:
        """The job, or None."""
        row = self.db.one(sa.select(fine_tunes).where(fine_tunes.c.id == job_id))
        return record(FineTuneRecord, row)

    def page(
        self, after, limit, order="desc", owner: str | None = None
    ) -> tuple[list[FineTuneRecord], bool]:
        """A page of the jobs `owner` may see."""
        visible = visible_to(fine_tunes, owner)
        return self.db.page(
            fine_tunes, after, limit, order, *visible, decode=FineTuneRecord.from_row
        )

    def cancel(self, job_id: str) -> str | None:
        """Cancel a queued job now or flag a running one; returns the status after."""
        with self.db.tx() as conn:
            row = self.db.locked(conn, fine_tunes, job_id)
            if row is None:
                return None
            if row["status"] == "queued":
                conn.execute(
                    fine_tunes.update()
                    .where(fine_tunes.c.id == job_id)
                    .values(status="cancelled", finished_at=now())
                )
                append_event(conn, job_id, "message", "The job was cancelled")
                return "cancelled"
            if row["status"] == "running":
                conn.execute(
                    fine_tunes.update().where(fine_tunes.c.id == job_id).values(cancel_requested=1)
                )
            return row["status"]

    def events(self, job_id: str, after: str | None, limit: int) -> tuple[list[EventRecord], bool]:
        """Newest first, as the OpenAI API pages them; `after` is an event id (`ftevent-<seq>`)."""
        stmt = sa.select(events).where(events.c.job_id == job_id)
        if after is not None:
            stmt = stmt.where(events.c.seq < int(after.removeprefix("ftevent-")))
        rows = self.db.all(stmt.order_by(events.c.seq.desc()).limit(limit + 1))
        return [EventRecord.from_row(r) for r in rows[:limit]], len(rows) > limit

    def checkpoint(self, job_id: str, checkpoint_id: str) -> CheckpointRecord | None:
        """One of the job's checkpoints, by its id."""
        mine = checkpoints.c.job_id == job_id, checkpoints.c.id == checkpoint_id
        return record(CheckpointRecord, self.db.one(sa.select(checkpoints).where(*mine)))

    def checkpoints(
        self, job_id: str, after: str | None, limit: int
    ) -> tuple[list[CheckpointRecord], bool]:
        """A page of the job's checkpoints, newest first."""
        mine = checkpoints.c.job_id == job_id
        return self.db.page(
            checkpoints, after, limit, "desc", mine, decode=CheckpointRecord.from_row
        )

    # --- a worker's side ---------------------------------------------------------------------

    def claim(self, worker: str, served: list[str], *, lease_s: float) -> FineTuneRecord | None:
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
        with self.db.tx() as conn:
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
                    lease_expires_at=self.db.clock() + lease_s,
                )
            )
        job = FineTuneRecord.from_row(row)
        return dataclasses.replace(
            job, status="running", attempts=job.attempts + 1, worker_id=worker, lease_token=token
        )

    @contextlib.contextmanager
    def fenced(self, job_id: str, token: str) -> Iterator[None]:
        """A context in which a fine-tune's files may be published under claim `token`: the
        job's row is write-locked while it lasts (a takeover waits), and `ClaimLost` is raised
        at once when the claim is no longer this one."""
        with self.db.tx() as conn:
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

    def _held(self, conn: sa.Connection, job_id: str, token: str) -> dict | None:
        """The job's row while claim `token` still runs it (else None); locked for this
        transaction."""
        row = self.db.locked(conn, fine_tunes, job_id)
        held = row is not None and row["status"] == "running" and row["lease_token"] == token
        return row if held else None

    def set_progress(
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
        with self.db.tx() as conn:
            if not self._held(conn, job_id, token):
                return False
            conn.execute(
                fine_tunes.update()
                .where(fine_tunes.c.id == job_id)
                .values(
                    step=step, total_steps=total_steps, lease_expires_at=self.db.clock() + lease_s
                )
            )
            if metrics is not None:
                message = f"Step {step}/{total_steps}: training loss={metrics['loss']:.4f}"
                append_event(conn, job_id, "metrics", message, metrics)
        return True

    def rewind(self, job_id: str, token: str, step: int) -> bool:
        """A fine-tune resumed at `step`: the metrics its lost run recorded past that step are
        deleted, so the steps it runs again are reported once."""
        with self.db.tx() as conn:
            if not self._held(conn, job_id, token):
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
        with self.db.tx() as conn:
            if token is not None and not self._held(conn, job_id, token):
                return False
            if token is None:
                self.db.locked(conn, fine_tunes, job_id)  # orders it after the job's other events
            append_event(conn, job_id, type_, message, data, level)
        return True

    def add_checkpoint(
        self,
        checkpoint_id: str,
        job_id: str,
        token: str,
        step: int,
        path: str,
        metrics: dict | None,
        validation: list[dict] | None = None,
    ) -> bool:
        """Record a checkpoint written under claim `token` (once: its id is the step's), with
        the validation videos sampled from it; False when the claim is no longer this one."""
        with self.db.tx() as conn:
            held = self._held(conn, job_id, token)
            if not held:
                return False
            stmt = self.db.insert(checkpoints).values(
                id=checkpoint_id,
                job_id=job_id,
                created_at=now(),
                step=step,
                path=path,
                metrics=json.dumps(metrics) if metrics else None,
                validation=json.dumps(validation) if validation is not None else None,
            )
            if conn.execute(stmt.on_conflict_do_nothing()).rowcount:  # a first record of it
                type_ = "fine_tuning.job.checkpoint.created"
                emit(
                    self.db,
                    conn,
                    type_,
                    job_id,
                    held["owner"],
                    lambda: {"checkpoint": row_of(conn, checkpoints, checkpoint_id), "job": held},
                )
        return True

    def cancel_requested(self, job_id: str) -> bool:
        """Whether the job's cancellation is pending."""
        stmt = sa.select(fine_tunes.c.cancel_requested).where(fine_tunes.c.id == job_id)
        row = self.db.one(stmt)
        return bool(row and row["cancel_requested"])

    def finish(
        self, job_id: str, token: str, status: str, *, error=None, model: dict | None = None
    ) -> bool:
        """running -> succeeded | failed | cancelled under claim `token`; a success registers
        its model in the same transaction. False when the claim is no longer this one."""
        code, message = error if error else (None, None)
        with self.db.tx() as conn:
            job = self._held(conn, job_id, token)
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
                # A fine-tuned model is its job owner's.
                models.register(conn, model, job_id=job_id, owner=job["owner"])
            text = {
                "succeeded": "The job has successfully completed",
                "cancelled": "The job was cancelled",
            }
            level = "error" if error else "info"
            append_event(conn, job_id, "message", message or text.get(status, status), level=level)
            self._notify(conn, job_id, status, job["owner"])
        return True

    def _notify(self, conn: sa.Connection, job_id: str, status: str, owner: str | None) -> None:
        """Owe the webhooks of a job that succeeded or failed, in its transaction."""
        if status in ("succeeded", "failed"):
            snapshot = functools.partial(row_of, conn, fine_tunes, job_id)
            emit(self.db, conn, f"fine_tuning.job.{status}", job_id, owner, snapshot)

    def requeue(self, job_id: str, token: str, reason: str) -> None:
        """A graceful stop: the fine-tune returns to the queue, to resume from its checkpoint."""
        with self.db.tx() as conn:
            held = sa.and_(fine_tunes.c.id == job_id, fine_tunes.c.lease_token == token)
            self.requeue_where(conn, held, reason)

    def requeue_where(
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
        `crash_limit`-th time, to failed. Returns how many went back to the queue."""
        stmt = (
            sa.select(
                fine_tunes.c.id,
                fine_tunes.c.cancel_requested,
                fine_tunes.c.crashes,
                fine_tunes.c.owner,
            )
            .where(fine_tunes.c.status == "running", where)
            .with_for_update(skip_locked=skip_locked)
        )
        requeued = 0
        for row in conn.execute(stmt).mappings().all():
            crashes = row["crashes"] + int(crashed)
            level = "info"
            if row["cancel_requested"]:
                changes = dict(status="cancelled", finished_at=now(), **RELEASED)
                message = "The job was cancelled"
            elif crashes >= self.crash_limit:
                changes = {**crashed_out(crashes, reason, "finished_at"), **RELEASED}
                message, level = changes["error_message"], "error"
            else:
                changes = dict(status="queued", **RELEASED)
                message = f"{reason}; resuming from the last checkpoint"
                requeued += 1
            changes["crashes"] = crashes
            conn.execute(fine_tunes.update().where(fine_tunes.c.id == row["id"]).values(**changes))
            append_event(conn, row["id"], "message", message, level=level)
            self._notify(conn, row["id"], changes["status"], row["owner"])
        return requeued
