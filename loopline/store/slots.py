"""Plans, slots, attempts and leases: who generates which trajectory, and what happens when they fail.

Claims use `FOR UPDATE SKIP LOCKED`, so concurrent workers never share a slot. Lock order, to stay
deadlock-free: a group row, then slot rows by id; a commit and a renewal lock only slot rows (by id), so
commits into one group do not wait for each other; claims never wait.
"""

from __future__ import annotations

import uuid
from typing import Collection, Sequence

import sqlalchemy as sa
from sqlmodel import Session

from loopline.errors import LooplineError
from loopline.store import nul
from loopline.store._sql import q, transaction
from loopline.store.errors import LedgerConflict
from loopline.store.records import Lease
from loopline.types import LEASE_SECONDS, MAX_ATTEMPTS, Split

# Slot and group ids are derived from their coordinates: planning the same step twice is a no-op.
_ID_NAMESPACE = uuid.UUID("6f1c9a52-3f6e-4d0b-9d0e-1c3a0b7e5a11")


def group_id_for(run_id: uuid.UUID, split: Split, step: int, group_index: int) -> uuid.UUID:
    return uuid.uuid5(_ID_NAMESPACE, f"group/{run_id}/{split}/{step}/{group_index}")


def slot_id_for(group_id: uuid.UUID, sample_index: int) -> uuid.UUID:
    return uuid.uuid5(_ID_NAMESPACE, f"slot/{group_id}/{sample_index}")


# --------------------------------------------------------------------------- planning


def plan_step(
    session: Session,
    run_id: uuid.UUID,
    step: int,
    task_ids: Sequence[str],
    group_size: int,
    split: Split = "train",
    max_attempts: int = MAX_ATTEMPTS,
) -> list[uuid.UUID]:
    """Create one group of `group_size` slots per task for this step; re-planning the same step is a no-op.

    Re-planning with different tasks or sizes is refused: the step was
    already handed out and its coordinates must keep their meaning.
    """
    if group_size < 1 or max_attempts < 1:
        raise LooplineError("group_size and max_attempts must be at least 1")
    group_ids = [group_id_for(run_id, split, step, i) for i in range(len(task_ids))]
    groups = [
        dict(id=g, run_id=run_id, split=split, step=step, group_index=i, task_id=t, size=group_size, max_attempts=max_attempts)
        for i, (g, t) in enumerate(zip(group_ids, task_ids))
    ]
    slots = [
        dict(id=slot_id_for(g["id"], k), run_id=run_id, group_id=g["id"], split=split, step=step, task_id=g["task_id"],
             group_index=g["group_index"], sample_index=k)
        for g in groups
        for k in range(group_size)
    ]
    with transaction(session):
        if groups:
            session.execute(
                sa.text(
                    "INSERT INTO rollout_group (id, run_id, split, step, group_index, task_id, size, max_attempts) "
                    "VALUES (:id, :run_id, :split, :step, :group_index, :task_id, :size, :max_attempts) "
                    "ON CONFLICT DO NOTHING"
                ),
                groups,
            )
            stored = {
                r.id: (r.task_id, r.size, r.max_attempts)
                for r in q(
                    session,
                    "SELECT id, task_id, size, max_attempts FROM rollout_group WHERE id = ANY(:ids)",
                    ids=group_ids,
                )
            }
            for g in groups:
                if stored.get(g["id"]) != (g["task_id"], g["size"], g["max_attempts"]):
                    raise LedgerConflict(
                        f"step {step} ({split}) of this run was already planned with other tasks "
                        f"(group {g['group_index']}: stored {stored.get(g['id'])}, asked {g['task_id']!r}); "
                        "plan a new step instead"
                    )
            session.execute(
                sa.text(
                    "INSERT INTO slot (id, run_id, group_id, split, step, task_id, group_index, sample_index) "
                    "VALUES (:id, :run_id, :group_id, :split, :step, :task_id, :group_index, :sample_index) "
                    "ON CONFLICT DO NOTHING"
                ),
                slots,
            )
    return group_ids


