"""The loop's stages as plain functions over the ledger (the Prefect tasks in `loop.py` wrap them).

Sync: plan -> rollout (barrier) -> learn -> checkpoint + export -> commit (one transaction) -> sync
weights. Async: a rollout worker (`rollout_continuous`) keeps generating behind the staleness bound
while the learner waits for each step's groups (`wait_for_groups`), trains, commits and syncs.
Every stage is idempotent against the ledger: re-running a step after a crash plans nothing new,
rolls out only what is not committed, retrains exactly the batch claimed for the step (or skips
it if committed), and re-publishes the version the ledger says is current.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import resource
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import sqlalchemy.exc
import torch

from sqlmodel import Session

from loopline import activity, holder
from loopline.envregistry.tasks import Task
from loopline.config import RolloutSettings, RunConfig
from loopline.errors import LooplineError
from loopline.failpoints import failpoint
from loopline.envregistry.sandbox.base import InfraFailure
from loopline.rollout.engines.base import Engine, EngineClosed, EngineError, LentWeights, SamplingParams
from loopline.rollout.harness.episode import EpisodeSetup, run_episode
from loopline.rollout.harness.scheduler import Binding, RolloutStats, StopFlag, WorkerConfig, run_barrier, run_continuous
from loopline.rollout.weights.store import WeightStore
from loopline.store import ledger
from loopline.store.errors import DatabaseUnavailable, LostTheRun
from loopline.store.records import LearnerCommit
from loopline.types import MAX_ATTEMPTS
from loopline.trainer.batch import TrainSequence, batch_metrics, sequences_from_trajectory
from loopline.pipeline.learner_side import LearnerSide
from loopline.trainer.learner import Learner, RefusedUpdate, computing_threads


@dataclass(kw_only=True)
class RolloutContext:
    """What a rollout worker needs: the run, the ledger, an engine and the environment's tasks."""

    run_id: uuid.UUID
    session_factory: Callable[[], Session]
    engine: Engine
    binding: Binding
    # The run config's section, whole: batch sizes, episodes in flight, leases, attempts, what a sync does to requests in flight.
    rollout: RolloutSettings = dataclasses.field(default_factory=RolloutSettings)
    # A LoRA run on SGLang: every version ships as its adapter alone (`policy_version.adapter_uri`), which the
    # learner writes with each commit and the engine loads; the full weights are exported only as `export_version` says.
    adapters: bool = False
    # Set while an evaluation runs on this context's engine: the rollout worker starts no new episode meanwhile.
    evaluating: threading.Event = dataclasses.field(default_factory=threading.Event)
    # The ledger's weight URIs to directories on this host (fetched from the trainer, or an object store, when not here).
    weights: WeightStore = dataclasses.field(default_factory=WeightStore.plain)

    def held_weights(self, version: int) -> Mapping[str, torch.Tensor] | None:
        """`version`'s weights when this process holds them in memory; None: the engine loads them from disk."""
        return None


@dataclass(kw_only=True)
class LoopContext(RolloutContext):
    """A whole training process: rollout, the plan, and the learner's side (`learning`)."""

    learning: LearnerSide
    seed: int = 0
    # The process that drives the run (its holder name): a learner commit is refused once another process has
    # taken the run over (fencing). None: not checked (a learner driven by hand, the tests of the stages).
    driver: str | None = None
    # when this process's previous learner step committed (or its loop began): a step's whole time runs from there
    last_commit: float = dataclasses.field(default_factory=time.monotonic)

    @classmethod
    def for_run(
        cls, config: RunConfig, run_id: uuid.UUID, session_factory: Callable[[], Session], engine: Engine, binding: Binding,
        learning: LearnerSide, driver: str | None, weights: WeightStore,
    ) -> "LoopContext":
        """A run's loop: its sizes and policies as its config says, around the live handles."""
        return cls(
            run_id=run_id, session_factory=session_factory, engine=engine, binding=binding, learning=learning, driver=driver,
            rollout=config.rollout, seed=config.seed, adapters=config.syncs_adapters, weights=weights,
        )

    def held_weights(self, version: int) -> Mapping[str, torch.Tensor] | None:
        return self.learning.held_weights(version)


log = logging.getLogger(__name__)


