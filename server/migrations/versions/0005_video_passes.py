"""Step caches: how many passes of the model a video's denoising ran.

`passes` on videos: the steps whose pass the video joined, fewer than `step` when its step cache
reused earlier outputs. NULL for videos made before (every step ran a pass).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("videos") as batch:
        batch.add_column(sa.Column("passes", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("videos") as batch:
        batch.drop_column("passes")
