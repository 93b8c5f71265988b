"""What this process is doing that the ledger cannot show yet: an evaluation's episodes are recorded only as
one result at its end, so its progress lives here, and the CLI's run bar (`cli_progress.follow_run`, in the
same process as the flow it runs) reads it; and which runs this process has opened (a stop before that has
nothing to resume). Thread-safe; one entry per activity name."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_current: dict[str, tuple[int, int]] = {}


def report(name: str, done: int, total: int) -> None:
    with _lock:
        _current[name] = (done, total)


def clear(name: str) -> None:
    with _lock:
        _current.pop(name, None)


def snapshot() -> dict[str, tuple[int, int]]:
    with _lock:
        return dict(_current)


_opened: set[str] = set()


def run_opened(name: str) -> None:
    """This process drives run `name` from now on (its row exists, its lease is held)."""
    with _lock:
        _opened.add(name)


def opened(name: str) -> bool:
    with _lock:
        return name in _opened