def load_sequences(session: Session, trajectory_ids: Sequence[uuid.UUID]) -> list[TrainSequence]:
    """The learner's view of a claimed batch, in the batch's order."""
    return [s for t in ledger.load_chained(session, trajectory_ids) for s in sequences_from_trajectory(t)]


def plan(ctx: LoopContext, step: int) -> list[uuid.UUID]:
    """The step's groups: task choice is a pure function of (seed, step), so a re-plan is identical."""
    train = sorted(t for t, task in ctx.binding.tasks.items() if task.split == "train")
    chosen = random.Random(f"{ctx.seed}/{step}").sample(train, ctx.rollout.groups_per_step)
    with ctx.session_factory() as s:
        if ctx.driver is not None:
            ledger.require_driver(s, ctx.run_id, ctx.driver)
        return ledger.plan_step(s, ctx.run_id, step, chosen, ctx.rollout.group_size, max_attempts=ctx.rollout.max_attempts)


async def rollout(ctx: LoopContext, step: int) -> RolloutStats:
    return await run_barrier(ctx.engine, ctx.binding, ctx.session_factory, WorkerConfig(ctx.run_id, concurrency=ctx.rollout.concurrency, lease_seconds=ctx.rollout.lease_seconds))


def release_engine_memory(ctx: LoopContext) -> None:
    """A sync step's rollouts are done and its learner is about to train: an engine in this process (LocalEngine)
    drops the KV caches it keeps to generate faster and its weights, which would otherwise sit under the learner's
    peak memory; the step's version reaches it whole (`sync_weights`) before it generates again. (Only once the
    learner will train: a step found committed already makes no version to serve, so the engine keeps its own.)"""
    release = getattr(ctx.engine, "release_memory", None)  # (EngineThread's; a server elsewhere has none here)
    if release is not None:
        release(weights=True)


async def rollout_continuous(ctx: RolloutContext, stop: StopFlag, worker: str | None = None) -> RolloutStats:
    """Generate until `stop`: slots of step p start only on version >= p - 1 - rollout.max_staleness."""
    cfg = WorkerConfig(
        ctx.run_id, worker or holder.this_process(), concurrency=ctx.rollout.concurrency, lease_seconds=ctx.rollout.lease_seconds,
        max_staleness=ctx.rollout.staleness_bound or 0, wait_for_work=True,
    )
    return await run_continuous(ctx.engine, ctx.binding, ctx.session_factory, cfg, stop, paused=ctx.evaluating.is_set)


STALL_REPORT_S = 120.0  # a learner waiting this long without a group completing says why, and again as long again


def wait_for_groups(
    ctx: LoopContext, step: int, producing: Callable[[], bool] | None = None, poll_s: float = 0.2, stall_report_s: float = STALL_REPORT_S,
) -> float:
    """Block until no train group of steps <= `step` is still open; returns the seconds waited.

    `producing` says whether a rollout worker is still alive; without one (workers on other machines) the wait
    is unbounded, but not silent: every `stall_report_s` without a group completing it names the engines and the
    versions they serve against the version the step's slots need.
    """
    started = changed = reported = time.monotonic()
    before = None
    while True:
        with ctx.session_factory() as s:
            still_open = ledger.open_groups_through(s, ctx.run_id, step)
        now = time.monotonic()
        if still_open == 0:
            return now - started
        if still_open != before:
            before, changed = still_open, now
        elif now - changed >= stall_report_s and now - reported >= stall_report_s:
            reported = now
            log.warning(_stalled(ctx, step, still_open, now - changed))
        if producing is not None and not producing():
            raise LooplineError(
                f"the local rollout worker stopped while groups of step {step} were still open (why is in the run's "
                "train.log); fix that, then resume (loopline train --resume RUN)"
            )
        time.sleep(poll_s)


