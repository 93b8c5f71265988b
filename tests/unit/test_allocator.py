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


FREED_INSIDE_THE_HEAP = (
    "import torch\n"
    "from loopline import allocator\n"
    "def rss():\n"
    "    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20\n"
    "allocator.tune()\n"
    "cached = [torch.ones(128 * 1024) for _ in range(600)]  # 600 x 512 KB: as a prefix cache's layers, below the threshold\n"
    "pin = torch.ones(1000)  # (allocated after them: the heap's top stays in use, so free cannot give it back)\n"
    "before = rss()\n"
    "del cached\n"
    "freed = rss()\n"
    "print(allocator.give_back(), round(before - freed), round(freed - rss()))\n"
)


def test_what_small_tensors_leave_inside_the_heap_is_given_back():
    """The engine's prefix cache is many tensors below the mmap threshold: freed, they stayed resident (only the
    heap's top is returned on `free`) until `give_back`."""
    ok, on_free, on_give_back = subprocess.run([sys.executable, "-c", FREED_INSIDE_THE_HEAP], capture_output=True, text=True, check=True).stdout.split()
    assert ok == "True"
    assert int(on_free) < 30 and int(on_give_back) > 250, (on_free, on_give_back)  # (of the 300 MB freed, in MB)
