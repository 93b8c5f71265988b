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


def undescribed_metrics(db, run_id) -> set[str]:
    """Metric names a run recorded that `loopline.metrics` does not describe (the docs' metric reference is
    generated from it: a name missing there reaches users unexplained)."""
    import sqlalchemy as sa

    from loopline.metrics import METRICS

    names = {name for (name,) in db.execute(sa.text("SELECT DISTINCT name FROM metric WHERE run_id = :r"), {"r": run_id})}
    db.rollback()
    return names - set(METRICS)
