"""Read-only summaries of runs for the CLI's progress and listings (no writes, one short read each)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session


@dataclass(frozen=True)
class RunProgress:
    learner_step: int
    policy_version: int
    trajectories: int  # committed train trajectories
    reward_mean: float | None  # of the last trained batch
    version_lag_mean: float | None
    eval_version: int | None  # the newest evaluated version and its held-out success
    eval_success: float | None


@dataclass(frozen=True)
class RunSummary:
    name: str
    id: uuid.UUID
    status: str
    created_at: datetime
    learner_step: int
    policy_version: int
    consumed: int
    first_eval: float | None
    last_eval: float | None


def run_progress(session: Session, run_id: uuid.UUID) -> RunProgress:
    row = session.execute(
        sa.text(
            "SELECT (SELECT coalesce(max(learner_step), 0) FROM checkpoint WHERE run_id = :r) AS step, "
            "(SELECT coalesce(max(version), 0) FROM policy_version WHERE run_id = :r) AS version, "
            "(SELECT count(*) FROM trajectory WHERE run_id = :r AND split = 'train') AS trajectories"
        ),
        {"r": run_id},
    ).one()
    metrics = dict(
        session.execute(
            sa.text(
                "SELECT name, value FROM metric WHERE run_id = :r AND step = :k "
                "AND name IN ('reward_mean', 'version_lag_mean')"
            ),
            {"r": run_id, "k": row.step},
        ).all()
    )
    last_eval = session.execute(
        sa.text("SELECT policy_version, success_rate FROM eval_result WHERE run_id = :r ORDER BY policy_version DESC LIMIT 1"),
        {"r": run_id},
    ).first()
    session.rollback()
    return RunProgress(
        row.step, row.version, row.trajectories, metrics.get("reward_mean"), metrics.get("version_lag_mean"),
        last_eval.policy_version if last_eval else None, last_eval.success_rate if last_eval else None,
    )


def list_runs(session: Session) -> list[RunSummary]:
    rows = session.execute(
        sa.text(
            "SELECT r.name, r.id, r.status, r.created_at, "
            "(SELECT coalesce(max(learner_step), 0) FROM checkpoint c WHERE c.run_id = r.id) AS step, "
            "(SELECT coalesce(max(version), 0) FROM policy_version p WHERE p.run_id = r.id) AS version, "
            "(SELECT count(*) FROM consumption c WHERE c.run_id = r.id) AS consumed, "
            "(SELECT success_rate FROM eval_result e WHERE e.run_id = r.id ORDER BY policy_version LIMIT 1) AS first_eval, "
            "(SELECT success_rate FROM eval_result e WHERE e.run_id = r.id ORDER BY policy_version DESC LIMIT 1) AS last_eval "
            "FROM run r ORDER BY r.created_at"
        )
    ).all()
    session.rollback()
    return [RunSummary(*r) for r in rows]


def eval_results(session: Session, run_id: uuid.UUID) -> list[tuple[int, int, float]]:
    """(policy version, tasks, held-out success) in version order."""
    rows = session.execute(
        sa.text("SELECT policy_version, n_tasks, success_rate FROM eval_result WHERE run_id = :r ORDER BY policy_version"),
        {"r": run_id},
    ).all()
    session.rollback()
    return [tuple(r) for r in rows]
