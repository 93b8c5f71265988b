"""Ledger operations in one process: planning, leases, commits, infra retries, learner steps, resume."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from loopline import holder
from loopline.store import ledger, queries, records
from loopline.store.db import session as new_session
from loopline.errors import LooplineError
from loopline.store.errors import LedgerConflict
from tests.factories import segment, trajectory


def _complete_step(db, run, step=1, tasks=("t0", "t1"), group_size=2, split="train", reward=1.0, version=0):
    """Plan a step and commit every slot of it; returns the group ids."""
    groups = ledger.plan_step(db, run.id, step, list(tasks), group_size, split=split)
    leases = ledger.claim_slots(db, run.id, "w", 100, split=split)
    outcomes = ledger.commit_trajectories(
        db, [(lease.attempt_id, trajectory(reward, version=version, seed=i)) for i, lease in enumerate(leases)]
    )
    assert all(o.committed for o in outcomes)
    return groups


def _scalar(db, sql, **params):
    value = db.execute(sa.text(sql), params).scalar_one()
    db.rollback()
    return value


# --------------------------------------------------------------------------- planning


def test_plan_step_is_idempotent_and_deterministic(db, run):
    first = ledger.plan_step(db, run.id, 1, ["a", "b", "c"], group_size=4)
    again = ledger.plan_step(db, run.id, 1, ["a", "b", "c"], group_size=4)
    assert first == again
    assert first[0] == ledger.group_id_for(run.id, "train", 1, 0)
    assert _scalar(db, "SELECT count(*) FROM slot WHERE run_id = :r", r=run.id) == 12
    assert _scalar(db, "SELECT count(*) FROM rollout_group WHERE run_id = :r", r=run.id) == 3


def test_replanning_a_step_with_other_tasks_is_refused(db, run):
    ledger.plan_step(db, run.id, 1, ["a", "b"], group_size=2)
    with pytest.raises(LedgerConflict, match="already planned"):
        ledger.plan_step(db, run.id, 1, ["a", "x"], group_size=2)
    with pytest.raises(LedgerConflict):
        ledger.plan_step(db, run.id, 1, ["a", "b"], group_size=3)


def test_run_names_are_unique_per_config(db, run):
    assert ledger.create_run(db, run.name, {"seed": 0}, "file:///w").id == run.id
    with pytest.raises(LedgerConflict, match="different config"):
        ledger.create_run(db, run.name, {"seed": 1}, "file:///w")


# --------------------------------------------------------------------------- leases


def test_claims_lease_each_slot_once_and_open_attempts(db, run):
    ledger.plan_step(db, run.id, 1, ["a", "b"], group_size=3)
    first = ledger.claim_slots(db, run.id, "w1", 4, split="train")
    second = ledger.claim_slots(db, run.id, "w2", 4, split="train")
    assert len(first) == 4 and len(second) == 2
    assert not {l.slot_id for l in first} & {l.slot_id for l in second}
    assert ledger.claim_slots(db, run.id, "w3", 4, split="train") == []
    # samples of one group are handed out together (group integrity starts at the claim)
    assert [l.sample_index for l in first[:3]] == [0, 1, 2] and len({l.group_id for l in first[:3]}) == 1
    assert [l.task_id for l in first + second] == ["a"] * 3 + ["b"] * 3  # groups in plan order (FIFO)
    assert _scalar(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND status = 'running'", r=run.id) == 6


def test_expired_lease_is_retried_with_a_new_attempt(db, run):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (old,) = ledger.claim_slots(db, run.id, "dead", 1, split="train", lease_seconds=0.2)
    assert ledger.claim_slots(db, run.id, "w2", 1, split="train") == []  # still leased
    time.sleep(0.4)
    assert ledger.renew_leases(db, [old.attempt_id]) == {old.attempt_id}  # lost
    (new,) = ledger.claim_slots(db, run.id, "w2", 1, split="train")
    assert new.slot_id == old.slot_id and new.attempt_id != old.attempt_id
    # a renewal that races the new attempt's commit finds it committed, not lost (it once cancelled the episode)
    assert ledger.commit_trajectory(db, new.attempt_id, trajectory(1.0)).committed
    assert ledger.renew_leases(db, [new.attempt_id, old.attempt_id]) == {old.attempt_id}
    status, error = db.execute(
        sa.text("SELECT status, error_class FROM attempt WHERE id = :a"), {"a": old.attempt_id}
    ).one()
    assert (status, error) == ("infra_failed", "LeaseExpired")
    # the holder vanished, the environment did not fail: not counted toward max_attempts
    assert _scalar(db, "SELECT infra_failures FROM slot WHERE id = :s", s=old.slot_id) == 0


def test_crashed_holders_never_drop_a_group(db, run):
    """A trainer killed again and again (here: more often than max_attempts) loses no slot and no group."""
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1, max_attempts=2)
    for _ in range(4):
        (lease,) = ledger.claim_slots(db, run.id, "host:1:1", 1, split="train")
        assert ledger.expire_leases(db, run.id, dead_holders=["host:1:1"]) == 1  # at once, not at expiry
    assert ledger.group_states(db, run.id) == {"open": 1}
    assert ledger.unfinished_slots(db, run.id, "train") == 1
    errors = db.execute(sa.text("SELECT error_class FROM attempt WHERE run_id = :r"), {"r": run.id}).scalars().all()
    db.rollback()
    assert errors == ["HolderDied"] * 4


def test_a_dead_process_on_this_host_is_a_dead_holder(tmp_path):
    child = subprocess.run(
        [sys.executable, "-c", "from loopline import holder; print(holder.this_process())"], capture_output=True, text=True, check=True
    )
    gone = child.stdout.strip()
    assert holder.is_dead(gone) and not holder.is_dead(holder.this_process())
    assert not holder.is_dead("another-host:1:1") and not holder.is_dead("legacy-worker-name")
    host, pid, _ = holder.this_process().split(":")
    assert holder.is_dead(f"{host}:{pid}:1")  # same pid, another start time: the pid was reused


def test_renewed_leases_are_not_reclaimed(db, run):
    ledger.plan_step(db, run.id, 1, ["a", "b"], group_size=2)
    leases = ledger.claim_slots(db, run.id, "w", 3, split="train", lease_seconds=0.3)
    for _ in range(3):  # a worker's leases, renewed in one statement
        time.sleep(0.15)
        assert ledger.renew_leases(db, [l.attempt_id for l in leases], lease_seconds=0.3) == set()
    (other,) = ledger.claim_slots(db, run.id, "w2", 2, split="train")  # only the slot nobody held
    assert other.slot_id not in {l.slot_id for l in leases}
    assert ledger.expire_leases(db, run.id) == 0 and ledger.lease_holders(db, run.id) == ["w", "w2"]


# --------------------------------------------------------------------------- commits


def test_commit_stores_segments_token_exact(db, run):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    spans = [{"version": 0, "start": 0, "end": 2}, {"version": 1, "start": 2, "end": 4}]
    first = segment(seed=1, action_loss_mask=[1, 1, 0, 1])
    segs = [first, segment(seed=2, version=0, version_spans=spans, after=first)]
    outcome = ledger.commit_trajectory(db, lease.attempt_id, trajectory(0.5, segments=segs))
    assert outcome.committed
    rows = db.execute(
        sa.text(
            "SELECT seq, prompt_ids, prompt_prefix_len, prompt_copies, starts_chain, generated_ids, action_loss_mask, rollout_logprobs::float8[] AS rollout_logprobs, version_spans, tool_events "
            "FROM segment WHERE trajectory_id = :t ORDER BY seq"
        ),
        {"t": outcome.trajectory_id},
    ).all()
    # issue 49: the second segment stores only what follows the first's prompt and generation
    head = len(first.prompt_ids) + len(first.generated_ids)
    assert [(r.prompt_prefix_len, len(r.prompt_ids)) for r in rows] == [(0, len(first.prompt_ids)), (head, len(segs[1].prompt_ids) - head)]
    assert ledger.whole_prompts(rows) == [list(s.prompt_ids) for s in segs]
    (loaded,) = ledger.load_trajectories(db, [outcome.trajectory_id])
    assert [list(s.prompt_ids) for s in loaded.segments] == [list(s.prompt_ids) for s in segs]
    for row, seg in zip(rows, segs):
        assert row.generated_ids == list(seg.generated_ids)
        assert row.action_loss_mask == list(seg.action_loss_mask)
        assert row.rollout_logprobs == list(seg.rollout_logprobs)  # float4, bit-exact for the float32 values engines give
        assert row.tool_events == list(seg.tool_events)
    assert rows[1].version_spans == spans
    vmin, vmax, status = db.execute(
        sa.text(
            "SELECT t.policy_version_min, t.policy_version_max, a.status FROM trajectory t "
            "JOIN attempt a ON a.id = t.attempt_id WHERE t.id = :t"
        ),
        {"t": outcome.trajectory_id},
    ).one()
    assert (vmin, vmax, status) == (0, 1, "ok")


@pytest.mark.parametrize("method", ["copy", "copy_lists", "executemany"])
def test_a_float64_logprob_is_stored_as_the_nearest_float32_by_every_bulk_path(db, run, method):
    """The ledger stores logprobs as float4 (what engines compute and the trainer holds): -0.1 is not a float32."""
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    seg = segment(n_gen=3, rollout_logprobs=[-0.1, -1e-50, -3.0])
    outcome = ledger.commit_trajectory(db, lease.attempt_id, trajectory(segments=[seg]), method=method)
    stored = db.execute(sa.text("SELECT rollout_logprobs::float8[] FROM segment WHERE trajectory_id = :t"), {"t": outcome.trajectory_id}).scalar_one()
    assert stored == [-0.10000000149011612, -0.0, -3.0]


@pytest.mark.parametrize("method", ["copy", "copy_lists", "executemany"])
def test_nul_characters_from_tools_are_stored_and_read_back_exactly(db, run, method):
    """PostgreSQL holds no NUL in text or jsonb; `cat` of a binary file and some tokenizers produce one."""
    from loopline.store import views

    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    events = [{"tool": "run", "args": {"cmd": "cat /bin/true"}, "output": "\x7fELF\x02\x01\x01\x00\x00"}, {"\u2400": ["looks", "encoded"]}]
    seg = segment(seed=1, tool_events=events)
    outcome = ledger.commit_trajectory(db, lease.attempt_id, trajectory(0.0, segments=[seg], info={"answer": "a\x00b"}), method=method)
    assert outcome.committed
    with db.connection() as conn:
        assert [s["tool_events"] for s in views.segments(conn, outcome.trajectory_id)] == [events]
        assert views.trajectory(conn, outcome.trajectory_id)["info"] == {"answer": "a\x00b"}


@pytest.mark.parametrize("method", ["copy", "copy_lists", "executemany"])
def test_every_bulk_path_writes_the_same_rows(db, run, method):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    traj = trajectory(1.0, n_segments=3)
    outcome = ledger.commit_trajectory(db, lease.attempt_id, traj, method=method)
    stored = db.execute(
        sa.text("SELECT prompt_prefix_len, prompt_ids, generated_ids, action_loss_mask, rollout_logprobs::float8[] AS rollout_logprobs FROM segment "
                "WHERE trajectory_id = :t ORDER BY seq"),
        {"t": outcome.trajectory_id},
    ).all()
    assert [tuple(r) for r in stored] == [
        (r.prompt_prefix_len, list(s.prompt_ids[r.prompt_prefix_len:]), list(s.generated_ids), list(s.action_loss_mask), list(s.rollout_logprobs))
        for r, s in zip(stored, traj.segments)
    ]
    assert [r.prompt_prefix_len for r in stored][1:] == [len(s.prompt_ids) + len(s.generated_ids) for s in traj.segments[:-1]]


def test_misaligned_segment_is_refused_before_and_by_the_database(db, run):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    bad = segment(n_gen=4, action_loss_mask=[1, 1, 1])
    with pytest.raises(LooplineError, match="same length"):
        ledger.commit_trajectory(db, lease.attempt_id, trajectory(segments=[bad]))
    outcome = ledger.commit_trajectory(db, lease.attempt_id, trajectory())
    with pytest.raises(IntegrityError, match="ck_segment_lengths"):
        db.execute(
            sa.text(
                "INSERT INTO segment (trajectory_id, seq, request_id, policy_version, tokenizer_version, prompt_ids, "
                "generated_ids, action_loss_mask, rollout_logprobs, logprob_semantics) "
                "VALUES (:t, 9, 'r', 0, 'tok', '{1}', '{1,2}', '{1}', '{-0.1,-0.2}', 'x')"
            ),
            {"t": outcome.trajectory_id},
        )
    db.rollback()


def test_second_attempt_at_a_committed_slot_is_refused(db, run):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (slow,) = ledger.claim_slots(db, run.id, "slow", 1, split="train", lease_seconds=0.1)
    time.sleep(0.3)
    (fast,) = ledger.claim_slots(db, run.id, "fast", 1, split="train")
    assert ledger.commit_trajectory(db, fast.attempt_id, trajectory(1.0)).committed
    late = ledger.commit_trajectory(db, slow.attempt_id, trajectory(0.0))
    assert not late.committed and "already" in late.reason
    assert _scalar(db, "SELECT count(*) FROM trajectory WHERE slot_id = :s", s=slow.slot_id) == 1
    assert _scalar(db, "SELECT reward FROM trajectory WHERE slot_id = :s", s=slow.slot_id) == 1.0


def test_an_attempt_whose_slot_another_holds_now_cannot_commit(db, run):
    """A worker frozen past its lease wakes and commits: refused while the retry holds the slot; with nobody
    holding it, the expired attempt's trajectory is still taken."""
    ledger.plan_step(db, run.id, 1, ["a", "b"], group_size=1)
    frozen = ledger.claim_slots(db, run.id, "frozen", 2, split="train", lease_seconds=0.2)
    time.sleep(0.4)
    (retry,) = ledger.claim_slots(db, run.id, "live", 1, split="train")
    stale = next(l for l in frozen if l.slot_id == retry.slot_id)
    refused = ledger.commit_trajectory(db, stale.attempt_id, trajectory(1.0))
    assert not refused.committed and "another attempt holds the slot" in refused.reason
    assert ledger.commit_trajectory(db, retry.attempt_id, trajectory(0.0)).committed
    untaken = next(l for l in frozen if l.slot_id != retry.slot_id)  # expired, but nobody took it
    assert ledger.commit_trajectory(db, untaken.attempt_id, trajectory(1.0)).committed


