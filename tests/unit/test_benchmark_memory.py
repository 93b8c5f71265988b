"""The race's memory measure (benchmarks/_memory.py): every process of a side, summed, shared pages counted once."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from benchmarks._memory import GIB, TreeMemory

HOLDS = "import sys, time; block = bytearray({mb} * 2**20); block[::4096] = b'x' * len(block[::4096]); print('ready', flush=True); time.sleep(60)"


def _holding(mb: int, *marks: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDS.format(mb=mb), *marks], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def test_a_side_is_its_process_tree_and_the_processes_that_name_its_home_summed():
    """A parent holding 150 MiB whose child holds 150 MiB, and a process outside the tree (as the embedded
    PostgreSQL, started by pg_ctl) holding 100 MiB that names the side's home: ~400 MiB in 3 processes. A process
    that names another home is not counted."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"child = subprocess.Popen([sys.executable, '-c', {HOLDS.format(mb=150)!r}], stdout=subprocess.PIPE, text=True); "
                               "child.stdout.readline(); " + HOLDS.format(mb=150).split("; ", 1)[1]], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "ready"  # (its child's block is touched by then)
    beside, other = _holding(100, "/tmp/side-home-a"), _holding(300, "/tmp/side-home-b")
    try:
        memory = TreeMemory(parent.pid, marks=["/tmp/side-home-a"], every_s=0.2)
        time.sleep(0.7)
        measured = memory.stop()
    finally:
        for process in [*psutil.Process(parent.pid).children(recursive=True), parent, beside, other]:
            process.kill()
    assert measured["processes"] == 3
    assert 0.38 < measured["peak_gib"] < 0.55, measured  # (300 MiB in the tree + 100 beside, and each interpreter's own)
    assert measured["samples"] >= 2
    # the peak by process kind, to say what to cut first: it adds up to the peak, the side's largest process first
    kinds = measured["at_peak_gib"]
    assert sum(kinds.values()) == pytest.approx(measured["peak_gib"]) and len(kinds) == 3, kinds
    assert list(kinds.values()) == sorted(kinds.values(), reverse=True) and "bytearray(100" in list(kinds)[-1], kinds
    assert GIB == 2**30
