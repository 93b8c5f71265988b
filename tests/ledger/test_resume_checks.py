"""`loopline train --resume RUN [--steps N]` as a user types it, against a real ledger: a run that is not there, a
name that is no run name and a number of steps the ledger cannot hold are one line before anything starts (they
were said after the whole start-up, ~50 s under load, with the progress bar drawn first, and `--steps 10^12` was
taken). "Before anything starts": no Prefect server was started (it writes its log under LOOPLINE_HOME/logs) and
no run directory exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("args", "says"), [
    (["--resume", "no-such-run"], "error: no run named 'no-such-run'; `loopline runs` lists them"),
    (["--resume", "../x"], "error: --resume: '../x' is not a run name"),
    (["--resume", "no-such-run", "--steps", "0"], "error: --steps 0: give the number of learner steps to train to, from 1 to 1,000,000"),
    (["--resume", "no-such-run", "--steps", str(10**12)], f"error: --steps {10**12}: give the number of learner steps"),
])
def test_a_resume_that_cannot_run_is_one_line_before_anything_starts(args, says, database_url, tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "LOOPLINE_HOME": str(home), "LOOPLINE_DATABASE_URL": database_url, "COLUMNS": "200"}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "train", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 1 and len(said) == 1 and said[0].startswith(says), said
    assert not (home / "logs").exists() and not (home / "runs").exists(), sorted(str(p.relative_to(home)) for p in home.rglob("*"))
