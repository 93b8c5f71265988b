"""`loopline check RUN`: six invariants of a run's ledger (INVARIANTS), verified on its rows.

Some invariants are also database constraints (one trajectory per slot, one
consumption per trajectory, no eval consumption); they are checked here too,
because a ledger can be restored from a dump, edited by hand, or written by an
older version. Each violation names the rows involved.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

from sqlmodel import Session

from loopline.store._sql import q
from loopline.store.prompts import StoredPromptBroken, decode

# What each invariant promises (DESIGN.md's list, as users read it in `loopline check`).
INVARIANTS = {
    1: "every trained action token is the token the engine generated, with the engine's logprob and its semantics named",
    2: "only generated action tokens are trained (loss mask 1); prompt, tool output and padding have mask 0",
    3: "with equal weights the learner's recomputed logprobs match the rollout's (the gap is recorded each step)",
    4: "a group holds samples of one task, of the configured size; groups without reward variance are flagged",
    5: "after any resume nothing is trained twice, nothing committed is lost, and eval tasks are never trained",
    6: "the report shows held-out success, cost and failure classes, not only training reward",
}

LOGPROB_GAP_TOLERANCE = 1e-2  # mean |recomputed - rollout| per step above this is reported (invariant 3)
CHECK_TRAJECTORIES = 64  # read per statement: a run's segments a few at a time


@dataclass(frozen=True)
class Violation:
    invariant: int
    message: str
    ids: tuple[str, ...] = ()


@dataclass
class CheckReport:
    run_id: uuid.UUID
    violations: list[Violation] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, invariant: int, message: str, ids=()) -> None:
        self.violations.append(Violation(invariant, message, tuple(str(i) for i in list(ids)[:10])))


def _rows(session: Session, sql: str, **params):
    return q(session, sql, **params).all()  # inside check_run's one transaction: every check sees one snapshot

# (invariant, what the offending rows are, a query returning their ids): each row found is a violation.
GROUP_OFFENDERS = (
    (4, "groups mix samples of different tasks",
     "SELECT g.id FROM rollout_group g JOIN trajectory t ON t.group_id = g.id WHERE g.run_id = :r "
     "GROUP BY g.id HAVING count(DISTINCT t.task_id) > 1 OR bool_or(t.task_id <> g.task_id)"),
    (4, "groups were handed to the learner without all their samples",
     "SELECT g.id FROM rollout_group g LEFT JOIN trajectory t ON t.group_id = g.id WHERE g.run_id = :r "
     "AND g.state IN ('complete', 'claimed', 'consumed') GROUP BY g.id, g.size HAVING count(t.id) <> g.size"),
)
EXACTLY_ONCE_OFFENDERS = (
    (5, "trajectories were consumed more than once",
     "SELECT trajectory_id FROM consumption WHERE run_id = :r GROUP BY trajectory_id HAVING count(*) > 1"),
    (5, "eval trajectories were trained on",
     "SELECT c.trajectory_id FROM consumption c JOIN trajectory t ON t.id = c.trajectory_id "
     "WHERE c.run_id = :r AND t.split <> 'train'"),
    (5, "consumed groups were only partly trained",
     "SELECT t.group_id FROM trajectory t JOIN rollout_group g ON g.id = t.group_id "
     "LEFT JOIN consumption c ON c.trajectory_id = t.id AND c.run_id = t.run_id "
     "WHERE t.run_id = :r AND g.state = 'consumed' GROUP BY t.group_id HAVING count(c.trajectory_id) <> count(t.id)"),
    (5, "trajectories were consumed outside a consumed group",
     "SELECT c.trajectory_id FROM consumption c JOIN trajectory t ON t.id = c.trajectory_id "
     "JOIN rollout_group g ON g.id = t.group_id WHERE c.run_id = :r AND g.state <> 'consumed'"),
    (5, "slots are done but their trajectory is missing",
     "SELECT s.id FROM slot s LEFT JOIN trajectory t ON t.slot_id = s.id WHERE s.run_id = :r AND s.state = 'done' "
     "AND t.id IS NULL"),
    (5, "consumptions name a policy version other than the one their step trained",
     "SELECT c.trajectory_id FROM consumption c JOIN policy_version p ON p.run_id = c.run_id AND p.learner_step = c.learner_step "
     "WHERE c.run_id = :r AND c.policy_version <> p.version - 1"),
)


def _offenders(session: Session, run_id: uuid.UUID, report: CheckReport, checks) -> None:
    for invariant, what, sql in checks:
        ids = [row[0] for row in _rows(session, sql, r=run_id)]
        if ids:
            report.add(invariant, f"{len(ids)} {what}", ids)


def check_run(session: Session, run_id: uuid.UUID) -> CheckReport:
    report = CheckReport(run_id)
    try:
        _tokens_and_masks(session, run_id, report)
        _logprob_gap(session, run_id, report)
        _groups(session, run_id, report)
        _exactly_once(session, run_id, report)
        _reporting(session, run_id, report)
    finally:
        session.rollback()
    return report


def _tokens_and_masks(session: Session, run_id: uuid.UUID, report: CheckReport) -> None:
    """1: recorded logprobs are real logprobs with named semantics; 2: masks are 0/1 on generated tokens only,
    and each trajectory's segments are prefix chains, broken only where a segment was recorded as starting a
    chain (tool output and prompts only ever appear as context)."""
    bad_logprobs, unnamed, bad_masks, broken_chains = set(), set(), set(), set()
    trajectories = [r.id for r in _rows(session, "SELECT id FROM trajectory WHERE run_id = :r ORDER BY id", r=run_id)]
    segments = 0
    for at in range(0, len(trajectories), CHECK_TRAJECTORIES):
        by_trajectory: dict[uuid.UUID, list] = {}
        for row in _rows(
            session,
            "SELECT trajectory_id, seq, prompt_ids, prompt_prefix_len, prompt_copies, generated_ids, action_loss_mask, "
            "rollout_logprobs::float8[] AS rollout_logprobs, logprob_semantics, starts_chain FROM segment "
            "WHERE trajectory_id = ANY(:t) ORDER BY trajectory_id, seq",
            t=trajectories[at : at + CHECK_TRAJECTORIES],
        ):
            if any(not math.isfinite(x) or x > 1e-6 for x in row.rollout_logprobs):
                bad_logprobs.add(row.trajectory_id)
            if not row.logprob_semantics:
                unnamed.add(row.trajectory_id)
            if any(m not in (0, 1) for m in row.action_loss_mask) or len(row.action_loss_mask) != len(row.generated_ids):
                bad_masks.add(row.trajectory_id)
            by_trajectory.setdefault(row.trajectory_id, []).append(row)
            segments += 1
        for trajectory_id, rows in by_trajectory.items():  # each prompt rebuilt as the learner rebuilds it
            try:
                decode(rows)
            except StoredPromptBroken:
                broken_chains.add(trajectory_id)
    if bad_logprobs:
        report.add(1, f"{len(bad_logprobs)} trajectories hold logprobs that are not finite log-probabilities (> 0 or NaN)", bad_logprobs)
    if unnamed:
        report.add(1, f"{len(unnamed)} trajectories do not name their logprob semantics", unnamed)
    if bad_masks:
        report.add(2, f"{len(bad_masks)} trajectories have loss masks other than 0/1 over their generated tokens", bad_masks)
    if broken_chains:
        report.add(2, f"{len(broken_chains)} trajectories re-tokenised their history (a segment does not extend the previous one)", broken_chains)
    report.stats["segments"] = segments


def _logprob_gap(session: Session, run_id: uuid.UUID, report: CheckReport) -> None:
    """3: every learner step recorded the rollout-vs-recomputed logprob gap, and it is small.

    The gap is measured on the tokens generated by the very weights being trained (metric
    `logprob_gap_tokens` counts them): there the two must agree. Samples of older versions (async
    staleness) differ by design; their gap is recorded as `logprob_abs_diff_stale`, not judged.
    """
    steps = [r.learner_step for r in _rows(session, "SELECT learner_step FROM policy_version WHERE run_id = :r AND version > 0", r=run_id)]
    metrics: dict[int, dict[str, float]] = {}
    for step, name, value in _rows(
        session,
        "SELECT step, name, value FROM metric WHERE run_id = :r AND name IN ('logprob_abs_diff', 'logprob_gap_tokens')",
        r=run_id,
    ):
        metrics.setdefault(step, {})[name] = value
    gaps = {s: m["logprob_abs_diff"] for s, m in metrics.items() if "logprob_abs_diff" in m}
    missing = [s for s in steps if s not in gaps]
    if missing:
        report.add(3, f"{len(missing)} learner steps recorded no logprob gap (metric logprob_abs_diff)", missing)
    judged = {s: g for s, g in gaps.items() if metrics[s].get("logprob_gap_tokens", 1.0) > 0}
    large = [s for s, g in judged.items() if g > LOGPROB_GAP_TOLERANCE]
    if large:
        report.add(3, f"{len(large)} learner steps had a mean logprob gap above {LOGPROB_GAP_TOLERANCE:g}", large)
    report.stats["max_logprob_gap"] = max(judged.values(), default=0.0)


def _groups(session: Session, run_id: uuid.UUID, report: CheckReport) -> None:
    """4: a group holds samples of one task, complete before training; zero-variance groups are counted."""
    _offenders(session, run_id, report, GROUP_OFFENDERS)
    degenerate = _rows(
        session,
        "SELECT g.id FROM rollout_group g JOIN trajectory t ON t.group_id = g.id WHERE g.run_id = :r "
        "AND g.state = 'consumed' GROUP BY g.id HAVING count(DISTINCT t.reward) = 1",
        r=run_id,
    )
    report.stats["degenerate_groups_trained"] = len(degenerate)


def _exactly_once(session: Session, run_id: uuid.UUID, report: CheckReport) -> None:
    """5: nothing consumed twice or partially, nothing committed lost, no eval trained, versions monotonic."""
    _offenders(session, run_id, report, EXACTLY_ONCE_OFFENDERS)
    versions = [r.version for r in _rows(session, "SELECT version FROM policy_version WHERE run_id = :r ORDER BY version", r=run_id)]
    if versions != list(range(len(versions))):
        report.add(5, f"policy versions are not 0..{len(versions) - 1} without gaps: {versions[:12]}")
    steps = [r.learner_step for r in _rows(session, "SELECT learner_step FROM policy_version WHERE run_id = :r AND version > 0 ORDER BY learner_step", r=run_id)]
    if steps != list(range(1, len(steps) + 1)):
        report.add(5, f"learner steps are not 1..{len(steps)} without gaps: {steps[:12]}")
    report.stats["trajectories"] = _rows(session, "SELECT count(*) FROM trajectory WHERE run_id = :r", r=run_id)[0][0]
    report.stats["consumed"] = _rows(session, "SELECT count(*) FROM consumption WHERE run_id = :r", r=run_id)[0][0]
    report.stats["policy_versions"] = len(versions)


def _reporting(session: Session, run_id: uuid.UUID, report: CheckReport) -> None:
    """6: failure classes and eval results are on record, not only training reward."""
    classes = dict(
        _rows(session, "SELECT status, count(*) FROM attempt WHERE run_id = :r GROUP BY status", r=run_id)
    )
    for status in ("ok", "task_failed", "infra_failed", "cancelled"):
        report.stats[f"attempts_{status}"] = classes.get(status, 0)
    truncated = _rows(session, "SELECT count(*) FROM trajectory WHERE run_id = :r AND truncated", r=run_id)[0][0]
    report.stats["truncated"] = truncated
    for reason, n in _rows(
        session,
        "SELECT drop_reason, count(*) FROM rollout_group WHERE run_id = :r AND state = 'dropped' GROUP BY drop_reason",
        r=run_id,
    ):
        report.stats[f"groups_dropped_{reason}"] = n
    report.stats["eval_results"] = _rows(session, "SELECT count(*) FROM eval_result WHERE run_id = :r", r=run_id)[0][0]
    # a resume that went on from rebuilt weights differing from the recorded ones (not bit-exact: a GPU)
    report.stats["weight_rebuilds"] = _rows(session, "SELECT count(*) FROM weight_rebuild WHERE run_id = :r", r=run_id)[0][0]
