"""`benchmarks/gpu_check.sh` on a machine without a GPU: one line saying what is missing, nothing started."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine runs the check itself")
def test_the_gpu_check_stops_with_one_line_on_a_machine_without_a_gpu():
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == ["gpu_check: no NVIDIA GPU here (nvidia-smi not found): run it on a machine with one"]
