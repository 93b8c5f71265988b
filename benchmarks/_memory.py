"""A side's memory as one number: every process it runs, summed, sampled while it runs (issue 66).

A process's own peak (`ru_maxrss`, `RUSAGE_CHILDREN`) leaves out what a side runs beside it: loopline's embedded
PostgreSQL (started by `pg_ctl`, so not the train process's child) and its Prefect server, TRL's dataloader
workers. Summed RSS counts a shared library once per process (torch's are mapped by every process that imports it),
so each process counts its PSS (proportional set size: a page shared by n processes counts 1/n in each); the sum
over processes is then the memory the side holds. Reported in GiB (2**30 bytes) on every side.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import psutil

GIB = 2**30


def _pss(process: psutil.Process) -> int:
    try:
        return process.memory_full_info().pss
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return 0


def _kind(process: psutil.Process) -> str:
    """A process named as a reader of the breakdown knows it: `postgres`, `python -m uvicorn --app-dir` (the Prefect
    server), `python -m loopline.cli train`."""
    try:
        line = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "gone"
    if not line:
        return process.name()
    words = [w.rsplit("/", 1)[-1] for w in line[:4]]
    if words[0].startswith("postgres"):
        return "postgres"
    return " ".join(w for w in words if not w.startswith("/"))[:60]


def side_processes(root: int, marks: Sequence[str] = ()) -> list[psutil.Process]:
    """`root` and its descendants, and any other process whose command line names one of `marks` (a side's home
    directory: the embedded PostgreSQL's data directory is in its command line)."""
    try:
        found = {root: psutil.Process(root)}
        found |= {p.pid: p for p in found[root].children(recursive=True)}
    except psutil.NoSuchProcess:
        found = {}
    if marks:
        for process in psutil.process_iter(["cmdline"]):
            line = " ".join(process.info["cmdline"] or ())
            if process.pid not in found and any(mark in line for mark in marks):
                found[process.pid] = process
                try:
                    found |= {p.pid: p for p in process.children(recursive=True)}
                except psutil.NoSuchProcess:
                    pass
    return list(found.values())


class TreeMemory:
    """Samples a side's summed PSS every `every_s` seconds in a thread until `stop()`; `peak_gib` is the largest
    sum seen, `processes` the most processes counted in one sample."""

    def __init__(self, root: int, marks: Sequence[str] = (), every_s: float = 1.0):
        self.root, self.marks, self.every_s = root, tuple(marks), every_s
        self.peak_bytes, self.processes, self.samples = 0, 0, 0
        self.at_peak: dict[str, float] = {}  # GiB by process kind at the peak sample (what to cut first)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="tree-memory", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stopped.is_set():
            processes = side_processes(self.root, self.marks)
            sizes = [(p, _pss(p)) for p in processes]
            total = sum(size for _, size in sizes)
            if total > self.peak_bytes:
                self.peak_bytes, self.at_peak = total, {}
                for process, size in sizes:
                    kind = _kind(process)
                    self.at_peak[kind] = self.at_peak.get(kind, 0.0) + size / GIB
            self.processes = max(self.processes, len(processes))
            self.samples += 1
            self._stopped.wait(self.every_s)

    def stop(self) -> dict:
        self._stopped.set()
        self._thread.join()
        return {"peak_gib": self.peak_bytes / GIB, "at_peak_gib": dict(sorted(self.at_peak.items(), key=lambda kv: -kv[1])), "processes": self.processes, "samples": self.samples, "every_s": self.every_s,
                "measure": "peak over samples of the summed PSS of every process of the side, GiB"}


def wait_measuring(process, marks: Sequence[str] = (), every_s: float = 1.0, deadline: float | None = None) -> dict:
    """Wait for a `subprocess.Popen` (until `deadline`, monotonic) while measuring its side."""
    sampler = TreeMemory(process.pid, marks, every_s)
    while process.poll() is None and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.5)
    return sampler.stop()