def test_racing_commits_of_one_slot_leave_one_trajectory(engine, db, run):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (a,) = ledger.claim_slots(db, run.id, "a", 1, split="train", lease_seconds=0.1)
    time.sleep(0.3)
    (b,) = ledger.claim_slots(db, run.id, "b", 1, split="train")
    barrier = threading.Barrier(2)
    results = {}

    def commit(lease, reward):
        with new_session(engine) as s:
            barrier.wait()
            results[reward] = ledger.commit_trajectory(
                s, lease.attempt_id, trajectory(reward)
            )

    threads = [threading.Thread(target=commit, args=(a, 0.0)), threading.Thread(target=commit, args=(b, 1.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(o.committed for o in results.values()) == [False, True]
    assert _scalar(db, "SELECT count(*) FROM trajectory WHERE slot_id = :s", s=a.slot_id) == 1


def test_database_refuses_a_second_trajectory_for_a_slot(db, run):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    outcome = ledger.commit_trajectory(db, lease.attempt_id, trajectory())
    second_attempt = uuid.uuid4()
    db.execute(
        sa.text("INSERT INTO attempt (id, slot_id, run_id, worker) VALUES (:a, :s, :r, 'rogue')"),
        {"a": second_attempt, "s": lease.slot_id, "r": run.id},
    )
    with pytest.raises(IntegrityError, match="uq_trajectory_slot"):
        db.execute(
            sa.text(
                "INSERT INTO trajectory (id, run_id, slot_id, attempt_id, group_id, task_id, split, env_name, "
                "env_version, verifier_version, harness_version, reward, terminated, truncated, "
                "policy_version_min, policy_version_max) SELECT gen_random_uuid(), run_id, slot_id, :a, group_id, "
                "task_id, split, env_name, 1, 'v', 'h', 0, true, false, 0, 0 FROM trajectory t WHERE id = :t"
            ),
            {"t": outcome.trajectory_id, "a": second_attempt},
        )
    db.rollback()


def test_group_completes_only_when_every_sample_is_committed(db, run):
    (group,) = ledger.plan_step(db, run.id, 1, ["a"], group_size=3)
    leases = ledger.claim_slots(db, run.id, "w", 3, split="train")
    for i, lease in enumerate(leases):
        assert ledger.complete_groups(db, run.id) == []
        ledger.commit_trajectory(db, lease.attempt_id, trajectory(float(i % 2)))
    assert ledger.complete_groups(db, run.id) == [group]


def test_a_group_left_open_by_a_worker_killed_between_its_two_commits_is_not_waited_for_and_is_trained(db, run):
    """A worker SIGKILLed after committing a group's last slot and before marking the group complete (its own
    transaction): the async learner must not wait for that group (it stalled a resumed run in CI), and claims it."""
    (group,) = _complete_step(db, run, tasks=("a",))
    db.execute(sa.text("UPDATE rollout_group SET state = 'open', completed_at = NULL WHERE id = :g"), {"g": group})
    db.commit()
    ledger.plan_step(db, run.id, 2, ["b"], group_size=2)  # (a later step's group, still generating)
    assert ledger.open_groups_through(db, run.id, 1) == 0
    assert ledger.open_groups_through(db, run.id, 2) == 1
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=10)
    assert list(batch.group_ids) == [group] and len(batch.trajectory_ids) == 2


def test_task_failure_is_a_trajectory_with_a_reward(db, run):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    traj = trajectory(0.0, terminated=False, truncated=True, failure_type="truncated")
    assert ledger.commit_trajectory(db, lease.attempt_id, traj).committed
    assert _scalar(db, "SELECT status FROM attempt WHERE id = :a", a=lease.attempt_id) == "task_failed"


# --------------------------------------------------------------------------- infra failures


def test_infra_failures_retry_then_drop_the_group(db, run):
    (group,) = ledger.plan_step(db, run.id, 1, ["a"], group_size=2, max_attempts=2)
    first, other = ledger.claim_slots(db, run.id, "w", 2, split="train")
    assert ledger.fail_attempt(db, first.attempt_id, "SandboxCrash", "container exited 137") == "retry"
    (retry,) = ledger.claim_slots(db, run.id, "w", 2, split="train")
    assert retry.slot_id == first.slot_id
    assert ledger.fail_attempt(db, retry.attempt_id, "SandboxCrash", "again") == "dropped"
    assert ledger.group_states(db, run.id) == {"dropped": 1}
    assert ledger.claim_slots(db, run.id, "w", 2, split="train") == []
    late = ledger.commit_trajectory(db, other.attempt_id, trajectory())
    assert not late.committed and "dropped" in late.reason
    assert _scalar(db, "SELECT count(*) FROM trajectory WHERE group_id = :g", g=group) == 0
    # an infra failure never became a reward
    assert _scalar(db, "SELECT count(*) FROM attempt WHERE slot_id = :s AND status = 'infra_failed'", s=first.slot_id) == 2


def test_a_batchs_rollout_metrics_count_its_episodes_tool_calls_and_failed_attempts(db, run):
    """Hand-computed: 2 episodes, one truncated; 4 tool calls, 1 failed; 3 attempts, 1 an infra failure."""
    ledger.plan_step(db, run.id, 1, ["a"], group_size=2, max_attempts=3)
    first, second = ledger.claim_slots(db, run.id, "w", 2, split="train")
    assert ledger.fail_attempt(db, first.attempt_id, "SandboxCrash", "container exited 137") == "retry"
    (retry,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    calls = [{"tool": "calc", "args": "1/0", "output": "ZeroDivisionError", "error": True}, {"tool": "calc", "args": "1", "output": "1"}]
    one = trajectory(1.0, segments=[segment(tool_events=calls)], timings={"episode_s": 2.0})
    cut = trajectory(0.0, terminated=False, truncated=True, failure_type="truncated", timings={"episode_s": 4.0})
    assert all(o.committed for o in ledger.commit_trajectories(db, [(retry.attempt_id, one), (second.attempt_id, cut)]))
    ids = [r[0] for r in db.execute(sa.text("SELECT id FROM trajectory WHERE run_id = :r"), {"r": run.id}).all()]
    db.rollback()
    metrics = ledger.rollout_metrics(db, run.id, ids, 0)
    assert metrics["timing_s/rollout"] > 0
    assert metrics["perf/trajectories_per_s"] == pytest.approx(2 / metrics["timing_s/rollout"])
    others = {k: v for k, v in metrics.items() if k not in ("timing_s/rollout", "perf/trajectories_per_s")}
    # (the truncated episode: 2 segments of the factory's, one call each)
    assert others == {
        "rollout/truncated_frac": 0.5, "rollout/infra_failed_frac": 1 / 3, "tool/calls_per_episode": 2.0,
        "tool/error_frac": 0.25, "timing_s/episode_mean": 3.0,
    }


def test_released_slot_goes_back_without_counting_a_failure(db, run):
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1, max_attempts=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    assert ledger.release_attempt(db, lease.attempt_id)
    (again,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    assert again.slot_id == lease.slot_id
    assert _scalar(db, "SELECT infra_failures FROM slot WHERE id = :s", s=lease.slot_id) == 0


# --------------------------------------------------------------------------- learner


def test_learner_step_consumes_each_trajectory_once(db, run):
    groups = _complete_step(db, run)
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=10)
    assert set(batch.group_ids) == set(groups) and len(batch.trajectory_ids) == 4
    assert batch.policy_version == 0
    commit = ledger.commit_learner_step(db, batch, "file:///w/v1", "file:///ckpt/1", metrics={"loss": 0.5})
    assert (commit.policy_version, commit.consumed) == (1, 4)
    assert ledger.consumed_trajectory_ids(db, run.id) == set(batch.trajectory_ids)
    # the next step finds nothing left to train
    assert ledger.claim_learner_batch(db, run.id, 2, max_groups=10).empty
    # consuming a trajectory twice is impossible at the database level
    with pytest.raises(IntegrityError):
        db.execute(
            sa.text(
                "INSERT INTO consumption (run_id, trajectory_id, learner_step, policy_version, version_lag) "
                "VALUES (:r, :t, 2, 1, 1)"
            ),
            {"r": run.id, "t": batch.trajectory_ids[0]},
        )
    db.rollback()


def test_retried_learner_step_gets_the_same_batch_and_commits_once(db, run):
    _complete_step(db, run, tasks=("a", "b", "c"))
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=2)
    _complete_step(db, run, step=2, tasks=("d",))  # more work arrives while the learner is down
    assert ledger.claim_learner_batch(db, run.id, 1, max_groups=2) == batch
    first = ledger.commit_learner_step(db, batch, "file:///w/v1", "file:///ckpt/1")
    second = ledger.commit_learner_step(db, batch, "file:///w/v1", "file:///ckpt/1")
    assert second.already_committed and (second.policy_version, second.consumed) == (1, first.consumed)
    replay = ledger.claim_learner_batch(db, run.id, 1, max_groups=2)
    assert replay.already_committed and replay.trajectory_ids == batch.trajectory_ids


def test_learner_steps_cannot_skip_or_diverge(db, run):
    _complete_step(db, run)
    with pytest.raises(LedgerConflict, match="last committed step is 0"):
        ledger.claim_learner_batch(db, run.id, 2, max_groups=1)
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=1)
    forged = type(batch)(batch.run_id, 1, 0, batch.group_ids, batch.trajectory_ids[:1])
    with pytest.raises(LedgerConflict, match="differs"):
        ledger.commit_learner_step(db, forged, "w", "c")


def test_failed_learner_commit_leaves_nothing_consumed(db, run):
    _complete_step(db, run)
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=10)
    # The last write of the transaction fails (the metrics, after consumption, version and checkpoint rows).
    with pytest.raises(IntegrityError, match='"name"'):
        ledger.commit_learner_step(db, batch, "w", "c", metrics={None: 1.0})
    assert ledger.consumed_trajectory_ids(db, run.id) == set()
    assert ledger.group_states(db, run.id) == {"claimed": 2}
    assert _scalar(db, "SELECT count(*) FROM checkpoint WHERE run_id = :r", r=run.id) == 0


