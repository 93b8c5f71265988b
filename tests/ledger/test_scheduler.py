"""Barrier and continuous schedulers over the ledger, with the real LocalEngine and arithmetic environment."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from transformers import AutoTokenizer

from loopline.envregistry.spec import load_spec
from loopline.envregistry.tasks import Task
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import SamplingParams
from loopline.rollout.harness.episode import EpisodeSetup
from loopline.rollout.engines.local import LocalEngine
from loopline.rollout.harness.scheduler import Binding, WorkerConfig, run_barrier, run_continuous
from loopline.store import ledger
from loopline.store.db import session as new_session

ARITHMETIC = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_env.yaml"
TASKS = {f"t{i}": Task(f"t{i}", "train", f"What is {i} + 1?", {"expression": f"{i} + 1", "answer": i + 1}) for i in range(6)}


@pytest.fixture(scope="module")
def binding(tiny_dirs):
    chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(tiny_dirs["v0"]))
    setup = EpisodeSetup(load_spec(ARITHMETIC), 1, chat, SamplingParams(temperature=1.0, max_new_tokens=12))
    return Binding(setup, TASKS)


def _count(db, sql, **params):
    value = db.execute(sa.text(sql), params).scalar_one()
    db.rollback()
    return value


def test_barrier_plays_every_slot_once(tiny_dirs, binding, engine, db, run):
    ledger.plan_step(db, run.id, 1, ["t0", "t1", "t2", "t3"], group_size=2)
    cfg = WorkerConfig(run.id, "barrier", concurrency=4)
    stats = asyncio.run(run_barrier(LocalEngine(tiny_dirs["v0"]), binding, lambda: new_session(engine), cfg))
    assert (stats.committed, stats.refused, stats.infra_failed) == (8, 0, 0)
    assert ledger.group_states(db, run.id) == {"complete": 4}


def test_two_continuous_workers_share_a_run(tiny_dirs, binding, engine, db, run):
    ledger.plan_step(db, run.id, 1, list(TASKS), group_size=2)
    local = LocalEngine(tiny_dirs["v0"])

    async def both():
        return await asyncio.gather(
            *(run_continuous(local, binding, lambda: new_session(engine), WorkerConfig(run.id, f"w{i}", concurrency=3)) for i in range(2))
        )

    a, b = asyncio.run(both())
    assert a.committed + b.committed == 12 and a.committed > 0 and b.committed > 0
    assert a.refused + b.refused == 0
    assert _count(db, "SELECT count(*) FROM attempt WHERE run_id = :r", r=run.id) == 12
    assert ledger.group_states(db, run.id) == {"complete": 6}


def test_infra_failures_are_retried_then_the_group_dropped(tiny_dirs, binding, engine, db, run, tmp_path):
    broken_spec = binding.setup.spec.model_copy(
        update={"sandbox": binding.setup.spec.sandbox.model_copy(update={"backend": "docker", "image": "loopline-missing:0"})}
    )
    broken = Binding(EpisodeSetup(broken_spec, 1, binding.setup.chat, binding.setup.sampling), TASKS)
    ledger.plan_step(db, run.id, 1, ["t0"], group_size=2, max_attempts=2)
    stats = asyncio.run(run_continuous(LocalEngine(tiny_dirs["v0"]), broken, lambda: new_session(engine), WorkerConfig(run.id, "w", concurrency=2)))
    assert stats.committed == 0 and stats.infra_failed >= 2
    assert ledger.group_states(db, run.id) == {"dropped": 1}
    assert _count(db, "SELECT count(*) FROM trajectory WHERE run_id = :r", r=run.id) == 0  # never a reward of 0

    # the learner step then has nothing to train on, and says why in one line (the last infra failure) and what to do
    from loopline.errors import LooplineError
    from loopline.pipeline.learner_side import LearnerSide
    from loopline.config import RolloutSettings
    from loopline.pipeline.stages import LoopContext, learn

    ctx = LoopContext(
        run_id=run.id, session_factory=lambda: new_session(engine), engine=None, binding=broken,
        rollout=RolloutSettings(concurrency=2, max_attempts=2, groups_per_step=1, group_size=2), learning=LearnerSide(learner=None, workdir=tmp_path),
    )
    expected = (
        "learner step 1: no group to train on: each was dropped after 2 infrastructure failures of a sample; the last: InfraFailure: "
        "sandbox image 'loopline-missing:0' is missing; build it with `envreg image build`. Check the environment on its own"
    )
    with pytest.raises(LooplineError, match=re.escape(expected)):
        learn(ctx, 1)


def test_staleness_gate_holds_work_until_the_engine_catches_up(tiny_dirs, binding, engine, db, run):
    ledger.plan_step(db, run.id, 1, ["t0"], group_size=2)
    for v in (1, 2):  # the learner has published versions 1 and 2
        db.execute(sa.text("INSERT INTO policy_version (run_id, version, learner_step, weights_uri) VALUES (:r, :v, :v, 'x')"), {"r": run.id, "v": v})
    db.commit()
    local = LocalEngine(tiny_dirs["v0"])
    cfg = WorkerConfig(run.id, "w", concurrency=2, max_staleness=1, poll_s=0.05)

    async def go():
        stop = asyncio.Event()
        worker = asyncio.create_task(run_continuous(local, binding, lambda: new_session(engine), cfg, stop))
        await asyncio.sleep(1.0)
        held = _count(db, "SELECT count(*) FROM attempt WHERE run_id = :r", r=run.id)
        await local.update_weights(1, tiny_dirs["v1"])  # now 1 version behind: within max_staleness
        return held, await worker

    held, stats = asyncio.run(go())
    assert held == 0 and stats.gate_waits["staleness"] > 0
    assert stats.committed == 2
    lags = db.execute(sa.text("SELECT policy_version_min FROM trajectory WHERE run_id = :r"), {"r": run.id}).scalars().all()
    db.rollback()
    assert lags == [1, 1]


def test_no_episode_starts_while_an_evaluation_shares_the_engine(tiny_dirs, binding, engine, db, run):
    """An async run evaluates on its rollout engine: rollouts started meanwhile would queue beside the
    evaluation's episodes and slow it (the training process waits for the evaluation)."""
    ledger.plan_step(db, run.id, 1, ["t0"], group_size=2)
    evaluating = [True]
    cfg = WorkerConfig(run.id, "w", concurrency=2, poll_s=0.05)

    async def go():
        worker = asyncio.create_task(
            run_continuous(LocalEngine(tiny_dirs["v0"]), binding, lambda: new_session(engine), cfg, paused=lambda: evaluating[0])
        )
        await asyncio.sleep(1.0)
        held = _count(db, "SELECT count(*) FROM attempt WHERE run_id = :r", r=run.id)
        evaluating[0] = False
        return held, await worker

    held, stats = asyncio.run(go())
    assert held == 0 and stats.gate_waits["evaluation"] > 0
    assert stats.committed == 2


