"""A throwaway, migrated database next to the ledger (LOOPLINE_DATABASE_URL or the embedded server)."""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from typing import Iterator

import sqlalchemy as sa

from loopline.store.db import make_engine, resolve_url
from loopline.store.migrate import upgrade


@contextmanager
def scratch_database() -> Iterator[tuple[str, sa.Engine]]:
    """Yield (url, engine) of a fresh database; it is dropped afterwards."""
    server = resolve_url()
    name = f"loopline_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = server.set(database=name).render_as_string(hide_password=False)
    engine = make_engine(url)
    try:
        upgrade(engine)
        yield url, engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