def test_eval_groups_are_never_trained(db, run):
    _complete_step(db, run, tasks=("e0", "e1"), split="eval")
    assert ledger.complete_groups(db, run.id, split="eval")
    assert ledger.claim_learner_batch(db, run.id, 1, max_groups=10).empty
    eval_trajectory = _scalar(db, "SELECT id FROM trajectory WHERE run_id = :r LIMIT 1", r=run.id)
    with pytest.raises(IntegrityError, match="fk_consumption_trajectory"):
        db.execute(
            sa.text(
                "INSERT INTO consumption (run_id, trajectory_id, learner_step, policy_version, version_lag) "
                "VALUES (:r, :t, 1, 0, 0)"
            ),
            {"r": run.id, "t": eval_trajectory},
        )
    db.rollback()
    with pytest.raises(IntegrityError, match="ck_group_eval_never_trained"):
        db.execute(
            sa.text("UPDATE rollout_group SET state = 'claimed', learner_step = 1 WHERE run_id = :r"), {"r": run.id}
        )
    db.rollback()


def test_an_evaluations_episodes_are_stored_with_its_result_once_and_never_trained(db, run):
    """Issue 47: held-out episodes were counted, then thrown away; they are browsable now, as the `eval` split."""
    from loopline.store.check import check_run

    episodes = [("e0", trajectory(reward=1.0, seed=1)), ("e1", trajectory(reward=0.0, seed=2)), ("e2", trajectory(reward=1.0, seed=3))]
    assert ledger.record_eval_result(db, run.id, 4, "arithmetic", 1, 3, 2, {"seconds": 1.5}, episodes=episodes, worker="w")
    stored = db.execute(sa.text(
        "SELECT g.step, g.group_index, g.task_id, g.state, t.reward, t.split, a.status, s.state FROM trajectory t "
        "JOIN rollout_group g ON g.id = t.group_id JOIN attempt a ON a.id = t.attempt_id JOIN slot s ON s.id = t.slot_id "
        "WHERE t.run_id = :r ORDER BY g.group_index"), {"r": run.id}).all()
    db.rollback()
    assert [tuple(r) for r in stored] == [
        (4, 0, "e0", "complete", 1.0, "eval", "ok", "done"), (4, 1, "e1", "complete", 0.0, "eval", "ok", "done"),
        (4, 2, "e2", "complete", 1.0, "eval", "ok", "done"),
    ]
    segments = _scalar(db, "SELECT count(*) FROM segment s JOIN trajectory t ON t.id = s.trajectory_id WHERE t.run_id = :r", r=run.id)
    assert segments == 6  # every model call, token for token
    # recorded once: a second recording of the version (a retried evaluation) writes nothing
    assert not ledger.record_eval_result(db, run.id, 4, "arithmetic", 1, 3, 2, {}, episodes=episodes, worker="w")
    assert _scalar(db, "SELECT count(*) FROM trajectory WHERE run_id = :r", r=run.id) == 3
    assert ledger.claim_learner_batch(db, run.id, 1, max_groups=10).empty
    assert [e.seconds for e in queries.eval_results(db, run.id)] == [1.5]
    report = check_run(db, run.id)
    assert report.ok, report.violations
    # a result whose episodes cannot be stored is not stored either (one transaction)
    bad = trajectory(seed=4)
    bad.segments[0].action_loss_mask[0] = 2
    with pytest.raises(LooplineError, match="other than 0 and 1"):
        ledger.record_eval_result(db, run.id, 5, "arithmetic", 1, 1, 1, {}, episodes=[("e0", bad)], worker="w")
    assert [e.version for e in queries.eval_results(db, run.id)] == [4]


