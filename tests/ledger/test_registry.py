"""The environment registry in a real ledger: versions, diffs, deprecation, and `envreg` as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loopline.envregistry import registry
from loopline.errors import LooplineError
from tests.envfiles import ROWS, write_env

ARITHMETIC = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_env.yaml"


def test_registry_versions_only_on_change_and_diffs(db, tmp_path):
    name = f"env-{os.getpid()}-{tmp_path.name[-6:]}".lower().replace("_", "-")
    path = write_env(tmp_path, name, ROWS)
    first = registry.add(db, path)
    assert first.created and first.version == 1
    assert registry.add(db, path) == registry.Registered(name, 1, first.spec_hash, created=False)
    # an equivalent file (defaults spelled out) is the same environment
    path.write_text(path.read_text() + "budgets: {max_turns: 4}\n")
    assert not registry.add(db, path).created
    # a changed task file is a new version, even with the YAML untouched
    write_env(tmp_path, name, ROWS + [{"id": "c", "split": "train", "prompt": "p3"}])
    second = registry.add(db, path)
    assert second.created and second.version == 2
    text = registry.diff(registry.get(db, f"{name}@1"), registry.get(db, f"{name}@2"))
    assert "-  rows: <2 tasks" in text and "+  rows: <3 tasks" in text
    assert [t.id for t in registry.tasks_of(registry.get(db, name))] == ["a", "b", "c"]
    registry.set_deprecated(db, f"{name}@2", True)
    assert registry.get(db, name).version == 1
    with pytest.raises(LooplineError, match="already deprecated"):
        registry.set_deprecated(db, f"{name}@2", True)
    assert registry.add(db, path).deprecated  # re-adding the same spec says it is deprecated
    registry.set_deprecated(db, f"{name}@2", False)
    assert registry.get(db, name).version == 2
    with pytest.raises(LooplineError, match="not deprecated"):
        registry.set_deprecated(db, f"{name}@2", False)
    with pytest.raises(LooplineError, match="has versions 1, 2"):
        registry.get(db, f"{name}@7")


def test_invalid_task_file_registers_nothing(db, tmp_path):
    path = write_env(tmp_path, "never-registered", ROWS + [{"id": "a", "split": "eval", "prompt": "x"}])
    with pytest.raises(LooplineError, match="duplicate task id"):
        registry.add(db, path)
    with pytest.raises(LooplineError, match="no environment named"):
        registry.get(db, "never-registered")


def _envreg(*args, url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from loopline.envreg import app; app()", *args],
        env={**os.environ, "LOOPLINE_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_envreg_add_then_test_the_arithmetic_environment(database_url):
    added = _envreg("add", str(ARITHMETIC), url=database_url)
    assert added.returncode == 0, added.stderr
    assert "arithmetic@" in added.stdout
    again = _envreg("add", str(ARITHMETIC), url=database_url)
    assert again.stdout.startswith("unchanged arithmetic@")
    tested = _envreg("test", "arithmetic", "--tasks", "3", url=database_url)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert tested.stdout.count("ok") >= 3


def test_envreg_test_verbose_shows_steps_and_plays_eval_tasks(database_url):
    assert _envreg("add", str(ARITHMETIC), url=database_url).returncode == 0
    tested = _envreg("test", "arithmetic", "--split", "eval", "--verbose", url=database_url)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "task arith-eval-00000" in tested.stdout and "calc(expression=" in tested.stdout
    assert "| " in tested.stdout and "verdict: reward 1" in tested.stdout


def test_show_prints_what_a_user_wrote(db, tmp_path):
    name = f"show-{os.getpid()}-{tmp_path.name[-6:]}".lower().replace("_", "-")
    path = write_env(tmp_path, name, ROWS, extra="reset:\n  system_prompt: |\n    line one\n    line two\n")
    text = registry.show(registry.get(db, registry.add(db, path).ref))
    assert "workdir" not in text  # the local backend has no fixed workdir
    assert "system_prompt: |\n    line one\n    line two\n" in text


def test_envreg_validate_reports_one_clear_error(tmp_path, database_url):
    bad = tmp_path / "env.yaml"
    bad.write_text(ARITHMETIC.read_text().replace("max_turns: 3", "max_turns: 0"))
    result = _envreg("validate", str(bad), url=database_url)
    assert result.returncode == 1
    assert f"{bad}:" in result.stderr and "budgets.max_turns" in result.stderr
    assert "Traceback" not in result.stderr
