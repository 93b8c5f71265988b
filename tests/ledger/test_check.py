"""`loopline check`: passes on a clean run, names the rows of every corruption."""

from __future__ import annotations

import os
import uuid
import subprocess
import sys

import pytest
import sqlalchemy as sa

from loopline.store import ledger
from loopline.errors import LooplineError
from loopline.store.check import check_run
from loopline.types import SegmentRecord, TrajectoryRecord


def chained_trajectory(reward: float, seed: int) -> TrajectoryRecord:
    """Two turns where the second prompt extends the first, as the harness writes them."""
    first_prompt = [1, 2, 3, seed + 10]
    first = SegmentRecord("r0/", 0, "tok", first_prompt, [7, 8, 9], [1, 1, 1], [-0.1, -0.2, -0.3], "log_softmax(logits/T)")
    second_prompt = first_prompt + [7, 8, 9] + [40, 41]
    second = SegmentRecord("r1/", 0, "tok", second_prompt, [5, 6], [1, 1], [-0.5, -0.6], "log_softmax(logits/T)")
    return TrajectoryRecord("arithmetic", 1, "v1", "h1", reward, True, False, [first, second])


@pytest.fixture
def trained_run(db, run):
    """A run with one learner step over two groups of two."""
    ledger.plan_step(db, run.id, 1, ["a", "b"], group_size=2)
    leases = ledger.claim_slots(db, run.id, "w", 4, split="train")
    ledger.commit_trajectories(db, [(l.attempt_id, chained_trajectory(float(i % 2), i)) for i, l in enumerate(leases)])
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=2)
    ledger.commit_learner_step(db, batch, "file:///w1", "file:///c1", metrics={"logprob_abs_diff": 2e-7})
    return run


def _corrupt(db, sql, **params):
    db.execute(sa.text(sql), params)
    db.commit()


def test_clean_run_passes(db, trained_run):
    report = check_run(db, trained_run.id)
    assert report.ok, report.violations
    assert report.stats["consumed"] == 4 and report.stats["policy_versions"] == 2 and report.stats["attempts_ok"] == 4


CORRUPTIONS = [
    (1, "UPDATE segment SET rollout_logprobs[1] = 0.5 WHERE seq = 0 AND trajectory_id IN (SELECT id FROM trajectory WHERE run_id = :r)", "not finite log-probabilities"),
    (2, "UPDATE segment SET action_loss_mask[1] = 2 WHERE seq = 0 AND trajectory_id IN (SELECT id FROM trajectory WHERE run_id = :r)", "loss masks other than 0/1"),
    # (a segment stores the prompt after what the previous one holds: its stored prefix no longer matching it, or
    # the first segment's prompt changed under a later one, both break the chain the learner reads)
    (2, "UPDATE segment SET prompt_prefix_len = prompt_prefix_len - 1 WHERE seq = 1 AND trajectory_id IN (SELECT id FROM trajectory WHERE run_id = :r)", "re-tokenised"),
    (2, "UPDATE segment SET prompt_prefix_len = 0 WHERE seq = 1 AND trajectory_id IN (SELECT id FROM trajectory WHERE run_id = :r)", "re-tokenised"),
    (3, "DELETE FROM metric WHERE run_id = :r AND name = 'logprob_abs_diff'", "recorded no logprob gap"),
    (4, "UPDATE trajectory SET task_id = 'other' WHERE id = (SELECT id FROM trajectory WHERE run_id = :r LIMIT 1)", "mix samples of different tasks"),
    (5, "DELETE FROM consumption WHERE trajectory_id = (SELECT trajectory_id FROM consumption WHERE run_id = :r LIMIT 1)", "only partly trained"),
    (5, "DELETE FROM trajectory WHERE id = (SELECT t.id FROM trajectory t LEFT JOIN consumption c ON c.trajectory_id = t.id WHERE t.run_id = :r LIMIT 1)", "trajectory is missing"),
]


@pytest.mark.parametrize("invariant, sql, message", CORRUPTIONS)
def test_each_corruption_is_reported(db, trained_run, invariant, sql, message):
    _corrupt(db, sql, r=trained_run.id)
    report = check_run(db, trained_run.id)
    assert not report.ok
    assert any(v.invariant == invariant and message in v.message for v in report.violations), report.violations


def _set_gap_metrics(db, run_id, **values):
    for name, value in values.items():
        _corrupt(db, "DELETE FROM metric WHERE run_id = :r AND name = :n", r=run_id, n=name)
        _corrupt(db, "INSERT INTO metric (run_id, step, name, value) VALUES (:r, 1, :n, :v)", r=run_id, n=name, v=value)