def test_groups_older_than_max_staleness_are_dropped_not_trained(db, run):
    # Groups are taken in step order: "old" (step 15, generated by version 0) waits behind steps 11 and 12.
    old = _complete_step(db, run, step=15, tasks=("old",), version=0)
    for k in (1, 2):  # two learner steps move the policy to version 2
        _complete_step(db, run, step=10 + k, tasks=(f"x{k}",), version=k - 1)
        batch = ledger.claim_learner_batch(db, run.id, k, max_groups=1)
        assert old[0] not in batch.group_ids
        ledger.commit_learner_step(db, batch, f"w{k}", f"c{k}")
    fresh = _complete_step(db, run, step=20, tasks=("new",), version=2)
    batch = ledger.claim_learner_batch(db, run.id, 3, max_groups=10, max_staleness=1)
    assert set(batch.group_ids) == set(fresh) and batch.stale_dropped == 1
    reason = _scalar(db, "SELECT state || '/' || drop_reason FROM rollout_group WHERE id = :g", g=old[0])
    assert reason == "dropped/stale"


def test_a_step_whose_groups_are_all_stale_or_whose_worker_stopped_says_what_to_do(db, run, engine):
    """Both reached users as a bare RuntimeError's traceback with no next step."""
    import types

    from loopline.store.db import session as new_session
    from loopline.pipeline import stages

    rollout = types.SimpleNamespace(max_attempts=3, groups_per_step=10, max_staleness=1, staleness_bound=1)
    ctx = types.SimpleNamespace(session_factory=lambda: new_session(engine), run_id=run.id, driver=None, rollout=rollout)
    _complete_step(db, run, step=15, tasks=("old",), version=0)
    for k in (1, 2):
        _complete_step(db, run, step=10 + k, tasks=(f"x{k}",), version=k - 1)
        ledger.commit_learner_step(db, ledger.claim_learner_batch(db, run.id, k, max_groups=1), f"w{k}", f"c{k}")
    with pytest.raises(LooplineError, match=r"older than rollout.max_staleness .*raise rollout.max_staleness or add rollout workers, then resume"):
        stages.learn(ctx, 3)
    ledger.plan_step(db, run.id, 30, ["open"], group_size=2)
    with pytest.raises(LooplineError, match=r"rollout worker stopped while groups of step 30 were still open .*train.log.*resume"):
        stages.wait_for_groups(ctx, 30, producing=lambda: False)
    lags = db.execute(
        sa.text("SELECT learner_step, version_lag FROM consumption WHERE run_id = :r ORDER BY learner_step"),
        {"r": run.id},
    ).all()
    assert {tuple(r) for r in lags} == {(1, 0), (2, 0)}


