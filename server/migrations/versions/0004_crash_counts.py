"""A job whose worker dies under it is counted: `crashes` on videos and fine-tunes.

A job that kills its worker (a poison input, a kernel that takes the process down) came back to
the head of the queue every time its lease expired. Now each such return counts; at the store's
`crash_limit` the job fails with the reason instead, and a job that crashed waits behind those
that never did (in its priority).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COUNTED = ("videos", "fine_tunes")


def upgrade() -> None:
    for table in COUNTED:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("crashes", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    for table in COUNTED:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("crashes")
