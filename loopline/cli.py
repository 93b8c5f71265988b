"""`loopline`: the pipeline's command line. Training commands arrive with the flows."""

from __future__ import annotations

import typer
from rich.table import Table

from loopline.cli_support import console, friendly_errors
from loopline.store import db as store_db
from loopline.store import migrate

app = typer.Typer(help="Agentic RL training with a PostgreSQL ledger.", no_args_is_help=True)
db_app = typer.Typer(help="The ledger database: schema upgrades and status.", no_args_is_help=True)
app.add_typer(db_app, name="db")


def _where() -> str:
    return "embedded server" if store_db.is_embedded() else f"${store_db.DATABASE_URL_ENV}"


@db_app.command("upgrade")
@friendly_errors
def db_upgrade() -> None:
    """Apply pending migrations (one transaction; safe to run from several processes at once)."""
    engine = store_db.make_engine()
    result = migrate.upgrade(engine)
    after = result.status
    if result.changed:
        console.print(f"upgraded {after.url} ({_where()}) from {result.applied_from or 'empty'} to {after.current}")
    else:
        console.print(f"{after.url} ({_where()}) is already at {after.current} (head)")


@db_app.command("status")
@friendly_errors
def db_status() -> None:
    """Show where the ledger is and whether its schema matches this loopline; exit 1 if it does not."""
    engine = store_db.make_engine()
    status = migrate.schema_status(engine)
    table = Table(show_header=False, box=None)
    table.add_row("database", f"{status.url} ({_where()})")
    table.add_row("revision", status.current or "none (empty database)")
    table.add_row("head", status.head)
    console.print(table)
    migrate.require_current_schema(engine)
    counts = Table("table", "rows", box=None)
    with engine.connect() as conn:
        for name in ("environment", "run", "slot", "trajectory", "consumption", "policy_version"):
            counts.add_row(name, str(conn.exec_driver_sql(f"SELECT count(*) FROM {name}").scalar_one()))
    console.print("[green]schema up to date[/]")
    console.print(counts)


if __name__ == "__main__":  # pragma: no cover
    app()
