"""Ledger operations: the only writes the pipeline makes, each one transaction.

Every function takes a `Session`, does its work in one transaction and
commits (or rolls back and raises). Exactly-once rests on three things:

- claims use `FOR UPDATE SKIP LOCKED`, so concurrent workers never share a slot;
- uniqueness lives in the database (one trajectory per slot, one
  consumption per trajectory, consumption only of train trajectories);
- a learner step's consumption, checkpoint and new policy version are
  written in a single transaction, and the groups it trains are recorded
  before training, so a retry trains exactly the same set.

Lock order, to stay deadlock-free: rollout_group rows (by id), then slot rows
(by id). Claims lock slots with SKIP LOCKED and never wait.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterator, Literal, Sequence

import sqlalchemy as sa
from psycopg.types.json import Jsonb
from sqlmodel import Session

from loopline.store.errors import LedgerConflict, LooplineError
from loopline.store.models import Run
from loopline.store.records import (
    CheckpointInfo,
    CommitOutcome,
    LearnerBatch,
    LearnerCommit,
    Lease,
    ResumeState,
    Split,
    TrajectoryRecord,
)

# Slot and group ids are derived from their coordinates: planning the same step twice is a no-op.
_ID_NAMESPACE = uuid.UUID("6f1c9a52-3f6e-4d0b-9d0e-1c3a0b7e5a11")

BulkMethod = Literal["copy", "executemany"]


@contextmanager
def _transaction(session: Session) -> Iterator[None]:
    try:
        yield
        session.commit()
    except BaseException:
        session.rollback()
        raise


def _q(session: Session, sql: str, **params: Any) -> sa.CursorResult:
    return session.execute(sa.text(sql), params)


def group_id_for(run_id: uuid.UUID, split: Split, step: int, group_index: int) -> uuid.UUID:
    return uuid.uuid5(_ID_NAMESPACE, f"group/{run_id}/{split}/{step}/{group_index}")


def slot_id_for(group_id: uuid.UUID, sample_index: int) -> uuid.UUID:
    return uuid.uuid5(_ID_NAMESPACE, f"slot/{group_id}/{sample_index}")


def config_hash(config: dict[str, Any]) -> str:
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


# --------------------------------------------------------------------------- runs


def create_run(
    session: Session,
    name: str,
    config: dict[str, Any],
    initial_weights_uri: str,
    initial_sha256: str | None = None,
) -> Run:
    """Create a run with policy version 0, or return the existing run of that name if its config matches."""
    digest = config_hash(config)
    with _transaction(session):
        _q(
            session,
            "INSERT INTO run (id, name, config, config_hash, status) "
            "VALUES (:id, :name, :config, :hash, 'created') ON CONFLICT (name) DO NOTHING",
            id=uuid.uuid4(),
            name=name,
            config=Jsonb(config),
            hash=digest,
        )
        run = session.execute(sa.select(Run).where(Run.name == name)).scalar_one()
        if run.config_hash != digest:
            raise LedgerConflict(
                f"run {name!r} already exists with a different config; resume it with its own config "
                "or choose another run name"
            )
        _q(
            session,
            "INSERT INTO policy_version (run_id, version, learner_step, weights_uri, sha256, published_at) "
            "VALUES (:run, 0, 0, :uri, :sha, now()) ON CONFLICT DO NOTHING",
            run=run.id,
            uri=initial_weights_uri,
            sha=initial_sha256,
        )
    return run


def get_run(session: Session, name_or_id: str | uuid.UUID) -> Run:
    try:
        condition = Run.id == uuid.UUID(str(name_or_id))
    except ValueError:
        condition = Run.name == str(name_or_id)
    # populate_existing: a long-lived session must see status changes made by other calls or processes
    run = session.execute(sa.select(Run).where(condition).execution_options(populate_existing=True)).scalar_one_or_none()
    session.commit()  # ends the read; with expire_on_commit=False the row stays usable
    if run is None:
        raise LooplineError(f"no run named {name_or_id!r}; `loopline runs` lists them")
    return run


def set_run_status(session: Session, run_id: uuid.UUID, status: str) -> None:
    with _transaction(session):
        _q(session, "UPDATE run SET status = :s WHERE id = :r", s=status, r=run_id)


# --------------------------------------------------------------------------- planning


def plan_step(
    session: Session,
    run_id: uuid.UUID,
    step: int,
    task_ids: Sequence[str],
    group_size: int,
    split: Split = "train",
    max_attempts: int = 3,
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
        dict(id=slot_id_for(g["id"], k), run_id=run_id, group_id=g["id"], split=split, step=step, task_id=g["task_id"], sample_index=k)
        for g in groups
        for k in range(group_size)
    ]
    with _transaction(session):
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
                for r in _q(
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
                    "INSERT INTO slot (id, run_id, group_id, split, step, task_id, sample_index) "
                    "VALUES (:id, :run_id, :group_id, :split, :step, :task_id, :sample_index) "
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
    lease_seconds: float = 120.0,
    max_step: int | None = None,
) -> list[Lease]:
    """Lease up to `n` pending slots, opening one attempt each; expired leases are reclaimed first.

    `max_step` bounds how far ahead of the learner a worker may generate (the
    async staleness bound): slots of later steps stay pending.
    """
    expire_leases(session, run_id)
    with _transaction(session):
        rows = _q(
            session,
            # plan order (step, group, sample): groups are handed out first-in first-out and stay together
            "SELECT s.id, s.group_id, s.step, s.task_id, s.sample_index FROM slot s "
            "JOIN rollout_group g ON g.id = s.group_id "
            "WHERE s.run_id = :run AND s.split = :split AND s.state = 'pending' "
            "AND (CAST(:max_step AS int) IS NULL OR s.step <= :max_step) "
            "ORDER BY s.step, g.group_index, s.sample_index LIMIT :n FOR UPDATE OF s SKIP LOCKED",
            run=run_id,
            split=split,
            n=n,
            max_step=max_step,
        ).all()
        if not rows:
            return []
        slot_ids = [r.id for r in rows]
        attempt_ids = [uuid.uuid4() for _ in rows]
        _q(
            session,
            "INSERT INTO attempt (id, slot_id, run_id, worker) "
            "SELECT a, s, :run, :worker FROM unnest(CAST(:aids AS uuid[]), CAST(:sids AS uuid[])) AS u(a, s)",
            run=run_id,
            worker=worker,
            aids=attempt_ids,
            sids=slot_ids,
        )
        expiry = dict(
            _q(
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


def renew_lease(session: Session, attempt_id: uuid.UUID, lease_seconds: float = 120.0) -> bool:
    """Extend a lease; False means it was lost (expired and reclaimed) and the work should stop."""
    with _transaction(session):
        row = _q(
            session,
            "UPDATE slot SET lease_expires_at = now() + make_interval(secs => :secs) "
            "WHERE lease_attempt_id = :a AND state = 'leased' AND lease_expires_at > now() RETURNING id",
            a=attempt_id,
            secs=lease_seconds,
        ).first()
    return row is not None


def expire_leases(session: Session, run_id: uuid.UUID | None = None, dead_holders: Collection[str] = ()) -> int:
    """Take back the slots of leases nobody will finish: expired ones, and those of `dead_holders`
    (processes known to be gone: see `loopline.holder`), at once instead of at expiry.

    The holder vanished, the environment did not fail: the slot is retried without counting
    toward its group's `max_attempts`, so crashes of the trainer never drop data.
    """
    with _transaction(session):
        rows = _q(
            session,
            "SELECT lease_attempt_id, lease_expires_at < now() AS expired FROM slot WHERE state = 'leased' "
            "AND (lease_expires_at < now() OR lease_owner = ANY(CAST(:dead AS text[]))) "
            "AND (CAST(:run AS uuid) IS NULL OR run_id = :run)",
            run=run_id,
            dead=list(dead_holders),
        ).all()
    taken = 0
    for attempt_id, expired in rows:
        if expired:
            fate = _record_lease_loss(session, attempt_id, "LeaseExpired", "the worker's lease expired before it committed")
        else:
            fate = _record_lease_loss(session, attempt_id, "HolderDied", "the process holding the lease is gone", dead_holders)
        taken += fate
    return taken


def lease_holders(session: Session, run_id: uuid.UUID) -> list[str]:
    """Who holds the run's leases now (one entry per holder)."""
    with _transaction(session):
        return list(
            _q(
                session, "SELECT DISTINCT lease_owner FROM slot WHERE run_id = :r AND state = 'leased'", r=run_id
            ).scalars()
        )