def test_resume_state_reports_checkpoint_version_and_pending_batch(db, run):
    state = ledger.resume_state(db, run.id)
    assert (state.last_checkpoint, state.policy_version, state.next_learner_step) == (None, 0, 1)
    _complete_step(db, run, tasks=("a", "b"))
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=1)
    ledger.commit_learner_step(db, batch, "file:///w/v1", "file:///ckpt/1")
    pending = ledger.claim_learner_batch(db, run.id, 2, max_groups=1)
    state = ledger.resume_state(db, run.id)
    assert state.last_checkpoint == records.CheckpointInfo(1, 1, "file:///ckpt/1")
    assert (state.policy_version, state.weights_uri, state.next_learner_step) == (1, "file:///w/v1", 2)
    assert state.consumed_trajectories == 2
    assert state.pending_learner_groups == pending.group_ids
    assert state.group_states == {"consumed": 1, "claimed": 1}
    # a step that wrote no full checkpoint (checkpoint_every) commits no checkpoint row: a resume restores
    # the newest one written and replays the steps since
    ledger.commit_learner_step(db, pending, "file:///w/v2", None)
    state = ledger.resume_state(db, run.id)
    assert state.last_checkpoint == records.CheckpointInfo(1, 1, "file:///ckpt/1")
    assert (state.policy_version, state.next_learner_step) == (2, 3)
    assert _scalar(db, "SELECT count(*) FROM checkpoint WHERE run_id = :r", r=run.id) == 1
    assert ledger.commit_learner_step(db, pending, "file:///w/v2", None).already_committed


