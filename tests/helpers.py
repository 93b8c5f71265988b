"""Small helpers the integration tests share: a free port, and waiting for a started server to answer."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path


def wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """Until `url` answers; fails with the server's log when it died or took longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)


class cpu_load:
    """`processes` busy loops beside the test, as another job on a shared machine: a guarantee that must hold
    "under load" is tested with them running (thread scheduling then differs from an idle machine's)."""

    def __init__(self, processes: int = 2):
        self.processes = processes
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "cpu_load":
        import sys

        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.processes)]
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
