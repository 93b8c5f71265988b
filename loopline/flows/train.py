"""The `train` flow: sync (rollout -> learn -> sync weights in lock-step) or async (rollouts overlap learning).

Calling `train("run.yaml")` from Python runs it like any Prefect flow; `loopline train run.yaml` is the
same call. Re-running it on an existing run continues from the ledger: the last committed checkpoint
is restored, the engine serves the newest version, and every stage skips what is already done. A run
whose config changed since it started is refused unless it is forked into a new run.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from loopline import stop_signals
from loopline.pipeline import assembly, learner_launch
from loopline.pipeline.resumption import extend_run, run_config
from loopline.config import RunConfig, config_file, run_name
from loopline.tracking import Trackers
from loopline.flows.worker import DeployedWorkers
from loopline.store import db as store_db
from loopline.store import ledger, queries
from loopline.errors import LooplineError
from loopline.failpoints import failpoint
from loopline.tasks import loop as tasks
from loopline.pipeline import stages
from loopline.pipeline.opening import prepare
from loopline.pipeline.stages import LoopContext


class Evaluations:
    """A training run's held-out evaluations: every version the config schedules, once, including those a crash
    between a learner commit and its evaluation left owed."""

    def __init__(self, parts: assembly.RunParts, ctx: stages.LoopContext, trackers: Trackers):
        self.parts, self.ctx, self.trackers = parts, ctx, trackers
        self.held_out = parts.held_out(ctx.binding.setup, ctx.session_factory)

    def evaluate(self, engine) -> None:
        """The version `engine` serves, recorded in the ledger and the trackers."""
        ctx = self.ctx
        failpoint("evaluate")
        # async: the local rollout worker starts no episode until the evaluation is done (they share the engine,
        # or on a resume's owed evaluation of an older version, the machine)
        ctx.evaluating.set()
        try:
            success = tasks.evaluate(quote(engine), quote(self.held_out))
        finally:
            ctx.evaluating.clear()
        get_run_logger().info("policy v%d: held-out success %.1f%% on %d tasks", engine.version(), 100 * success, len(self.held_out.tasks))
        self.trackers.wake()

    def owed(self) -> None:
        """Every scheduled evaluation the ledger lacks, up to the served version (older versions get an engine
        of their own)."""
        ctx, config, log = self.ctx, self.parts.config, get_run_logger()
        owed = tasks.waiting_out_outages(lambda: stages.read(ctx, ledger.owed_evaluations, config.evaluates, ctx.engine.version()))
        for weights in owed:
            if weights.version == ctx.engine.version():
                self.evaluate(ctx.engine)
                continue
            if config.engine.running_servers:
                log.warning(
                    "v%d's evaluation is owed (an earlier process stopped before it), but the run's SGLang servers "
                    "serve v%d: evaluate it with an engine that can load it (loopline eval %s --version %d)",
                    weights.version, ctx.engine.version(), config.name, weights.version,
                )
                continue
            log.info("evaluating v%d, owed since an earlier process stopped before it", weights.version)
            engine = assembly.build_run_engine(self.parts, weights.uri, weights.version)
            try:
                self.evaluate(engine)
            finally:
                engine.shutdown()


@flow(name="train", **tasks.RESULT)
def train(
    config_path: str | dict | RunConfig | None = None, resume: str | None = None, fork: str | None = None, steps: int | None = None,
) -> dict:
    """Train a policy as the run config says; continue where the ledger says the run stands. `steps` (with
    `resume` and no config file) extends the run to that many learner steps. From Python the config may be a
    path, a dict or a RunConfig."""
    log = get_run_logger()
    if fork is not None:
        try:
            run_name(fork)
        except ValueError as exc:
            raise LooplineError(f"fork: {exc}") from None
    config_path = config_file(config_path, store_db.loopline_home() / "configs")
    if steps is not None:
        extend_run(config_path, resume, steps)
    config, base = run_config(config_path, resume)
    if (ranks := config.learner.ranks) is not None and not learner_launch.launched():
        log.info("starting %d learner ranks through DeepSpeed's launcher; rank 0 runs the run", ranks.ranks)
        return learner_launch.run(ranks, config_path, resume, fork)
    # the run's status records how this ends, whatever the way (a stop signal even if its exception is lost)
    with stop_signals.noted(), contextlib.ExitStack() as lifecycle:
        return _train(config, base, fork, lifecycle)


def _train(config: RunConfig, base: Path, fork: str | None, lifecycle: contextlib.ExitStack) -> dict:
    log = get_run_logger()
    prepared = prepare(config, base, lifecycle, fork)
    parts, ctx = prepared.parts, prepared.ctx
    config, live = parts.config, quote(ctx)  # (quote: see loopline/tasks/loop.py, Prefect must not walk the live context)
    trackers = Trackers(
        config.tracking, config.name, ctx.run_id, parts.workdir(), config.model_dump(mode="json"), ctx.session_factory, warn=log.warning,
    )
    lifecycle.callback(trackers.close)
    evaluations, lagging = Evaluations(parts, ctx, trackers), quote(set())

    def after_step(step: int) -> None:
        version = tasks.sync_weights(live)
        log.info("step %d trained; now serving v%d", step, version)
        trackers.wake()  # (they read the step from the ledger, in a thread of their own)
        tasks.report_lagging_servers(live, version, lagging)
        evaluations.owed()  # the scheduled one, and any a crash left owed

    try:
        tasks.sync_weights(live)  # a resumed run may have committed a version it never published
        evaluations.owed()
        if config.rollout.mode == "sync":
            for step in range(prepared.first_step, config.steps + 1):
                stop_signals.raise_if_received()
                tasks.plan_step(live, step)
                rolled = tasks.rollout_batch(live, step)
                log.info("step %d: %d trajectories, %d infra failures", step, rolled["committed"], rolled["infra_failed"])
                tasks.learner_step(live, step)
                after_step(step)
        else:
            _run_async(ctx, config, prepared.first_step, after_step)
    finally:
        ctx.engine.shutdown()
        stages.release_servers(ctx)
    return _summary(ctx, config, trackers)


def _summary(ctx: LoopContext, config: RunConfig, trackers: Trackers) -> dict:
    """What the flow returns (and persists for `run_deployment` callers); the newest model to the trackers."""
    history = [(e.version, e.success) for e in tasks.waiting_out_outages(lambda: stages.read(ctx, queries.eval_results))]
    if trackers.active:  # the newest model on disk, for the trackers that keep artifacts
        with ctx.session_factory() as s:
            newest = ledger.version_weights(s, ctx.run_id, ledger.exported_versions(s, ctx.run_id)[-1])
        trackers.artifact(ctx.weights.local(newest.uri))
    return {"run": config.name, "run_id": str(ctx.run_id), "policy_version": ctx.engine.version(), "eval": history}


def _run_async(ctx: LoopContext, config: RunConfig, first_step: int, after_step) -> None:
    """A rollout worker task runs beside the learner steps; slots are planned just as far ahead as they may start."""
    live = quote(ctx)
    staleness = config.rollout.max_staleness
    for step in range(first_step, min(config.steps, first_step + staleness) + 1):
        tasks.plan_step(live, step)
    stop = threading.Event()
    worker = tasks.rollout_worker.submit(live, stop) if config.rollout.local_rollout else None
    producing = (lambda: not worker.state.is_final()) if worker else None
    if config.rollout.workers:  # flow runs of the rollout_worker deployment, on the machines of its work pool
        deployed = DeployedWorkers(config.name, config.rollout.workers)
        deployed.start()
        producing = deployed.alive
    try:
        for step in range(first_step, config.steps + 1):
            stop_signals.raise_if_received()
            tasks.learner_step(live, step, producing=producing)
            if step + 1 + staleness <= config.steps:  # version `step` may now start slots of step `step + 1 + staleness`
                tasks.plan_step(live, step + 1 + staleness)
            after_step(step)
    finally:
        stop.set()
        if worker:
            worker.wait()
    if worker:
        worker.result()  # a worker that failed fails the flow


@flow(name="learner", **tasks.RESULT)
def learner(config_path: str | None = None, resume: str | None = None) -> dict:
    """The learner on its own: an async run (`rollout.local_rollout: false`) fed by `rollout_worker` flows elsewhere."""
    config, _ = run_config(config_path, resume)
    if config.rollout.mode != "async" or config.rollout.local_rollout:
        raise LooplineError(f"run {config.name}: the learner flow trains async runs with `rollout: {{mode: async, local_rollout: false}}`; use `train` otherwise")
    return train.fn(config_path, resume)