def test_runs_are_found_by_name_or_id_and_track_status_and_publication(db, run):
    assert ledger.get_run(db, run.name).id == run.id == ledger.get_run(db, str(run.id)).id
    with pytest.raises(LooplineError, match="no run named 'nope'"):
        ledger.get_run(db, "nope")
    ledger.start_run(db, run.id, "host:1:1")
    assert ledger.get_run(db, run.name).status == "running"
    assert ledger.heartbeat(db, run.id, "host:1:1") is None and ledger.heartbeat(db, run.id, "host:2:2") == "lost"
    assert not ledger.end_run(db, run.id, "host:2:2", "completed", None)  # only the process driving it ends it
    ledger.request_cancel(db, run.id, "cancelled while not running")
    assert ledger.heartbeat(db, run.id, "host:1:1") == "cancel" and ledger.get_run(db, run.name).status == "running"
    assert ledger.end_run(db, run.id, "host:1:1", "cancelled", "cancelled (loopline cancel)")
    found = ledger.get_run(db, run.name)
    assert (found.status, found.status_reason) == ("cancelled", "cancelled (loopline cancel)")
    with pytest.raises(IntegrityError, match="ck_run_status"):
        ledger.end_run(db, run.id, "host:1:1", "exploded", None)
    _complete_step(db, run, tasks=("a",))
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=1)
    ledger.commit_learner_step(db, batch, "file:///w/v1", "file:///ckpt/1")
    assert _scalar(db, "SELECT published_at FROM policy_version WHERE run_id = :r AND version = 1", r=run.id) is None
    ledger.mark_published(db, run.id, 1)
    assert _scalar(db, "SELECT published_at FROM policy_version WHERE run_id = :r AND version = 1", r=run.id) is not None


def test_a_run_driven_by_a_live_process_cannot_be_started_by_another(db, run):
    """Two `loopline train` of one run overwrote each other's files; the second is now refused, saying who holds it,
    until the holder ends, goes silent for the lease time, or is known dead (its pid gone on this host)."""
    ledger.start_run(db, run.id, "gpu-7:4242:99")  # another host, alive: it just wrote its first heartbeat
    with pytest.raises(LedgerConflict, match=f"run {run.name} is being trained by gpu-7:4242:99 .*loopline cancel {run.name}"):
        ledger.start_run(db, run.id, holder.this_process())
    ledger.start_run(db, run.id, "gpu-7:4242:99")  # the holder itself may (a retried start)
    assert ledger.end_run(db, run.id, "gpu-7:4242:99", "interrupted", "interrupted (Ctrl-C)")
    ledger.start_run(db, run.id, holder.this_process())  # it ended: the run is free
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    db.execute(sa.text("UPDATE run SET holder = :h WHERE id = :r"), {"h": f"{holder.this_process().split(':')[0]}:{gone.pid}:1", "r": run.id})
    db.commit()
    ledger.start_run(db, run.id, holder.this_process())  # its holder's process is gone on this host
    db.execute(sa.text("UPDATE run SET holder = 'gpu-7:1:1', heartbeat_at = now() - interval '1 hour' WHERE id = :r"), {"r": run.id})
    db.commit()
    ledger.start_run(db, run.id, holder.this_process())  # silent for longer than the lease: stale
    assert ledger.get_run(db, run.name).holder == holder.this_process()