# --------------------------------------------------------------------------- leases


def claim_slots(
    session: Session,
    run_id: uuid.UUID,
    worker: str,
    n: int,
    split: Split,
    lease_seconds: float = LEASE_SECONDS,
    max_step: int | None = None,
) -> list[Lease]:
    """Lease up to `n` pending slots, opening one attempt each; expired leases are reclaimed first.

    `max_step` bounds how far ahead of the learner a worker may generate (the
    async staleness bound): slots of later steps stay pending.
    """
    expire_leases(session, run_id)
    with transaction(session):
        rows = q(
            session,
            # plan order (step, group, sample): groups are handed out first-in first-out and stay together;
            # read in that order from ix_slot_pending (no sort, whatever the number pending)
            "SELECT s.id, s.group_id, s.step, s.task_id, s.sample_index FROM slot s "
            "WHERE s.run_id = :run AND s.split = :split AND s.state = 'pending' "
            "AND (CAST(:max_step AS int) IS NULL OR s.step <= :max_step) "
            "ORDER BY s.step, s.group_index, s.sample_index LIMIT :n FOR UPDATE SKIP LOCKED",
            run=run_id,
            split=split,
            n=n,
            max_step=max_step,
        ).all()
        if not rows:
            return []
        slot_ids = [r.id for r in rows]
        attempt_ids = [uuid.uuid4() for _ in rows]
        q(
            session,
            "INSERT INTO attempt (id, slot_id, run_id, worker) "
            "SELECT a, s, :run, :worker FROM unnest(CAST(:aids AS uuid[]), CAST(:sids AS uuid[])) AS u(a, s)",
            run=run_id,
            worker=worker,
            aids=attempt_ids,
            sids=slot_ids,
        )
        expiry = dict(
            q(
                session,
                "UPDATE slot SET state = 'leased', lease_owner = :worker, lease_attempt_id = u.a, "
                "lease_expires_at = now() + make_interval(secs => :secs) "
                "FROM unnest(CAST(:aids AS uuid[]), CAST(:sids AS uuid[])) AS u(a, s) "
                "WHERE slot.id = u.s RETURNING slot.id, slot.lease_expires_at",
                worker=worker,
                secs=lease_seconds,
                aids=attempt_ids,
                sids=slot_ids,
            ).all()
        )
    return [
        Lease(a, r.id, r.group_id, run_id, split, r.step, r.task_id, r.sample_index, expiry[r.id])
        for a, r in zip(attempt_ids, rows)
    ]


def renew_leases(session: Session, attempt_ids: Collection[uuid.UUID], lease_seconds: float = LEASE_SECONDS) -> set[uuid.UUID]:
    """Extend a worker's leases, all in one statement by primary key (a fleet's renewals cost what its
    episodes do, not their square); returns those lost (expired and reclaimed): their work should stop. An
    attempt whose trajectory was committed meanwhile (a renewal racing the commit) lost nothing."""
    if not attempt_ids:
        return set()
    with transaction(session):
        renewed = set(
            q(
                session,
                # slots locked in id order, as every other writer of several slots locks them (no deadlock)
                "WITH held AS (SELECT s.id FROM attempt a JOIN slot s ON s.id = a.slot_id "
                "  WHERE a.id = ANY(:a) AND s.lease_attempt_id = a.id AND s.state = 'leased' AND s.lease_expires_at > now() "
                "  ORDER BY s.id FOR UPDATE OF s) "
                "UPDATE slot SET lease_expires_at = now() + make_interval(secs => :secs) FROM held "
                "WHERE slot.id = held.id RETURNING slot.lease_attempt_id",
                a=list(attempt_ids),
                secs=lease_seconds,
            ).scalars()
        )
        rest = [a for a in attempt_ids if a not in renewed]
        committed = set(
            q(session, "SELECT id FROM attempt WHERE id = ANY(:a) AND status IN ('ok', 'task_failed')", a=rest).scalars()
        ) if rest else set()
    return set(rest) - committed


