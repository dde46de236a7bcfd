"""Idempotency keys: a request's key reserved before its work, the resource or the answer it made
kept for its retries, and keys past their lifetime forgotten."""

from __future__ import annotations

import json

import sqlalchemy as sa

from ..tables import idempotency
from .database import Database, now

IDEMPOTENCY_TTL_S = 24 * 3600
ABANDONED_KEY_S = 600  # a reserved key whose request did not finish in this long was abandoned


def remember(conn: sa.Connection, key: tuple[str, str, str] | None, resource_id: str) -> None:
    """Record the resource a reserved key's request created, in the transaction creating it."""
    if key is None:
        return
    scope, name, _ = key
    t = idempotency
    conn.execute(
        t.update().where(t.c.scope == scope, t.c.key == name).values(resource_id=resource_id)
    )


class IdempotencyKeys:
    """The `idempotency` table: one row per (scope, Idempotency-Key)."""

    def __init__(self, db: Database):
        self.db = db

    def reserve(self, scope: str, key: str, request_hash: str) -> dict | None:
        """Reserve an Idempotency-Key for a request about to do its work: None when this call
        reserved it (the work then records its outcome under it, or `release` frees it);
        otherwise what the key holds: `request_hash`, `resource_id` (None while the first
        request is still at work) and `response`. A key past its lifetime, or one whose first
        request never finished (its process died), is reserved afresh."""
        t = idempotency
        mine = dict(request_hash=request_hash, resource_id=None, response=None, created_at=now())
        with self.db.tx() as conn:
            stmt = self.db.insert(t).values(scope=scope, key=key, **mine).on_conflict_do_nothing()
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

    def release(self, scope: str, key: str) -> None:
        """Free a reservation whose request failed, so a retry does the work anew."""
        t = idempotency
        pending = sa.and_(
            t.c.scope == scope, t.c.key == key, t.c.resource_id.is_(None), t.c.response.is_(None)
        )
        with self.db.tx() as conn:
            conn.execute(t.delete().where(pending))

    def record_response(self, scope: str, key: str, response: dict) -> None:
        """Keep the first answer of a request (a DELETE, a cancel) for its retries."""
        t = idempotency
        with self.db.tx() as conn:
            conn.execute(
                t.update()
                .where(t.c.scope == scope, t.c.key == key)
                .values(response=json.dumps(response))
            )

    def forget_expired(self) -> int:
        """Delete keys past their lifetime; returns how many."""
        with self.db.tx() as conn:
            stale = idempotency.c.created_at < now() - IDEMPOTENCY_TTL_S
            return conn.execute(idempotency.delete().where(stale)).rowcount