def test_taking_a_run_over_ends_the_frozen_drivers_sessions_and_their_locks(db, run, database_url, monkeypatch):
    """Seen in CI: a trainer frozen (SIGSTOP) in the middle of a COPY held its row locks; the server's `idle in
    transaction` limit does not end an open statement, so the trainer taking the run over waited out its lock
    timeout and stopped. The new driver now ends the stale driver's sessions (by their application_name) first."""
    import psycopg

    from loopline.store.db import make_engine

    frozen_holder = "gpu-7:4242:99"
    db.execute(sa.text("UPDATE run SET status = 'running', holder = :h, heartbeat_at = now() - interval '1 hour' WHERE id = :r"),
               {"h": frozen_holder, "r": run.id})
    db.commit()
    frozen = psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://"),
                             application_name=holder.application_name(frozen_holder), autocommit=False)
    try:
        frozen.execute("CREATE TEMP TABLE fed (a int)")
        frozen.execute("SELECT 1 FROM run WHERE id = %s FOR UPDATE", (run.id,))
        opened = frozen.cursor().copy("COPY fed FROM STDIN")
        copying = opened.__enter__()  # the statement is open: the server waits for rows that never come
        monkeypatch.setenv("LOOPLINE_DB_LOCK_TIMEOUT_S", "5")  # (fails in 5 s, not 120, if the lock is still held)
        engine = make_engine(database_url)
        try:
            with new_session(engine) as mine:
                assert mine.execute(sa.text("SHOW application_name")).scalar_one() == holder.application_name(holder.this_process())
                mine.commit()
                ledger.start_run(mine, run.id, holder.this_process())
                assert ledger.get_run(mine, run.name).holder == holder.this_process()
                assert mine.execute(sa.text("SELECT 1")).scalar_one() == 1  # its own sessions go on
        finally:
            engine.dispose()
        with pytest.raises(psycopg.OperationalError):
            copying.write_row((1,))
            opened.__exit__(None, None, None)
    finally:
        frozen.close()


def test_a_holders_application_name_puts_pid_and_start_first_and_fits_postgresql(db):
    assert holder.application_name("gpu-7:4242:99") == "loopline 4242:99@gpu-7"
    long = holder.application_name("h" * 80 + ":4242:99")
    assert long.startswith("loopline 4242:99@hhh") and len(long.encode()) == 63


def test_each_process_registers_the_servers_it_syncs_and_releases_them(db, run):
    """Two workers share server A (a router or a fixed list); worker 2 also launched B. What each loaded is kept
    per (server, worker); a worker that stops releases only its own rows, and one that comes back re-registers."""
    a, b = "http://gpu-1:30000", "http://gpu-2:30000"
    ledger.record_served(db, run.id, "w1", [a], 0)
    ledger.record_served(db, run.id, "w2", [a, b], 0)
    ledger.record_served(db, run.id, "w2", [a, b], 3)
    serving = lambda: [row[:3] for row in ledger.serving_servers(db, run.id)]  # noqa: E731
    assert serving() == [(a, "w1", 0), (a, "w2", 3), (b, "w2", 3)]
    assert all(0 <= row[3] < 60 for row in ledger.serving_servers(db, run.id))  # (seconds since each was last seen)
    ledger.release_servers(db, run.id, "w2")
    assert serving() == [(a, "w1", 0)]
    ledger.record_served(db, run.id, "w2", [b], 4)
    assert serving() == [(a, "w1", 0), (b, "w2", 4)]
    assert _scalar(db, "SELECT count(*) FROM engine_server WHERE run_id = :r", r=run.id) == 3  # one row per pair


def test_a_retokenised_history_is_refused_at_commit(db, run):
    """Invariant 2: each model call's prompt extends the previous call's; a break is never stored."""
    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    unrelated = [segment(seed=1), segment(seed=2)]  # the second prompt does not start with the first turn
    with pytest.raises(LooplineError, match="does not extend segment 0"):
        ledger.commit_trajectory(db, lease.attempt_id, trajectory(1.0, segments=unrelated))


def test_commits_into_one_group_do_not_wait_for_each_other_and_the_last_completes_it(db, engine, run):
    """Issue 63: a commit locks only its slots; the group is completed after, in a transaction of its own (a
    commit once held the group's row through its COPY and WAL flush, and every commit into the group queued)."""
    from loopline.store import commits

    ledger.plan_step(db, run.id, 1, ["a"], group_size=2)
    first, second = ledger.claim_slots(db, run.id, "w", 2, split="train")
    with new_session(engine) as other:
        outcomes, groups = commits._commit(other, [(first.attempt_id, trajectory(1.0))], "copy")  # in flight, not committed
        db.execute(sa.text("SET lock_timeout = '2s'"))  # (waiting on the other's locks would fail here)
        assert ledger.commit_trajectory(db, second.attempt_id, trajectory(0.0)).committed
        db.execute(sa.text("RESET lock_timeout"))
        assert ledger.group_states(db, run.id) == {"open": 1}  # (the other slot is not done yet)
        other.commit()  # ... its process dies before it completes the group
    assert groups == [first.group_id] and ledger.group_states(db, run.id) == {"open": 1}
    batch = ledger.claim_learner_batch(db, run.id, 1, max_groups=1)  # the learner completes it before it claims
    assert batch.group_ids == (first.group_id,) and len(batch.trajectory_ids) == 2


