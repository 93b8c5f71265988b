"""Who holds a lease: `host:pid:start` names one process, so a dead holder on this host is recognised at once.

A lease otherwise only ends when it expires (`lease_seconds`). When the holder ran on this
host and its pid is gone, or now belongs to a process started at another time (the pid was
reused), nobody will ever renew or commit it: a resumed run may expire it immediately instead
of waiting. Holders on other hosts are never judged from here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from typing import Callable


def process_alive(pid: int) -> bool:
    """Whether a process on this host still exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "(comm)" start at field 3


def this_process() -> str:
    # Not cached: a forked child is another holder.
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid) or 0}"


def application_name(holder: str) -> str:
    """The name a holder's database sessions carry (PostgreSQL's `application_name`, cut at 63 bytes), so that a
    process taking a run over can end the sessions of the one it replaced: pid and start first, the host last,
    where a cut can only shorten an unusually long host name."""
    parts = holder.split(":")
    name = f"loopline {parts[1]}:{parts[2]}@{parts[0]}" if len(parts) >= 3 else f"loopline {holder}"
    return name.encode()[:63].decode(errors="ignore")


def is_dead(holder: str | None) -> bool:
    """True only when certain: the holder ran on this host and that process no longer exists."""
    parts = (holder or "").split(":")
    if len(parts) < 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    return _start_ticks(int(parts[1])) != parts[2]


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets SIGTERM when this process dies, even by SIGKILL
    (the kernel sends it), so a killed trainer leaves no server behind."""
    parent = os.getpid()

    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec
