"""A learner of two data-parallel ranks, started by the train flow through DeepSpeed's launcher (issue 18).

The same path a multi-host learner takes (`learner.launch` in the run config; on several hosts a
hostfile), with both ranks on this machine: the run trains, a crash of rank 0 or of the flow process
that launched it leaves no rank behind, and a resume finishes the run exactly once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.test_chaos import ROOT, _checked_run, _rows, _small_run, _train


def _ranks_of(home: Path) -> list[int]:
    """Pids of the learner rank processes of runs under `home` (their --result file lives there)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"loopline.orchestration.learner_rank" in cmdline and any(str(home).encode() in arg for arg in cmdline):
            found.append(int(proc.name))
    return found


def _gone_within(home: Path, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while _ranks_of(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _ranks_of(home)


@pytest.mark.slow
def test_two_learner_ranks_train_a_run_and_leave_nothing_behind_when_killed(tiny_dirs, database_url, db, tmp_path):
    name = f"ranks-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode="sync", lease_seconds=600, backend="deepspeed", every=4)
    settings = yaml.safe_load(config.read_text())
    settings["steps"] = 3
    settings["learner"] |= {"zero_stage": 1, "launch": {"ranks_per_node": 2}}
    config.write_text(yaml.safe_dump(settings))
    home = Path(env["LOOPLINE_HOME"])

    # rank 0 dies before its step-2 commit: the launcher takes the other rank down, the flow says why
    log = tmp_path / "rank0-killed.log"
    assert _train(config, env, "learner_commit:2", log) == 1, log.read_text()[-4000:]
    assert "rank" in log.read_text() and "exited with status" in log.read_text()
    assert _gone_within(home, 15) == []

    # the flow process that launched the ranks is SIGKILLed while they run: they follow it
    with (tmp_path / "parent-killed.log").open("w") as out:
        parent = subprocess.Popen([sys.executable, "-m", "loopline.cli", "train", str(config)], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while len(_ranks_of(home)) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
        assert len(_ranks_of(home)) == 2, (tmp_path / "parent-killed.log").read_text()[-4000:]
        parent.send_signal(signal.SIGKILL)
        assert parent.wait() == -signal.SIGKILL
    assert _gone_within(home, 15) == []

    log = tmp_path / "final.log"
    assert _train(config, env, None, log) == 0, log.read_text()[-4000:]
    run_id = _checked_run(db, name)
    ranks = _rows(db, "SELECT step, value FROM metric WHERE run_id = :r AND name = 'learner_ranks' ORDER BY step", r=run_id)
    assert ranks == [(1, 2.0), (2, 2.0), (3, 2.0)]
    once = _rows(db, "SELECT count(*), count(DISTINCT trajectory_id) FROM consumption WHERE run_id = :r", r=run_id)[0]
    assert once[0] == once[1] == 3 * 2 * 4

    # the two ranks' update is the one a single process makes on the whole batch, bit for bit (CPU)
    replay = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "replay", name, "--step", "1"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert replay.returncode == 0 and "reproduced" in replay.stdout, replay.stdout[-2000:] + replay.stderr[-2000:]
