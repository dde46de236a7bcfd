"""The schema as it was before migrations existed: a data directory made then is stamped at this
revision and migrated from here.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _seq() -> sa.Column:
    return sa.Column("seq", Seq, primary_key=True, autoincrement=True)


def upgrade() -> None:
    op.create_table(
        "videos",
        _seq(),
        sa.Column("id", sa.Text, nullable=False, unique=True),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("progress", sa.Integer, nullable=False, server_default="0"),
        sa.Column("step", sa.Integer, nullable=False, server_default="0"),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("cancel_requested", sa.Integer, nullable=False, server_default="0"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("started_at", sa.Integer),
        sa.Column("completed_at", sa.Integer),
        sa.Column("expires_at", sa.Integer),
        sa.Column("error_code", sa.Text),
        sa.Column("error_message", sa.Text),
        sqlite_autoincrement=True,
    )
    op.create_index("videos_by_status", "videos", ["status", sa.text("priority DESC"), "seq"])
    op.create_table(
        "files",
        _seq(),
        sa.Column("id", sa.Text, nullable=False, unique=True),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("filename", sa.Text, nullable=False),
        sa.Column("purpose", sa.Text, nullable=False),
        sa.Column("bytes", sa.Integer, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("clips", sa.Integer, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "fine_tunes",
        _seq(),
        sa.Column("id", sa.Text, nullable=False, unique=True),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("training_file", sa.Text, nullable=False),
        sa.Column("hyperparameters", sa.Text, nullable=False),
        sa.Column("seed", sa.Integer, nullable=False),
        sa.Column("suffix", sa.Text),
        sa.Column("output_dir", sa.Text, nullable=False),
        sa.Column("fine_tuned_model", sa.Text),
        sa.Column("step", sa.Integer, nullable=False, server_default="0"),
        sa.Column("total_steps", sa.Integer),
        sa.Column("cancel_requested", sa.Integer, nullable=False, server_default="0"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("finished_at", sa.Integer),
        sa.Column("error_code", sa.Text),
        sa.Column("error_message", sa.Text),
        sqlite_autoincrement=True,
    )
    op.create_index("fine_tunes_by_status", "fine_tunes", ["status", "seq"])
    op.create_table(
        "events",
        _seq(),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("level", sa.Text, nullable=False, server_default="info"),
        sa.Column("message", sa.Text, nullable=False, server_default=""),
        sa.Column("data", sa.Text),
        sqlite_autoincrement=True,
    )
    op.create_index("events_by_job", "events", ["job_id", "seq"])
    op.create_table(
        "checkpoints",
        _seq(),
        sa.Column("id", sa.Text, nullable=False, unique=True),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("metrics", sa.Text),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "models",
        _seq(),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("parent", sa.Text, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "idempotency",
        sa.Column("scope", sa.Text, primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("request_hash", sa.Text, nullable=False),
        sa.Column("resource_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    for table in (
        "idempotency",
        "models",
        "checkpoints",
        "events",
        "fine_tunes",
        "files",
        "videos",
    ):
        op.drop_table(table)
