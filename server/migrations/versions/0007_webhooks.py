"""Webhooks: a key's endpoints, the outbox of deliveries owed to them, and each delivery's tries.

A delivery is written in the transaction of the job's change it reports (a video completed or
failed, a fine-tune succeeded, failed or wrote a checkpoint), so none is lost to a crash.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _seq() -> sa.Column:
    return sa.Column("seq", Seq, primary_key=True, autoincrement=True)


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        _seq(),
        sa.Column("id", sa.Text, nullable=False, unique=True),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("owner", sa.Text),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("events", sa.Text, nullable=False),
        sa.Column("secret", sa.Text, nullable=False),
        sa.Column("description", sa.Text),
        sa.Column("disabled", sa.Integer, nullable=False, server_default="0"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "webhook_deliveries",
        _seq(),
        sa.Column("id", sa.Text, nullable=False, unique=True),
        sa.Column("endpoint_id", sa.Text, nullable=False),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("snapshot", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.Float, nullable=False),
        sa.Column("lease_token", sa.Text),
        sa.Column("lease_expires_at", sa.Float),
        sa.Column("delivered_at", sa.Integer),
        sqlite_autoincrement=True,
    )
    op.create_index("webhook_deliveries_due", "webhook_deliveries", ["status", "next_attempt_at"])
    op.create_index(
        "webhook_deliveries_by_endpoint",
        "webhook_deliveries",
        ["endpoint_id", "job_id", "seq"],
    )
    op.create_table(
        "webhook_attempts",
        _seq(),
        sa.Column("delivery_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("status_code", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("duration_ms", sa.Integer, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("webhook_attempts_by_delivery", "webhook_attempts", ["delivery_id", "seq"])


def downgrade() -> None:
    op.drop_table("webhook_attempts")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_endpoints")
