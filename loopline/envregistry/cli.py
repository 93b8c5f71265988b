"""`envreg`: the environment registry's command line."""

from __future__ import annotations

import sqlalchemy as sa
import typer
from rich.table import Table

from loopline.cli_support import console, friendly_errors
from loopline.store.db import session
from loopline.store.migrate import open_ledger
from loopline.store.models import Environment

app = typer.Typer(help="Register, inspect and test environments.", no_args_is_help=True)


@app.callback()
def main() -> None:
    """Environments are declared in YAML and registered with versions."""


@app.command("list")
@friendly_errors
def list_environments(all_versions: bool = typer.Option(False, "--all", help="Include deprecated versions.")) -> None:
    """List registered environments, newest version first."""
    engine = open_ledger()
    query = sa.select(Environment).order_by(Environment.name, Environment.version.desc())
    if not all_versions:
        query = query.where(Environment.deprecated.is_(False))
    with session(engine) as s:
        envs = s.execute(query).scalars().all()
    if not envs:
        console.print("no environments registered")
        return
    table = Table("name@version", "env", "verifier", "harness", "spec hash", "created")
    for env in envs:
        label = f"{env.name}@{env.version}" + (" (deprecated)" if env.deprecated else "")
        table.add_row(label, env.env_version, env.verifier_version, env.harness_version, env.spec_hash[:12], f"{env.created_at:%Y-%m-%d %H:%M}")
    console.print(table)
