"""The job store's tables, as SQLAlchemy Core metadata: one description for SQLite and PostgreSQL.

This is the schema at the newest migration (migrations/versions/): the store's queries are written
against it, and a test checks that running every migration yields exactly these tables.

Times are seconds since the epoch: whole seconds (`INTEGER`) where the API shows them, fractional
(`lease_expires_at`, `heartbeat_at`) where workers compare them. JSON documents (a video's resolved
request, hyperparameters, event data) are stored as text.
"""

from __future__ import annotations

import sqlalchemy as sa

# A 64-bit key on PostgreSQL; on SQLite an INTEGER PRIMARY KEY is the rowid (64-bit already), and
# only that exact type name makes it one.
Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

metadata = sa.MetaData()


def _seq() -> sa.Column:
    """The creation-order key every table pages by."""
    return sa.Column("seq", Seq, primary_key=True, autoincrement=True)


def _lease() -> list[sa.Column]:
    """Which worker holds a running job, under which claim, and until when (see store/)."""
    return [
        sa.Column("worker_id", sa.Text),
        sa.Column("lease_token", sa.Text),
        sa.Column("lease_expires_at", sa.Float),
    ]


videos = sa.Table(
    "videos",
    metadata,
    _seq(),
    sa.Column("id", sa.Text, nullable=False, unique=True),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("progress", sa.Integer, nullable=False, server_default="0"),
    sa.Column("step", sa.Integer, nullable=False, server_default="0"),
    sa.Column("passes", sa.Integer),  # steps that ran a pass of the model; NULL: as many as steps
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("cancel_requested", sa.Integer, nullable=False, server_default="0"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    # Claims that ended with the worker dead (lease expired, or it restarted): at the store's
    # crash_limit the job fails instead of running again.
    sa.Column("crashes", sa.Integer, nullable=False, server_default="0"),
    # 1 once a worker died while the video shared it with other videos: which of them killed it
    # is unknown, so none is counted; each runs alone from then on, where a death is its own.
    sa.Column("suspect", sa.Integer, nullable=False, server_default="0"),
    sa.Column("started_at", sa.Integer),
    sa.Column("completed_at", sa.Integer),
    sa.Column("expires_at", sa.Integer),
    sa.Column("error_code", sa.Text),
    sa.Column("error_message", sa.Text),
    *_lease(),
    sa.Column("owner", sa.Text),  # the principal that made it (auth.py); NULL: made before keys
    # A digest of everything that decides its pixels (services/repeats.py); NULL: made before.
    sa.Column("pixel_key", sa.Text),
    # The finished video whose MP4 answered this request (a repeat, no pass run); NULL: its own.
    sa.Column("cached_from", sa.Text),
    sa.Index("videos_by_status", "status", sa.desc("priority"), "seq"),
    sa.Index("videos_by_pixel_key", "owner", "pixel_key"),
    sqlite_autoincrement=True,
)

files = sa.Table(
    "files",
    metadata,
    _seq(),
    sa.Column("id", sa.Text, nullable=False, unique=True),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("filename", sa.Text, nullable=False),
    sa.Column("purpose", sa.Text, nullable=False),
    sa.Column("bytes", sa.Integer, nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("clips", sa.Integer, nullable=False),
    sa.Column("owner", sa.Text),
    # uploaded -> processed | error: an archive is validated after its upload returns, by the API
    # host that holds `validating_until`.
    sa.Column("status", sa.Text, nullable=False, server_default="processed"),
    sa.Column("status_details", sa.Text),
    sa.Column("validating_until", sa.Float),
    sqlite_autoincrement=True,
)

fine_tunes = sa.Table(
    "fine_tunes",
    metadata,
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
    sa.Column("crashes", sa.Integer, nullable=False, server_default="0"),
    sa.Column("finished_at", sa.Integer),
    sa.Column("error_code", sa.Text),
    sa.Column("error_message", sa.Text),
    *_lease(),
    sa.Column("owner", sa.Text),
    sa.Index("fine_tunes_by_status", "status", "seq"),
    sqlite_autoincrement=True,
)

events = sa.Table(
    "events",
    metadata,
    _seq(),
    sa.Column("job_id", sa.Text, nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("level", sa.Text, nullable=False, server_default="info"),
    sa.Column("message", sa.Text, nullable=False, server_default=""),
    sa.Column("data", sa.Text),
    sa.Index("events_by_job", "job_id", "seq"),
    sqlite_autoincrement=True,
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    _seq(),
    sa.Column("id", sa.Text, nullable=False, unique=True),
    sa.Column("job_id", sa.Text, nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("metrics", sa.Text),
    sa.Column("validation", sa.Text),  # JSON: the validation videos sampled from it
    sqlite_autoincrement=True,
)

models = sa.Table(
    "models",
    metadata,
    _seq(),
    sa.Column("name", sa.Text, nullable=False, unique=True),
    sa.Column("parent", sa.Text, nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("job_id", sa.Text, nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("owner", sa.Text),
    sqlite_autoincrement=True,
)

# An Idempotency-Key, reserved when its first request starts: `resource_id` is set in the
# transaction that creates the resource (NULL while that request runs); `response` keeps the
# first answer of a DELETE or cancel.
idempotency = sa.Table(
    "idempotency",
    metadata,
    sa.Column("scope", sa.Text, primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("request_hash", sa.Text, nullable=False),
    sa.Column("resource_id", sa.Text),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("response", sa.Text),
)

# One row per worker process: who it is, what it serves, and when it last proved alive.
workers = sa.Table(
    "workers",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),  # one per device slot, e.g. "gpu-3/cuda:0"
    sa.Column("token", sa.Text, nullable=False),  # this incarnation (a restart registers anew)
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("device", sa.Text, nullable=False),
    sa.Column("capacity", sa.Integer, nullable=False),  # video jobs per denoising pass
    sa.Column("models", sa.Text, nullable=False),  # JSON: the model cards it serves
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("heartbeat_at", sa.Float, nullable=False),
    sa.Column("ready", sa.Integer, nullable=False, server_default="0"),
    sa.Column("dead", sa.Text),  # why its job loop stopped, while the process still lives
    sa.Column("metrics", sa.Text),  # JSON snapshot of its counters and histograms
)

# A key's webhook endpoint: where the events it subscribed to (`events`, a JSON list) of its own
# jobs are POSTed, signed with `secret` (Standard Webhooks, webhooks.py).
webhook_endpoints = sa.Table(
    "webhook_endpoints",
    metadata,
    _seq(),
    sa.Column("id", sa.Text, nullable=False, unique=True),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("owner", sa.Text),  # the principal that made it; its jobs' events alone reach it
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("events", sa.Text, nullable=False),
    sa.Column("secret", sa.Text, nullable=False),
    sa.Column("description", sa.Text),
    sa.Column("disabled", sa.Integer, nullable=False, server_default="0"),
    sqlite_autoincrement=True,
)

# The outbox: one message for one endpoint, written in the transaction of the change it reports,
# so a change committed is a delivery owed. pending -> delivered | failed (retries exhausted, or
# its endpoint deleted). A sender holds one under `lease_token` until `lease_expires_at`, like a
# worker its job; `seq` orders the messages of one job (`job_id`) to one endpoint.
webhook_deliveries = sa.Table(
    "webhook_deliveries",
    metadata,
    _seq(),
    sa.Column("id", sa.Text, nullable=False, unique=True),  # the webhook-id header: msg_...
    sa.Column("endpoint_id", sa.Text, nullable=False),
    sa.Column("job_id", sa.Text, nullable=False),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("snapshot", sa.Text, nullable=False),  # JSON: the rows the payload is made from
    sa.Column("status", sa.Text, nullable=False, server_default="pending"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("next_attempt_at", sa.Float, nullable=False),
    sa.Column("lease_token", sa.Text),
    sa.Column("lease_expires_at", sa.Float),
    sa.Column("delivered_at", sa.Integer),
    sa.Index("webhook_deliveries_due", "status", "next_attempt_at"),
    sa.Index("webhook_deliveries_by_endpoint", "endpoint_id", "job_id", "seq"),
    sqlite_autoincrement=True,
)

# Each try of a delivery: when, the receiver's status code (NULL: no answer) or why it failed.
webhook_attempts = sa.Table(
    "webhook_attempts",
    metadata,
    _seq(),
    sa.Column("delivery_id", sa.Text, nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("status_code", sa.Integer),
    sa.Column("error", sa.Text),
    sa.Column("duration_ms", sa.Integer, nullable=False),
    sa.Index("webhook_attempts_by_delivery", "delivery_id", "seq"),
    sqlite_autoincrement=True,
)
