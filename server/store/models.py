"""Fine-tuned models: each registered by the fine-tune that made it, in the transaction recording
that job's success."""

from __future__ import annotations

import sqlalchemy as sa

from ..records import ModelRecord
from ..tables import models
from .database import Database, now


def register(conn: sa.Connection, model: dict, *, job_id: str, owner: str | None) -> None:
    """Add the model (`name`, `parent`, `path`) job `job_id` of `owner` made, in its transaction."""
    conn.execute(
        models.insert().values(
            name=model["name"],
            parent=model["parent"],
            path=model["path"],
            job_id=job_id,
            created_at=now(),
            owner=owner,
        )
    )


class ModelStore:
    """The `models` table."""

    def __init__(self, db: Database):
        self.db = db

    def list(self) -> list[ModelRecord]:
        """Fine-tuned models, in the order they were made."""
        return [
            ModelRecord.from_row(r) for r in self.db.all(sa.select(models).order_by(models.c.seq))
        ]
