"""Alembic environment: migrations run in ONE transaction under an advisory lock.

Postgres DDL is transactional, so a failed or interrupted upgrade leaves the
schema as it was; the advisory lock makes a second `loopline db upgrade`
wait for the first and then find nothing left to do.
"""

from alembic import context
from sqlalchemy import text

from loopline.store.db import make_engine
from loopline.store.migrate import MIGRATION_LOCK_KEY
from loopline.store.models import SQLModel

target_metadata = SQLModel.metadata


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        url = context.config.get_main_option("sqlalchemy.url") or None
        engine = make_engine(url)
        with engine.connect() as connection:
            _run(connection)
        engine.dispose()
    else:
        _run(connection)


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        # Read under the lock: what this process actually upgraded from (a racing process may have done it all).
        context.config.attributes["applied_from"] = context.get_context().get_current_revision()
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("loopline migrations run online only: use `loopline db upgrade`")
run_migrations_online()
