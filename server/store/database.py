"""The database every repository of the store shares: opening and migrating it, the `Database`
that owns its engine, and the transaction helpers, clocks, errors and job statuses they all use.

SQLite commits with `synchronous=FULL` in WAL mode and takes its write lock at BEGIN (IMMEDIATE),
so writers queue instead of deadlocking; PostgreSQL locks the rows a transition reads (`FOR
UPDATE`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.dialects import postgresql, sqlite

from ..tables import events, workers

VIDEO_ACTIVE = ("queued", "in_progress")
VIDEO_TERMINAL = ("completed", "failed", "cancelled")
FINETUNE_ACTIVE = ("queued", "running")
MIGRATIONS = Path(__file__).parent.parent / "migrations"
BASELINE = "0001"  # the schema data directories had before migrations existed
MIGRATION_LOCK = 0x6D6567615F6462  # PostgreSQL advisory lock: one migrating process at a time


def now() -> int:
    return int(time.time())


def new_token() -> str:
    return secrets.token_hex(8)


class ClaimLost(RuntimeError):
    """A job's claim (lease token) is no longer the caller's: another worker holds it now."""


class WorkerNameInUse(RuntimeError):
    """Another live worker registered under this name."""


# What a store call raises when the database cannot be reached or written (a full disk, a lock
# held too long, a dropped connection): conditions that pass, unlike a bug in a query.
UNAVAILABLE = (sa.exc.OperationalError, sa.exc.InterfaceError)


def is_disk_full(exc: BaseException) -> bool:
    """Whether a store error (or a file write) failed for want of space."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    orig = getattr(exc, "orig", None)
    if orig is not None and getattr(orig, "sqlstate", None) == "53100":  # PostgreSQL disk_full
        return True
    return "database or disk is full" in str(orig or exc)


# ---------------------------------------------------------------------------------------------
# Opening and migrating


def database_url(url: str) -> sa.URL:
    """`sqlite:///path` or `postgresql://...` (psycopg 3 is the driver PostgreSQL gets)."""
    parsed = sa.make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ValueError(f"unsupported database {url!r}: use sqlite:///PATH or postgresql://...")
    return parsed


