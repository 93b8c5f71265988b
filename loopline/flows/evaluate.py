"""The `evaluate` flow: held-out success of one policy version of a run, stored once, never trained on.

Fixed eval split (the run's first `eval.tasks` eval tasks), the environment's tool budget, and the
run's eval temperature and seed, so two evaluations of one version measure the same thing.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from loopline.pipeline import assembly
from loopline.store import ledger, queries
from loopline.errors import LooplineError
from loopline.tasks import loop as tasks


@flow(name="evaluate", **tasks.RESULT)
def evaluate(run: str, version: int | None = None) -> dict:
    """Evaluate `version` of `run` (default: its newest); a version already evaluated is read back, not re-run."""
    log = get_run_logger()
    parts = assembly.open_named_run(run)
    config, run_id = parts.config, parts.run_id
    with parts.session() as s:
        weights = ledger.version_weights(s, run_id, version)
        done = {e.version: e.success for e in queries.eval_results(s, run_id)}
    version = weights.version
    if version in done:
        log.info("run %s v%d: already evaluated, held-out success %.1f%%", config.name, version, 100 * done[version])
        return {"run": config.name, "policy_version": version, "success": done[version], "recorded": False}
    with parts.session() as s:
        exported = ledger.exported_versions(s, run_id)
    if version not in exported:
        why = (f"was never written to disk (learner.export_every: {config.exports_every})" if weights.uri is None else
               "had its files deleted by the run's pruning (learner.keep_exports keeps the newest exports and each evaluated "
               "version's): they are gone for good")
        raise LooplineError(f"run {config.name} v{version} {why}; versions on disk: {', '.join(map(str, exported)) or 'none'}")
    held_out = parts.held_out()
    if not held_out.tasks:
        raise LooplineError(f"{parts.env_name}@{parts.env_version} has no eval tasks")
    served = assembly.build_run_engine(parts, weights.uri, version)
    try:
        if served.version() != version:
            raise LooplineError(
                f"run {config.name}: its SGLang servers serve v{served.version()}, not v{version}; evaluate the version "
                f"they serve, or give the run's engine `launch:` so that an evaluation starts servers of its own"
            )
        success = tasks.evaluate(quote(served), quote(held_out))
    finally:
        served.shutdown()
    log.info("run %s v%d: held-out success %.1f%% on %d tasks", config.name, version, 100 * success, len(held_out.tasks))
    return {"run": config.name, "policy_version": version, "success": success, "recorded": True}
