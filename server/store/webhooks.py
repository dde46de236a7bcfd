"""Webhooks in the store: a key's endpoints, and the outbox of the deliveries owed to them.

`emit` writes a job's event into the outbox inside the transaction of the change it reports (a
video completed, a fine-tune wrote a checkpoint), one delivery per endpoint of the job's owner
that subscribed to it: once that change is committed, its deliveries are too, and a crash at any
later point leaves them there to be sent. A sender (webhooks.py) claims due deliveries under a
lease, as a worker claims jobs, so several API processes never send one at the same time, and one
killed mid-send leaves the delivery to be claimed again once its lease runs out: each delivery
reaches its receiver at least once, under the same message id, which the receiver dedups on.

The deliveries of one job to one endpoint go out in the order the job's events happened: one is
claimed only once every earlier one is settled (delivered, or failed for good).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

import sqlalchemy as sa

from ..records import WebhookAttemptRecord, WebhookDeliveryRecord, WebhookEndpointRecord
from ..tables import webhook_attempts, webhook_deliveries, webhook_endpoints
from .database import Database, now, record, visible_to

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


def emit(
    db: Database,
    conn: sa.Connection,
    type_: str,
    job_id: str,
    owner: str | None,
    snapshot: Callable[[], dict],
) -> int:
    """Owe `type_` of job `job_id` to every endpoint of `owner` that subscribed to it, in
    the caller's transaction; `snapshot()` reads the rows the payload is made from
    (webhooks.py) as they are now, only when some endpoint subscribed. Another owner's endpoints
    never see it. Returns how many deliveries."""
    mine = (
        webhook_endpoints.c.owner.is_(None) if owner is None else webhook_endpoints.c.owner == owner
    )
    # A disabled endpoint is owed its events too: they wait for it to be enabled again.
    stmt = sa.select(webhook_endpoints.c.id, webhook_endpoints.c.events).where(mine)
    subscribed = [r.id for r in conn.execute(stmt) if type_ in json.loads(r.events)]
    if not subscribed:
        return 0
    text = json.dumps(snapshot())
    for endpoint_id in subscribed:
        conn.execute(
            webhook_deliveries.insert().values(
                id=f"msg_{secrets.token_hex(12)}",
                endpoint_id=endpoint_id,
                job_id=job_id,
                type=type_,
                created_at=now(),
                snapshot=text,
                status=PENDING,
                next_attempt_at=db.clock(),
            )
        )
    return len(subscribed)


def row_of(conn: sa.Connection, table: sa.Table, key: str) -> dict:
    """A row as this transaction sees it, for a snapshot."""
    return dict(conn.execute(sa.select(table).where(table.c.id == key)).mappings().one())


class WebhookStore:
    """The `webhook_endpoints` table, its outbox (`webhook_deliveries`) and their tries."""

    def __init__(self, db: Database):
        self.db = db

    # --- endpoints (the API's side) ---------------------------------------------------------

    def create_endpoint(self, row: dict) -> WebhookEndpointRecord:
        """Record an endpoint (`row`: id, owner, url, events, secret, description)."""
        with self.db.tx() as conn:
            conn.execute(
                webhook_endpoints.insert().values(
                    created_at=now(),
                    **{**row, "events": json.dumps(row["events"])},
                )
            )
        return self.get_endpoint(row["id"])

    def get_endpoint(self, endpoint_id: str) -> WebhookEndpointRecord | None:
        """The endpoint, or None."""
        stmt = sa.select(webhook_endpoints).where(webhook_endpoints.c.id == endpoint_id)
        return record(WebhookEndpointRecord, self.db.one(stmt))

    def page_endpoints(
        self, after: str | None, limit: int, owner: str | None = None
    ) -> tuple[list[WebhookEndpointRecord], bool]:
        """A page of the endpoints `owner` may see, newest first."""
        visible = visible_to(webhook_endpoints, owner)
        return self.db.page(
            webhook_endpoints,
            after,
            limit,
            "desc",
            *visible,
            decode=WebhookEndpointRecord.from_row,
        )

    def delete_endpoint(self, endpoint_id: str) -> bool:
        """Delete an endpoint with its deliveries and their tries; False when there is none. A
        sender holding one of them finds its claim gone and records nothing."""
        with self.db.tx() as conn:
            n = conn.execute(
                webhook_endpoints.delete().where(webhook_endpoints.c.id == endpoint_id)
            ).rowcount
            owed = sa.select(webhook_deliveries.c.id).where(
                webhook_deliveries.c.endpoint_id == endpoint_id
            )
            conn.execute(webhook_attempts.delete().where(webhook_attempts.c.delivery_id.in_(owed)))
            conn.execute(
                webhook_deliveries.delete().where(webhook_deliveries.c.endpoint_id == endpoint_id)
            )
        return n > 0

    def enable(self, endpoint_id: str) -> bool:
        """Send to a disabled endpoint again, from the deliveries it was owed meanwhile; False
        when there is no such endpoint."""
        with self.db.tx() as conn:
            return bool(
                conn.execute(
                    webhook_endpoints.update()
                    .where(webhook_endpoints.c.id == endpoint_id)
                    .values(disabled=0)
                ).rowcount
            )

    def prune(self, older_than_s: float) -> int:
        """Delete settled deliveries (delivered, or failed for good) older than `older_than_s`
        with their tries; returns how many. Pending ones stay, however old."""
        d = webhook_deliveries
        stale = sa.and_(d.c.status != PENDING, d.c.created_at < now() - older_than_s)
        with self.db.tx() as conn:
            ids = sa.select(d.c.id).where(stale)
            conn.execute(webhook_attempts.delete().where(webhook_attempts.c.delivery_id.in_(ids)))
            return conn.execute(d.delete().where(stale)).rowcount

    def deliveries(
        self, endpoint_id: str, after: str | None, limit: int
    ) -> tuple[list[tuple[WebhookDeliveryRecord, list[WebhookAttemptRecord]]], bool]:
        """A page of an endpoint's deliveries, newest first, each with its tries in order."""
        mine = webhook_deliveries.c.endpoint_id == endpoint_id
        rows, more = self.db.page(
            webhook_deliveries, after, limit, "desc", mine, decode=WebhookDeliveryRecord.from_row
        )
        tries: dict[str, list[WebhookAttemptRecord]] = {r.id: [] for r in rows}
        if rows:
            stmt = (
                sa.select(webhook_attempts)
                .where(webhook_attempts.c.delivery_id.in_(list(tries)))
                .order_by(webhook_attempts.c.seq)
            )
            for row in self.db.all(stmt):
                tries[row["delivery_id"]].append(WebhookAttemptRecord.from_row(row))
        return [(r, tries[r.id]) for r in rows], more

    # --- the outbox (a sender's side) -------------------------------------------------------

    def claim(
        self, limit: int, *, lease_s: float
    ) -> list[tuple[WebhookDeliveryRecord, WebhookEndpointRecord]]:
        """Claim up to `limit` due deliveries, oldest first, each with its endpoint: pending, its
        time come, held by no live lease, and the first unsettled one of its job to its
        endpoint. Each comes back with a new `lease_token`, held for `lease_s`."""
        if limit <= 0:
            return []
        d, e = webhook_deliveries, webhook_endpoints
        earlier = d.alias("earlier")
        waits = (
            sa.select(earlier.c.seq)
            .where(
                earlier.c.endpoint_id == d.c.endpoint_id,
                earlier.c.job_id == d.c.job_id,
                earlier.c.status == PENDING,
                earlier.c.seq < d.c.seq,
            )
            .exists()
        )
        clock = self.db.clock()
        stmt = (
            sa.select(d)
            .join(e, e.c.id == d.c.endpoint_id)
            .where(
                d.c.status == PENDING,
                d.c.next_attempt_at <= clock,
                sa.or_(d.c.lease_expires_at.is_(None), d.c.lease_expires_at < clock),
                e.c.disabled == 0,
                ~waits,
            )
            .order_by(d.c.seq)
            .limit(limit)
            .with_for_update(of=d, skip_locked=True)
        )
        claimed = []
        with self.db.tx() as conn:
            for row in conn.execute(stmt).mappings().all():
                token = secrets.token_hex(8)
                conn.execute(
                    d.update()
                    .where(d.c.id == row["id"])
                    .values(lease_token=token, lease_expires_at=clock + lease_s)
                )
                claimed.append(WebhookDeliveryRecord.from_row({**row, "lease_token": token}))
            ids = {delivery.endpoint_id for delivery in claimed}
            rows = conn.execute(sa.select(e).where(e.c.id.in_(ids))).mappings()
            endpoints = {row["id"]: WebhookEndpointRecord.from_row(row) for row in rows}
        return [(delivery, endpoints[delivery.endpoint_id]) for delivery in claimed]

    def record_attempt(
        self,
        delivery: WebhookDeliveryRecord,
        *,
        status_code: int | None,
        error: str | None,
        duration_ms: int,
        delivered: bool,
        retry_s: list[float],
    ) -> str | None:
        """Record a try of a delivery claimed as `delivery.lease_token`: delivered, or due again
        after `retry_s[n - 1]` seconds at its n-th failure, or failed for good once `retry_s` is
        spent, which disables its endpoint (a receiver that failed for that long is gone until
        someone enables it). Returns its status after, or None when the claim is no longer this
        one (its lease ran out and another sender took it, or its endpoint was deleted)."""
        d = webhook_deliveries
        with self.db.tx() as conn:
            held = d.c.id == delivery.id, d.c.lease_token == delivery.lease_token
            row = conn.execute(sa.select(d).where(*held).with_for_update()).mappings().first()
            if row is None or row["status"] != PENDING:
                return None
            conn.execute(
                webhook_attempts.insert().values(
                    delivery_id=delivery.id,
                    created_at=now(),
                    status_code=status_code,
                    error=error,
                    duration_ms=duration_ms,
                )
            )
            attempts = row["attempts"] + 1
            changes = dict(attempts=attempts, lease_token=None, lease_expires_at=None)
            if delivered:
                changes |= dict(status=DELIVERED, delivered_at=now())
            elif attempts > len(retry_s):
                changes |= dict(status=FAILED)
                conn.execute(
                    webhook_endpoints.update()
                    .where(webhook_endpoints.c.id == delivery.endpoint_id)
                    .values(disabled=1)
                )
            else:
                changes |= dict(next_attempt_at=self.db.clock() + retry_s[attempts - 1])
            conn.execute(d.update().where(*held).values(**changes))
            return changes.get("status", PENDING)