def expire_leases(session: Session, run_id: uuid.UUID | None = None, dead_holders: Collection[str] = ()) -> int:
    """Take back the slots of leases nobody will finish: expired ones, and those of `dead_holders`
    (processes known to be gone: see `loopline.holder`), at once instead of at expiry.

    The holder vanished, the environment did not fail: the slot is retried without counting
    toward its group's `max_attempts`, so crashes of the trainer never drop data. Reads only the leases
    that ran out (ix_slot_lease_expiry) and the dead holders' (ix_slot_lease_owner), whatever the fleet holds.
    """
    with transaction(session):
        expired = q(
            session,
            "SELECT lease_attempt_id FROM slot WHERE state = 'leased' AND lease_expires_at < now() "
            "AND (CAST(:run AS uuid) IS NULL OR run_id = :run)",
            run=run_id,
        ).scalars().all()
        dead = q(
            session,
            "SELECT lease_attempt_id FROM slot WHERE state = 'leased' AND run_id = :run AND lease_owner = ANY(CAST(:dead AS text[])) "
            "AND lease_expires_at >= now()",
            run=run_id,
            dead=list(dead_holders),
        ).scalars().all() if dead_holders and run_id is not None else []
    taken = 0
    for attempt_id in expired:
        taken += _record_lease_loss(session, attempt_id, "LeaseExpired", "the worker's lease expired before it committed")
    for attempt_id in dead:
        taken += _record_lease_loss(session, attempt_id, "HolderDied", "the process holding the lease is gone", dead_holders)
    return taken


def lease_holders(session: Session, run_id: uuid.UUID) -> list[str]:
    """Who holds the run's leases now (one entry per holder), found one index probe per holder (a loose index
    scan of ix_slot_lease_owner), not by reading every lease."""
    with transaction(session):
        return list(
            q(
                session,
                "WITH RECURSIVE h(owner) AS ("
                "  (SELECT lease_owner FROM slot WHERE run_id = :r AND state = 'leased' AND lease_owner IS NOT NULL ORDER BY lease_owner LIMIT 1)"
                "  UNION ALL"
                "  SELECT (SELECT lease_owner FROM slot WHERE run_id = :r AND state = 'leased' AND lease_owner > h.owner ORDER BY lease_owner LIMIT 1)"
                "  FROM h WHERE h.owner IS NOT NULL"
                ") SELECT owner FROM h WHERE owner IS NOT NULL",
                r=run_id,
            ).scalars()
        )


def unfinished_slots(session: Session, run_id: uuid.UUID, split: Split) -> int:
    """Slots of the split still pending or leased: work that may yet come back to a worker."""
    with transaction(session):
        return q(
            session,
            "SELECT count(*) FROM slot WHERE run_id = :r AND split = :s AND state IN ('pending', 'leased')",
            r=run_id,
            s=split,
        ).scalar_one()


def fail_attempt(session: Session, attempt_id: uuid.UUID, error_class: str, error_text: str) -> str:
    """Record an infrastructure failure (sandbox crash, engine error, ...): never a reward.

    The slot is retried with a new attempt until its group's `max_attempts`
    infra failures, then the whole group is dropped (and counted as dropped).
    Returns 'retry', 'dropped' or 'stale' (the attempt no longer held the lease).
    """
    return _record_infra_failure(session, attempt_id, error_class, error_text)


def release_attempt(session: Session, attempt_id: uuid.UUID, reason: str = "released by worker") -> bool:
    """Give a slot back without blaming anyone (graceful shutdown); returns False if the lease was gone."""
    with transaction(session):
        slot = _lock_attempt_slot(session, attempt_id)
        end_attempt(session, attempt_id, "cancelled", "Released", reason)
        if slot is None or slot.state != "leased" or slot.lease_attempt_id != attempt_id:
            return False
        q(session, "UPDATE slot SET state = 'pending', " + NO_LEASE + " WHERE id = :s", s=slot.id)
    return True


