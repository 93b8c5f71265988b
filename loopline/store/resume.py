"""Where a run stands when a process resumes it: its newest checkpoint and version, what it consumed, the groups
its next learner step had claimed."""

from __future__ import annotations

import uuid

from sqlmodel import Session

from loopline.errors import LooplineError
from loopline.store._sql import column, q, transaction
from loopline.store.learning import group_state_counts, groups_of_step
from loopline.store.records import CheckpointInfo, ResumeState


def consumed_trajectory_ids(session: Session, run_id: uuid.UUID) -> set[uuid.UUID]:
    ids = column(session, "SELECT trajectory_id FROM consumption WHERE run_id = :r", r=run_id)
    return set(ids)


def resume_state(session: Session, run_id: uuid.UUID) -> ResumeState:
    """Where a run stands in the ledger: the newest full checkpoint to restore (the steps after it are replayed)
    and what the next learner step is."""
    with transaction(session):
        ckpt = q(
            session,
            "SELECT learner_step, policy_version, uri FROM checkpoint WHERE run_id = :r AND complete "
            "ORDER BY learner_step DESC LIMIT 1",
            r=run_id,
        ).first()
        latest = q(
            session,
            "SELECT version, learner_step, weights_uri, adapter_uri FROM policy_version WHERE run_id = :r ORDER BY version DESC LIMIT 1",
            r=run_id,
        ).first()
        if latest is None:
            raise LooplineError(f"run {run_id} has no policy version; create it with create_run")
        next_step = latest.learner_step + 1
        consumed = q(session, "SELECT count(*) FROM consumption WHERE run_id = :r", r=run_id).scalar_one()
        pending = groups_of_step(session, run_id, next_step, "claimed")
        states = group_state_counts(session, run_id)
    return ResumeState(
        run_id=run_id,
        last_checkpoint=CheckpointInfo(*ckpt) if ckpt else None,
        policy_version=latest.version,
        weights_uri=latest.weights_uri,
        adapter_uri=latest.adapter_uri,
        next_learner_step=next_step,
        consumed_trajectories=consumed,
        pending_learner_groups=pending,
        group_states=states,
    )
