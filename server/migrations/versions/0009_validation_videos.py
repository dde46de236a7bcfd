"""A fine-tune's checkpoints keep the validation videos sampled from them.

`validation` on checkpoints: JSON, one entry per validation prompt of the job (its prompt and
sampling, `status` succeeded or failed, `error`, and `path`: the MP4 relative to the storage).
NULL for checkpoints of jobs without validation prompts, and for those recorded before.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("validation", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("validation")