def _stalled(ctx: LoopContext, step: int, still_open: int, for_s: float) -> str:
    """Why the learner waits: which engine serves which version, against what the step's slots need."""
    needs = step - 1 - ctx.rollout.max_staleness
    servers = read(ctx, ledger.serving_servers)
    engines = [f"{syncer} serves v{served} (seen {age:.0f} s ago)" for _, syncer, served, age in servers]
    behind = [engine for engine, (_, _, served, _) in zip(engines, servers) if served < needs]
    return (
        f"learner step {step} waits for {still_open} groups, none completed for {for_s:.0f} s; its slots start only on v{max(needs, 0)} or "
        f"newer (rollout.max_staleness {ctx.rollout.max_staleness}). Rollout engines: {', '.join(engines) or 'none has reported'}"
        + (f"; behind: {', '.join(behind)} (a worker that cannot get a version stops and its log says why)" if behind else "")
        + ("" if engines else " (start `loopline worker RUN`, or check the work pool's workers)")
    )


def learn(ctx: LoopContext, step: int) -> LearnerCommit | None:
    """Train on the groups claimed for `step` (at most `rollout.groups_per_step`, none staler than the run allows) and
    commit consumption + checkpoint + version atomically."""
    with ctx.session_factory() as s:
        if ctx.driver is not None:  # (a step another process committed must not look done to one that lost the run)
            ledger.require_driver(s, ctx.run_id, ctx.driver)
        batch = ledger.claim_learner_batch(
            s, ctx.run_id, step, max_groups=ctx.rollout.groups_per_step, max_staleness=ctx.rollout.staleness_bound
        )
        if batch.already_committed:
            return None
        if batch.empty and batch.stale_dropped:
            raise LooplineError(
                f"learner step {step}: each of its {batch.stale_dropped} complete groups was older than rollout.max_staleness "
                "(the rollouts fell behind the learner); raise rollout.max_staleness or add rollout workers, then resume "
                "(loopline train --resume RUN)"
            )
        if batch.empty:  # every group of the step was dropped: its slots kept failing outside the policy
            failure = ledger.last_infra_failure(s, ctx.run_id)
            raise LooplineError(
                f"learner step {step}: no group to train on: each was dropped after {ctx.rollout.max_attempts} infrastructure failures of "
                f"a sample{f'; the last: {failure}' if failure else ''}. Check the environment on its own (`envreg test ENV`), "
                "then resume (loopline train --resume RUN)"
            )
        sequences = load_sequences(s, batch.trajectory_ids)
        if not any(sequence.action_tokens for sequence in sequences):  # (it would publish the same weights as a new version)
            why = ledger.first_refusal(s, batch.trajectory_ids)
            raise LooplineError(
                f"learner step {step}: none of its {len(batch.trajectory_ids)} episodes holds a token the policy generated: every "
                f"model call was refused{f' (the first: {why})' if why else ''}. Fix the agent program or the env's budgets, check "
                "it with `envreg test ENV`, then resume (loopline train --resume RUN)"
            )
        episodes = ledger.rollout_metrics(s, ctx.run_id, batch.trajectory_ids, batch.policy_version)
    if batch.stale_dropped:
        log.warning("learner step %d: dropped %d groups older than rollout.max_staleness", step, batch.stale_dropped)
    if ctx.rollout.mode == "sync":  # (its rollouts are done; the version this step makes is served next)
        release_engine_memory(ctx)
    side = ctx.learning
    learner = side.at(batch.policy_version, step)
    side.version = None  # from here until the commit lands the weights are no committed version's
    started = time.monotonic()
    try:
        result = learner.rl_step(sequences, trained_version=batch.policy_version)
    except RefusedUpdate as refused:
        with ctx.session_factory() as s:  # why the run stopped, in the ledger; the batch stays unconsumed
            ledger.record_refused_step(s, ctx.run_id, step, refused.metrics)
        raise
    learner_s = time.monotonic() - started
    failpoint("learner_step")
    version = batch.policy_version + 1
    written = side.write(step, version)
    failpoint("learner_commit")
    # the process's peak so far (learner, and the engine when it runs here): the inspector shows it beside the plan
    peak = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}
    if torch.cuda.is_available():  # the learner's device memory (the plan's estimate is beside it in the inspector)
        peak["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    metrics = {
        **result.metrics, "learner_s": learner_s, **batch_metrics(sequences, learner_s), **episodes, **written.timings, **peak,
        "groups_stale_dropped": batch.stale_dropped, "timing_s/step": time.monotonic() - ctx.last_commit,
    }
    uri = lambda path: side.publish(path) if path else None  # noqa: E731
    try:
        with ctx.session_factory() as s:
            committed = ledger.commit_learner_step(
                s, batch, uri(written.weights), str(written.checkpoint) if written.checkpoint else None, written.sha256, metrics=metrics, samples=result.samples,
                driver=ctx.driver, adapter_uri=uri(written.adapter),
            )
    except LostTheRun:  # (only a commit that lands names what the step wrote)
        written.remove()
        raise
    side.committed(committed.policy_version, written)
    ctx.last_commit = time.monotonic()
    return committed