def test_the_last_slots_of_a_group_committed_at_once_complete_it(engine, run):
    """Two commits finishing a group's last slots at the same moment: each completes after its own commit, so
    the later one sees both (the group never stays open with every slot done)."""
    with new_session(engine) as s:
        ledger.plan_step(s, run.id, 1, [f"t{i}" for i in range(20)], group_size=2)
        leases = ledger.claim_slots(s, run.id, "w", 40, split="train")
    by_group: dict = {}
    for lease in leases:
        by_group.setdefault(lease.group_id, []).append(lease)
    start = threading.Barrier(2)

    def commit(k: int) -> None:
        with new_session(engine) as s:
            for pair in by_group.values():
                start.wait()
                ledger.commit_trajectory(s, pair[k].attempt_id, trajectory(float(k)))

    threads = [threading.Thread(target=commit, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with new_session(engine) as s:
        assert ledger.group_states(s, run.id) == {"complete": 20}


@pytest.mark.parametrize("history", ["appending", "re-rendering", "trimming", "summarising"])
def test_the_learner_reads_what_every_other_reader_reads_whatever_the_agent_did_to_its_history(db, run, history):
    """Issue 63: the learner's read (each chain's ids once, a few trajectories per statement) gives the
    sequences the whole-prompt read gives, token for token, for agents whose calls are stored as pieces; the
    trajectory stores about what an appending agent's does; `check` passes on it."""
    import random

    from benchmarks._trajectories import rewriting
    from loopline.pipeline.stages import load_sequences
    from loopline.store import check
    from loopline.store.commits import READ_TRAJECTORIES
    from loopline.trainer.batch import sequences_from_trajectory
    from loopline.types import StoredSegment, StoredTrajectory

    n = READ_TRAJECTORIES + 2  # (more than one statement's worth)
    ledger.plan_step(db, run.id, 1, ["a", "b", "c"], group_size=4)
    leases = ledger.claim_slots(db, run.id, "w", n, split="train")
    episodes = [rewriting(random.Random(k), 40, 64, 24, 16, history) for k in range(n)]
    ids = [ledger.commit_trajectory(db, lease.attempt_id, e).trajectory_id for lease, e in zip(leases, episodes)]
    read = load_sequences(db, ids[::-1])
    whole = [s for t in ledger.load_trajectories(db, ids[::-1]) for s in sequences_from_trajectory(t)]
    direct = [  # (from the records as the rollout made them: whole prompts)
        s for e, t in zip(episodes[::-1], ids[::-1]) for s in sequences_from_trajectory(StoredTrajectory(t, None, e.reward, 0, 0, tuple(
            StoredSegment(k, c.prompt_ids, c.generated_ids, c.action_loss_mask, c.rollout_logprobs, c.starts_chain) for k, c in enumerate(e.segments))))
    ]
    assert len(read) == len(whole) == len(direct) == sum(1 + sum(s.starts_chain for s in e.segments) for e in episodes)
    for a, b, c in zip(read, whole, direct):
        assert a.trajectory_id == b.trajectory_id == c.trajectory_id and a.chain == b.chain == c.chain
        assert a.input_ids.tolist() == b.input_ids.tolist() == c.input_ids.tolist()
        assert a.action_mask.tolist() == c.action_mask.tolist() and a.behaviour_logprobs.tolist() == c.behaviour_logprobs.tolist()
    stored = _scalar(db, "SELECT sum(cardinality(prompt_ids) + cardinality(generated_ids) + coalesce(cardinality(prompt_copies), 0)) "
                         "FROM segment WHERE trajectory_id = :t", t=ids[0])
    appending, summaries = 64 + 40 * 24 + 39 * 16, 256 * (40 // 16) * (history == "summarising")  # (a summary is new)
    assert stored <= 1.2 * appending + summaries
    assert check.check_run(db, run.id).stats["segments"] == 40 * n and not [
        v for v in check.check_run(db, run.id).violations if v.invariant in (1, 2)]


def test_the_inspector_reads_each_token_of_a_long_trajectory_about_once(db, engine, run):
    """Issue 63: the inspector's view of a trajectory holds what is stored, not its square: a continuing call's
    new ids only (with how many of its prompt the call above holds), a chain's whole prompt where it starts,
    and each chain's ids once, at its last call, for the re-tokenisation check."""
    import random

    from benchmarks._trajectories import rewriting
    from loopline.store import views
    from loopline.ui.data import chain_of

    ledger.plan_step(db, run.id, 1, ["a"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    episode = rewriting(random.Random(3), 40, 64, 24, 16, "summarising")  # appends, with a new chain every 16 calls
    trajectory_id = ledger.commit_trajectory(db, lease.attempt_id, episode).trajectory_id
    with engine.connect() as conn:
        shown = views.segments(conn, trajectory_id)
    starts = [k for k, s in enumerate(episode.segments) if k == 0 or s.starts_chain]
    assert starts == [0, 16, 32]
    for k, (s, call) in enumerate(zip(shown, episode.segments)):
        assert s["prompt_len"] == len(call.prompt_ids) and s["generated_ids"] == list(call.generated_ids)
        assert s["continues"] + len(s["prompt_ids"]) == s["prompt_len"] and (s["continues"] == 0) == (k in starts)
        assert s["prompt_ids"] == list(call.prompt_ids[s["continues"]:])
        assert (s["chain_ids"] is not None) == (k + 1 in starts or k == 39)
        if s["chain_ids"] is not None:
            assert s["chain_ids"] == [*call.prompt_ids, *call.generated_ids]
            assert [c["seq"] for c in chain_of(shown, s)] == list(range(max(x for x in starts if x <= k), k + 1))
    whole = sum(len(c.prompt_ids) + len(c.generated_ids) for c in episode.segments)
    held = sum(len(s["prompt_ids"]) + len(s["generated_ids"]) + len(s["chain_ids"] or []) for s in shown)
    assert held < whole / 4  # (the whole prompts, as the page once built them: 4.6x here, growing with the turns)
