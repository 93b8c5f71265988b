"""Guarantees across processes, with real crashes (SIGKILL), against the real server."""

from __future__ import annotations

import multiprocessing as mp
import time

import sqlalchemy as sa

from loopline.store import ledger
from tests import workers
from tests.factories import trajectory

ctx = mp.get_context("spawn")


def _start(target, *args):
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue), daemon=True)
    proc.start()
    return proc, queue


def test_concurrent_claimers_never_share_a_slot(database_url, db, run):
    ledger.plan_step(db, run.id, 1, [f"task-{i}" for i in range(30)], group_size=4)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=workers.claim_and_commit_until_empty, args=(database_url, run.id, f"w{i}", queue))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    claimed = [slot for slots in results.values() for slot in slots]
    assert len(claimed) == 120 and len(set(claimed)) == 120
    assert sum(1 for slots in results.values() if slots) >= 2, "the work was not actually shared"
    counts = db.execute(
        sa.text(
            "SELECT count(*) FILTER (WHERE status = 'ok'), count(*) FROM attempt WHERE run_id = :r"
        ),
        {"r": run.id},
    ).one()
    assert tuple(counts) == (120, 120)  # one attempt per slot: nobody ever claimed a leased slot
    assert ledger.group_states(db, run.id) == {"complete": 30}


def test_sigkilled_worker_loses_its_lease_and_the_slot_is_retried(database_url, db, run):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    proc, queue = _start(workers.hold_a_lease, database_url, run.id, 1.0)
    lease = queue.get(timeout=60)
    proc.kill()  # SIGKILL: no cleanup, no release
    proc.join(timeout=10)
    assert ledger.claim_slots(db, run.id, "survivor", 1, split="train") == []  # lease still valid
    time.sleep(1.2)
    (retry,) = ledger.claim_slots(db, run.id, "survivor", 1, split="train")
    assert retry.slot_id == lease.slot_id and retry.attempt_id != lease.attempt_id
    assert ledger.commit_trajectory(db, retry.attempt_id, trajectory()).committed
    attempts = db.execute(
        sa.text("SELECT worker, status, error_class FROM attempt WHERE slot_id = :s ORDER BY started_at"),
        {"s": lease.slot_id},
    ).all()
    assert [tuple(a) for a in attempts] == [("doomed", "infra_failed", "LeaseExpired"), ("survivor", "ok", None)]


def test_learner_killed_before_commit_consumes_nothing_and_its_retry_the_same_set(database_url, db, run):
    ledger.plan_step(db, run.id, 1, [f"t{i}" for i in range(5)], group_size=2)
    leases = ledger.claim_slots(db, run.id, "w", 10, split="train")
    ledger.commit_trajectories(db, [(l.attempt_id, trajectory(float(i % 2), seed=i)) for i, l in enumerate(leases)])
    proc, queue = _start(workers.learner_dies_before_commit, database_url, run.id)
    doomed = queue.get(timeout=60)
    proc.kill()
    proc.join(timeout=10)
    assert len(doomed.group_ids) == 3
    assert ledger.consumed_trajectory_ids(db, run.id) == set()
    state = ledger.resume_state(db, run.id)
    assert state.next_learner_step == 1 and state.pending_learner_groups == doomed.group_ids
    retry = ledger.claim_learner_batch(db, run.id, 1, max_groups=3)
    assert retry == doomed
    ledger.commit_learner_step(db, retry, "file:///w/v1", "file:///ckpt/1")
    assert ledger.consumed_trajectory_ids(db, run.id) == set(doomed.trajectory_ids)
    # the two groups it did not take are still there for step 2
    assert len(ledger.claim_learner_batch(db, run.id, 2, max_groups=10).group_ids) == 2


LOCKER = """
import os, signal, sys, uuid
import sqlalchemy as sa
from loopline.store.db import make_engine
engine = make_engine(sys.argv[1])
with engine.connect() as conn:  # a worker frozen inside its commit: row locks held, transaction open
    conn.execute(sa.text("SELECT id FROM rollout_group WHERE run_id = :r FOR UPDATE"), {"r": uuid.UUID(sys.argv[2])})
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_process_frozen_inside_a_transaction_does_not_stall_the_run(database_url, db, run):
    """Its locks are released by the server after `LOOPLINE_DB_IDLE_IN_TRANSACTION_S` (here 2 s), while it is still
    frozen; before, every other worker waited for as long as it stayed frozen."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    db.commit()
    env = {**os.environ, "LOOPLINE_DB_IDLE_IN_TRANSACTION_S": "2"}
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, database_url, str(run.id)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        outcome = []
        committer = threading.Thread(target=lambda: outcome.append(ledger.commit_trajectory(db, lease.attempt_id, trajectory())))
        committer.start()
        committer.join(timeout=90)  # (a hang guard: without the server's limit it waits until the locker is killed)
        state = open(f"/proc/{locker.pid}/stat").read().rsplit(")", 1)[1].split()[0]
        assert outcome and outcome[0].committed and state == "T", f"commit done: {bool(outcome)}, locker state {state}"
    finally:
        locker.send_signal(signal.SIGKILL)
        locker.wait()


def test_commands_started_together_on_a_new_home_all_find_the_database(database_url):
    """Two `loopline train` started at once on a new home both see the ledger database missing and both
    create it: the loser must take the winner's database, not die (seen: UniqueViolation on pg_database)."""
    import threading
    import uuid

    from sqlalchemy.engine import make_url

    from loopline.store.db import _create_database_if_missing
    from tests.conftest import admin_url, drop_scratch_database

    for _ in range(5):
        name = f"loopline_race_{uuid.uuid4().hex[:10]}"
        barrier, failures = threading.Barrier(6), []

        def create() -> None:
            barrier.wait()
            try:
                _create_database_if_missing(make_url(admin_url()), name)
            except Exception as exc:  # noqa: BLE001 - the test reports whatever escaped
                failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")

        threads = [threading.Thread(target=create) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        drop_scratch_database(make_url(admin_url()).set(database=name).render_as_string(hide_password=False))
        assert failures == []