def unfinished_slots(session: Session, run_id: uuid.UUID, split: Split) -> int:
    """Slots of the split still pending or leased: work that may yet come back to a worker."""
    with _transaction(session):
        return _q(
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
    with _transaction(session):
        slot = _lock_attempt_slot(session, attempt_id)
        _end_attempt(session, attempt_id, "cancelled", "Released", reason)
        if slot is None or slot.state != "leased" or slot.lease_attempt_id != attempt_id:
            return False
        _q(session, "UPDATE slot SET state = 'pending', " + _NO_LEASE + " WHERE id = :s", s=slot.id)
    return True


_NO_LEASE = "lease_owner = NULL, lease_attempt_id = NULL, lease_expires_at = NULL"


def _lock_attempt_slot(session: Session, attempt_id: uuid.UUID) -> sa.Row | None:
    """Lock the attempt's group, then its slot (the global lock order); returns the slot row."""
    ref = _q(
        session,
        "SELECT s.id, s.group_id FROM attempt a JOIN slot s ON s.id = a.slot_id WHERE a.id = :a",
        a=attempt_id,
    ).first()
    if ref is None:
        raise LooplineError(f"no attempt {attempt_id} in the ledger")
    _q(session, "SELECT id FROM rollout_group WHERE id = :g FOR UPDATE", g=ref.group_id)
    return _q(
        session,
        "SELECT s.id, s.group_id, s.state, s.lease_attempt_id, s.lease_owner, s.infra_failures, "
        "s.lease_expires_at < now() AS expired, g.max_attempts "
        "FROM slot s JOIN rollout_group g ON g.id = s.group_id WHERE s.id = :s FOR UPDATE OF s",
        s=ref.id,
    ).first()


def _end_attempt(
    session: Session, attempt_id: uuid.UUID, status: str, error_class: str | None, error_text: str | None
) -> None:
    _q(
        session,
        "UPDATE attempt SET status = :st, error_class = :ec, error_text = :et, ended_at = now() "
        "WHERE id = :a AND status = 'running'",
        a=attempt_id,
        st=status,
        ec=error_class,
        et=error_text,
    )


def _record_lease_loss(
    session: Session, attempt_id: uuid.UUID, error_class: str, error_text: str, dead_holders: Collection[str] = ()
) -> bool:
    """End an attempt whose holder vanished and give its slot back, uncounted; False if it was not lost after all."""
    with _transaction(session):
        slot = _lock_attempt_slot(session, attempt_id)
        holds_lease = slot.state == "leased" and slot.lease_attempt_id == attempt_id
        if not (holds_lease and (slot.expired or slot.lease_owner in dead_holders)):
            return False  # renewed, committed or handled by another process meanwhile
        _end_attempt(session, attempt_id, "infra_failed", error_class, error_text)
        _q(session, "UPDATE slot SET state = 'pending', " + _NO_LEASE + " WHERE id = :s", s=slot.id)
    return True


def _record_infra_failure(session: Session, attempt_id: uuid.UUID, error_class: str, error_text: str) -> str:
    with _transaction(session):
        slot = _lock_attempt_slot(session, attempt_id)
        holds_lease = slot.state == "leased" and slot.lease_attempt_id == attempt_id
        _end_attempt(session, attempt_id, "infra_failed", error_class, error_text)
        if not holds_lease:
            return "stale"
        if slot.infra_failures + 1 < slot.max_attempts:
            _q(
                session,
                "UPDATE slot SET state = 'pending', infra_failures = infra_failures + 1, " + _NO_LEASE + " WHERE id = :s",
                s=slot.id,
            )
            return "retry"
        _q(session, "UPDATE slot SET infra_failures = infra_failures + 1 WHERE id = :s", s=slot.id)
        _drop_group(session, slot.group_id)
        return "dropped"


def _drop_group(session: Session, group_id: uuid.UUID) -> None:
    _q(
        session,
        "UPDATE rollout_group SET state = 'dropped', drop_reason = 'infra_retries_exhausted' "
        "WHERE id = :g AND state = 'open'",
        g=group_id,
    )
    _q(
        session,
        "UPDATE attempt SET status = 'cancelled', error_class = 'GroupDropped', ended_at = now() "
        "WHERE status = 'running' AND slot_id IN (SELECT id FROM slot WHERE group_id = :g)",
        g=group_id,
    )
    _q(
        session,
        "UPDATE slot SET state = 'abandoned', " + _NO_LEASE + " WHERE group_id = :g AND state IN ('pending', 'leased')",
        g=group_id,
    )


# --------------------------------------------------------------------------- commits

_TRAJECTORY_COLUMNS = (
    "id", "run_id", "slot_id", "attempt_id", "group_id", "task_id", "split", "env_name", "env_version",
    "verifier_version", "harness_version", "reward", "terminated", "truncated", "failure_type",
    "policy_version_min", "policy_version_max", "timings", "info",
)
_TRAJECTORY_TYPES = (
    "uuid", "uuid", "uuid", "uuid", "uuid", "text", "text", "text", "int4",
    "text", "text", "float8", "bool", "bool", "text",
    "int4", "int4", "jsonb", "jsonb",
)
_SEGMENT_COLUMNS = (
    "trajectory_id", "seq", "request_id", "policy_version", "version_spans", "tokenizer_version",
    "prompt_ids", "generated_ids", "action_loss_mask", "rollout_logprobs", "logprob_semantics",
    "sampling_config", "tool_events", "started_at", "ended_at",
)
_SEGMENT_TYPES = (
    "uuid", "int4", "text", "int4", "jsonb", "text",
    "int4[]", "int4[]", "int2[]", "float8[]", "text",
    "jsonb", "jsonb", "timestamptz", "timestamptz",
)


def commit_trajectory(
    session: Session, attempt_id: uuid.UUID, trajectory: TrajectoryRecord, method: BulkMethod = "copy"
) -> CommitOutcome:
    return commit_trajectories(session, [(attempt_id, trajectory)], method)[0]


def commit_trajectories(
    session: Session,
    items: Sequence[tuple[uuid.UUID, TrajectoryRecord]],
    method: BulkMethod = "copy",
) -> list[CommitOutcome]:
    """Commit finished attempts as trajectories with their segments, in one transaction.

    A slot keeps the first trajectory committed for it: a later (or racing)
    attempt at a slot already done, or at a dropped group, is refused and
    marked cancelled. Any attempt may commit while its slot is open, even
    one whose lease expired: its trajectory is as valid as a retry's would be.
    `method` picks the bulk path (binary COPY, or executemany for comparison).
    """
    for _, traj in items:
        traj.validate()
    outcomes: dict[uuid.UUID, CommitOutcome] = {}
    with _transaction(session):
        refs = _q(
            session,
            "SELECT a.id AS attempt_id, s.id AS slot_id, s.group_id FROM attempt a "
            "JOIN slot s ON s.id = a.slot_id WHERE a.id = ANY(:ids)",
            ids=[a for a, _ in items],
        ).all()
        known = {r.attempt_id for r in refs}
        missing = [a for a, _ in items if a not in known]
        if missing:
            raise LooplineError(f"no attempt {missing[0]} in the ledger")
        _q(
            session,
            "SELECT id FROM rollout_group WHERE id = ANY(:g) ORDER BY id FOR UPDATE",
            g=sorted({r.group_id for r in refs}),
        )
        slots = {
            r.id: r
            for r in _q(
                session,
                "SELECT id, run_id, group_id, split, task_id, state FROM slot WHERE id = ANY(:s) ORDER BY id FOR UPDATE",
                s=sorted({r.slot_id for r in refs}),
            )
        }
        slot_of = {r.attempt_id: r.slot_id for r in refs}

        trajectory_rows: list[tuple] = []
        segment_rows: list[tuple] = []
        done_slots: set[uuid.UUID] = set()
        statuses: list[tuple[uuid.UUID, str]] = []
        for attempt_id, traj in items:
            slot = slots[slot_of[attempt_id]]
            if slot.id in done_slots or slot.state == "done":
                outcomes[attempt_id] = CommitOutcome(attempt_id, None, "slot already has a committed trajectory")
                _end_attempt(session, attempt_id, "cancelled", "SlotAlreadyCommitted", outcomes[attempt_id].reason)
                continue
            if slot.state == "abandoned":
                outcomes[attempt_id] = CommitOutcome(attempt_id, None, "its group was dropped after infra failures")
                _end_attempt(session, attempt_id, "cancelled", "GroupDropped", outcomes[attempt_id].reason)
                continue
            trajectory_id = uuid.uuid4()
            done_slots.add(slot.id)
            outcomes[attempt_id] = CommitOutcome(attempt_id, trajectory_id)
            statuses.append((attempt_id, "ok" if traj.failure_type is None else "task_failed"))
            vmin, vmax = traj.version_range()
            trajectory_rows.append((
                trajectory_id, slot.run_id, slot.id, attempt_id, slot.group_id, slot.task_id, slot.split,
                traj.env_name, traj.env_version, traj.verifier_version, traj.harness_version, float(traj.reward),
                traj.terminated, traj.truncated, traj.failure_type, vmin, vmax, Jsonb(traj.timings), Jsonb(traj.info),
            ))
            for seq, seg in enumerate(traj.segments):
                segment_rows.append((
                    trajectory_id, seq, seg.request_id, seg.policy_version,
                    Jsonb(list(seg.version_spans)) if seg.version_spans is not None else None,
                    seg.tokenizer_version, list(seg.prompt_ids), list(seg.generated_ids),
                    list(seg.action_loss_mask), [float(x) for x in seg.rollout_logprobs], seg.logprob_semantics,
                    Jsonb(seg.sampling_config), Jsonb(list(seg.tool_events)), seg.started_at, seg.ended_at,
                ))

        if trajectory_rows:
            raw = session.connection().connection.driver_connection
            _bulk_write(raw, "trajectory", _TRAJECTORY_COLUMNS, _TRAJECTORY_TYPES, trajectory_rows, method)
            _bulk_write(raw, "segment", _SEGMENT_COLUMNS, _SEGMENT_TYPES, segment_rows, method)
            _q(
                session,
                "UPDATE slot SET state = 'done', " + _NO_LEASE + " WHERE id = ANY(:s)",
                s=list(done_slots),
            )
            for status in ("ok", "task_failed"):
                ids = [a for a, s in statuses if s == status]
                if ids:
                    _q(
                        session,
                        "UPDATE attempt SET status = :st, ended_at = now(), error_class = NULL, error_text = NULL "
                        "WHERE id = ANY(:ids)",
                        st=status,
                        ids=ids,
                    )
            _q(
                session,
                "UPDATE rollout_group g SET state = 'complete', completed_at = now() "
                "WHERE g.id = ANY(:g) AND g.state = 'open' "
                "AND NOT EXISTS (SELECT 1 FROM slot s WHERE s.group_id = g.id AND s.state <> 'done')",
                g=list({slots[s].group_id for s in done_slots}),
            )
    return [outcomes[a] for a, _ in items]


def _bulk_write(raw, table: str, columns: Sequence[str], types: Sequence[str], rows: list[tuple], method: BulkMethod) -> None:
    cols = ", ".join(columns)
    with raw.cursor() as cur:
        if method == "copy":
            with cur.copy(f"COPY {table} ({cols}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(list(types))
                for row in rows:
                    copy.write_row(row)
        elif method == "executemany":
            placeholders = ", ".join(["%s"] * len(columns))
            cur.executemany(f"INSERT INTO {table} ({cols}) VALUES ({placeholders})", rows)
        else:
            raise ValueError(f"unknown bulk method {method!r}")


# --------------------------------------------------------------------------- groups and the learner


def complete_groups(session: Session, run_id: uuid.UUID, split: Split = "train") -> list[uuid.UUID]:
    """Groups whose every sample is committed and that no learner step has claimed yet."""
    ids = _q(
        session,
        "SELECT id FROM rollout_group WHERE run_id = :r AND split = :s AND state = 'complete' "
        "ORDER BY step, group_index",
        r=run_id,
        s=split,
    ).scalars().all()
    session.rollback()
    return list(ids)


def group_states(session: Session, run_id: uuid.UUID) -> dict[str, int]:
    """How many groups are open, complete, claimed, consumed and dropped."""
    states = _group_states(session, run_id)
    session.rollback()
    return states


def _group_states(session: Session, run_id: uuid.UUID) -> dict[str, int]:
    rows = _q(session, "SELECT state, count(*) FROM rollout_group WHERE run_id = :r GROUP BY state", r=run_id)
    return {state: n for state, n in rows}


def _lock_run_progress(session: Session, run_id: uuid.UUID) -> tuple[int, int]:
    """Serialise learner bookkeeping for a run; returns (last committed learner step, latest policy version)."""
    if _q(session, "SELECT id FROM run WHERE id = :r FOR UPDATE", r=run_id).first() is None:
        raise LooplineError(f"no run {run_id} in the ledger")
    last_step = _q(
        session, "SELECT coalesce(max(learner_step), 0) FROM checkpoint WHERE run_id = :r AND complete", r=run_id
    ).scalar_one()
    latest = _q(session, "SELECT max(version) FROM policy_version WHERE run_id = :r", r=run_id).scalar_one()
    if latest is None:
        raise LooplineError(f"run {run_id} has no policy version 0; create it with create_run")
    return last_step, latest


def _batch_trajectories(session: Session, group_ids: Sequence[uuid.UUID]) -> tuple[uuid.UUID, ...]:
    return tuple(
        _q(
            session,
            "SELECT t.id FROM trajectory t JOIN slot s ON s.id = t.slot_id "
            "JOIN rollout_group g ON g.id = t.group_id WHERE t.group_id = ANY(:g) "
            "ORDER BY g.step, g.group_index, s.sample_index",
            g=list(group_ids),
        ).scalars().all()
    )


def _groups_of_step(session: Session, run_id: uuid.UUID, learner_step: int, state: str) -> tuple[uuid.UUID, ...]:
    return tuple(
        _q(
            session,
            "SELECT id FROM rollout_group WHERE run_id = :r AND learner_step = :k AND state = :st "
            "ORDER BY step, group_index",
            r=run_id,
            k=learner_step,
            st=state,
        ).scalars().all()
    )


def claim_learner_batch(
    session: Session,
    run_id: uuid.UUID,
    learner_step: int,
    max_groups: int,
    max_staleness: int | None = None,
) -> LearnerBatch:
    """Reserve complete train groups for `learner_step` before training on them.

    The reservation is durable: a learner that dies and retries the same step
    gets exactly the same groups. Groups generated by a policy more than
    `max_staleness` versions behind the current one are not taken. Eval
    groups are never taken. A step already committed returns what it consumed
    with `already_committed=True`, so a retried task can skip its work.
    """
    with _transaction(session):
        last_step, latest = _lock_run_progress(session, run_id)
        if learner_step <= last_step:
            groups = _groups_of_step(session, run_id, learner_step, "consumed")
            produced = _q(
                session,
                "SELECT policy_version FROM checkpoint WHERE run_id = :r AND learner_step = :k",
                r=run_id,
                k=learner_step,
            ).scalar_one()
            return LearnerBatch(
                run_id, learner_step, produced - 1, groups, _batch_trajectories(session, groups), True
            )
        if learner_step != last_step + 1:
            raise LedgerConflict(
                f"learner step {learner_step} requested, but the last committed step is {last_step}; "
                f"resume from step {last_step + 1}"
            )
        groups = _groups_of_step(session, run_id, learner_step, "claimed")
        stale = 0
        if not groups:
            if max_staleness is not None:  # too old to ever train: drop them so nothing waits on them
                stale = _q(
                    session,
                    "UPDATE rollout_group g SET state = 'dropped', drop_reason = 'stale' "
                    "WHERE g.run_id = :r AND g.split = 'train' AND g.state = 'complete' AND EXISTS ("
                    "  SELECT 1 FROM trajectory t WHERE t.group_id = g.id AND t.policy_version_min < :oldest)",
                    r=run_id,
                    oldest=latest - max_staleness,
                ).rowcount
            groups = tuple(
                _q(
                    session,
                    "SELECT g.id FROM rollout_group g WHERE g.run_id = :r AND g.split = 'train' "
                    "AND g.state = 'complete' ORDER BY g.step, g.group_index LIMIT :n FOR UPDATE SKIP LOCKED",
                    r=run_id,
                    n=max_groups,
                ).scalars().all()
            )
            if groups:
                _q(
                    session,
                    "UPDATE rollout_group SET state = 'claimed', learner_step = :k WHERE id = ANY(:g)",
                    k=learner_step,
                    g=list(groups),
                )
        return LearnerBatch(run_id, learner_step, latest, groups, _batch_trajectories(session, groups), stale_dropped=stale)


def commit_learner_step(
    session: Session,
    batch: LearnerBatch,
    weights_uri: str,
    checkpoint_uri: str,
    weights_sha256: str | None = None,
    metrics: dict[str, float] | None = None,
) -> LearnerCommit:
    """Record a finished learner step atomically: consumption rows, checkpoint, new policy version, metrics.

    Either all of it is in the ledger or none of it: a learner that dies
    before this returns has consumed nothing, and its retry trains the same
    batch. Committing a step twice is a no-op that returns the first result.
    """
    run_id, k = batch.run_id, batch.learner_step
    with _transaction(session):
        last_step, latest = _lock_run_progress(session, run_id)
        if k <= last_step:
            consumed = _q(
                session, "SELECT count(*) FROM consumption WHERE run_id = :r AND learner_step = :k", r=run_id, k=k
            ).scalar_one()
            version = _q(
                session, "SELECT policy_version FROM checkpoint WHERE run_id = :r AND learner_step = :k", r=run_id, k=k
            ).scalar_one()
            return LearnerCommit(k, version, consumed, already_committed=True)
        if k != last_step + 1:
            raise LedgerConflict(f"cannot commit learner step {k}: the last committed step is {last_step}")
        claimed = _groups_of_step(session, run_id, k, "claimed")
        if not claimed:
            raise LedgerConflict(f"learner step {k} has no claimed groups: call claim_learner_batch first")
        if set(claimed) != set(batch.group_ids) or _batch_trajectories(session, claimed) != batch.trajectory_ids:
            raise LedgerConflict(f"learner step {k} trained on a batch that differs from the one claimed for it")
        if batch.policy_version != latest:
            raise LedgerConflict(
                f"learner step {k} trained policy version {batch.policy_version}, but the latest is {latest}"
            )
        consumed = _q(
            session,
            "INSERT INTO consumption (run_id, trajectory_id, split, learner_step, policy_version, version_lag) "
            "SELECT t.run_id, t.id, t.split, :k, :v, :v - t.policy_version_min FROM trajectory t "
            "WHERE t.group_id = ANY(:g)",
            k=k,
            v=latest,
            g=list(claimed),
        ).rowcount
        _q(session, "UPDATE rollout_group SET state = 'consumed' WHERE id = ANY(:g)", g=list(claimed))
        new_version = latest + 1
        _q(
            session,
            "INSERT INTO policy_version (run_id, version, learner_step, weights_uri, sha256) "
            "VALUES (:r, :v, :k, :uri, :sha)",
            r=run_id,
            v=new_version,
            k=k,
            uri=weights_uri,
            sha=weights_sha256,
        )
        _q(
            session,
            "INSERT INTO checkpoint (run_id, learner_step, policy_version, uri, complete) "
            "VALUES (:r, :k, :v, :uri, true)",
            r=run_id,
            k=k,
            v=new_version,
            uri=checkpoint_uri,
        )
        lag = _q(
            session,
            "SELECT avg(version_lag), max(version_lag) FROM consumption WHERE run_id = :r AND learner_step = :k",
            r=run_id,
            k=k,
        ).one()
        metrics = {**(metrics or {}), "version_lag_mean": float(lag[0] or 0), "version_lag_max": float(lag[1] or 0)}
        session.execute(
            sa.text("INSERT INTO metric (run_id, step, name, value, policy_version) VALUES (:r, :k, :name, :value, :v)"),
            [dict(r=run_id, k=k, name=name, value=float(value), v=new_version) for name, value in metrics.items()],
        )
    return LearnerCommit(k, new_version, consumed)


def open_groups_through(session: Session, run_id: uuid.UUID, step: int) -> int:
    """Train groups of steps <= `step` still being generated (the async learner waits for them)."""
    n = _q(
        session,
        "SELECT count(*) FROM rollout_group WHERE run_id = :r AND split = 'train' AND step <= :k AND state = 'open'",
        r=run_id,
        k=step,
    ).scalar_one()
    session.rollback()
    return n


@dataclass(frozen=True)
class VersionWeights:
    version: int
    uri: str


def version_weights(session: Session, run_id: uuid.UUID, version: int | None = None) -> VersionWeights:
    """Where a policy version's weights are (the newest version when `version` is None)."""
    row = _q(
        session,
        "SELECT version, weights_uri FROM policy_version WHERE run_id = :r AND (CAST(:v AS int) IS NULL OR version = :v) "
        "ORDER BY version DESC LIMIT 1",
        r=run_id,
        v=version,
    ).first()
    session.rollback()
    if row is None:
        raise LooplineError(f"run {run_id} has no policy version {version}")
    return VersionWeights(row.version, row.weights_uri)


def owed_evaluations(
    session: Session, run_id: uuid.UUID, scheduled: Callable[[int], bool], through: int
) -> list[VersionWeights]:
    """Versions up to `through` whose scheduled evaluation is not in the ledger yet, oldest first."""
    rows = _q(
        session,
        "SELECT p.version, p.weights_uri FROM policy_version p WHERE p.run_id = :r AND p.version <= :upto "
        "AND NOT EXISTS (SELECT 1 FROM eval_result e WHERE e.run_id = p.run_id AND e.policy_version = p.version) "
        "ORDER BY p.version",
        r=run_id,
        upto=through,
    ).all()
    session.rollback()
    return [VersionWeights(r.version, r.weights_uri) for r in rows if scheduled(r.version)]


def initial_weights(session: Session, run_id: uuid.UUID) -> str:
    """Where the run's version 0 came from (the learner and tokenizer start there)."""
    uri = _q(session, "SELECT weights_uri FROM policy_version WHERE run_id = :r AND version = 0", r=run_id).scalar_one()
    session.rollback()
    return uri


def latest_policy_version(session: Session, run_id: uuid.UUID) -> int:
    """The learner's newest version (what the staleness gate compares the engines' versions with)."""
    version = _q(session, "SELECT coalesce(max(version), 0) FROM policy_version WHERE run_id = :r", r=run_id).scalar_one()
    session.rollback()
    return version


def record_eval_result(
    session: Session,
    run_id: uuid.UUID,
    policy_version: int,
    env_name: str,
    env_version: int,
    n_tasks: int,
    n_success: int,
    details: dict[str, Any] | None = None,
) -> bool:
    """Store a policy version's held-out success once; returns False if it was already recorded."""
    with _transaction(session):
        inserted = _q(
            session,
            "INSERT INTO eval_result (run_id, policy_version, env_name, env_version, n_tasks, n_success, success_rate, details) "
            "VALUES (:r, :v, :e, :ev, :n, :k, :rate, :d) ON CONFLICT DO NOTHING",
            r=run_id, v=policy_version, e=env_name, ev=env_version, n=n_tasks, k=n_success,
            rate=n_success / n_tasks if n_tasks else 0.0, d=Jsonb(details or {}),
        ).rowcount
    return inserted == 1


def mark_published(session: Session, run_id: uuid.UUID, version: int) -> None:
    """Record that every engine now serves `version` (weight sync finished)."""
    with _transaction(session):
        _q(
            session,
            "UPDATE policy_version SET published_at = coalesce(published_at, now()) WHERE run_id = :r AND version = :v",
            r=run_id,
            v=version,
        )


# --------------------------------------------------------------------------- resume


def consumed_trajectory_ids(session: Session, run_id: uuid.UUID) -> set[uuid.UUID]:
    ids = _q(session, "SELECT trajectory_id FROM consumption WHERE run_id = :r", r=run_id).scalars().all()
    session.rollback()
    return set(ids)


def resume_state(session: Session, run_id: uuid.UUID) -> ResumeState:
    """Where a run stands in the ledger: the checkpoint to restore and what the next learner step is."""
    with _transaction(session):
        ckpt = _q(
            session,
            "SELECT learner_step, policy_version, uri FROM checkpoint WHERE run_id = :r AND complete "
            "ORDER BY learner_step DESC LIMIT 1",
            r=run_id,
        ).first()
        latest = _q(
            session,
            "SELECT version, weights_uri FROM policy_version WHERE run_id = :r ORDER BY version DESC LIMIT 1",
            r=run_id,
        ).first()
        if latest is None:
            raise LooplineError(f"run {run_id} has no policy version; create it with create_run")
        next_step = (ckpt.learner_step if ckpt else 0) + 1
        consumed = _q(session, "SELECT count(*) FROM consumption WHERE run_id = :r", r=run_id).scalar_one()
        pending = _groups_of_step(session, run_id, next_step, "claimed")
        states = _group_states(session, run_id)
    return ResumeState(
        run_id=run_id,
        last_checkpoint=CheckpointInfo(*ckpt) if ckpt else None,
        policy_version=latest.version,
        weights_uri=latest.weights_uri,
        next_learner_step=next_step,
        consumed_trajectories=consumed,
        pending_learner_groups=pending,
        group_states=states,
    )
