"""Which run a `loopline train` drives, and with which config: a file's, or the one the ledger stored for the
run it resumes, extended to more steps or not. Light on purpose (the ledger and the config, no torch, no
Prefect): the CLI checks `--resume` and `--steps` with it in its first second, before anything starts."""

from __future__ import annotations

from pathlib import Path

from loopline.config import MAX_STEPS, RunConfig, load_config, parse_config, run_name
from loopline.errors import LooplineError
from loopline.store import db as store_db
from loopline.store import ledger, migrate
from loopline.store.models import Run

FORKED_FROM = "forked_from"  # stored next to a forked run's config: parent run and the version it started from


def run_config(config_path: str | None, resume: str | None) -> tuple[RunConfig, Path]:
    """The config to run: the file's, or (resume without a file) the one the ledger stored for the run."""
    if config_path is not None:
        config, base = load_config(config_path)
        if resume is not None and resume != config.name:
            raise LooplineError(f"--resume {resume}: {config_path} describes run {config.name!r}")
        return config, base
    if resume is None:
        raise LooplineError("pass a run config, or --resume RUN to continue a run from the ledger")
    with store_db.session(migrate.open_ledger()) as s:
        stored = dict(ledger.get_run(s, resume).config)
    stored.pop(FORKED_FROM, None)
    return parse_config(stored, f"run {resume} (stored config)"), Path.cwd()


def refuse_bad_resume(config_path: str | None, resume: str, steps: int | None) -> None:
    """`--resume RUN [--steps N]` checked before anything starts: RUN a run's name (and without a config file, a run
    in the ledger whose stored config reads), N a number of steps the run can train to (they were checked after the
    whole start-up, ~50 s under load, and `--steps 10^12` was taken)."""
    try:
        run_name(resume)
    except ValueError as exc:
        raise LooplineError(f"--resume: {exc}") from None
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        raise LooplineError(f"--steps {steps}: give the number of learner steps to train to, from 1 to {MAX_STEPS:,}")
    if config_path is not None:
        return  # (a config file's run: checked with the file; it may not exist yet)
    with store_db.session(migrate.open_ledger()) as s:
        run = ledger.get_run(s, resume)
        if steps is not None:
            _check_extension(s, run, config_path, steps)
    parse_config({k: v for k, v in run.config.items() if k != FORKED_FROM}, f"run {resume} (stored config)")


def _check_extension(s, run: Run, config_path: str | None, steps: int) -> None:
    if config_path is not None:
        raise LooplineError("--steps N extends a run with its stored config: loopline train --resume RUN --steps N")
    done = ledger.resume_state(s, run.id).next_learner_step - 1
    if steps < max(done, 1):
        raise LooplineError(f"run {run.name} has trained {done} steps already: --steps must be at least {max(done, 1)}")
    schedule = run.config.get("learner", {}).get("lr_schedule", "constant")
    if schedule != "constant" and steps != run.config["steps"]:
        raise LooplineError(
            f"run {run.name} decays its learning rate over its {run.config['steps']} steps (lr_schedule: {schedule}); more steps "
            "would change the rate of those it trained. Fork it instead: loopline train NEW.yaml --fork " + run.name
        )


def extend_run(config_path: str | None, resume: str | None, steps: int) -> None:
    """`loopline train --resume RUN --steps N`: the run trains on to N steps (its stored config says N from
    now on; nothing else may change without a fork)."""
    if resume is None:
        raise LooplineError("--steps N extends a run with its stored config: loopline train --resume RUN --steps N")
    with store_db.session(migrate.open_ledger()) as s:
        run = ledger.get_run(s, resume)
        _check_extension(s, run, config_path, steps)
        ledger.restate_config(s, run.id, {**run.config, "steps": steps})
