"""Idempotency keys: a request's key reserved before its work, the resource or the answer it made
kept for its retries, and keys past their lifetime forgotten."""

from __future__ import annotations

import dataclasses
import json

import sqlalchemy as sa

from ..records import IdempotencyRecord
from ..tables import idempotency
from .database import Database, now

IDEMPOTENCY_TTL_S = 24 * 3600
ABANDONED_KEY_S = 600  # a reserved key whose request did not finish in this long was abandoned


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    """A request's hold on its Idempotency-Key (`IdempotencyKeys.reserve`): its outcome is
    recorded under it."""

    scope: str
    key: str
    request_hash: str

    def where(self) -> sa.ColumnElement[bool]:
        return sa.and_(idempotency.c.scope == self.scope, idempotency.c.key == self.key)


def remember(conn: sa.Connection, reservation: Reservation | None, resource_id: str) -> None:
    """Record the resource a reserved key's request created, in the transaction creating it."""
    if reservation is not None:
        conn.execute(
            idempotency.update().where(reservation.where()).values(resource_id=resource_id)
        )


class IdempotencyKeys:
    """The `idempotency` table: one row per (scope, Idempotency-Key)."""

    def __init__(self, db: Database):
        self.db = db

    def reserve(self, reservation: Reservation) -> IdempotencyRecord | None:
        """Reserve an Idempotency-Key for a request about to do its work: None when this call
        reserved it (the work then records its outcome under it, or `release` frees it);
        otherwise what the key holds (not `settled` while its first request is still at work).
        A key past its lifetime, or one whose first request never finished (its process died),
        is reserved afresh."""
        t = idempotency
        mine = dict(
            request_hash=reservation.request_hash, resource_id=None, response=None, created_at=now()
        )
        with self.db.tx() as conn:
            stmt = (
                self.db.insert(t)
                .values(scope=reservation.scope, key=reservation.key, **mine)
                .on_conflict_do_nothing()
            )
            if conn.execute(stmt.returning(t.c.key)).first() is not None:  # inserted: ours
                return None
            held = sa.select(t).where(reservation.where()).with_for_update()
            prior = IdempotencyRecord.from_row(conn.execute(held).mappings().one())
            expired = prior.created_at < now() - IDEMPOTENCY_TTL_S
            abandoned = not prior.settled and prior.created_at < now() - ABANDONED_KEY_S
            if expired or abandoned:
                conn.execute(t.update().where(reservation.where()).values(**mine))
                return None
            return prior

    def release(self, reservation: Reservation) -> None:
        """Free a reservation whose request failed, so a retry does the work anew."""
        t = idempotency
        pending = sa.and_(reservation.where(), t.c.resource_id.is_(None), t.c.response.is_(None))
        with self.db.tx() as conn:
            conn.execute(t.delete().where(pending))

    def record_response(self, reservation: Reservation, response: dict) -> None:
        """Keep the first answer of a request (a DELETE, a cancel) for its retries."""
        with self.db.tx() as conn:
            conn.execute(
                idempotency.update()
                .where(reservation.where())
                .values(response=json.dumps(response))
            )

    def forget_expired(self) -> int:
        """Delete keys past their lifetime; returns how many."""
        with self.db.tx() as conn:
            stale = idempotency.c.created_at < now() - IDEMPOTENCY_TTL_S
            return conn.execute(idempotency.delete().where(stale)).rowcount
