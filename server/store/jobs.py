"""What spans both kinds of job, videos and fine-tunes: the queue's depth, the counts by state the
metrics show, and the pruning of the events of jobs that are over."""

from __future__ import annotations

import sqlalchemy as sa

from ..tables import events, fine_tunes, models, videos
from .database import FINETUNE_ACTIVE, VIDEO_ACTIVE, Database, now


class Jobs:
    """Reads and housekeeping over the `videos` and `fine_tunes` tables together."""

    def __init__(self, db: Database):
        self.db = db

    def queue_depth(self, owner: str | None = None) -> int:
        """Jobs waiting for a worker: queued videos and queued fine-tunes (of `owner` alone, when
        given)."""
        if owner is None:
            return sum(self.queue_depth_by_model().values())
        total = 0
        for table in (videos, fine_tunes):
            mine = sa.and_(table.c.status == "queued", table.c.owner == owner)
            total += self.db.one(sa.select(sa.func.count().label("n")).where(mine))["n"]
        return total

    def queue_depth_by_model(self) -> dict[str, int]:
        """Queued jobs (videos and fine-tunes) per base model they need. A fine-tuned model's
        jobs count under the base model it was tuned from: its name carries its owner's suffix
        and job id, which the metrics every key may scrape must not show."""
        out: dict[str, int] = {}
        for table in (videos, fine_tunes):
            stmt = (
                sa.select(table.c.model, sa.func.count().label("n"))
                .where(table.c.status == "queued")
                .group_by(table.c.model)
            )
            for row in self.db.all(stmt):
                out[row["model"]] = out.get(row["model"], 0) + row["n"]
        base = self._bases(set(out))
        counts: dict[str, int] = {}
        for model, n in out.items():
            counts[base[model]] = counts.get(base[model], 0) + n
        return counts

    def _bases(self, names: set[str]) -> dict[str, str]:
        """Each of `names` mapped to the base model under it: a fine-tune of a fine-tune is
        walked up to the first name that no fine-tune registered, the base it was made from."""
        # One level per round; it ends, as a model's parent was registered before it.
        base = {name: name for name in names}
        parents: dict[str, str] = {}
        asked: set[str] = set()
        while True:
            if pending := set(base.values()) - asked:
                asked |= pending
                stmt = sa.select(models.c.name, models.c.parent).where(models.c.name.in_(pending))
                parents.update((row["name"], row["parent"]) for row in self.db.all(stmt))
            up = {name: parents.get(top, top) for name, top in base.items()}
            if up == base:
                return base
            base = up

    def counts_by_state(self) -> dict[tuple[str, str], int]:
        """Jobs per `(kind, status)`, kind "video" or "fine_tune"."""
        out = {}
        for kind, table in (("video", videos), ("fine_tune", fine_tunes)):
            stmt = sa.select(table.c.status, sa.func.count().label("n")).group_by(table.c.status)
            for row in self.db.all(stmt):
                out[(kind, row["status"])] = row["n"]
        return out

    def prune_events(self, older_than_s: float) -> int:
        """Delete events older than `older_than_s` of jobs that are over (or gone); returns how
        many. The events of queued and running jobs stay, however old."""
        active = sa.union_all(
            sa.select(videos.c.id).where(videos.c.status.in_(VIDEO_ACTIVE)),
            sa.select(fine_tunes.c.id).where(fine_tunes.c.status.in_(FINETUNE_ACTIVE)),
        )
        stale = sa.and_(events.c.created_at < now() - older_than_s, events.c.job_id.not_in(active))
        with self.db.tx() as conn:
            return conn.execute(events.delete().where(stale)).rowcount
