"""A worker's death is charged to the video at fault, not to every video of its batch.

`suspect` on videos: 1 once a worker died while the video shared it with other videos. None of
them is counted for that death; each runs alone from then on, where a death is its own and counts
toward `crash_limit`.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("videos") as batch:
        batch.add_column(sa.Column("suspect", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("videos") as batch:
        batch.drop_column("suspect")