def test_a_trajectory_the_ledger_refuses_counts_toward_max_attempts(tiny_dirs, binding, engine, db, run, monkeypatch):
    """Data the ledger cannot hold used to leave the attempt running: its slot came back at every lease expiry, forever."""
    import psycopg

    def refuse(session, attempt_id, trajectory):
        raise psycopg.errors.UntranslatableCharacter('unsupported Unicode escape sequence: \\u0000 cannot be converted to text')

    monkeypatch.setattr(ledger, "commit_trajectory", refuse)
    monkeypatch.setattr(ledger, "commit_trajectories", lambda session, items: refuse(session, *items[0]))
    ledger.plan_step(db, run.id, 1, ["t0"], group_size=2, max_attempts=2)
    cfg = WorkerConfig(run.id, "w", concurrency=2, lease_seconds=2)
    stats = asyncio.run(asyncio.wait_for(run_barrier(LocalEngine(tiny_dirs["v0"]), binding, lambda: new_session(engine), cfg), 120))
    assert stats.committed == 0 and stats.infra_failed >= 2
    assert ledger.group_states(db, run.id) == {"dropped": 1}
    assert _count(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND error_class = 'CommitRefused'", r=run.id) >= 2


def test_trajectories_finished_together_commit_together_and_one_the_ledger_refuses_sinks_no_other(
    tiny_dirs, binding, engine, db, run, monkeypatch
):
    """Issue 49: a worker's finished trajectories go to the ledger in one transaction while a commit is in flight
    (a group commit); one the ledger refuses fails alone, its batch's others are committed."""
    import time

    import psycopg

    real, batches, refused = ledger.commit_trajectories, [], []

    def commit_trajectories(session, items):
        batches.append(len(items))
        time.sleep(0.3)  # (a busy ledger: what finishes meanwhile waits for the next commit)
        refused[:] = refused or [items[-1][0]]
        if refused[0] in [attempt_id for attempt_id, _ in items]:
            raise psycopg.errors.UntranslatableCharacter("unsupported Unicode escape sequence")
        return real(session, items)

    monkeypatch.setattr(ledger, "commit_trajectories", commit_trajectories)
    monkeypatch.setattr(ledger, "commit_trajectory", lambda session, a, t: commit_trajectories(session, [(a, t)])[0])
    ledger.plan_step(db, run.id, 1, list(TASKS), group_size=4, max_attempts=1)
    cfg = WorkerConfig(run.id, "w", concurrency=24)
    stats = asyncio.run(run_barrier(LocalEngine(tiny_dirs["v0"]), binding, lambda: new_session(engine), cfg))
    assert (stats.committed, stats.infra_failed) == (23, 1)
    assert max(batches) > 1 and len(batches) < 24 + 1 + max(batches), batches  # together, and the refused batch's others alone
    assert _count(db, "SELECT count(*) FROM trajectory WHERE run_id = :r", r=run.id) == 23
    assert _count(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND error_class = 'CommitRefused'", r=run.id) == 1


def test_a_ledger_outage_while_committing_or_renewing_is_ridden_out_and_its_slots_played_again(
    tiny_dirs, binding, engine, db, run, monkeypatch, caplog
):
    """Seen on a rollout host whose network was cut for 30 s (tests/integration/test_hosts.py): the commits that
    failed left their exceptions in episode tasks nobody awaits ("Task exception was never retrieved", with three
    tracebacks, when the worker ended), and a renewal that failed would have ended the lease keeper for good."""
    import gc
    import time

    import psycopg

    real_commit, real_renew, calls = ledger.commit_trajectories, ledger.renew_leases, {"commit": 0, "renew": 0, "lost": 0}

    def commit_trajectories(session, items):
        calls["commit"] += 1
        if calls["commit"] <= 2:
            calls["lost"] += len(items)  # (a group commit: every trajectory of the batch)
            raise psycopg.OperationalError("consuming input failed: could not receive data from server: Connection timed out")
        return real_commit(session, items)

    def renew_leases(session, attempt_ids, seconds):
        calls["renew"] += 1
        if calls["renew"] == 1:
            raise psycopg.OperationalError("the connection is lost")
        return real_renew(session, attempt_ids, seconds)

    async def slow_episode(*args, **kwargs):  # (in flight across renewals)
        await asyncio.sleep(1.0)
        return await real_episode(*args, **kwargs)

    from loopline.rollout.harness import scheduler

    real_episode = scheduler.run_episode
    monkeypatch.setattr(scheduler, "run_episode", slow_episode)
    monkeypatch.setattr(ledger, "commit_trajectories", commit_trajectories)
    monkeypatch.setattr(ledger, "renew_leases", renew_leases)
    ledger.plan_step(db, run.id, 1, ["t0", "t1", "t2"], group_size=2)
    cfg = WorkerConfig(run.id, "cut", concurrency=2, lease_seconds=1.5)
    started = time.monotonic()
    with caplog.at_level("WARNING"):
        stats = asyncio.run(asyncio.wait_for(run_continuous(LocalEngine(tiny_dirs["v0"]), binding, lambda: new_session(engine), cfg), 120))
        gc.collect()  # (an exception left in a task is reported when the task is collected)
    assert stats.outages == calls["lost"] >= 2 and stats.committed == 6, (stats, calls)
    assert ledger.group_states(db, run.id) == {"complete": 3}
    assert calls["renew"] > 1 + (time.monotonic() - started - 4) / 0.5, calls  # (it went on renewing: every 0.5 s)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "never retrieved" in m], said
    assert sum("its slot is played again once its lease expires" in m for m in said) == calls["lost"], said


def test_leases_stay_renewed_while_episodes_block_every_default_thread(tiny_dirs, binding, engine, db, run, monkeypatch):
    """Docker's sandbox calls block a thread for a whole command (an agent program: its whole episode). When
    those took every thread of the loop's default executor (min(32, CPUs + 4)), the lease renewals queued
    behind them, the leases of live episodes expired, and their slots were played again and again (seen in a
    coding-agent run: 62 `LeaseExpired` attempts, no step trained). Here each episode first holds a default
    thread for 6 s, 4 more episodes than there are threads, with 3 s leases."""
    import os
    import time

    from loopline.rollout.harness import scheduler

    real = scheduler.run_episode

    async def blocking_episode(*args, **kwargs):
        await asyncio.to_thread(time.sleep, 6)  # a sandbox call on the default executor
        return await real(*args, **kwargs)

    monkeypatch.setattr(scheduler, "run_episode", blocking_episode)
    threads = min(32, (os.cpu_count() or 1) + 4)
    tasks = {f"b{i}": Task(f"b{i}", "train", f"What is {i} + 2?", {"expression": f"{i} + 2", "answer": i + 2}) for i in range(threads + 4)}
    ledger.plan_step(db, run.id, 1, list(tasks), group_size=1)
    cfg = WorkerConfig(run.id, "blocked", concurrency=len(tasks), lease_seconds=3)
    stats = asyncio.run(run_barrier(LocalEngine(tiny_dirs["v0"]), Binding(binding.setup, tasks), lambda: new_session(engine), cfg))
    assert (stats.committed, stats.lost_leases, stats.infra_failed) == (len(tasks), 0, 0)
    assert _count(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND error_class = 'LeaseExpired'", r=run.id) == 0


@pytest.mark.parametrize("scheduler", ["barrier", "continuous"])
def test_an_engine_closed_by_a_stopping_process_gives_its_slots_back_unblamed_and_stops_the_loop(tiny_dirs, binding, engine, db, run, scheduler):
    """Seen in CI: Ctrl-C closed the engine while a step rolled out; the loop went on claiming slots, each failed at
    once ("the engine was shut down") as an infra failure, three times, and the step's groups were dropped: the
    resumed run had nothing to train on. The slots go back now, no failure counted, and the loop stops."""
    from loopline.rollout.engines.base import EngineClosed
    from loopline.rollout.engines.thread import EngineThread

    ledger.plan_step(db, run.id, 1, ["t0", "t1"], group_size=2, max_attempts=3)
    closed = EngineThread(LocalEngine(tiny_dirs["v0"]))
    closed.shutdown()
    cfg = WorkerConfig(run.id, scheduler, concurrency=4)
    play = run_barrier(closed, binding, lambda: new_session(engine), cfg) if scheduler == "barrier" else \
        run_continuous(closed, binding, lambda: new_session(engine), cfg)
    with pytest.raises(EngineClosed):
        asyncio.run(play)
    assert _count(db, "SELECT count(*) FROM slot WHERE run_id = :r AND state = 'pending' AND infra_failures = 0", r=run.id) == 4
    assert _count(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND error_class <> 'Released'", r=run.id) == 0
    assert ledger.group_states(db, run.id) == {"open": 2}


@pytest.mark.parametrize("scheduler", ["barrier", "continuous"])
def test_a_stop_that_lands_while_slots_are_claimed_hands_them_back_at_once(tiny_dirs, binding, engine, db, run, scheduler, monkeypatch):
    """Seen in CI: `loopline worker` stopped with SIGTERM while its claim ran in a ledger thread; the wait was
    cancelled, the claim committed anyway, and its attempt stayed `running` until the lease expired. Here the stop
    lands after the claim has committed, before the worker has its leases: every slot is pending again at once."""
    import threading
    import time

    ledger.plan_step(db, run.id, 1, ["t0", "t1"], group_size=2)
    claimed, real = threading.Event(), ledger.claim_slots

    def slow_claim(*args, **kwargs):
        leases = real(*args, **kwargs)
        claimed.set()
        time.sleep(1.0)  # (committed; not yet returned to the worker)
        return leases

    monkeypatch.setattr(ledger, "claim_slots", slow_claim)
    cfg = WorkerConfig(run.id, scheduler, concurrency=4)

    async def stopped():
        play = run_barrier if scheduler == "barrier" else run_continuous
        worker = asyncio.create_task(play(LocalEngine(tiny_dirs["v0"]), binding, lambda: new_session(engine), cfg))
        assert await asyncio.to_thread(claimed.wait, 60)
        worker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await worker

    asyncio.run(stopped())
    assert _count(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND status = 'running'", r=run.id) == 0
    assert _count(db, "SELECT count(*) FROM slot WHERE run_id = :r AND state = 'pending' AND infra_failures = 0", r=run.id) == 4
