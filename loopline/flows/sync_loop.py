"""One synchronous RL step over the ledger, as plain functions (the Prefect flow wraps each as a task).

plan -> rollout (barrier) -> learn -> checkpoint + export -> commit (one transaction) -> sync weights.
Every stage is idempotent against the ledger: re-running a step after a crash plans nothing new,
rolls out only what is not committed, retrains exactly the batch claimed for the step (or skips
it if committed), and re-publishes the version the ledger says is current.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sqlmodel import Session

from loopline.envregistry.tasks import Task
from loopline.rollout.engine import Engine
from loopline.rollout.scheduler import Binding, RolloutStats, WorkerConfig, run_barrier
from loopline.store import ledger
from loopline.trainer.batch import load_sequences
from loopline.trainer.learner import Learner


@dataclass
class LoopContext:
    run_id: uuid.UUID
    session_factory: Callable[[], Session]
    engine: Engine
    binding: Binding
    learner: Learner
    workdir: Path  # checkpoints and exported weights live under here
    groups_per_step: int
    group_size: int
    concurrency: int = 16
    seed: int = 0


def plan(ctx: LoopContext, step: int) -> list[uuid.UUID]:
    """The step's groups: task choice is a pure function of (seed, step), so a re-plan is identical."""
    train = sorted(t for t, task in ctx.binding.tasks.items() if task.split == "train")
    chosen = random.Random(f"{ctx.seed}/{step}").sample(train, ctx.groups_per_step)
    with ctx.session_factory() as s:
        return ledger.plan_step(s, ctx.run_id, step, chosen, ctx.group_size)


async def rollout(ctx: LoopContext, step: int) -> RolloutStats:
    return await run_barrier(ctx.engine, ctx.binding, ctx.session_factory, WorkerConfig(ctx.run_id, f"sync-{step}", concurrency=ctx.concurrency))


def learn(ctx: LoopContext, step: int, max_groups: int) -> ledger.LearnerCommit | None:
    """Train on the groups claimed for `step` and commit consumption + checkpoint + version atomically."""
    with ctx.session_factory() as s:
        batch = ledger.claim_learner_batch(s, ctx.run_id, step, max_groups=max_groups)
        if batch.already_committed:
            return None
        if batch.empty:
            raise RuntimeError(f"learner step {step}: no complete group to train on")
        sequences = load_sequences(s, batch.trajectory_ids)
    result = ctx.learner.rl_step(sequences)
    version = batch.policy_version + 1
    checkpoint = ctx.learner.save_checkpoint(ctx.workdir / "checkpoints" / f"step-{step:06d}", version, {"learner_step": step})
    weights = ctx.workdir / "weights" / f"v{version:06d}"
    digest = ctx.learner.export_weights(weights)
    with ctx.session_factory() as s:
        return ledger.commit_learner_step(s, batch, str(weights), str(checkpoint), digest, metrics=result.metrics)


async def sync_weights(ctx: LoopContext) -> int:
    """Serve the ledger's newest version on the engine, then record it as published."""
    with ctx.session_factory() as s:
        state = ledger.resume_state(s, ctx.run_id)
    if ctx.engine.version() < state.policy_version:
        await ctx.engine.update_weights(state.policy_version, state.weights_uri)
    with ctx.session_factory() as s:
        ledger.mark_published(s, ctx.run_id, state.policy_version)
    return state.policy_version


async def sync_step(ctx: LoopContext, step: int) -> dict:
    plan(ctx, step)
    stats = await rollout(ctx, step)
    commit = learn(ctx, step, max_groups=ctx.groups_per_step)
    version = await sync_weights(ctx)
    return {"step": step, "committed": stats.committed, "infra_failed": stats.infra_failed, "policy_version": version, "trained": commit is not None}


async def evaluate(ctx: LoopContext, eval_tasks: list[Task], env_version: int, temperature: float, seed: int) -> float:
    """Held-out success of the engine's current version (fixed tasks and seed); recorded once per version."""
    import dataclasses

    from loopline.rollout.engine import SamplingParams
    from loopline.rollout.harness import run_episode

    version = ctx.engine.version()
    setup = dataclasses.replace(
        ctx.binding.setup, sampling=SamplingParams(temperature=temperature, max_new_tokens=ctx.binding.setup.sampling.max_new_tokens, seed=seed)
    )
    results = await asyncio.gather(*(run_episode(ctx.engine, setup, t, f"eval-v{version}-{t.id}/") for t in eval_tasks))
    successes = sum(r.reward == 1.0 for r in results)
    with ctx.session_factory() as s:
        ledger.record_eval_result(
            s, ctx.run_id, version, setup.spec.name, env_version, len(results), successes,
            {"truncated": sum(r.truncated for r in results), "temperature": temperature, "seed": seed},
        )
    return successes / len(results)


def tasks_by_id(tasks: list[Task]) -> dict[str, Task]:
    return {t.id: t for t in tasks}
