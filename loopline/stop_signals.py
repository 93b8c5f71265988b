"""Ctrl-C and SIGTERM, remembered: a stop signal must stop the process even when its exception is lost.

Python delivers a signal as an exception raised wherever the main thread happens to be, and code that
cleans up on the way out can replace it with an exception of its own. Measured: a SIGTERM that landed
inside a ledger query left psycopg's pipeline busy, its cleanup raised `OperationalError: cannot exit
pipeline mode while busy`, the task retried that as a database outage, and the run trained on (60 s,
120 more steps) as if nothing had been asked. So each arrival is also noted here; the loop raises it
again at its next step (`raise_if_received`), nothing is retried after it, and the run's status
says it was interrupted, whatever exception surfaced first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: list[tuple[int, Callable]] = []  # (signal, the handler it went to) for each arrival while noted


@contextlib.contextmanager
def noted() -> Iterator[None]:
    """While inside, each Ctrl-C and SIGTERM is noted, then handed to the handler in place (Prefect's SIGTERM bridge
    inside a flow run, KeyboardInterrupt for Ctrl-C): enter it inside the flow run. On the way out the handlers
    are put back and the notes forgotten, so a later run in the same process (a notebook) starts unasked. Only the
    main thread can install handlers; elsewhere (a flow run in a thread) this notes nothing."""
    if threading.current_thread() is not threading.main_thread() or any(
        getattr(signal.getsignal(sig), "noting", False) for sig in STOP_SIGNALS
    ):
        yield  # (not the main thread; or a run inside a run: the outer one notes)
        return
    previous = {int(sig): signal.getsignal(sig) for sig in STOP_SIGNALS}
    # (SIG_IGN / SIG_DFL: the process ignores the signal or dies of it, nothing to lose)
    wrapped: dict[int, Callable] = {sig: handler for sig, handler in previous.items() if callable(handler)}

    def noting(signum: int, frame: FrameType | None) -> None:
        _received.append((signum, wrapped[signum]))
        wrapped[signum](signum, frame)

    noting.noting = True  # type: ignore[attr-defined]
    for sig in wrapped:
        signal.signal(sig, noting)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        _received.clear()


def received() -> int | None:
    """The first stop signal this process got while noting, if any."""
    return _received[0][0] if _received else None


def raise_if_received() -> None:
    """Raise the first stop signal's exception again (its handler's), in case it was replaced on its way up."""
    if _received:
        signum, handler = _received[0]
        handler(signum, None)
        raise KeyboardInterrupt  # (a handler that returned: stop anyway)
