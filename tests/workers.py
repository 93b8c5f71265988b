"""Processes for the concurrency tests (top-level functions, so `spawn` can start them)."""

from __future__ import annotations

import random
import time
import uuid

from loopline.store import ledger
from loopline.store.db import make_engine, session


def claim_and_commit_until_empty(url: str, run_id: uuid.UUID, worker: str, out) -> None:
    from tests.factories import trajectory

    engine = make_engine(url)
    claimed: list[uuid.UUID] = []
    rng = random.Random(worker)
    with session(engine) as s:
        while leases := ledger.claim_slots(s, run_id, worker, rng.randint(1, 4), split="train"):
            claimed += [lease.slot_id for lease in leases]
            outcomes = ledger.commit_trajectories(s, [(lease.attempt_id, trajectory(seed=rng.randrange(99))) for lease in leases])
            assert all(o.committed for o in outcomes)
    out.put((worker, claimed))
    engine.dispose()


def hold_a_lease(url: str, run_id: uuid.UUID, lease_seconds: float, out) -> None:
    """Claim one slot, report it, then hang as if stuck in a long tool call (the test SIGKILLs us)."""
    engine = make_engine(url)
    with session(engine) as s:
        (lease,) = ledger.claim_slots(s, run_id, "doomed", 1, split="train", lease_seconds=lease_seconds)
    out.put(lease)
    time.sleep(600)


def learner_dies_before_commit(url: str, run_id: uuid.UUID, out) -> None:
    """Claim a learner batch, report it, then 'train' until SIGKILLed, never reaching the commit."""
    engine = make_engine(url)
    with session(engine) as s:
        batch = ledger.claim_learner_batch(s, run_id, 1, max_groups=3)
    out.put(batch)
    time.sleep(600)