def test_a_refused_episode_with_nothing_generated_is_stored_trained_on_as_a_zero_and_passes_check(db, run):
    """An agent program whose every call the endpoint refused (agent_program._refused): one segment, the task's
    prompt, nothing generated. Its group trains on the others' tokens with its 0 in the group's mean."""
    from loopline.pipeline.stages import load_sequences

    refused = TrajectoryRecord(
        "arithmetic", 1, "v1", "h1", 0.0, True, False, [SegmentRecord("r/refused/", 0, "tok", [1, 2, 3], [], [], [], "none: nothing was generated")],
        failure_type="task_failed",
    )
    ledger.plan_step(db, run.id, 1, ["a"], group_size=2)
    first, second = ledger.claim_slots(db, run.id, "w", 2, split="train")
    assert all(o.committed for o in ledger.commit_trajectories(db, [(first.attempt_id, refused), (second.attempt_id, chained_trajectory(1.0, 0))]))
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=1)
    sequences = load_sequences(db, batch.trajectory_ids)
    assert sorted(s.action_tokens for s in sequences) == [0, 5]
    ledger.commit_learner_step(db, batch, "file:///w1", "file:///c1", metrics={"logprob_abs_diff": 0.0})
    report = check_run(db, run.id)
    assert report.ok, report.violations


def test_a_trajectory_of_two_chains_is_stored_loaded_as_two_sequences_and_passes_check_only_where_marked(db, run):
    """Issue 48: an agent that rewrote its history made a second chain; it was discarded, it is kept now."""
    from dataclasses import replace

    from loopline.pipeline.stages import load_sequences

    first = chained_trajectory(1.0, 0)
    rewritten = SegmentRecord("r2/", 0, "tok", [1, 2, 99], [4], [1], [-0.4], "log_softmax(logits/T)", starts_chain=True)
    two_chains = replace(first, segments=[*first.segments, rewritten])
    ledger.plan_step(db, run.id, 1, ["a"], group_size=2)
    a, b = ledger.claim_slots(db, run.id, "w", 2, split="train")
    assert all(o.committed for o in ledger.commit_trajectories(db, [(a.attempt_id, two_chains), (b.attempt_id, chained_trajectory(0.0, 1))]))
    stored = db.execute(sa.text("SELECT seq, starts_chain FROM segment WHERE trajectory_id = (SELECT id FROM trajectory WHERE attempt_id = :a) ORDER BY seq"),
                        {"a": a.attempt_id}).all()
    db.rollback()
    assert [tuple(r) for r in stored] == [(0, False), (1, False), (2, True)]
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=1)
    sequences = load_sequences(db, batch.trajectory_ids)
    assert sorted((s.chain, s.action_tokens) for s in sequences) == [(0, 5), (0, 5), (1, 1)]
    assert check_run(db, run.id).ok
    # the same break where no segment was recorded as starting a chain: re-tokenised history, as before
    _corrupt(db, f"UPDATE segment SET starts_chain = false WHERE seq = 2 AND trajectory_id IN (SELECT id FROM trajectory WHERE run_id = '{run.id}')")  # (this run's alone)
    report = check_run(db, run.id)
    assert any("re-tokenised their history" in v.message for v in report.violations), report.violations
    with pytest.raises(LooplineError, match="does not extend segment 1"):
        ledger.commit_trajectories(db, [(b.attempt_id, replace(first, segments=[*first.segments, replace(rewritten, starts_chain=False)]))])


def test_gap_of_stale_samples_is_lag_not_a_violation(db, trained_run):
    """An async step whose samples all came from an older version: the gap is staleness, reported apart."""
    _set_gap_metrics(db, trained_run.id, logprob_abs_diff=0.0, logprob_gap_tokens=0.0, logprob_abs_diff_stale=0.03)
    assert check_run(db, trained_run.id).ok


