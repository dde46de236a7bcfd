"""The durable job store: jobs, files, events, idempotency keys and the worker registry, in SQLite
(the embedded default: a file in the data directory) or PostgreSQL (many hosts), through one
SQLAlchemy Core description of the tables (tables.py) and Alembic migrations.

`JobStore` (job_store.py) holds one repository per resource over one `Database` (database.py):
`videos` (with their events and queue positions), `fine_tunes` (with their checkpoints and events),
`files`, `models`, `workers` (the registry and lease recovery), `keys` (idempotency), `jobs`
(what spans both kinds of job) and `webhooks` (endpoints and the outbox of their deliveries). Async routes reach it through `AsyncStore` (async_store.py).

Every state change is one transaction. SQLite takes its write lock at BEGIN, so writers queue
instead of deadlocking; PostgreSQL locks the rows a transition reads (`FOR UPDATE`), and workers
claim queued jobs with `FOR UPDATE SKIP LOCKED`, so two workers never take the same job and never
wait on each other's claims.

State machines (a transition is a conditional UPDATE, so the API and the workers cannot both win):

    video:     queued -> in_progress -> completed | failed | cancelled;  queued -> cancelled
    fine-tune: queued -> running -> succeeded | failed | cancelled;      queued -> cancelled

Leases. A worker that claims a job writes its name, a fresh `lease_token` and an expiry into the
row; every write it makes afterwards (progress, events, the outcome) names that token and is
refused once the token changed. Its heartbeat (for the claims it still works on) and every
denoising step extend the expiry. A worker that dies stops extending it: once it passes,
`recover_expired` (any worker runs it) puts the job back in the queue with a new claim to come,
so a video re-runs and a fine-tune resumes from its last checkpoint, and a late write from the
presumed-dead worker finds a token that is no longer there. Each job thus completes exactly once.
Lease times come from the database's clock, so hosts with skewed clocks agree on them.

Events of one job keep their order across hosts: every transaction that appends one first writes
(and so locks) the job's row, so two writers to one job commit one after the other and its event
numbers grow in commit order, which is what a reader resuming "after event N" relies on.
"""

from .async_store import AsyncStore
from .database import (
    UNAVAILABLE,
    VIDEO_TERMINAL,
    ClaimLost,
    Database,
    WorkerNameInUse,
    database_url,
    is_disk_full,
    migrate,
    new_token,
    now,
    schema_revision,
)
from .job_store import JobStore
from .keys import Reservation

__all__ = [
    "UNAVAILABLE",
    "VIDEO_TERMINAL",
    "AsyncStore",
    "ClaimLost",
    "Database",
    "JobStore",
    "Reservation",
    "WorkerNameInUse",
    "database_url",
    "is_disk_full",
    "migrate",
    "new_token",
    "now",
    "schema_revision",
]