NO_LEASE = "lease_owner = NULL, lease_attempt_id = NULL, lease_expires_at = NULL"


def _lock_attempt_slot(session: Session, attempt_id: uuid.UUID) -> sa.Row | None:
    """Lock the attempt's group, then its slots in id order (a failure may drop them all: the lock order every
    writer of slots keeps); returns the attempt's slot."""
    ref = q(
        session,
        "SELECT s.id, s.group_id FROM attempt a JOIN slot s ON s.id = a.slot_id WHERE a.id = :a",
        a=attempt_id,
    ).first()
    if ref is None:
        raise LooplineError(f"no attempt {attempt_id} in the ledger")
    max_attempts = q(session, "SELECT max_attempts FROM rollout_group WHERE id = :g FOR UPDATE", g=ref.group_id).scalar_one()
    slots = q(
        session,
        "SELECT id, group_id, state, lease_attempt_id, lease_owner, infra_failures, lease_expires_at < now() AS expired, "
        ":m AS max_attempts FROM slot WHERE group_id = :g ORDER BY id FOR UPDATE",
        g=ref.group_id,
        m=max_attempts,
    ).all()
    return next(s for s in slots if s.id == ref.id)


def end_attempt(
    session: Session, attempt_id: uuid.UUID, status: str, error_class: str | None, error_text: str | None
) -> None:
    q(
        session,
        "UPDATE attempt SET status = :st, error_class = :ec, error_text = :et, ended_at = now() "
        "WHERE id = :a AND status = 'running'",
        a=attempt_id,
        st=status,
        ec=error_class,
        et=nul.text(error_text),
    )


def _record_lease_loss(
    session: Session, attempt_id: uuid.UUID, error_class: str, error_text: str, dead_holders: Collection[str] = ()
) -> bool:
    """End an attempt whose holder vanished and give its slot back, uncounted; False if it was not lost after all."""
    with transaction(session):
        slot = _lock_attempt_slot(session, attempt_id)
        holds_lease = slot.state == "leased" and slot.lease_attempt_id == attempt_id
        if not (holds_lease and (slot.expired or slot.lease_owner in dead_holders)):
            return False  # renewed, committed or handled by another process meanwhile
        end_attempt(session, attempt_id, "infra_failed", error_class, error_text)
        q(session, "UPDATE slot SET state = 'pending', " + NO_LEASE + " WHERE id = :s", s=slot.id)
    return True


def _record_infra_failure(session: Session, attempt_id: uuid.UUID, error_class: str, error_text: str) -> str:
    with transaction(session):
        slot = _lock_attempt_slot(session, attempt_id)
        holds_lease = slot.state == "leased" and slot.lease_attempt_id == attempt_id
        end_attempt(session, attempt_id, "infra_failed", error_class, error_text)
        if not holds_lease:
            return "stale"
        if slot.infra_failures + 1 < slot.max_attempts:
            q(
                session,
                "UPDATE slot SET state = 'pending', infra_failures = infra_failures + 1, " + NO_LEASE + " WHERE id = :s",
                s=slot.id,
            )
            return "retry"
        q(session, "UPDATE slot SET infra_failures = infra_failures + 1 WHERE id = :s", s=slot.id)
        _drop_group(session, slot.group_id)
        return "dropped"


def _drop_group(session: Session, group_id: uuid.UUID) -> None:
    q(
        session,
        "UPDATE rollout_group SET state = 'dropped', drop_reason = 'infra_retries_exhausted' "
        "WHERE id = :g AND state = 'open'",
        g=group_id,
    )
    q(
        session,
        "UPDATE attempt SET status = 'cancelled', error_class = 'GroupDropped', ended_at = now() "
        "WHERE status = 'running' AND slot_id IN (SELECT id FROM slot WHERE group_id = :g)",
        g=group_id,
    )
    q(
        session,
        "UPDATE slot SET state = 'abandoned', " + NO_LEASE + " WHERE group_id = :g AND state IN ('pending', 'leased')",
        g=group_id,
    )

