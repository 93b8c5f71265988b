"""Rollout schedulers: claim slots from the ledger, play them through the harness, commit or fail them.

- barrier: claim a batch, play it all, wait for the slowest, repeat (simple; idles on long tails).
- continuous: keep `concurrency` episodes in flight and refill as each finishes, behind a staleness
  gate (no new work while the engine's weights are more than `max_staleness` versions behind the
  learner's, and no slot of a step beyond `engine version + 1 + max_staleness`: learner step p
  trains version p - 1, so a group of step p started on version v is p - 1 - v versions stale).

Both only talk to the ledger, so any number of workers in any number of processes can share a run.
Ledger calls are blocking SQL; they run in threads with a session each.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Protocol

from sqlmodel import Session

from loopline import holder
from loopline.envregistry.sandbox.base import InfraFailure
from loopline.envregistry.tasks import Task
from loopline.failpoints import failpoint
from loopline.rollout.engines.base import Engine, EngineClosed, EngineError
from loopline.rollout.harness.episode import EpisodeSetup, run_episode
from loopline.store import ledger
from loopline.store.errors import is_outage
from loopline.store.records import CommitOutcome, Lease
from loopline.types import LEASE_SECONDS, Split, TrajectoryRecord

log = logging.getLogger(__name__)
REAP_INTERVAL_S = 2.0  # how often an idle worker looks for leases of dead holders
COMMIT_BATCH = 32  # trajectories in one commit at most (a transaction's rows stay bounded)


@dataclass(frozen=True)
class WorkerConfig:
    run_id: uuid.UUID
    worker: str = field(default_factory=holder.this_process)  # host:pid:start, see loopline.holder
    split: Split = "train"
    concurrency: int = field(kw_only=True)  # episodes in flight (the run config's `concurrency`: one default)
    lease_seconds: float = LEASE_SECONDS
    max_staleness: int | None = None
    poll_s: float = 0.25
    wait_for_work: bool = False  # keep polling when nothing is pending (a planner will add more) until stopped


@dataclass
class RolloutStats:
    committed: int = 0
    refused: int = 0  # a racing attempt committed the slot first, or its group was dropped
    infra_failed: int = 0
    lost_leases: int = 0
    busy_s: float = 0.0  # sum of episode durations
    wall_s: float = 0.0
    gate_waits: dict[str, int] = field(default_factory=lambda: {"staleness": 0, "evaluation": 0})
    episode_s: list[float] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)  # in commit order
    engine_closed: bool = False  # an episode found the engine closed: this process is stopping
    outages: int = 0  # episodes whose end the ledger could not hear (their slots are played again)

    def utilisation(self, concurrency: int) -> float:
        return self.busy_s / (self.wall_s * concurrency) if self.wall_s else 0.0


@dataclass(frozen=True)
class Binding:
    """What a worker needs to play a run's slots: the environment setup and its tasks by id."""

    setup: EpisodeSetup
    tasks: dict[str, Task]


# The ledger's calls have threads of their own: a lease renewal must never wait behind an episode's blocking
# work (a sandbox, a tool), or the leases of live episodes expire and their slots are played again.
_LEDGER_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="loopline-ledger")


class StopFlag(Protocol):
    """threading.Event or asyncio.Event: the worker only polls it."""

    def is_set(self) -> bool: ...


