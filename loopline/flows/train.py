"""The `train` flow (sync mode): plan -> rollout -> learn -> sync weights, step after step, resumable.

Calling `train("run.yaml")` from Python runs it like any Prefect flow; `loopline train run.yaml` is the
same call. Re-running it on an existing run continues from the ledger: the last committed checkpoint
is restored, the engine serves the newest version, and every stage skips what is already done.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger

from loopline.envregistry import registry
from loopline.flows.config import RunConfig, load_config
from loopline.flows.sync_loop import LoopContext, tasks_by_id
from loopline.rollout.chat import ChatFormat
from loopline.rollout.engine import SamplingParams
from loopline.rollout.harness import EpisodeSetup
from loopline.rollout.local_engine import LocalEngine
from loopline.rollout.scheduler import Binding
from loopline.store import db as store_db
from loopline.store import ledger, migrate
from loopline.tasks import loop as tasks
from loopline.trainer.learner import Learner, LearnerConfig


@dataclass
class Prepared:
    config: RunConfig
    ctx: LoopContext
    eval_tasks: list
    env_version: int
    first_step: int


def resolve_policy(config: RunConfig, env_yaml: Path) -> Path:
    """tiny: built once per seed under the loopline home; smollm2-135m: pulled once; else a model directory."""
    from loopline.flows.starter import TinyRecipe, build_tiny_policy, pull_smollm2

    models = store_db.loopline_home() / "models"
    if config.policy == "tiny":
        target = models / f"tiny-{config.seed}"
        if not (target / "config.json").is_file():
            build_tiny_policy(target, env_yaml, TinyRecipe(seed=config.seed))
        return target
    if config.policy == "smollm2-135m":
        return pull_smollm2(models / "smollm2-135m")
    path = Path(config.policy).expanduser()
    if not (path / "config.json").is_file():
        from loopline.store.errors import LooplineError

        raise LooplineError(f"policy {config.policy!r}: not 'tiny', 'smollm2-135m' or a model directory with config.json")
    return path


def prepare(config_path: str | Path) -> Prepared:
    config, base = load_config(config_path)
    engine = store_db.make_engine()
    migrate.upgrade(engine)
    env_yaml = (base / config.env).resolve()
    with store_db.session(engine) as s:
        registered = registry.add(s, env_yaml)
        row = registry.get(s, registered.ref)
    spec, all_tasks = registry.spec_of(row), registry.tasks_of(row)
    policy = resolve_policy(config, env_yaml)
    with store_db.session(engine) as s:
        run = ledger.create_run(s, config.name, config.model_dump(mode="json"), str(policy))
        state = ledger.resume_state(s, run.id)
    learner_config = LearnerConfig(
        lr=config.learner.lr, temperature=config.sampling.temperature, micro_batch_tokens=config.learner.micro_batch_tokens,
        minibatches=config.learner.minibatches, zero_stage=config.learner.zero_stage, seed=config.seed,
        advantage=config.learner.advantage, loss=config.learner.loss,
    )
    learner = Learner(policy, learner_config, backend=config.learner.backend)
    if state.last_checkpoint is not None:
        learner.load_checkpoint(state.last_checkpoint.uri)
    setup = EpisodeSetup(spec, row.version, ChatFormat.for_policy(policy), SamplingParams(temperature=config.sampling.temperature, max_new_tokens=config.sampling.max_new_tokens))
    train = [t for t in all_tasks if t.split == "train"]
    ctx = LoopContext(
        run_id=run.id,
        session_factory=lambda: store_db.session(engine),
        engine=LocalEngine(state.weights_uri, version=state.policy_version, max_batch=config.concurrency),
        binding=Binding(setup, tasks_by_id(train)),
        learner=learner,
        workdir=store_db.loopline_home() / "runs" / config.name,
        groups_per_step=config.groups_per_step,
        group_size=config.group_size,
        concurrency=config.concurrency,
        seed=config.seed,
    )
    evals = [t for t in all_tasks if t.split == "eval"][: config.eval.tasks]
    return Prepared(config, ctx, evals, row.version, state.next_learner_step)


@flow(name="train")
def train(config_path: str) -> dict:
    """Train a policy as the run config says; continue where the ledger says the run stands."""
    log = get_run_logger()
    p = prepare(config_path)
    c, ctx = p.config, p.ctx
    history: list[tuple[int, float]] = []

    def evaluate():
        success = tasks.evaluate(ctx, p.eval_tasks, p.env_version, c.eval.temperature, c.eval.seed, history)
        history.append((ctx.engine.version(), success))
        log.info("policy v%d: held-out success %.1f%% on %d tasks", ctx.engine.version(), 100 * success, len(p.eval_tasks))

    with ctx.session_factory() as s:
        ledger.set_run_status(s, ctx.run_id, "running")
    if p.first_step == 1:
        evaluate()
    for step in range(p.first_step, c.steps + 1):
        tasks.plan_step(ctx, step)
        rolled = tasks.rollout_batch(ctx, step)
        tasks.learner_step(ctx, step)
        version = tasks.sync_weights(ctx)
        log.info("step %d: %d trajectories, %d infra failures, now serving v%d", step, rolled["committed"], rolled["infra_failed"], version)
        if step % c.eval.every == 0 or step == c.steps:
            evaluate()
    with ctx.session_factory() as s:
        ledger.set_run_status(s, ctx.run_id, "completed")
    return {"run": c.name, "run_id": str(ctx.run_id), "policy_version": ctx.engine.version(), "eval": history}

