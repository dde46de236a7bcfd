"""A repeated request is answered with the finished video it repeats.

`pixel_key` on videos: a digest of everything that decides the video's pixels (services/repeats.py),
indexed with the owner, so that a tenant's request equal to one of its finished videos finds it.
`cached_from`: the video whose MP4 answered the request, when no pass ran for it. NULL for videos
made before: they are never found as repeats.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("videos") as batch:
        batch.add_column(sa.Column("pixel_key", sa.Text))
        batch.add_column(sa.Column("cached_from", sa.Text))
        batch.create_index("videos_by_pixel_key", ["owner", "pixel_key"])


def downgrade() -> None:
    with op.batch_alter_table("videos") as batch:
        batch.drop_index("videos_by_pixel_key")
        batch.drop_column("cached_from")
        batch.drop_column("pixel_key")
