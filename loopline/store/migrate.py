"""Schema upgrades and the check every ledger user makes before writing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.util import CommandError
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from loopline.store.db import describe_url, error_reason, is_embedded, make_engine
from loopline.errors import LooplineError
from loopline.store.errors import SchemaOutOfDate

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

# pg_advisory_xact_lock key shared by every `db upgrade` ("loopline" as a number).
MIGRATION_LOCK_KEY = 0x6C6F6F706C696E65


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


@dataclass(frozen=True)
class SchemaStatus:
    url: str
    current: str | None
    head: str
    known: bool  # False when the database carries a revision this code does not know (newer loopline)

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head


@dataclass(frozen=True)
class UpgradeResult:
    applied_from: str | None  # the revision this call found under the migration lock
    status: SchemaStatus

    @property
    def changed(self) -> bool:
        return self.applied_from != self.status.current


def schema_status(engine: Engine) -> SchemaStatus:
    script = ScriptDirectory.from_config(alembic_config())
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    known = current is None or _has_revision(script, current)
    return SchemaStatus(describe_url(engine.url), current, script.get_current_head(), known)


def _has_revision(script: ScriptDirectory, revision: str) -> bool:
    try:
        return script.get_revision(revision) is not None
    except CommandError:
        return False


def upgrade(engine: Engine, revision: str = "head") -> UpgradeResult:
    """Apply migrations in one transaction; concurrent callers serialise on an advisory lock."""
    before = schema_status(engine)
    if not before.known:
        raise SchemaOutOfDate(
            f"{before.url} is at revision {before.current}, which this loopline does not know: "
            "it was migrated by a newer loopline; upgrade loopline"
        )
    config = alembic_config()
    try:
        with engine.connect() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
            conn.commit()
    except DBAPIError as exc:
        raise LooplineError(
            f"upgrading {before.url} failed and nothing was applied (it is still at "
            f"{before.current or 'no revision'}): {error_reason(exc)}"
        ) from exc
    return UpgradeResult(config.attributes.get("applied_from"), schema_status(engine))


def open_ledger(url: str | None = None) -> Engine:
    """An engine on a reachable ledger whose schema matches this code: what every writer should use. The
    embedded ledger (no URL given or set) is loopline's own and is brought up to date here, as `train` does:
    a new user's first `loopline runs` asked for `loopline db upgrade`; a server you configured is upgraded
    only by `loopline db upgrade`."""
    engine = make_engine(url)
    if url is None and is_embedded():
        upgrade(engine)
    require_current_schema(engine)
    return engine


def require_current_schema(engine: Engine) -> None:
    """Refuse to write to a ledger whose schema differs from this code's."""
    status = schema_status(engine)
    if status.up_to_date:
        return
    if status.current is None:
        raise SchemaOutOfDate(f"{status.url} has no loopline schema yet: run `loopline db upgrade`")
    if not status.known:
        raise SchemaOutOfDate(
            f"{status.url} is at revision {status.current}, newer than this loopline ({status.head}): "
            "upgrade loopline"
        )
    raise SchemaOutOfDate(
        f"{status.url} is at revision {status.current}, this loopline needs {status.head}: "
        "run `loopline db upgrade`"
    )
