"""API keys as tenants, idempotency keys reserved before the work, uploads validated after them.

- `owner` on videos, files, fine-tunes and fine-tuned models: the principal (API key, or the name
  a keys file gives it) that made them. NULL for rows made before: they belong to no key.
- Idempotency keys are reserved when a request starts (`resource_id` NULL until it is done) and
  keep the first answer of a DELETE or cancel (`response`).
- An upload is a file at once (`status` uploaded), validated afterwards (processed or error,
  `status_details` saying why), by whichever API host holds its `validating_until` lease. Files
  made before were validated on upload: processed.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

OWNED = ("videos", "files", "fine_tunes", "models")


def upgrade() -> None:
    for table in OWNED:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("owner", sa.Text))
    with op.batch_alter_table("idempotency") as batch:
        batch.alter_column("resource_id", existing_type=sa.Text, nullable=True)
        batch.add_column(sa.Column("response", sa.Text))
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("status", sa.Text, nullable=False, server_default="processed"))
        batch.add_column(sa.Column("status_details", sa.Text))
        batch.add_column(sa.Column("validating_until", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        for column in ("validating_until", "status_details", "status"):
            batch.drop_column(column)
    with op.batch_alter_table("idempotency") as batch:
        batch.drop_column("response")
        batch.alter_column("resource_id", existing_type=sa.Text, nullable=False)
    for table in OWNED:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("owner")
