"""Alembic's entry point: migrations run on the connection the store hands over (store.migrate),
inside the store's own transaction, so no alembic.ini or URL is needed."""

from alembic import context

from megaslide.server.tables import metadata

connection = context.config.attributes["connection"]
# Batch mode: SQLite alters a table by copying it, which alembic does for us when asked.
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
