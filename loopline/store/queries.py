"""Read-only summaries of runs for the CLI's progress and listings (no writes, one short read each)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from sqlmodel import Session

from loopline import holder
from loopline.store import _sql
from loopline.types import LEASE_SECONDS


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
    status: str  # as stored, except 'stale': stored 'running', but its driving process is gone or silent
    created_at: datetime
    learner_step: int
    policy_version: int
    consumed: int
    first_eval: float | None
    last_eval: float | None
    reason: str | None  # why it stopped (or why it is stale)
    parent: str | None  # the run it was forked from, `NAME@vN`


HEARTBEAT_S = 5.0  # how often a run's driving process says it is alive


def run_lease(run: str = "") -> str:
    """SQL for a run's lease_seconds, in its stored config's layout (under `rollout:`, or at the top level as
    configs stored before sections have it), else the default: `run` is the run table's alias, if any."""
    config = f"{run}.config" if run else "config"
    return f"coalesce(({config}->'rollout'->>'lease_seconds')::float, ({config}->>'lease_seconds')::float, {LEASE_SECONDS})"


def shown_status(status: str, holder_name: str | None, silent_s: float | None, lease_seconds: float) -> tuple[str, str | None]:
    """A stored 'running' whose driving process is gone (this host: its pid is dead) or has not written for
    the lease time (any host) is shown as 'stale', with why: a SIGKILLed process cannot say it stopped."""
    if status != "running":
        return status, None
    if holder.is_dead(holder_name):
        return "stale", f"its process ({holder_name}) is gone"
    if silent_s is None or silent_s > max(lease_seconds, 3 * HEARTBEAT_S):
        return "stale", f"no sign of life from {holder_name or 'its process'} for {silent_s or 0:.0f} s"
    return status, None


def run_progress(session: Session, run_id: uuid.UUID) -> RunProgress:
    row = _sql.one_row(
        session,
        "SELECT (SELECT coalesce(max(learner_step), 0) FROM policy_version WHERE run_id = :r) AS step, "
        "(SELECT coalesce(max(version), 0) FROM policy_version WHERE run_id = :r) AS version, "
        "(SELECT count(*) FROM trajectory WHERE run_id = :r AND split = 'train') AS trajectories",
        r=run_id,
    )
    metrics = dict(_sql.rows(
        session, "SELECT name, value FROM metric WHERE run_id = :r AND step = :k AND name IN ('reward_mean', 'version_lag_mean')",
        r=run_id, k=row.step,
    ))
    last_eval = _sql.first_row(
        session, "SELECT policy_version, success_rate FROM eval_result WHERE run_id = :r ORDER BY policy_version DESC LIMIT 1", r=run_id
    )
    return RunProgress(
        row.step, row.version, row.trajectories, metrics.get("reward_mean"), metrics.get("version_lag_mean"),
        last_eval.policy_version if last_eval else None, last_eval.success_rate if last_eval else None,
    )


def list_runs(session: Session) -> list[RunSummary]:
    rows = _sql.rows(
        session,
        "SELECT r.name, r.id, r.status, r.created_at, r.status_reason, r.holder, "
        f"extract(epoch FROM now() - r.heartbeat_at) AS silent_s, {run_lease('r')} AS lease, "
        "r.config->'forked_from'->>'run' AS parent, r.config->'forked_from'->>'policy_version' AS parent_version, "
        "(SELECT coalesce(max(learner_step), 0) FROM policy_version p WHERE p.run_id = r.id) AS step, "
        "(SELECT coalesce(max(version), 0) FROM policy_version p WHERE p.run_id = r.id) AS version, "
        "(SELECT count(*) FROM consumption c WHERE c.run_id = r.id) AS consumed, "
        "(SELECT success_rate FROM eval_result e WHERE e.run_id = r.id ORDER BY policy_version LIMIT 1) AS first_eval, "
        "(SELECT success_rate FROM eval_result e WHERE e.run_id = r.id ORDER BY policy_version DESC LIMIT 1) AS last_eval "
        "FROM run r ORDER BY r.created_at",
    )
    out = []
    for r in rows:
        silent = float(r.silent_s) if r.silent_s is not None else None
        status, stale = shown_status(r.status, r.holder, silent, float(r.lease))
        parent = f"{r.parent}@v{r.parent_version}" if r.parent else None
        out.append(RunSummary(
            r.name, r.id, status, r.created_at, r.step, r.version, r.consumed, r.first_eval, r.last_eval, stale or r.status_reason, parent,
        ))
    return out


def metrics_after(session: Session, run_id: uuid.UUID, after: int, upto: int | None = None) -> dict[int, dict[str, float]]:
    """Every metric of the learner steps after `after` (to `upto`), by step in order: what a tracker lacks."""
    rows = _sql.rows(
        session,
        "SELECT step, name, value FROM metric WHERE run_id = :r AND step > :a AND (CAST(:u AS integer) IS NULL OR step <= :u) "
        "ORDER BY step, name",
        r=run_id, a=after, u=upto,
    )
    steps: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        steps.setdefault(step, {})[name] = float(value)
    return steps


class EvalRow(NamedTuple):
    version: int
    tasks: int
    success: float  # held-out success rate
    seconds: float | None  # the evaluation's wall time (not recorded before loopline stored it)


def eval_results(session: Session, run_id: uuid.UUID) -> list[EvalRow]:
    """Each evaluation of the run, in version order."""
    rows = _sql.rows(
        session,
        "SELECT policy_version, n_tasks, success_rate, (details->>'seconds')::float8 FROM eval_result WHERE run_id = :r ORDER BY policy_version",
        r=run_id,
    )
    return [EvalRow(*r) for r in rows]