def test_runs_in_a_pipe_keeps_each_run_on_one_line(database_url, db):
    """`loopline runs | grep NAME`: in a pipe Rich wrapped at 80 columns and split a long run name over two lines."""
    name = "r" + uuid.uuid4().hex + "-" + "x" * 60
    ledger.create_run(db, name, {"seed": 0}, "file:///weights/v0")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"LOOPLINE_DATABASE_URL": database_url}
    listed = subprocess.run([sys.executable, "-m", "loopline.cli", "runs"], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and any(line.split()[:2] == [name, "created"] for line in listed.stdout.splitlines()), listed.stdout


def test_gap_on_the_trained_versions_own_tokens_is_a_violation(db, trained_run):
    _set_gap_metrics(db, trained_run.id, logprob_abs_diff=0.05, logprob_gap_tokens=12.0, logprob_abs_diff_stale=0.0)
    report = check_run(db, trained_run.id)
    assert any(v.invariant == 3 and "gap above" in v.message for v in report.violations), report.violations


def test_cli_exits_nonzero_and_names_the_rows(database_url, db, trained_run):
    env = {**os.environ, "LOOPLINE_DATABASE_URL": database_url}
    ok = subprocess.run([sys.executable, "-m", "loopline.cli", "check", trained_run.name], env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "all invariants hold" in ok.stdout, ok.stdout + ok.stderr
    listed = subprocess.run([sys.executable, "-m", "loopline.cli", "runs"], env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=120)
    row = next(line for line in listed.stdout.splitlines() if line.strip().startswith(trained_run.name))
    assert row.split()[1:5] == ["created", "1", "1", "4"], listed.stdout  # status, learner step, version, consumed
    why = "OperationalError: (psycopg.errors.LockNotAvailable) canceling statement due to lock timeout; resume with loopline train --resume RUN"
    db.execute(sa.text("UPDATE run SET status = 'failed', status_reason = :w WHERE id = :r"), {"w": why, "r": trained_run.id})
    db.commit()
    narrow = subprocess.run([sys.executable, "-m", "loopline.cli", "runs"], env={**env, "COLUMNS": "80"}, capture_output=True, text=True, timeout=120)
    db.execute(sa.text("UPDATE run SET status = 'created', status_reason = NULL WHERE id = :r"), {"r": trained_run.id})
    db.commit()
    assert "…" not in narrow.stdout and max(len(line) for line in narrow.stdout.splitlines()) <= 80, narrow.stdout  # nothing cut
    assert f"{trained_run.name}: failed: {why}" in " ".join(narrow.stdout.split()), narrow.stdout  # the reason in full, wrapped
    number, sql, _ = next(c for c in CORRUPTIONS if c[2] == "only partly trained")
    _corrupt(db, sql, r=trained_run.id)
    bad = subprocess.run([sys.executable, "-m", "loopline.cli", "check", str(trained_run.id)], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "only partly trained" in bad.stdout
    from loopline.store.check import INVARIANTS

    said = " ".join(bad.stdout.split())
    assert f"invariant {number} ({INVARIANTS[number]}):" in said, bad.stdout  # what the invariant means, in the user's words
    groups = {str(g) for g in db.execute(sa.text("SELECT group_id FROM trajectory WHERE run_id = :r"), {"r": trained_run.id}).scalars()}
    db.rollback()
    assert any(f"    {g}" in bad.stdout for g in groups)  # the offending group is named


def test_eval_of_a_measured_version_is_read_back_without_prefect_or_torch(database_url, db, trained_run):
    from loopline.store import ledger

    ledger.record_eval_result(db, trained_run.id, 1, "arithmetic", 1, 4, 3)
    probe = (
        "import sys\nfrom loopline.cli import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as exit:\n"
        "    print('exit', exit.code, 'torch' in sys.modules, 'prefect' in sys.modules)"
    )
    env = {**os.environ, "LOOPLINE_DATABASE_URL": database_url}
    run = lambda *args: subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120, env=env)  # noqa: E731
    done = run("eval", trained_run.name, "--version", "1")
    assert f"run {trained_run.name} v1: held-out success 75.0% on 4 tasks (measured before)" in done.stdout, done.stdout + done.stderr
    assert done.stdout.split()[-4:] == ["exit", "0", "False", "False"], done.stdout
    missing = run("eval", trained_run.name, "--version", "9")
    assert missing.stderr.strip() == f"error: run {trained_run.name} has no policy version 9; its versions are 0 to 1", missing.stderr


def test_eval_of_an_unknown_run_is_one_line_before_torch_or_prefect_load(database_url):
    probe = (
        "import sys\nfrom loopline.cli import app\ntry:\n    app(['eval', 'no-such-run'])\nexcept SystemExit as exit:\n"
        "    print('exit', exit.code, 'torch' in sys.modules, 'prefect' in sys.modules)"
    )
    env = {**os.environ, "LOOPLINE_DATABASE_URL": database_url}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.stderr.strip() == "error: no run named 'no-such-run'; `loopline runs` lists them", done.stderr
    assert done.stdout.split() == ["exit", "1", "False", "False"], done.stdout