def replay(
    learner: Learner, session_factory: Callable[[], Session], run_id: uuid.UUID, steps: range,
    after_each: Callable[[Learner, int], None] | None = None,
) -> None:
    """Bring a learner restored from an older checkpoint (or from the initial weights) up to the last
    committed step: retrain each step's recorded batch, in the order it was trained, with the thread count
    it was trained with. On CPU this gives the same weights bit for bit, under any load (the chaos tests
    compare them). `after_each(learner, step)`: called with each step's weights in the learner (`loopline replay`
    compares every step on the way)."""
    for step in steps:
        with session_factory() as s:
            sequences = load_sequences(s, ledger.trained_batch(s, run_id, step))
            threads = ledger.trained_threads(s, run_id, step)
        log.info("replaying learner step %d (%d trajectories) since the last full checkpoint", step, len(sequences))
        with computing_threads(threads):
            learner.rl_step(sequences, trained_version=step - 1)
        if after_each is not None:
            after_each(learner, step)


async def sync_weights(ctx: RolloutContext) -> int:
    """Serve the ledger's newest version on the engine, then record it as published."""
    with ctx.session_factory() as s:
        newest = ledger.version_weights(s, ctx.run_id)
    timings = None
    if ctx.engine.version() < newest.version:
        started = time.monotonic()
        uri = newest.adapter_uri if ctx.adapters else newest.uri
        if ctx.adapters and uri is None:
            raise LooplineError(
                f"v{newest.version} was committed without its LoRA adapter (by a loopline before adapter sync, or with "
                "engine.lora_sync: merged); resume with the config the run was started with"
            )
        held = None if ctx.adapters else ctx.held_weights(newest.version)
        if held is not None and ctx.rollout.mode == "sync":  # (the learner runs after the rollouts, never beside them)
            held = LentWeights(held)
        if held is None and uri is None:
            raise LooplineError(
                f"v{newest.version} was committed without an export and this process does not hold it; "
                "a process other than the learner needs learner.export_every: 1"
            )
        # (a URI is fetched to this host when its directory is not here, and checked against its digest)
        weights: Mapping[str, torch.Tensor] | str = held if held is not None else str(ctx.weights.local(uri or ""))
        timings = dict(await ctx.engine.update_weights(newest.version, weights, ctx.rollout.in_flight) or {})
        timings["total_s"] = time.monotonic() - started
        failpoint("weight_sync")
    with ctx.session_factory() as s:
        ledger.mark_published(s, ctx.run_id, newest.version, timings)
    _record_servers(ctx)
    if timings is not None:  # (the versions before it are of no use to this host's engine any more)
        ctx.weights.evict({u for u in (newest.uri, newest.adapter_uri) if u})
    return newest.version


_recorded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> (version, when) last written to the ledger
SERVERS_SEEN_EVERY_S = 30.0


IN_PROCESS = "in-process"  # the engine_server row of an engine that generates inside its process (the CPU engine)


def _engine_urls(ctx: RolloutContext) -> list[str]:
    return ctx.engine.server_urls() or [IN_PROCESS]


def _record_servers(ctx: RolloutContext) -> None:
    """Which version this process's engine serves (each of its inference servers, or the engine in this process),
    in the ledger: at each change, and every SERVERS_SEEN_EVERY_S as a sign of life (a worker on another machine
    polls every second). The learner names them when it waits for groups no engine can fill."""
    urls, version = _engine_urls(ctx), ctx.engine.version()
    last = _recorded.get(ctx.engine)
    if last and last[0] == version and time.monotonic() - last[1] < SERVERS_SEEN_EVERY_S:
        return
    with ctx.session_factory() as s:
        ledger.record_served(s, ctx.run_id, holder.this_process(), urls, version)
    _recorded[ctx.engine] = (version, time.monotonic())


