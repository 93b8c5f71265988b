"""Chaos: SIGKILL the training process at each dangerous point, resume, and audit the ledger.

Kills (via failpoints, see loopline/failpoints.py): mid-rollout after a few commits and with slots leased, inside the learner
step, between the learner step and its ledger commit, and during the weight sync. After the final,
undisturbed resume the run must pass `check`, every trajectory of a consumed group must be consumed
exactly once, and replaying the run's own records (each step's consumed batch, in order, from the
initial weights) must reproduce the final published weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
import yaml

from loopline.store.uris import path_on_publisher

ROOT = Path(__file__).resolve().parents[2]
# A 3-step run takes ~10 s alone; one still running after this is stuck (and says where: its stacks in the
# failure) before the test's own timeout would end it saying nothing of it.
TRAIN_WITHIN_S = 240
pytestmark = pytest.mark.timeout(15 * 60)
# (episode_start:6: the second round of a step's slots is leased, none committed; rollout_commit:3 just after a
# commit, which takes the episodes that finished together: no lease left behind)
KILLS = ["rollout_commit:3", "episode_start:6", "learner_step", "learner_commit", "weight_sync"]


def _train(config: Path, env: dict, failpoint: str | None, log: Path, leftovers: list[str] | None = None) -> int:
    """One `loopline train` in its own process group; returns its exit code. A failpoint SIGKILLs the main
    pid only, as the OOM killer does; `leftovers` then receives what the dead process left running in its
    group after a grace of 15 s. The group is killed afterwards, so one failure does not leak into the next."""
    env = {**env, "LOOPLINE_FAILPOINT": failpoint or ""}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "loopline.cli", "train", str(config)], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            try:
                code = proc.wait(timeout=TRAIN_WITHIN_S)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGUSR1)  # (its threads' stacks into the run's log: `cli_support.run_cli`)
                time.sleep(3)
                run_logs = "".join(f.read_text()[-12000:] for f in Path(env["LOOPLINE_HOME"]).glob("runs/*/train.log"))
                pytest.fail(f"{failpoint or 'the resume'}: still running after {TRAIN_WITHIN_S} s\n{log.read_text()[-4000:]}\n{run_logs}")
            if leftovers is not None:
                deadline = time.monotonic() + 15
                while _group_members(proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.5)
                leftovers += _group_members(proc.pid)
            return code
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _small_run(tmp_path: Path, name: str, policy, database_url: str, *, mode: str, lease_seconds: float, backend: str, every: int):
    """A 3-step run of 2 groups of 4 on the arithmetic env: its config file and the environment to train it in."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "env": str(ROOT / "examples" / "arithmetic_env.yaml"), "policy": str(policy),
        "steps": 3, "rollout": {"mode": mode, "max_staleness": 1, "groups_per_step": 2, "group_size": 4, "concurrency": 4,
                                "lease_seconds": lease_seconds, "sampling": {"max_new_tokens": 16}},
        # a full checkpoint at steps 2 and 3 only: a resume after step 1 replays its recorded batch
        "learner": {"lr": 1e-3, "backend": backend, "checkpoint_every": 2},
        "eval": {"every": every, "tasks": 4},
    }))
    env = {**os.environ, "LOOPLINE_DATABASE_URL": database_url, "LOOPLINE_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return config, env


def _kill_at_each_then_resume(config: Path, env: dict, kills, tmp_path: Path) -> None:
    """`loopline train` SIGKILLed at each failpoint in turn, then run to the end undisturbed."""
    for kill in kills:
        log = tmp_path / f"{kill}.log"
        assert _train(config, env, kill, log) == -signal.SIGKILL, f"{kill}: the failpoint did not fire\n{log.read_text()[-4000:]}"
    log = tmp_path / "final.log"
    assert _train(config, env, None, log) == 0, log.read_text()[-4000:]


def _checked_run(db, name: str):
    """The run's id, after `check` found every invariant holding."""
    from loopline.store.check import check_run

    run_id = _rows(db, "SELECT id FROM run WHERE name = :n", n=name)[0][0]
    report = check_run(db, run_id)
    assert report.ok, report.violations
    return run_id


def _rows(db, sql, **params):
    rows = db.execute(sa.text(sql), params).all()
    db.rollback()
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync"])  # async: the main-pid test below (the kill points' code is shared)
def test_sigkill_at_every_stage_then_resume_trains_everything_exactly_once(mode, tiny_dirs, database_url, db, tmp_path):
    from loopline.config import load_config
    from loopline.pipeline.stages import load_sequences
    from loopline.trainer.checkpoint import weights_sha256
    from loopline.trainer.learner import Learner

    name = f"chaos-{mode}-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode=mode, lease_seconds=3, backend="torch", every=3)
    _kill_at_each_then_resume(config, env, KILLS, tmp_path)
    run_id = _checked_run(db, name)
    # the kill mid-rollout left leased slots behind: their leases expired and the slots were retried
    assert _rows(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND error_class = 'LeaseExpired'", r=run_id)[0][0] > 0
    versions = [v for (v,) in _rows(db, "SELECT version FROM policy_version WHERE run_id = :r ORDER BY version", r=run_id)]
    assert versions == [0, 1, 2, 3]
    # v1 (no checkpoint, no evaluation) was committed without an export; the process killed at its weight sync
    # had served it from memory, and the resume exported it from the learner it rebuilt (replaying step 1)
    uri, sha = _rows(db, "SELECT weights_uri, sha256 FROM policy_version WHERE run_id = :r AND version = 1", r=run_id)[0]
    assert uri is not None and weights_sha256(path_on_publisher(uri)) == sha
    consumed, distinct, in_consumed_groups = _rows(
        db,
        "SELECT (SELECT count(*) FROM consumption WHERE run_id = :r), "
        "(SELECT count(DISTINCT trajectory_id) FROM consumption WHERE run_id = :r), "
        "(SELECT count(*) FROM trajectory t JOIN rollout_group g ON g.id = t.group_id WHERE g.run_id = :r AND g.state = 'consumed')",
        r=run_id,
    )[0]
    assert consumed == distinct == in_consumed_groups == 3 * 2 * 4

    # replay the records: the consumed batches, step by step, from version 0, must give the final weights
    settings, _ = load_config(config)
    learner = Learner(tiny_dirs["v0"], settings.learner_config(), backend="torch")
    for step in (1, 2, 3):
        ids = [t for (t,) in _rows(
            db,
            "SELECT t.id FROM consumption c JOIN trajectory t ON t.id = c.trajectory_id JOIN slot s ON s.id = t.slot_id "
            "JOIN rollout_group g ON g.id = t.group_id WHERE c.run_id = :r AND c.learner_step = :k "
            "ORDER BY g.step, g.group_index, s.sample_index",
            r=run_id, k=step,
        )]
        learner.rl_step(load_sequences(db, ids))
    uri, sha = _rows(db, "SELECT weights_uri, sha256 FROM policy_version WHERE run_id = :r AND version = 3", r=run_id)[0]
    assert weights_sha256(path_on_publisher(uri)) == sha
    final = Learner(path_on_publisher(uri), settings.learner_config(), backend="torch")
    assert torch.allclose(learner.parameters_vector(), final.parameters_vector(), atol=1e-6)


def _group_members(pgid: int) -> list[str]:
    """Processes still in process group `pgid` (`pid command`): what a killed run left running."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # field 5: pgrp; zombies are already dead
            alive.append(f"{stat.parent.name} {cmdline[:200]}")
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_main_pid_kills_leave_nothing_running_and_no_evaluation_owed(mode, tiny_dirs, database_url, db, tmp_path):
    """Issue 12: kills of the main pid only — while DeepSpeed starts, mid-rollout, between a learner commit
    and its evaluation, before a learner commit — leave no process behind (the temporary Prefect server
    dies with its parent), and the resumed run finishes with every scheduled evaluation and passes `check`.
    Leases of the killed process are taken back at once (its holder is dead), not after `lease_seconds`."""
    name = f"orphans-{mode}-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode=mode, lease_seconds=600, backend="deepspeed", every=1)
    env.pop("PREFECT_API_URL", None)  # each run starts its temporary Prefect server, as a user's does
    # DeepSpeed's start and the learner commit run the same code in both modes: async repeats the kills
    # whose surroundings differ (its rollout worker beside the learner, its evaluations between steps).
    kills = ["deepspeed_start", "episode_start:6", "evaluate:2", "learner_commit"] if mode == "sync" else ["episode_start:6", "evaluate:2"]
    for kill in kills:
        log, left = tmp_path / f"{kill}.log", []
        assert _train(config, env, kill, log, left) == -signal.SIGKILL, f"{kill}: the failpoint did not fire\n{log.read_text()[-4000:]}"
        assert left == [], f"killed at {kill}, still running: {left}"
    log = tmp_path / "final.log"
    started = time.monotonic()
    assert _train(config, env, None, log) == 0, log.read_text()[-4000:]
    assert time.monotonic() - started < 400  # never waited out a 600 s lease of a dead holder
    run_id = _checked_run(db, name)
    evaluated = [v for (v,) in _rows(db, "SELECT policy_version FROM eval_result WHERE run_id = :r ORDER BY 1", r=run_id)]
    assert evaluated == [0, 1, 2, 3]  # v1's evaluation was killed before it ran: the resume ran it
    assert _rows(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND error_class = 'HolderDied'", r=run_id)[0][0] > 0
    assert _rows(db, "SELECT coalesce(max(infra_failures), 0) FROM slot WHERE run_id = :r", r=run_id)[0][0] == 0
