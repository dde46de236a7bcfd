"""Video jobs: the API's side (queue, read, list, cancel, delete), a worker's side (claim,
progress, finish, requeue), the queue's order and each video's place in it, and the event log the
SSE streams read.

    video: queued -> in_progress -> completed | failed | cancelled;  queued -> cancelled
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Hashable

import sqlalchemy as sa

from ..records import EventRecord, VideoRecord
from ..tables import events, videos
from .database import (
    RELEASED,
    VIDEO_ACTIVE,
    VIDEO_TERMINAL,
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

CLAIM_LOOKAHEAD = 32  # queued videos a worker looks past for ones it can run
# The status poll's read, built once: building a select costs more than running it on SQLite.
GET_VIDEO = sa.select(videos).where(videos.c.id == sa.bindparam("video_id"))


def _queue_order(stmt: sa.Select) -> sa.Select:
    stmt = stmt.where(videos.c.status == "queued")
    # Within a priority, a video whose worker died under it waits behind those that never
    # crashed one: a poison job cannot hold the head of the queue.
    return stmt.order_by(videos.c.priority.desc(), videos.c.crashes, videos.c.seq)


class VideoStore:
    """The `videos` table and the events of its jobs."""

    def __init__(self, db: Database, *, crash_limit: int):
        self.db = db
        self.crash_limit = crash_limit

    # --- the API's side ----------------------------------------------------------------------

    def insert(
        self,
        video_id: str,
        spec: dict,
        priority: int = 0,
        idempotency: Reservation | None = None,
        owner: str | None = None,
        pixel_key: str | None = None,
    ) -> VideoRecord:
        """Queue a resolved video request (`ResolvedVideo.to_dict()`) for `owner`; `pixel_key`
        finds it for the requests that repeat it once it is completed (`repeated`)."""
        with self.db.tx() as conn:
            conn.execute(
                videos.insert().values(
                    id=video_id,
                    created_at=now(),
                    status="queued",
                    model=spec["model"],
                    priority=priority,
                    spec=json.dumps(spec),
                    owner=owner,
                    pixel_key=pixel_key,
                )
            )
            data = {"status": "queued", "progress": 0, "step": 0}
            append_event(conn, video_id, "video.queued", data=data)
            remember(conn, idempotency, video_id)
        return self.get(video_id)

    def repeated(self, owner: str | None, pixel_key: str) -> VideoRecord | None:
        """The newest completed video of `owner` with `pixel_key` whose content has not expired,
        or None. Another owner's is never found (NULL finds only the videos made without keys)."""
        owned = videos.c.owner.is_(None) if owner is None else videos.c.owner == owner
        stmt = (
            sa.select(videos)
            .where(
                owned,
                videos.c.pixel_key == pixel_key,
                videos.c.status == "completed",
                sa.or_(videos.c.expires_at.is_(None), videos.c.expires_at >= now()),
            )
            .order_by(videos.c.seq.desc())
            .limit(1)
        )
        return record(VideoRecord, self.db.one(stmt))

    def insert_repeat(
        self,
        video_id: str,
        spec: dict,
        source: VideoRecord,
        *,
        expires_at: int,
        priority: int = 0,
        idempotency: Reservation | None = None,
        owner: str | None = None,
    ) -> VideoRecord:
        """A video completed at once with the content of `source` (its files are already in
        place): a request that repeats `source` in everything that decides its pixels. It ran
        no pass of the model (`passes` 0), and names `source` in `cached_from`."""
        stamp = now()
        with self.db.tx() as conn:
            conn.execute(
                videos.insert().values(
                    id=video_id,
                    created_at=stamp,
                    status="completed",
                    progress=100,
                    step=source.step,
                    passes=0,
                    model=spec["model"],
                    priority=priority,
                    spec=json.dumps(spec),
                    owner=owner,
                    started_at=stamp,
                    completed_at=stamp,
                    expires_at=expires_at,
                    pixel_key=source.pixel_key,
                    cached_from=source.id,
                )
            )
            data = {"status": "completed", "progress": 100, "step": source.step}
            append_event(conn, video_id, "video.completed", data=data)
            remember(conn, idempotency, video_id)
        return self.get(video_id)

    def repeats(self) -> int:
        """The videos in the store that were answered with another's content."""
        stmt = sa.select(sa.func.count().label("n")).where(videos.c.cached_from.is_not(None))
        return self.db.one(stmt)["n"]

    def get(self, video_id: str) -> VideoRecord | None:
        """The video, or None."""
        return record(VideoRecord, self.db.one(GET_VIDEO, {"video_id": video_id}))

    def page(
        self, after: str | None, limit: int, order: str, owner: str | None = None
    ) -> tuple[list[VideoRecord], bool]:
        """A page of the videos `owner` may see."""
        visible = visible_to(videos, owner)
        return self.db.page(videos, after, limit, order, *visible, decode=VideoRecord.from_row)

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
        row = self.db.one(stmt)
        return row["position"] if row is not None else None

    def queue_positions(self) -> dict[str, int]:
        """Every queued video's place in the queue (1 = next), in one query."""
        stmt = _queue_order(sa.select(videos.c.id))
        return {row["id"]: n for n, row in enumerate(self.db.all(stmt), start=1)}

    def cancel(self, video_id: str) -> str | None:
        """Cancel a queued video now, or flag a running one for its worker. Returns the status
        after, None if there is no such video."""
        with self.db.tx() as conn:
            row = self.db.locked(conn, videos, video_id)
            if row is None:
                return None
            if row["status"] == "queued":
                conn.execute(
                    videos.update()
                    .where(videos.c.id == video_id)
                    .values(status="cancelled", completed_at=now())
                )
                data = {"status": "cancelled", "progress": 0, "step": 0}
                append_event(conn, video_id, "video.cancelled", data=data)
                return "cancelled"
            if row["status"] == "in_progress":
                conn.execute(
                    videos.update().where(videos.c.id == video_id).values(cancel_requested=1)
                )
            return row["status"]

    def delete(self, video_id: str) -> bool:
        """Delete a finished video and its events; False when none is (it runs, or is gone)."""
        with self.db.tx() as conn:
            finished = sa.and_(videos.c.id == video_id, videos.c.status.in_(VIDEO_TERMINAL))
            n = conn.execute(videos.delete().where(finished)).rowcount
            if n:
                conn.execute(events.delete().where(events.c.job_id == video_id))
        return n > 0

    def expired(self) -> list[str]:
        """The videos past their `expires_at`."""
        stmt = sa.select(videos.c.id).where(
            videos.c.expires_at.is_not(None), videos.c.expires_at < now()
        )
        return [r["id"] for r in self.db.all(stmt)]

    def naming_adapter(self, model: str, name: str) -> list[str]:
        """The queued or running videos of base model `model` that apply adapter `name`."""
        stmt = sa.select(videos.c.id, videos.c.spec).where(
            videos.c.model == model, videos.c.status.in_(VIDEO_ACTIVE)
        )
        with self.db.tx() as conn:
            rows = conn.execute(stmt).all()
        return [
            video_id
            for video_id, spec in rows
            if any(c["name"] == name for c in json.loads(spec).get("loras") or ())
        ]

    # --- events ------------------------------------------------------------------------------

    def events_after(self, job_id: str, after_seq: int, limit: int = 100) -> list[EventRecord]:
        """A job's events in order, starting after `after_seq` (for SSE and its Last-Event-ID)."""
        stmt = (
            sa.select(events)
            .where(events.c.job_id == job_id, events.c.seq > after_seq)
            .order_by(events.c.seq)
            .limit(limit)
        )
        return [EventRecord.from_row(r) for r in self.db.all(stmt)]

    def last_event_seq(self) -> int:
        """Where the event log of every job ends now (0: it is empty)."""
        newest = self.db.one(sa.select(sa.func.max(events.c.seq).label("seq")))
        return (newest or {}).get("seq") or 0

    def events_since(self, after_seq: int, limit: int = 1000) -> list[EventRecord]:
        """Every job's events after `after_seq`, in order. One query feeds every SSE stream of an
        API process (feed.py)."""
        stmt = sa.select(events).where(events.c.seq > after_seq).order_by(events.c.seq)
        return [EventRecord.from_row(r) for r in self.db.all(stmt.limit(limit))]

    # --- a worker's side ---------------------------------------------------------------------

    def claim(
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
        among the next `CLAIM_LOOKAHEAD`. A suspect video (see `requeue_where`) runs alone: it
        is claimed only by a worker that holds no other video, and nothing joins it. Each video
        comes back in progress, with its `lease_token`."""
        if room <= 0 or not served:
            return []
        stmt = _queue_order(sa.select(videos).where(videos.c.model.in_(served)))
        lookahead = CLAIM_LOOKAHEAD if runnable is not None else 0
        stmt = stmt.limit(room + lookahead).with_for_update(skip_locked=True)
        held = sa.select(sa.func.count().label("n"), sa.func.max(videos.c.suspect).label("s"))
        held = held.where(videos.c.status == "in_progress", videos.c.worker_id == worker)
        claimed = []
        with self.db.tx() as conn:
            holding = conn.execute(held).mappings().one()
            if holding["s"]:
                return []  # a suspect runs alone
            for row in conn.execute(stmt).mappings().all():
                if len(claimed) == room or (claimed and claimed[-1].suspect):
                    break
                video = VideoRecord.from_row(row)
                if runnable is not None and not runnable(video):
                    continue
                if video.suspect and (claimed or holding["n"]):
                    break  # it waits for this worker to be free, keeping its place
                key = batch_key(video)
                if running_key is None:
                    running_key = key
                elif key != running_key:
                    break
                claimed.append(self._take(conn, video, worker, lease_s))
        return claimed

    def _take(self, conn, video: VideoRecord, worker: str, lease_s: float) -> VideoRecord:
        """Puts a queued video in progress on `worker` under a new lease, with its event; the
        video as it now is."""
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
                lease_expires_at=self.db.clock() + lease_s,
            )
        )
        data = {"status": "in_progress", "progress": 0, "step": 0}
        append_event(conn, video.id, "video.in_progress", data=data)
        return dataclasses.replace(
            video,
            status="in_progress",
            progress=0,
            step=0,
            attempts=video.attempts + 1,
            worker_id=worker,
            lease_token=token,
        )

    def set_progress(
        self, updates: list[tuple], *, lease_s: float, previews: dict[str, str] | None = None
    ) -> set[str]:
        """`(id, lease_token, step, progress)` or `(id, lease_token, step, progress, passes)` for
        running videos, in one transaction; extends their leases. `passes`: the steps that ran a
        pass of the model (fewer than `step` when a step cache reused). `previews`: by video, an
        image of its clip as predicted at this step (a data URI), logged after its progress as a
        `video.preview` event. Returns the ids whose lease is no longer this claim's (stop
        working on them: another worker has them, or they ended)."""
        previews = previews or {}
        lost = set()
        with self.db.tx() as conn:
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
                    .values(**values, lease_expires_at=self.db.clock() + lease_s)
                ).rowcount
                if not n:
                    lost.add(video_id)
                    continue
                data = {"status": "in_progress", **values}
                append_event(conn, video_id, "video.progress", data=data)
                if video_id in previews:
                    data = {"step": step, "preview": previews[video_id]}
                    append_event(conn, video_id, "video.preview", data=data)
        return lost

    def finish(
        self, video_id: str, token: str, status: str, *, expires_at=None, error=None
    ) -> str | None:
        """in_progress -> completed | failed | cancelled under claim `token`. A pending cancel
        wins over completion. Returns the status written, or None when the claim is no longer
        this one (the outcome belongs to whoever holds the job now)."""
        code, message = error if error else (None, None)
        with self.db.tx() as conn:
            row = self.db.locked(conn, videos, video_id)
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
            append_event(conn, video_id, f"video.{status}", message or "", data, level=level)
            self._notify(conn, video_id, status, row["owner"])
        return status

    def _notify(self, conn: sa.Connection, video_id: str, status: str, owner: str | None) -> None:
        """Owe the webhooks of a video that completed or failed, in its transaction."""
        if status in ("completed", "failed"):
            snapshot = functools.partial(row_of, conn, videos, video_id)
            emit(self.db, conn, f"video.{status}", video_id, owner, snapshot)

    def cancel_requested(self, ids: list[str]) -> set[str]:
        """Those of `ids` whose cancellation is pending."""
        if not ids:
            return set()
        stmt = sa.select(videos.c.id).where(videos.c.cancel_requested == 1, videos.c.id.in_(ids))
        return {r["id"] for r in self.db.all(stmt)}

    def requeue(self, claims: list[tuple[str, str]], reason: str) -> None:
        """`(id, lease_token)` claims back to the queue (a graceful stop): each runs again from
        noise, on whichever worker claims it next."""
        if not claims:
            return
        with self.db.tx() as conn:
            held = sa.or_(
                *(sa.and_(videos.c.id == i, videos.c.lease_token == t) for i, t in claims)
            )
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
        """Running videos matching `where` back to the queue (from noise), or to cancelled.
        `crashed`: their worker died under them. A death counts against a video that ran alone
        (or among suspects only), and at `crash_limit` it fails instead; one that shared its
        worker with others that were not all suspect is not counted but made suspect: it runs
        alone from now on, so that the next death names the video at fault. `skip_locked`:
        leave rows another transaction holds (a recovery pass racing another). Returns how many
        went back to the queue."""
        stmt = (
            sa.select(
                videos.c.id,
                videos.c.cancel_requested,
                videos.c.crashes,
                videos.c.suspect,
                videos.c.worker_id,
                videos.c.owner,
            )
            .where(videos.c.status == "in_progress", where)
            .with_for_update(skip_locked=skip_locked)
        )
        rows = conn.execute(stmt).mappings().all()
        shared = self._shared(conn, {row["worker_id"] for row in rows}) if crashed else set()
        requeued = 0
        for row in rows:
            blamed = crashed and row["worker_id"] not in shared
            crashes = row["crashes"] + int(blamed)
            data = {"status": "queued", "progress": 0, "step": 0}
            if row["cancel_requested"]:
                status, message = "cancelled", ""
                changes = dict(status=status, completed_at=now(), **RELEASED)
            elif crashes >= self.crash_limit:
                changes = {**crashed_out(crashes, reason, "completed_at"), **RELEASED}
                status, message = "failed", changes["error_message"]
                data["error"] = {"code": changes["error_code"], "message": message}
            else:
                status, message = "queued", reason
                if crashed and not blamed:
                    message += "; it shared the worker with other videos, so it runs alone next"
                changes = dict(status=status, progress=0, step=0, **RELEASED)
                requeued += 1
            changes["crashes"] = crashes
            if crashed:
                changes["suspect"] = 1
            conn.execute(videos.update().where(videos.c.id == row["id"]).values(**changes))
            data["status"] = status
            level = "error" if status == "failed" else "info"
            append_event(conn, row["id"], f"video.{status}", message, data, level=level)
            self._notify(conn, row["id"], status, row["owner"])
        return requeued

    def _shared(self, conn: sa.Connection, workers: set[str | None]) -> set[str]:
        """Those of `workers` that died holding several videos, not all of them suspect: which
        one killed it is unknown. Counted over every video the worker held, not only those
        `where` matched (one whose lease had not yet run out shared its death too)."""
        named = {w for w in workers if w is not None}
        if not named:
            return set()
        stmt = (
            sa.select(videos.c.worker_id)
            .where(videos.c.status == "in_progress", videos.c.worker_id.in_(named))
            .group_by(videos.c.worker_id)
            .having(sa.func.count() > 1, sa.func.min(videos.c.suspect) == 0)
        )
        return {row["worker_id"] for row in conn.execute(stmt).mappings()}
