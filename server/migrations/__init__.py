"""Alembic migrations of the job store (see store.migrate)."""