def open_engine(url: str) -> sa.Engine:
    """An engine for the store's database, with SQLite set up for durability and concurrency."""
    parsed = database_url(url)
    if parsed.get_backend_name() == "postgresql":
        return sa.create_engine(parsed, pool_pre_ping=True, pool_size=8, max_overflow=32)
    if not parsed.database or parsed.database == ":memory:":
        raise ValueError("the SQLite store must be a file: sqlite:///PATH")
    Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(
        parsed, connect_args={"check_same_thread": False}, pool_size=8, max_overflow=32
    )

    @sa.event.listens_for(engine, "connect")
    def _configure(dbapi_conn, _record):
        # Transactions are ours (the "begin" hook below), not the driver's implicit ones.
        dbapi_conn.isolation_level = None
        for pragma in (
            "journal_mode=WAL",  # readers never block the writer, nor it them
            # FULL: a COMMIT returns only once the WAL is on disk, so an acknowledged job
            # survives a power cut as well as a kill -9.
            "synchronous=FULL",
            "busy_timeout=30000",
        ):
            dbapi_conn.execute(f"PRAGMA {pragma}")

    @sa.event.listens_for(engine, "begin")
    def _begin(conn):
        # IMMEDIATE takes the write lock at once: a read-then-write transaction that had to
        # upgrade its lock later could deadlock against another one doing the same.
        read_only = conn.get_execution_options().get("read_only", False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _alembic(connection: sa.Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def migrate(engine: sa.Engine) -> None:
    """Bring the database to the newest schema: create it, or upgrade what an older server left
    (a data directory from before migrations is stamped at the baseline first)."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Several hosts starting at once: the first migrates, the others wait and find it done.
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(MIGRATION_LOCK)))
        current = MigrationContext.configure(conn).get_current_revision()
        config = _alembic(conn)
        if current is None and sa.inspect(conn).has_table("videos"):
            command.stamp(config, BASELINE)
        command.upgrade(config, "head")


def schema_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


# ---------------------------------------------------------------------------------------------
# The database the repositories share


class Database:
    """The store's engine, opened and migrated, with the helpers every repository's queries use."""

    def __init__(self, url: str):
        self.engine = open_engine(url)
        self.dialect = self.engine.dialect.name
        self._reader = self.engine.execution_options(read_only=True)
        migrate(self.engine)
        self._insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert

    def close(self) -> None:
        self.engine.dispose()

    @contextlib.contextmanager
    def tx(self) -> Iterator[sa.Connection]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        with self.engine.begin() as conn:
            yield conn

    def one(self, stmt, params: dict | None = None) -> dict | None:
        """The first row a read returns, or None."""
        with self._reader.connect() as conn:
            row = conn.execute(stmt, params).mappings().first()
        return dict(row) if row is not None else None

    def all(self, stmt) -> list[dict]:
        """Every row a read returns."""
        with self._reader.connect() as conn:
            return [dict(r) for r in conn.execute(stmt).mappings()]

    def clock(self) -> sa.ColumnElement:
        """The database's clock in seconds since the epoch: the one clock every host shares."""
        if self.dialect == "postgresql":
            return sa.func.extract("epoch", sa.func.clock_timestamp())
        return (sa.func.julianday("now") - 2440587.5) * 86400.0

    def insert(self, table: sa.Table):
        """This dialect's INSERT into `table`, the one with ON CONFLICT clauses."""
        return self._insert(table)

    @staticmethod
    def locked(conn: sa.Connection, table: sa.Table, key) -> dict | None:
        """A row read for a transition: locked until the transaction ends (SQLite locks the
        whole database at BEGIN IMMEDIATE already)."""
        column = table.c.name if table is workers else table.c.id
        stmt = sa.select(table).where(column == key).with_for_update()
        row = conn.execute(stmt).mappings().first()
        return dict(row) if row is not None else None

    def page(
        self, table: sa.Table, after: str | None, limit: int, order: str, *where, decode
    ) -> tuple[list, bool]:
        """A page of `table` in creation order and whether more follow; `after` is an id, found
        among the rows `where` allows only (another owner's id pages like an unknown one, so a
        cursor cannot tell whether it exists)."""
        descending = order == "desc"
        stmt = sa.select(table).where(*where)
        if after is not None:
            cursor = sa.select(table.c.seq).where(table.c.id == after, *where).scalar_subquery()
            stmt = stmt.where(table.c.seq < cursor if descending else table.c.seq > cursor)
        stmt = stmt.order_by(table.c.seq.desc() if descending else table.c.seq).limit(limit + 1)
        rows = self.all(stmt)
        return [decode(r) for r in rows[:limit]], len(rows) > limit


# ---------------------------------------------------------------------------------------------
# Helpers of more than one repository


def append_event(
    conn: sa.Connection,
    job_id: str,
    type_: str,
    message: str = "",
    data: dict | None = None,
    level: str = "info",
) -> None:
    """Append a job's event; the caller has written or locked the job's row in this transaction."""
    conn.execute(
        events.insert().values(
            job_id=job_id,
            created_at=now(),
            type=type_,
            level=level,
            message=message,
            data=json.dumps(data) if data is not None else None,
        )
    )


def record(cls, row: dict | None):
    """`cls.from_row(row)`, or None for no row."""
    return cls.from_row(row) if row is not None else None


def visible_to(table: sa.Table, owner: str | None) -> list:
    """Rows `owner` may see: its own, and those made before keys were owners. None: all."""
    if owner is None:
        return []
    return [sa.or_(table.c.owner == owner, table.c.owner.is_(None))]


# A requeued job gives up its claim.
RELEASED = dict(worker_id=None, lease_token=None, lease_expires_at=None)


def crashed_out(crashes: int, reason: str, finished_at: str) -> dict:
    """A job's row changes when it fails at the crash limit (`finished_at`: the column its kind
    records the end in)."""
    times = "once" if crashes == 1 else f"{crashes} times"
    message = f"its worker died {times} while running it ({reason}); not run again"
    return {
        "status": "failed",
        finished_at: now(),
        "error_code": "worker_crashed",
        "error_message": message,
    }
