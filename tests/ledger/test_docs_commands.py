"""The how-to pages' commands, run as the pages write them: each page that shows a `loopline` or `envreg` command
has one of them run here for real (a fresh LOOPLINE_HOME, the test ledger, the repository as the working
directory), or names the test that runs it (minutes of training, a server of its own)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOW_TO = ROOT / "docs" / "how-to"

SCORED = r"│ 1\s+│ ok\s+│"  # (envreg test's table: a task scored 1, its verdict ok)
# a command as a page writes it -> what its output says when it worked (a regex), and files it reads that the page
# describes rather than ships (name -> the repository's file the page shows for it)
RUN = {
    "loopline db status": ("revision", {}),
    "loopline runs": ("no runs|status .* consumed", {}),  # (the ledger the tests share may hold runs)
    "loopline plan examples/plan_7b_coding.yaml --gpu h100 --gpus 8": ("fits:", {}),
    "loopline plan examples/arithmetic_quickstart.yaml": ("fits:", {}),
    "envreg validate my_env.yaml": (r"my_env.yaml: valid \(", {"my_env.yaml": "examples/arithmetic_env.yaml"}),  # ("the quickstart's, whole")
    "envreg test my_env.yaml --tasks 3 -v": (SCORED, {"my_env.yaml": "examples/arithmetic_env.yaml"}),
    "envreg test examples/agents/arithmetic_tools_env.yaml --tasks 3": (SCORED, {}),
}
# a page whose every command is long -> the test that runs it
ELSEWHERE = {
    "extend.md": "tests/integration/test_plugins.py",  # (the page's module and config, two ranks and a worker)
    "hf-model.md": "tests/integration/test_models.py",  # (pulls and builds models)
    "prefect-server.md": "tests/integration/test_server.py",
    "work-pools.md": "tests/integration/test_work_pool.py",  # (a Prefect server, a pool, workers)
}


def _commands(page: Path) -> set[str]:
    """The page's `loopline` / `envreg` command lines (shell blocks, comments and continuations dropped)."""
    found = set()
    for block in re.findall(r"^```(?:bash|sh|console)\n(.*?)^```", page.read_text(), re.M | re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words and words[0] in ("loopline", "envreg"):
                found.add(shlex.join(words))
    return found


def test_every_how_to_page_with_a_command_has_one_run_here_or_names_the_test_that_runs_it():
    pages = {page.relative_to(HOW_TO).as_posix(): _commands(page) for page in sorted(HOW_TO.rglob("*.md"))}
    unchecked = [name for name, commands in pages.items() if commands and not commands & set(RUN) and name not in ELSEWHERE]
    assert not unchecked, f"run one of their commands in RUN (or name the test that does in ELSEWHERE): {unchecked}"
    assert not [c for c in RUN if not any(c in commands for commands in pages.values())], "a command no page shows (any more)"
    for name, test in ELSEWHERE.items():
        assert pages[name] and (ROOT / test).is_file(), name


@pytest.mark.parametrize("command", sorted(RUN))
def test_a_how_to_command_runs_as_the_page_writes_it(command, database_url, tmp_path):
    says, files = RUN[command]
    cwd = ROOT
    if files:  # (the page's own example, under the name the page gives it)
        cwd = tmp_path / "work"
        cwd.mkdir()
        for name, source in files.items():
            shutil.copy(ROOT / source, cwd / name)
    words = shlex.split(command)
    env = {**os.environ, "LOOPLINE_HOME": str(tmp_path / "home"), "LOOPLINE_DATABASE_URL": database_url, "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", f"loopline.{'cli' if words[0] == 'loopline' else 'envreg'}", *words[1:]],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and re.search(says, said), said[-3000:]
