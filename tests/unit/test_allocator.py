"""The CLI's allocator setting (loopline/allocator.py): on for the process and its children, a user's own kept."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = (
    "import os, subprocess, sys\n"
    "from loopline import allocator\n"
    "print(allocator.tune())\n"
    "print(subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get(\"MALLOC_MMAP_THRESHOLD_\"))'],"
    " capture_output=True, text=True).stdout.strip())\n"
)


def _run(env: dict[str, str]) -> list[str]:
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True).stdout.split()


def test_the_threshold_is_fixed_for_the_process_and_inherited_by_its_children():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    assert _run(env) == ["True", str(1 << 20)]


def test_a_threshold_the_user_set_is_kept():
    assert _run({**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}) == ["False", "65536"]
