"""Prefect tasks around the loop's stages: coarse (one batch, one learner step), retriable, idempotent.

Each wraps a plain function of `loopline.pipeline.stages`; the ledger, not Prefect's cache, is what
makes a retry or a re-run safe, so caching is off (the inputs hold live engines and learners).

Callers pass live objects wrapped in `prefect.utilities.annotations.quote`: otherwise Prefect walks
every argument looking for upstream futures, and a context holding 2,000 tasks, a model and an
engine cost ~330 ms per task run (measured), a fifth of a quickstart step.
"""

from __future__ import annotations

import os
import time

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from loopline import aio, stop_signals
from loopline.envregistry.sandbox.base import InfraFailure
from loopline.rollout.engines.base import Engine, EngineClosed, EngineError
from loopline.rollout.harness.scheduler import StopFlag
from loopline.store import queries
from loopline.store.errors import is_outage
from loopline.pipeline import stages

# What may succeed on a second try: the database, an inference engine, a sandbox, the network.
# A config or contract error (LooplineError, LedgerConflict, a bug) fails at once instead.
TRANSIENT = (EngineError, InfraFailure)


def transient(task, task_run, state) -> bool:
    """Prefect's `retry_condition_fn`: retry a task only when it failed for a transient reason, and never once the
    process was told to stop (the failure may be the stop signal's exception, replaced by a cleanup's)."""
    if stop_signals.received() is not None or isinstance(state.data, EngineClosed):  # (closed: this process is stopping)
        return False
    return isinstance(state.data, TRANSIENT) or is_outage(state.data)


def backoff(total_s: float) -> list[float]:
    """Delays 1, 2, 4, 8, 15, 15, ... s adding up to at least `total_s`."""
    delays: list[float] = []
    while sum(delays) < total_s:
        delays.append(min(2.0 ** len(delays), 15.0))
    return delays


# A database outage or a restarting server shorter than this is waited out (LOOPLINE_RETRY_S, default 60 s):
# a failing task is retried with growing pauses; past it the run stops with one line and resumes later.
RETRY_DELAYS = backoff(float(os.environ.get("LOOPLINE_RETRY_S", "60")))
RETRY = dict(retries=len(RETRY_DELAYS), retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=transient)
# A task's result is an in-process value (the ledger is the record): never cached, never persisted (a flow that
# persists its own result would otherwise have every task persist too, live handles included).
TASK = dict(cache_policy=NO_CACHE, persist_result=False, **RETRY)
# A flow's returned dict (a JSON file in Prefect's result storage, PREFECT_HOME/storage) is what the caller of
# `run_deployment` reads with `run.state.result()`; without it that is a MissingResult.
RESULT = dict(persist_result=True, result_serializer="json")


def waiting_out_outages(call):
    """A flow's own ledger reads (between its tasks) wait out an outage as the tasks do (`RETRY_DELAYS`), and
    likewise not once the process was told to stop."""
    for delay in [*RETRY_DELAYS, None]:
        try:
            return call()
        except Exception as exc:
            if delay is None or not is_outage(exc) or stop_signals.received() is not None:
                raise
            get_run_logger().warning("the ledger is unreachable (%s); retrying in %g s", type(exc).__name__, delay)
            time.sleep(delay)


@task(name="plan_step", **TASK)
def plan_step(ctx: stages.LoopContext, step: int) -> int:
    return len(stages.plan(ctx, step))


@task(name="rollout_batch", **TASK)
def rollout_batch(ctx: stages.LoopContext, step: int) -> dict:
    stats = aio.run(stages.rollout(ctx, step))
    return {"committed": stats.committed, "infra_failed": stats.infra_failed, "utilisation": stats.utilisation(ctx.rollout.concurrency)}


@task(name="rollout_worker", **TASK)
def rollout_worker(ctx: stages.RolloutContext, stop: StopFlag, worker: str | None = None) -> dict:
    """The async producer: runs until `stop`, beside the learner steps or in a `rollout_worker` flow elsewhere."""
    stats = aio.run(stages.rollout_continuous(ctx, stop, worker))
    return {"committed": stats.committed, "infra_failed": stats.infra_failed, "gate_waits": stats.gate_waits}


@task(name="learner_step", **TASK)
def learner_step(ctx: stages.LoopContext, step: int, producing=None) -> bool:
    """Trains step `step` once its groups are settled (immediately in sync mode: the barrier settled them)."""
    stages.wait_for_groups(ctx, step, producing)
    return stages.learn(ctx, step) is not None


@task(name="sync_weights", **TASK)
def sync_weights(ctx: stages.RolloutContext) -> int:
    return aio.run(stages.sync_weights(ctx))


@task(name="report_lagging_servers", **TASK)
def report_lagging_servers(ctx: stages.RolloutContext, version: int, reported: set) -> None:
    stages.report_lagging_servers(ctx, version, reported)


@task(name="evaluate", **TASK)
def evaluate(engine: Engine, held_out: stages.HeldOut) -> float:
    """Held-out success of the version `engine` serves, stored in the ledger and shown as the run's eval table."""
    success = aio.run(stages.evaluate(engine, held_out))
    with held_out.session_factory() as s:
        rows = queries.eval_results(s, held_out.run_id)
    table = "\n".join(f"| {e.version} | {e.tasks} | {e.success:.1%} |" for e in rows)
    create_markdown_artifact(
        key="eval-success",
        markdown=f"| policy version | tasks | held-out success |\n|---|---|---|\n{table}\n",
        description="Held-out success per policy version (never used for training)",
    )
    return success
