"""Prefect tasks around the loop's stages: coarse (one batch, one learner step), retriable, idempotent.

Each wraps a plain function of `loopline.flows.sync_loop`; the ledger, not Prefect's cache, is what
makes a retry or a re-run safe, so caching is off (the inputs hold live engines and learners).
"""

from __future__ import annotations

import asyncio

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from loopline.flows import sync_loop


@task(name="plan_step", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def plan_step(ctx: sync_loop.LoopContext, step: int) -> int:
    return len(sync_loop.plan(ctx, step))


@task(name="rollout_batch", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def rollout_batch(ctx: sync_loop.LoopContext, step: int) -> dict:
    stats = asyncio.run(sync_loop.rollout(ctx, step))
    return {"committed": stats.committed, "infra_failed": stats.infra_failed, "utilisation": stats.utilisation(ctx.concurrency)}


@task(name="learner_step", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1)
def learner_step(ctx: sync_loop.LoopContext, step: int) -> bool:
    return sync_loop.learn(ctx, step, max_groups=ctx.groups_per_step) is not None


@task(name="sync_weights", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def sync_weights(ctx: sync_loop.LoopContext) -> int:
    return asyncio.run(sync_loop.sync_weights(ctx))


@task(name="evaluate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1)
def evaluate(ctx: sync_loop.LoopContext, eval_tasks: list, env_version: int, temperature: float, seed: int, history: list) -> float:
    success = asyncio.run(sync_loop.evaluate(ctx, eval_tasks, env_version, temperature, seed))
    rows = "\n".join(f"| {v} | {s:.1%} |" for v, s in [*history, (ctx.engine.version(), success)])
    create_markdown_artifact(
        key="eval-success", markdown=f"| policy version | held-out success |\n|---|---|\n{rows}\n", description="Held-out success per version"
    )
    return success
