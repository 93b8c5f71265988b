"""A long-lived Prefect server for real use: UI, schedules, deployments, work pools.

Without one, every `loopline train` starts a temporary server of its own (~15 s) and its history is
gone afterwards. `loopline server start` runs `prefect server start --background` with Prefect's
database on the same PostgreSQL server as the ledger (database `prefect`, created with the pg_trgm
extension Prefect needs) and points this machine's Prefect profile at it, so later `loopline`
and `prefect` commands report there. With the embedded ledger server (unix socket only, stopped
with its last process) Prefect keeps its default SQLite database instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from loopline.store import db as store_db
from loopline.store.errors import LooplineError


@dataclass(frozen=True)
class ServerInfo:
    api_url: str
    ui_url: str
    database: str  # where Prefect keeps its own state, password hidden


def _prefect(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("prefect")), *args]
    done = subprocess.run(command, env=env or os.environ.copy(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise LooplineError(f"`prefect {' '.join(args)}` failed: {(done.stderr or done.stdout).strip()[-800:]}")
    return done


def prefect_database_url(database: str) -> str | None:
    """Create `database` (with pg_trgm) next to the ledger; None when the ledger is the embedded server."""
    if store_db.is_embedded():
        return None
    server = store_db.resolve_url()
    admin = sa.create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if not conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": database}).first():
                conn.exec_driver_sql(f'CREATE DATABASE "{database}"')
    finally:
        admin.dispose()
    target = sa.create_engine(server.set(database=database), isolation_level="AUTOCOMMIT")
    try:
        with target.connect() as conn:
            conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    finally:
        target.dispose()
    return server.set(drivername="postgresql+asyncpg", database=database).render_as_string(hide_password=False)


def start(host: str = "127.0.0.1", port: int = 4200, database: str = "prefect", wait_s: float = 90) -> ServerInfo:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the server itself must not try to report to a server
    db_url = prefect_database_url(database)
    if db_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = db_url
    api = f"http://{host}:{port}/api"
    if not _healthy(api):
        _prefect("server", "start", "--background", "--host", host, "--port", str(port), "--analytics-off", env=env)
        deadline = time.monotonic() + wait_s
        while not _healthy(api):
            if time.monotonic() > deadline:
                raise LooplineError(f"the Prefect server did not become healthy at {api} within {wait_s:g} s")
            time.sleep(0.5)
    _prefect("config", "set", f"PREFECT_API_URL={api}")
    shown = sa.engine.make_url(db_url).render_as_string(hide_password=True) if db_url else "SQLite under PREFECT_HOME"
    return ServerInfo(api, f"http://{host}:{port}", shown)


def stop() -> None:
    _prefect("server", "stop")
    _prefect("config", "unset", "PREFECT_API_URL", "-y")


def _healthy(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
