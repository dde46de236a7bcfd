"""Uploaded files: their rows, and the validation an API host claims for each upload after it
returned (uploaded -> processed | error)."""

from __future__ import annotations

import sqlalchemy as sa

from ..records import FileRecord
from ..tables import files, fine_tunes
from .database import FINETUNE_ACTIVE, Database, now, record, visible_to
from .keys import Reservation, remember


class FileStore:
    """The `files` table."""

    def __init__(self, db: Database):
        self.db = db

    def insert(self, row: dict, idempotency: Reservation | None = None) -> FileRecord:
        """An upload, `uploaded` until validated (`claim_validation`), unless `row` says it is
        `processed` already (a video's input, checked where it is used)."""
        keys = ("id", "filename", "purpose", "bytes", "path")
        with self.db.tx() as conn:
            conn.execute(
                files.insert().values(
                    created_at=now(),
                    clips=0,
                    status=row.get("status", "uploaded"),
                    owner=row.get("owner"),
                    **{k: row[k] for k in keys},
                )
            )
            remember(conn, idempotency, row["id"])
        return self.get(row["id"])

    def claim_validation(self, lease_s: float) -> FileRecord | None:
        """An upload waiting for validation, now this caller's for `lease_s` seconds (an API
        host that dies meanwhile leaves it to another, or to its own restart)."""
        clock = self.db.clock()
        free = sa.or_(files.c.validating_until.is_(None), files.c.validating_until < clock)
        stmt = (
            sa.select(files)
            .where(files.c.status == "uploaded", free)
            .order_by(files.c.seq)
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        with self.db.tx() as conn:
            row = conn.execute(stmt).mappings().first()
            if row is None:
                return None
            conn.execute(
                files.update()
                .where(files.c.id == row["id"])
                .values(validating_until=self.db.clock() + lease_s)
            )
        return FileRecord.from_row(row)

    def finish_validation(
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
        with self.db.tx() as conn:
            pending = sa.and_(files.c.id == file_id, files.c.status == "uploaded")
            return bool(conn.execute(files.update().where(pending).values(**changes)).rowcount)

    def get(self, file_id: str) -> FileRecord | None:
        """The file, or None."""
        return record(FileRecord, self.db.one(sa.select(files).where(files.c.id == file_id)))

    def ids(self) -> set[str]:
        """Every file's id."""
        return {r["id"] for r in self.db.all(sa.select(files.c.id))}

    def page(
        self, after, limit, order, purpose=None, owner: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        """A page of the files `owner` may see (of one `purpose`, when given)."""
        where = [files.c.purpose == purpose] if purpose else []
        visible = visible_to(files, owner)
        return self.db.page(
            files, after, limit, order, *where, *visible, decode=FileRecord.from_row
        )

    def delete(self, file_id: str) -> str:
        """'deleted', 'missing', or 'in_use' when an active fine-tune still reads it."""
        with self.db.tx() as conn:
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
