"""Many workers on one store: a registry of live workers, and a lease on every running job.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

LEASED = ("videos", "fine_tunes")


def upgrade() -> None:
    for table in LEASED:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("worker_id", sa.Text))
            batch.add_column(sa.Column("lease_token", sa.Text))
            batch.add_column(sa.Column("lease_expires_at", sa.Float))
    op.create_table(
        "workers",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("token", sa.Text, nullable=False),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("device", sa.Text, nullable=False),
        sa.Column("capacity", sa.Integer, nullable=False),
        sa.Column("models", sa.Text, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("ready", sa.Integer, nullable=False, server_default="0"),
        sa.Column("dead", sa.Text),
        sa.Column("metrics", sa.Text),
    )


def downgrade() -> None:
    op.drop_table("workers")
    for table in LEASED:
        with op.batch_alter_table(table) as batch:
            for column in ("lease_expires_at", "lease_token", "worker_id"):
                batch.drop_column(column)
