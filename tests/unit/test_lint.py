"""The code passes ruff (pyflakes' checks: unused and undefined names, and pycodestyle's errors) and its typed
core passes mypy, as part of the one test command, so CI and the quick tier both run them. Configured in
pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_typed_core_type_checks():
    """mypy over the files pyproject's [tool.mypy] lists (the RL records, trainer, rollout, stages): a protocol
    an engine does not meet, an Optional used unchecked, a record given a value outside its Literal."""
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