class _LedgerCalls:
    """Blocking ledger calls, each in a ledger thread with its own session."""

    def __init__(self, session_factory: Callable[[], Session]):
        self.session_factory = session_factory
        self._pending: list[tuple[uuid.UUID, TrajectoryRecord, asyncio.Future]] = []
        self._committer: asyncio.Task | None = None

    async def commit(self, attempt_id: uuid.UUID, trajectory: TrajectoryRecord) -> CommitOutcome:
        """A group commit: trajectories that finish while a commit is in flight go in the next one together (one
        transaction for many under load, no wait when idle). Its commit goes ahead if this episode is cancelled
        meanwhile, as a blocking call in a thread would."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((attempt_id, trajectory, future))
        if self._committer is None or self._committer.done():  # (it ends once nothing is pending)
            self._committer = asyncio.create_task(self._commit_pending())
        return await asyncio.shield(future)

    async def _commit_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:COMMIT_BATCH], self._pending[COMMIT_BATCH:]
            try:
                outcomes = await self.call(ledger.commit_trajectories, [(a, t) for a, t, _ in batch])
            except asyncio.CancelledError:  # (the loop is shutting down: its waiters with it)
                for _, _, future in batch + self._pending:
                    future.cancel()
                raise
            except Exception as exc:
                if is_outage(exc) or len(batch) == 1:
                    for _, _, future in batch:
                        future.set_exception(exc)
                    continue
                # one trajectory the ledger refuses (nothing of the batch was committed): each on its own
                for attempt_id, trajectory, future in batch:
                    try:
                        future.set_result(await self.call(ledger.commit_trajectory, attempt_id, trajectory))
                    except Exception as single:
                        future.set_exception(single)
                continue
            for (_, _, future), outcome in zip(batch, outcomes):
                future.set_result(outcome)

    async def call(self, fn, *args, **kwargs):
        def run():
            with self.session_factory() as s:
                return fn(s, *args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(_LEDGER_THREADS, run)


async def _play(engine: Engine, binding: Binding, lease: Lease, db: _LedgerCalls, stats: RolloutStats) -> None:
    """One leased slot, start to commit. An outage does not escape: an episode task is never awaited for its
    result, so an error left in it was printed as "Task exception was never retrieved" when the process ended
    (seen on a worker whose network was cut while it committed); the other failures are recorded in `_play_slot`."""
    try:
        await _play_slot(engine, binding, lease, db, stats)
    except Exception as exc:
        if not is_outage(exc):
            raise
        # The ledger could not be reached (to commit, or to record a failure): the slot stays leased to this
        # attempt until its lease expires, then it is played again; nothing is trained from it meanwhile.
        stats.outages += 1
        log.warning("attempt %s: the ledger could not be reached (%s); its slot is played again once its lease expires",
                    lease.attempt_id, str(exc).splitlines()[0])


async def _play_slot(engine: Engine, binding: Binding, lease: Lease, db: _LedgerCalls, stats: RolloutStats) -> None:
    failpoint("episode_start")
    started = time.monotonic()
    labels = {"loopline.run": str(lease.run_id), "loopline.attempt": str(lease.attempt_id)}
    try:
        task = binding.tasks[lease.task_id]
        trajectory = await run_episode(engine, binding.setup, task, str(lease.attempt_id), labels)
    except EngineClosed:  # this process is stopping: the slot goes back unblamed, and the loop stops claiming
        stats.engine_closed = True
        await db.call(ledger.release_attempt, lease.attempt_id, "the engine was closed (the process is stopping)")
        return
    except (InfraFailure, EngineError) as exc:
        stats.infra_failed += 1
        await db.call(ledger.fail_attempt, lease.attempt_id, type(exc).__name__, str(exc)[:2000])
        return
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a bug is never the agent's fault: retry the slot, keep the worker alive
        log.exception("episode %s crashed", lease.attempt_id)
        stats.infra_failed += 1
        await db.call(ledger.fail_attempt, lease.attempt_id, type(exc).__name__, str(exc)[:2000])
        return
    finally:
        elapsed = time.monotonic() - started
        stats.busy_s += elapsed
    try:
        outcome = await db.commit(lease.attempt_id, trajectory)
    except Exception as exc:
        if is_outage(exc):
            raise  # (`_play` says so; the slot is played again)
        # the ledger refused this trajectory: a retry would produce one like it and fail the same way, so it
        # counts toward max_attempts like any infra failure instead of being retried forever
        log.exception("the ledger refused the trajectory of attempt %s", lease.attempt_id)
        stats.infra_failed += 1
        await db.call(ledger.fail_attempt, lease.attempt_id, "CommitRefused", f"{type(exc).__name__}: {exc}"[:2000])
        return
    failpoint("rollout_commit")
    if outcome.committed:
        stats.committed += 1
        stats.episode_s.append(elapsed)
        stats.task_ids.append(lease.task_id)
    else:
        stats.refused += 1


class _Renewer:
    """Keeps the leases of in-flight episodes alive; cancels an episode whose lease was lost."""

    def __init__(self, db: _LedgerCalls, lease_seconds: float):
        self.db, self.lease_seconds = db, lease_seconds
        self.inflight: dict[uuid.UUID, asyncio.Task] = {}

    async def run(self, stats: RolloutStats) -> None:
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            # (a finished task committed: its slot is no longer leased, and nothing is lost)
            running = {a: t for a, t in self.inflight.items() if not t.done()}
            try:
                lost = await self.db.call(ledger.renew_leases, list(running), self.lease_seconds)  # one statement
            except Exception as exc:  # (one failure ended this loop for good, and every later lease expired)
                if is_outage(exc):
                    log.warning("renewing %d leases: the ledger could not be reached (%s); trying again", len(running), str(exc).splitlines()[0])
                else:
                    log.exception("renewing %d leases failed; trying again", len(running))
                continue
            for attempt_id in lost:
                stats.lost_leases += 1
                running[attempt_id].cancel()


async def run_barrier(engine: Engine, binding: Binding, session_factory, cfg: WorkerConfig) -> RolloutStats:
    """Claim up to `concurrency` slots, play them all, wait for every one, repeat until every slot is done.

    Slots leased by another worker are waited for: if that worker died, its leases expire and the
    slots come back here, so the barrier never ends with a group left open.
    """
    db, stats, start = _LedgerCalls(session_factory), RolloutStats(), time.monotonic()
    renewer = _Renewer(db, cfg.lease_seconds)
    keeper = asyncio.create_task(renewer.run(stats))
    try:
        while True:
            leases = await _claim(db, cfg, cfg.concurrency)
            if not leases:
                if not await _unfinished(db, cfg):
                    break
                await asyncio.sleep(cfg.poll_s)
                continue
            tasks = {l.attempt_id: asyncio.create_task(_play(engine, binding, l, db, stats)) for l in leases}
            renewer.inflight.update(tasks)
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            renewer.inflight.clear()
            if stats.engine_closed:
                raise EngineClosed("the engine was closed while the step's episodes played (the process is stopping)")
    finally:
        keeper.cancel()
        await _hand_back(db, renewer.inflight)
        stats.wall_s = time.monotonic() - start
    return stats


def _forget(inflight: dict, attempt_id: uuid.UUID, _task: asyncio.Task) -> None:
    inflight.pop(attempt_id, None)


async def run_continuous(
    engine: Engine, binding: Binding, session_factory, cfg: WorkerConfig, stop: StopFlag | None = None,
    paused: Callable[[], bool] | None = None,
) -> RolloutStats:
    """Keep `concurrency` episodes in flight until no slot is pending (or `stop` is set).

    While `paused()` (an evaluation on the same engine) no new episode starts: the evaluation has the engine
    to itself and ends sooner (the training process waits for it anyway before its next learner step)."""
    db, stats, start = _LedgerCalls(session_factory), RolloutStats(), time.monotonic()
    stop = stop or asyncio.Event()
    renewer = _Renewer(db, cfg.lease_seconds)
    keeper = asyncio.create_task(renewer.run(stats))
    inflight = renewer.inflight
    next_reap = 0.0
    try:
        while not stop.is_set():
            if stats.engine_closed:
                raise EngineClosed("the engine was closed while episodes played (the process is stopping)")
            gate = "evaluation" if paused is not None and paused() else await _gate(engine, db, cfg)
            free = cfg.concurrency - len(inflight)
            if gate is not None:
                stats.gate_waits[gate] += 1
            elif free > 0:
                ahead = engine.version() + 1 + cfg.max_staleness if cfg.max_staleness is not None else None
                for lease in await _claim(db, cfg, free, max_step=ahead):
                    task = asyncio.create_task(_play(engine, binding, lease, db, stats))
                    inflight[lease.attempt_id] = task
                    task.add_done_callback(functools.partial(_forget, inflight, lease.attempt_id))
            if inflight:
                await asyncio.wait(list(inflight.values()), timeout=cfg.poll_s, return_when=asyncio.FIRST_COMPLETED)
            elif not cfg.wait_for_work and not await _unfinished(db, cfg):
                break  # nothing pending, and nobody holds a lease whose slot could come back
            else:
                if time.monotonic() >= next_reap:  # idle: slots of a dead holder may be waiting
                    await _reap_dead_holders(db, cfg)
                    next_reap = time.monotonic() + REAP_INTERVAL_S
                await asyncio.sleep(cfg.poll_s)  # gates closed, or other workers' slots may return
    finally:
        keeper.cancel()
        await _hand_back(db, inflight)
        stats.wall_s = time.monotonic() - start
    return stats


async def _claim(db: _LedgerCalls, cfg: WorkerConfig, n: int, max_step: int | None = None) -> list[Lease]:
    """Lease up to `n` slots. A stop that cancels the wait does not stop the claim: it goes on in its ledger thread
    and commits (seen in CI: a worker stopped with SIGTERM mid-claim left an attempt running until its lease expired),
    so what it leased is handed back before the cancellation goes on."""
    claim = asyncio.ensure_future(db.call(ledger.claim_slots, cfg.run_id, cfg.worker, n, cfg.split, cfg.lease_seconds, max_step=max_step))
    try:
        return await asyncio.shield(claim)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # (a claim that failed leased nothing)
            await _hand_back(db, {lease.attempt_id: None for lease in await claim})
        raise


async def _hand_back(db: _LedgerCalls, inflight: Mapping[uuid.UUID, asyncio.Task | None]) -> None:
    """A stopping worker's episodes end, and their slots go back now rather than when their leases expire."""
    stopped = {a: task for a, task in inflight.items() if task is None or not task.done()}  # (a done one ended its attempt)
    tasks = [task for task in stopped.values() if task is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for attempt_id in stopped:
        await db.call(ledger.release_attempt, attempt_id, "worker stopped")


async def _reap_dead_holders(db: _LedgerCalls, cfg: WorkerConfig) -> int:
    """Take back at once the leases of holders known dead (a resumed run does not wait `lease_seconds`
    for the process it replaces); returns how many."""
    dead = [h for h in await db.call(ledger.lease_holders, cfg.run_id) if holder.is_dead(h)]
    return await db.call(ledger.expire_leases, cfg.run_id, dead) if dead else 0


async def _unfinished(db: _LedgerCalls, cfg: WorkerConfig) -> bool:
    """Whether slots may still come back (to this worker or another)."""
    await _reap_dead_holders(db, cfg)
    return await db.call(ledger.unfinished_slots, cfg.run_id, cfg.split) > 0


async def _gate(engine: Engine, db: _LedgerCalls, cfg: WorkerConfig) -> Literal["staleness"] | None:
    """Why no new work may start now, or None."""
    if cfg.max_staleness is not None:
        latest = await db.call(ledger.latest_policy_version, cfg.run_id)
        if engine.version() < latest - cfg.max_staleness:
            return "staleness"
    return None
