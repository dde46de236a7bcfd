"""The worker registry: each worker process registered under its name with its model cards,
proving itself alive by heartbeats that extend the leases of the jobs it runs, and the recovery
that requeues the jobs of workers that stopped."""

from __future__ import annotations

import json

import sqlalchemy as sa

from ..records import WorkerRecord
from ..tables import fine_tunes, videos, workers
from .database import Database, record
from .fine_tunes import FineTuneStore
from .videos import VideoStore


class WorkerRegistry:
    """The `workers` table, and the leases its workers hold on videos and fine-tunes."""

    def __init__(self, db: Database, videos: VideoStore, fine_tunes: FineTuneStore):
        self.db = db
        self.videos = videos
        self.fine_tunes = fine_tunes

    def get(self, name: str) -> WorkerRecord | None:
        """A worker's registration, with `age_s`: seconds since its last heartbeat."""
        age = (self.db.clock() - workers.c.heartbeat_at).label("age_s")
        return record(
            WorkerRecord, self.db.one(sa.select(workers, age).where(workers.c.name == name))
        )

    def register(
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
        with self.db.tx() as conn:
            row = dict(
                token=token,
                host=host,
                pid=pid,
                device=device,
                capacity=capacity,
                models=json.dumps(cards),
                started_at=self.db.clock(),
                heartbeat_at=self.db.clock(),
                ready=0,
                dead=None,
                metrics=None,
            )
            stmt = self.db.insert(workers).values(name=name, **row)
            conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_=row))
            reason = f"requeued: worker {name} restarted while it ran"
            held_v, held_f = videos.c.worker_id == name, fine_tunes.c.worker_id == name
            videos_back = self.videos.requeue_where(conn, held_v, reason, crashed=True)
            tunes_back = self.fine_tunes.requeue_where(conn, held_f, reason, crashed=True)
        return {"videos_requeued": videos_back, "fine_tunes_requeued": tunes_back}

    def publish_cards(self, name: str, token: str, cards: list[dict]) -> bool:
        """Replace the model cards worker `name` (incarnation `token`) serves, e.g. once it has
        registered an uploaded adapter; False when another incarnation holds the name."""
        with self.db.tx() as conn:
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
        with self.db.tx() as conn:
            n = conn.execute(
                workers.update()
                .where(workers.c.name == name, workers.c.token == token)
                .values(
                    heartbeat_at=self.db.clock(),
                    ready=int(ready),
                    dead=dead,
                    metrics=json.dumps(metrics) if metrics is not None else None,
                )
            ).rowcount
            if not n:
                return False
            if leases:
                expiry = self.db.clock() + lease_s
                for table in (videos, fine_tunes):
                    conn.execute(
                        table.update()
                        .where(table.c.lease_token.in_(leases), table.c.worker_id == name)
                        .values(lease_expires_at=expiry)
                    )
        return True

    def publish_metrics(self, name: str, token: str, metrics: dict) -> None:
        """Replace the metrics snapshot `name` shows (between heartbeats, after a step)."""
        with self.db.tx() as conn:
            conn.execute(
                workers.update()
                .where(workers.c.name == name, workers.c.token == token)
                .values(metrics=json.dumps(metrics))
            )

    def deregister(self, name: str, token: str) -> None:
        """Remove incarnation `token` of `name` from the registry (a clean shutdown)."""
        with self.db.tx() as conn:
            conn.execute(workers.delete().where(workers.c.name == name, workers.c.token == token))

    def live(self, ttl_s: float) -> list[WorkerRecord]:
        """Workers heard from within `ttl_s` seconds, oldest registration first."""
        fresh = workers.c.heartbeat_at >= self.db.clock() - ttl_s
        rows = self.db.all(sa.select(workers).where(fresh).order_by(workers.c.started_at))
        return [WorkerRecord.from_row(row) for row in rows]

    def recover_expired(self) -> dict[str, int]:
        """Requeue running jobs whose lease expired (their worker stopped renewing it); a job
        whose cancellation was pending is cancelled instead."""
        reason = "requeued: its worker stopped renewing its lease"
        with self.db.tx() as conn:
            expired = sa.or_(
                videos.c.lease_expires_at.is_(None), videos.c.lease_expires_at < self.db.clock()
            )
            videos_back = self.videos.requeue_where(
                conn, expired, reason, crashed=True, skip_locked=True
            )
            expired = sa.or_(
                fine_tunes.c.lease_expires_at.is_(None),
                fine_tunes.c.lease_expires_at < self.db.clock(),
            )
            tunes_back = self.fine_tunes.requeue_where(
                conn, expired, reason, crashed=True, skip_locked=True
            )
        return {"videos_requeued": videos_back, "fine_tunes_requeued": tunes_back}
