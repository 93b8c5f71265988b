"""The `evaluate` flow: held-out success of one policy version of a run, stored once, never trained on.

Fixed eval split (the run's first `eval.tasks` eval tasks), the environment's tool budget, and the
run's eval temperature and seed, so two evaluations of one version measure the same thing.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from loopline.envregistry import registry
from loopline.flows.train import run_config
from loopline.rollout.chat import ChatFormat
from loopline.rollout.engine import SamplingParams
from loopline.rollout.engine_thread import EngineThread
from loopline.rollout.harness import EpisodeSetup
from loopline.rollout.local_engine import LocalEngine
from loopline.store import db as store_db
from loopline.store import ledger, migrate, queries
from loopline.errors import LooplineError
from loopline.tasks import loop as tasks


@flow(name="evaluate")
def evaluate(run: str, version: int | None = None) -> dict:
    """Evaluate `version` of `run` (default: its newest); a version already evaluated is read back, not re-run."""
    log = get_run_logger()
    config, _ = run_config(None, run)
    database = migrate.open_ledger()
    with store_db.session(database) as s:
        run_id = ledger.get_run(s, run).id
        weights = ledger.version_weights(s, run_id, version)
        initial = Path(ledger.initial_weights(s, run_id))
        done = {v: rate for v, _, rate in queries.eval_results(s, run_id)}
        row = registry.get(s, config.env)
    version = weights.version
    if version in done:
        log.info("run %s v%d: already evaluated, held-out success %.1f%%", config.name, version, 100 * done[version])
        return {"run": config.name, "policy_version": version, "success": done[version], "recorded": False}
    evals = [t for t in registry.tasks_of(row) if t.split == "eval"][: config.eval.tasks]
    if not evals:
        raise LooplineError(f"{row.name}@{row.version} has no eval tasks")
    sampling = SamplingParams(temperature=config.sampling.temperature, max_new_tokens=config.sampling.max_new_tokens)
    setup = EpisodeSetup(registry.spec_of(row), row.version, ChatFormat.for_policy(initial), sampling)
    served = EngineThread(LocalEngine(weights.uri, version=version, max_batch=config.concurrency))
    try:
        success = tasks.evaluate(
            run_id, quote(served), quote(setup), quote(lambda: store_db.session(database)), quote(evals), row.version,
            config.eval.temperature, config.eval.seed,
        )
    finally:
        served.shutdown()
    log.info("run %s v%d: held-out success %.1f%% on %d tasks", config.name, version, 100 * success, len(evals))
    return {"run": config.name, "policy_version": version, "success": success, "recorded": True}