def read(ctx: RolloutContext, query, *args):
    """`query(session, run_id, *args)` on the run's ledger."""
    with ctx.session_factory() as s:
        return query(s, ctx.run_id, *args)


def report_lagging_servers(ctx: RolloutContext, version: int, reported: set) -> None:
    """A server another process syncs (a rollout worker's, on any machine) that fell behind what its worker
    should have loaded by now: said once (`reported` remembers), since its process may be gone or stuck."""
    for url, syncer, served, _ in read(ctx, ledger.serving_servers):
        if served < version - ctx.rollout.max_staleness - 1 and (url, syncer) not in reported:
            reported.add((url, syncer))
            log.warning("server %s (synced by %s) serves v%d while the run is at v%d: is that process gone?", url, syncer, served, version)


def release_servers(ctx: RolloutContext) -> None:
    """This process no longer generates on its servers (its engine was shut down). Called on the way out,
    from a `finally`: a ledger out of reach then is logged, never raised over the reason the flow stops
    (the rows keep their last sign of life, and the train flow reports servers that fall behind)."""
    try:
        with ctx.session_factory() as s:
            ledger.release_servers(s, ctx.run_id, holder.this_process())
    except (DatabaseUnavailable, sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError) as exc:
        log.warning("could not mark this process's servers released in the ledger: %s", exc)


@dataclass(frozen=True)
class HeldOut:
    """A run's held-out evaluation: the same tasks, sampling and seed for every version it evaluates."""

    run_id: uuid.UUID
    setup: EpisodeSetup  # the run's (its sampling's temperature and seed are the evaluation's own)
    session_factory: Callable[[], Session]
    tasks: list[Task]
    env_version: int
    temperature: float
    seed: int
    concurrency: int  # episodes at once, as in training: each holds a sandbox from its start
    max_attempts: int = MAX_ATTEMPTS


async def evaluate(engine: Engine, held_out: HeldOut) -> float:
    """Held-out success of the engine's current version; recorded once per version."""
    version = engine.version()
    run_id, session_factory, eval_tasks = held_out.run_id, held_out.session_factory, held_out.tasks
    temperature, seed, max_attempts = held_out.temperature, held_out.seed, held_out.max_attempts
    setup = dataclasses.replace(
        held_out.setup, sampling=SamplingParams(temperature=temperature, max_new_tokens=held_out.setup.sampling.max_new_tokens, seed=seed)
    )
    slots = asyncio.Semaphore(held_out.concurrency)
    name, done = f"evaluating v{version}", [0]
    activity.report(name, 0, len(eval_tasks))

    async def episode(task: Task):
        # An infra failure (the engine, the sandbox) is retried with the same task and seed, as a training slot
        # would be: it says nothing about the policy, and one must not fail the evaluation.
        for attempt in range(1, max_attempts + 1):
            try:
                async with slots:
                    result = await run_episode(engine, setup, task, f"eval-v{version}-{task.id}/{attempt}/")
                break
            except EngineClosed:  # this process is stopping: nothing to try again
                raise
            except (EngineError, InfraFailure) as exc:
                if attempt == max_attempts:
                    raise
                log.warning("evaluation of v%d: task %s, attempt %d: %s; trying again", version, task.id, attempt, exc)
        done[0] += 1
        activity.report(name, done[0], len(eval_tasks))
        return result

    started = time.monotonic()
    try:
        results = await asyncio.gather(*(episode(t) for t in eval_tasks))
    finally:
        activity.clear(name)
    successes = sum(r.reward == 1.0 for r in results)
    with session_factory() as s:
        ledger.record_eval_result(
            s, run_id, version, setup.spec.name, held_out.env_version, len(results), successes,
            {"truncated": sum(r.truncated for r in results), "temperature": temperature, "seed": seed,
             "mean_reward": sum(r.reward for r in results) / len(results),  # partial credit (coding: tests passed)
             "seconds": time.monotonic() - started},
            episodes=[(t.id, r) for t, r in zip(eval_tasks, results)], worker=holder.this_process(),
        )
    return successes / len(results)
