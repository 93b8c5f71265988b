"""Committing trajectories (token-exact, in bulk) and reading them back."""

from __future__ import annotations

import uuid
from typing import Iterator, Literal, Sequence

import numpy as np
from psycopg.rows import namedtuple_row
from psycopg.types.json import Jsonb
from sqlalchemy.dialects import postgresql
from sqlmodel import Session, SQLModel

from loopline.errors import LooplineError
from loopline.store.nul import storable
from loopline.store import prompts
from loopline.store.packed import read_numpy_arrays, use_packed_arrays
from loopline.store._sql import one_row, q, transaction
from loopline.store.models import Segment, Trajectory
from loopline.store.records import CommitOutcome
from loopline.types import ChainedTrajectory, StoredCall, StoredChain, StoredSegment, StoredTrajectory, TrajectoryRecord
from loopline.store.slots import NO_LEASE, end_attempt, group_id_for, slot_id_for

BulkMethod = Literal["copy", "copy_lists", "executemany"]  # the last two for comparison (benchmarks)


def _copy_layout(model: type[SQLModel], written_by_server: tuple[str, ...] = ()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Column names and PostgreSQL type names for binary COPY, read from the table model (one source of truth)."""
    dialect = postgresql.dialect()
    columns = [c for c in model.__table__.columns if c.name not in written_by_server]
    return tuple(c.name for c in columns), tuple(c.type.compile(dialect=dialect).lower() for c in columns)


_TRAJECTORY_COLUMNS, _TRAJECTORY_TYPES = _copy_layout(Trajectory, written_by_server=("created_at",))
_SEGMENT_COLUMNS, _SEGMENT_TYPES = _copy_layout(Segment)


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
    marked cancelled. An attempt whose lease expired may still commit while
    nobody else took the slot (its trajectory is as valid as a retry's would
    be), but not once another attempt holds it (fencing: a worker frozen past
    its lease never commits over the live one).
    `method` picks the bulk path: binary COPY with the arrays packed by numpy (`packed`), or for comparison
    psycopg's own element-by-element dumping (`copy_lists`) or executemany.
    """
    for _, traj in items:
        traj.validate()
    with transaction(session):
        outcomes, groups = _commit(session, items, method)
    if groups:
        with transaction(session):  # (a crash between the two: the learner completes them before it claims)
            complete_finished_groups(session, groups)
    return outcomes


def complete_finished_groups(session: Session, group_ids: Sequence[uuid.UUID] | None = None, run_id: uuid.UUID | None = None) -> int:
    """Mark complete the open groups (of `group_ids`, or of the run) whose every slot is done: after the commit
    that finished their slots, in a transaction of its own, so that commits into one group never wait on its row.
    Two commits finishing a group's last slots at once each run this after their own commit: the later one
    sees both. Returns how many were completed."""
    return q(
        session,
        "UPDATE rollout_group g SET state = 'complete', completed_at = now() WHERE g.state = 'open' "
        "AND (CAST(:g AS uuid[]) IS NULL OR g.id = ANY(:g)) AND (CAST(:r AS uuid) IS NULL OR g.run_id = :r) "
        "AND NOT EXISTS (SELECT 1 FROM slot s WHERE s.group_id = g.id AND s.state <> 'done')",
        g=None if group_ids is None else list(group_ids),
        r=run_id,
    ).rowcount


def _commit(
    session: Session, items: Sequence[tuple[uuid.UUID, TrajectoryRecord]], method: BulkMethod
) -> tuple[list[CommitOutcome], list[uuid.UUID]]:
    """commit_trajectories inside the caller's transaction: its outcomes, and the groups whose slots it finished.
    Only slot rows are locked (in id order: the lock order of `slots`)."""
    outcomes: dict[uuid.UUID, CommitOutcome] = {}
    refs = q(
        session,
        "SELECT a.id AS attempt_id, s.id AS slot_id, s.group_id FROM attempt a "
        "JOIN slot s ON s.id = a.slot_id WHERE a.id = ANY(:ids)",
        ids=[a for a, _ in items],
    ).all()
    known = {r.attempt_id for r in refs}
    missing = [a for a, _ in items if a not in known]
    if missing:
        raise LooplineError(f"no attempt {missing[0]} in the ledger")
    slots = {
        r.id: r
        for r in q(
            session,
            "SELECT id, run_id, group_id, split, task_id, state, lease_attempt_id FROM slot WHERE id = ANY(:s) ORDER BY id FOR UPDATE",
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
            end_attempt(session, attempt_id, "cancelled", "SlotAlreadyCommitted", outcomes[attempt_id].reason)
            continue
        if slot.state == "abandoned":
            outcomes[attempt_id] = CommitOutcome(attempt_id, None, "its group was dropped after infra failures")
            end_attempt(session, attempt_id, "cancelled", "GroupDropped", outcomes[attempt_id].reason)
            continue
        if slot.state == "leased" and slot.lease_attempt_id != attempt_id:  # fencing: a worker frozen past its lease
            outcomes[attempt_id] = CommitOutcome(attempt_id, None, "another attempt holds the slot now (this one's lease expired)")
            end_attempt(session, attempt_id, "cancelled", "LeaseLost", outcomes[attempt_id].reason)
            continue
        trajectory_id = uuid.uuid4()
        done_slots.add(slot.id)
        outcomes[attempt_id] = CommitOutcome(attempt_id, trajectory_id)
        statuses.append((attempt_id, "ok" if traj.failure_type is None else "task_failed"))
        vmin, vmax = traj.version_range()
        trajectory_rows.append(_row(_TRAJECTORY_COLUMNS, dict(
            id=trajectory_id, run_id=slot.run_id, slot_id=slot.id, attempt_id=attempt_id, group_id=slot.group_id,
            task_id=slot.task_id, split=slot.split, env_name=traj.env_name, env_version=traj.env_version,
            verifier_version=traj.verifier_version, harness_version=traj.harness_version, reward=float(traj.reward),
            terminated=traj.terminated, truncated=traj.truncated, failure_type=traj.failure_type,
            policy_version_min=vmin, policy_version_max=vmax, timings=Jsonb(traj.timings), info=Jsonb(storable(traj.info)),
        )))
        for seq, (seg, (prefix, copies, stored)) in enumerate(zip(traj.segments, prompts.encode(traj.segments))):
            segment_rows.append(_row(_SEGMENT_COLUMNS, dict(
                trajectory_id=trajectory_id, seq=seq, request_id=seg.request_id, policy_version=seg.policy_version,
                version_spans=Jsonb(list(seg.version_spans)) if seg.version_spans is not None else None,
                tokenizer_version=seg.tokenizer_version, prompt_ids=list(stored), prompt_prefix_len=prefix, prompt_copies=copies,
                generated_ids=list(seg.generated_ids), action_loss_mask=list(seg.action_loss_mask),
                rollout_logprobs=_float32(seg.rollout_logprobs), logprob_semantics=seg.logprob_semantics,
                sampling_config=Jsonb(seg.sampling_config), tool_events=Jsonb(storable(list(seg.tool_events))),
                started_at=seg.started_at, ended_at=seg.ended_at, starts_chain=seq > 0 and seg.starts_chain,
            )))

    if trajectory_rows:
        raw = session.connection().connection.driver_connection
        _bulk_write(raw, "trajectory", _TRAJECTORY_COLUMNS, _TRAJECTORY_TYPES, trajectory_rows, method)
        _bulk_write(raw, "segment", _SEGMENT_COLUMNS, _SEGMENT_TYPES, segment_rows, method)
        q(
            session,
            "UPDATE slot SET state = 'done', " + NO_LEASE + " WHERE id = ANY(:s)",
            s=list(done_slots),
        )
        for status in ("ok", "task_failed"):
            ids = [a for a, s in statuses if s == status]
            if ids:
                q(
                    session,
                    "UPDATE attempt SET status = :st, ended_at = now(), error_class = NULL, error_text = NULL "
                    "WHERE id = ANY(:ids)",
                    st=status,
                    ids=ids,
                )
    return [outcomes[a] for a, _ in items], sorted({slots[s].group_id for s in done_slots})


def write_eval_episodes(session: Session, run_id: uuid.UUID, version: int, episodes: Sequence[TrajectoryRecord], task_ids: Sequence[str], worker: str) -> int:
    """An evaluation's episodes as trajectories of the `eval` split, inside the caller's transaction (the one that
    records the evaluation's result, so both are written once or not at all): one group of one slot per task, at
    step = the evaluated version, browsable as training's are and refused by the learner (the ledger's checks).
    Returns how many were written: none where this version's eval groups exist already (another environment's
    evaluation of the same version)."""
    if not episodes or q(session, "SELECT 1 FROM rollout_group WHERE run_id = :r AND split = 'eval' AND step = :v LIMIT 1",
                         r=run_id, v=version).first():
        return 0
    for traj in episodes:
        traj.validate()
    groups = [group_id_for(run_id, "eval", version, i) for i in range(len(episodes))]
    slots = [slot_id_for(g, 0) for g in groups]
    attempts = [uuid.uuid4() for _ in episodes]
    q(session,
      "INSERT INTO rollout_group (id, run_id, split, step, group_index, task_id, size, max_attempts) "
      "SELECT g, :r, 'eval', :v, i - 1, t, 1, 1 FROM unnest(CAST(:g AS uuid[]), CAST(:t AS text[])) WITH ORDINALITY AS u(g, t, i)",
      r=run_id, v=version, g=groups, t=list(task_ids))
    q(session,
      "INSERT INTO slot (id, run_id, group_id, split, step, task_id, group_index, sample_index) "
      "SELECT s, :r, g, 'eval', :v, t, i - 1, 0 FROM unnest(CAST(:s AS uuid[]), CAST(:g AS uuid[]), CAST(:t AS text[])) WITH ORDINALITY AS u(s, g, t, i)",
      r=run_id, v=version, s=slots, g=groups, t=list(task_ids))
    q(session,
      "INSERT INTO attempt (id, slot_id, run_id, worker) SELECT a, s, :r, :w FROM unnest(CAST(:a AS uuid[]), CAST(:s AS uuid[])) AS u(a, s)",
      r=run_id, w=worker, a=attempts, s=slots)
    outcomes, groups = _commit(session, list(zip(attempts, episodes)), "copy")
    complete_finished_groups(session, groups)  # (new groups of one slot each: nobody else commits into them)
    return sum(o.trajectory_id is not None for o in outcomes)


def _float32(logprobs: Sequence[float]) -> list[float]:
    """Logprobs as the ledger stores them (float4), rounded here, so every bulk path stores the same values
    (PostgreSQL's own cast refuses a float8 too small for a float4 instead of rounding it to 0)."""
    return np.asarray(logprobs, dtype=np.float32).tolist()


def _row(columns: tuple[str, ...], values: dict) -> tuple:
    """A row in the table's column order; a column the model has and this code does not fill fails here."""
    return tuple(values[name] for name in columns)


def _bulk_write(raw, table: str, columns: Sequence[str], types: Sequence[str], rows: list[tuple], method: BulkMethod) -> None:
    cols = ", ".join(columns)
    with raw.cursor() as cur:
        if method in ("copy", "copy_lists"):
            if method == "copy":
                use_packed_arrays(cur)
            with cur.copy(f"COPY {table} ({cols}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(list(types))
                for row in rows:
                    copy.write_row(row)
        elif method == "executemany":
            placeholders = ", ".join(["%s"] * len(columns))
            cur.executemany(f"INSERT INTO {table} ({cols}) VALUES ({placeholders})", rows)
        else:
            raise ValueError(f"unknown bulk method {method!r}")


def rollout_metrics(session: Session, run_id: uuid.UUID, trajectory_ids: Sequence[uuid.UUID], version: int) -> dict[str, float]:
    """How a learner batch's episodes went, beside the learner's own numbers, named as verl names its own: the
    fraction cut by a budget (`rollout/truncated_frac`), the infrastructure failures of their slots' attempts
    (`rollout/infra_failed_frac`: played again; the policy never saw them), tool calls per episode and the
    fraction that failed, the wall time from the batch's first attempt to its last (`timing_s/rollout`, and
    `perf/trajectories_per_s` over it), the mean episode, and the sync that served `version` (its weights)."""
    row = one_row(
        session,
        "WITH t AS (SELECT id, slot_id, truncated, (timings->>'episode_s')::float8 AS episode_s FROM trajectory WHERE id = ANY(:ids)), "
        "calls AS (SELECT count(*) AS n, count(*) FILTER (WHERE (e->>'error')::boolean) AS errors "
        "          FROM segment s CROSS JOIN LATERAL jsonb_array_elements(s.tool_events) e WHERE s.trajectory_id = ANY(:ids)), "
        "attempts AS (SELECT count(*) AS n, count(*) FILTER (WHERE a.status = 'infra_failed') AS infra, "
        "             extract(epoch FROM max(a.ended_at) - min(a.started_at))::float8 AS wall_s "
        "             FROM attempt a WHERE a.slot_id IN (SELECT slot_id FROM t)) "
        "SELECT (SELECT count(*) FROM t) AS episodes, (SELECT count(*) FILTER (WHERE truncated) FROM t) AS truncated, "
        "(SELECT avg(episode_s) FROM t) AS episode_s, calls.n AS calls, calls.errors, attempts.n AS attempts, attempts.infra, "
        "attempts.wall_s, (SELECT (sync_timings->>'total_s')::float8 FROM policy_version WHERE run_id = :r AND version = :v) AS sync_s "
        "FROM calls, attempts",
        ids=list(trajectory_ids), r=run_id, v=version,
    )
    episodes = max(row.episodes, 1)
    timed = {
        "timing_s/rollout": row.wall_s, "perf/trajectories_per_s": row.episodes / row.wall_s if row.wall_s else None,
        "timing_s/episode_mean": row.episode_s, "timing_s/sync": row.sync_s,
    }
    return {
        "rollout/truncated_frac": row.truncated / episodes,
        "rollout/infra_failed_frac": row.infra / max(row.attempts, 1),
        "tool/calls_per_episode": row.calls / episodes,
        "tool/error_frac": row.errors / max(row.calls, 1),
        **{name: float(value) for name, value in timed.items() if value is not None},
    }


READ_TRAJECTORIES = 4  # per statement: a learner's read holds no transaction open while it decodes


def _read_segments(session: Session, trajectory_ids: Sequence[uuid.UUID]) -> Iterator[tuple[uuid.UUID, list]]:
    """Each asked trajectory's rows (its own columns on each of its segments', in seq order), a few trajectories
    per statement, each statement its own transaction, the arrays loaded as numpy's: time and memory linear in
    what is stored, whatever the batch. All must exist."""
    wanted = list(trajectory_ids)
    for at in range(0, len(wanted), READ_TRAJECTORIES):
        chunk = wanted[at : at + READ_TRAJECTORIES]
        try:
            raw = session.connection().connection.driver_connection
            with raw.cursor(binary=True, row_factory=namedtuple_row) as cur:
                read_numpy_arrays(cur)
                cur.execute(
                    "SELECT t.id, t.group_id, t.reward, t.policy_version_min, t.policy_version_max, s.seq, s.prompt_ids, "
                    "s.prompt_prefix_len, s.prompt_copies, s.generated_ids, s.action_loss_mask, s.rollout_logprobs, s.starts_chain "
                    "FROM trajectory t JOIN segment s ON s.trajectory_id = t.id WHERE t.id = ANY(%s) ORDER BY t.id, s.seq",
                    (chunk,),
                )
                found = cur.fetchall()
        finally:
            session.rollback()
        by_id: dict[uuid.UUID, list] = {}
        for row in found:
            by_id.setdefault(row.id, []).append(row)
        missing = [t for t in chunk if t not in by_id]
        if missing:
            raise LooplineError(f"trajectories not in the ledger: {', '.join(map(str, missing[:3]))}")
        for trajectory_id in chunk:
            yield trajectory_id, by_id[trajectory_id]


def load_chained(session: Session, trajectory_ids: Sequence[uuid.UUID]) -> Iterator[ChainedTrajectory]:
    """Committed trajectories as the learner trains them (each chain's ids once), in the order asked for, as
    they are read (a consumer that keeps only what it makes of each holds one trajectory's rows at a time)."""
    for _, segs in _read_segments(session, trajectory_ids):
        decoded = prompts.decode(segs)
        calls: list[list[StoredCall]] = [[] for _ in decoded.chains]
        for call in decoded.calls:
            calls[call.chain].append(StoredCall(call.prompt_len, call.row.action_loss_mask, call.row.rollout_logprobs))
        first = segs[0]
        yield ChainedTrajectory(
            first.id, first.group_id, first.reward, first.policy_version_min, first.policy_version_max,
            tuple(StoredChain(ids, tuple(c)) for ids, c in zip(decoded.chains, calls)),
        )


def load_trajectories(session: Session, trajectory_ids: Sequence[uuid.UUID]) -> list[StoredTrajectory]:
    """Committed trajectories with each call's whole prompt (as Python lists), in the order asked for: for
    readers that show every call (a trajectory's prompts together are quadratic in its turns: the learner
    reads `load_chained`)."""
    out = []
    for _, segs in _read_segments(session, trajectory_ids):
        decoded = prompts.decode(segs)
        first = segs[0]
        out.append(StoredTrajectory(
            first.id, first.group_id, first.reward, first.policy_version_min, first.policy_version_max,
            tuple(
                StoredSegment(r.seq, decoded.prompt(c).tolist(), r.generated_ids.tolist(), r.action_loss_mask.tolist(),
                              r.rollout_logprobs.tolist(), r.starts_chain)
                for c, r in zip(decoded.calls, segs)
            ),
        ))
    return out
