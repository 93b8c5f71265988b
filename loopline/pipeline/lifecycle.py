"""A run's lifecycle in the ledger: which process drives it, that it is alive, and how it ended.

No run may stay `running` without a live process behind it. The process that trains a run marks it
running under its holder name, writes a heartbeat every few seconds, and on the way out records how it
ended, whatever the way: completed; interrupted (Ctrl-C, SIGTERM, SIGHUP); cancelled (`loopline cancel`, seen
at a heartbeat, which then stops this process as Ctrl-C would, so every stage unwinds the same way);
failed, with the error in one line. A process that finds at a heartbeat that another drives the run now
(it was frozen past the lease) stops the same way and says so in one line; the run is the other's. A
SIGKILLed process writes nothing: `loopline runs` shows its run as stale once its heartbeat is older than
the lease time (at once when its pid is gone on this host). A second process cannot start driving a run
whose holder is alive (`ledger.start_run`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import uuid
from typing import Callable, Iterator

from sqlmodel import Session

from loopline import holder, stop_signals
from loopline.store import ledger
from loopline.store.errors import LostTheRun
from loopline.store.queries import HEARTBEAT_S

log = logging.getLogger(__name__)


def how_it_ended(exc: BaseException | None, cancelled: bool) -> tuple[str, str | None]:
    """(status, reason) for a run whose driving process leaves with `exc` (None: it finished)."""
    if exc is None:
        return "completed", None
    if cancelled:
        return "cancelled", "cancelled (loopline cancel)"
    # (a stop signal whose exception was replaced on its way up, by a cleanup that failed, is still a stop)
    if isinstance(exc, KeyboardInterrupt) or stop_signals.received() == signal.SIGINT:
        return "interrupted", "interrupted (Ctrl-C); resume with loopline train --resume RUN"
    # (Prefect raises its TerminationSignal, which carries the signal, in a flow that gets SIGTERM)
    if getattr(exc, "signal", None) == signal.SIGTERM or stop_signals.received() == signal.SIGTERM:
        return "interrupted", "terminated (SIGTERM); resume with loopline train --resume RUN"
    if stop_signals.received() == signal.SIGHUP or (isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGHUP):
        return "interrupted", "hung up (SIGHUP: its terminal closed); resume with loopline train --resume RUN"
    first = (str(exc).strip().splitlines() or [""])[0]
    return "failed", f"{type(exc).__name__}: {first}"[:500]


@contextlib.contextmanager
def driving(session_factory: Callable[[], Session], run_id: uuid.UUID, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """The run is driven by this process while inside; on the way out its status records how it ended."""
    me = holder.this_process()
    with session_factory() as s:
        ledger.start_run(s, run_id, me)
    stop, cancelled, lost = threading.Event(), threading.Event(), threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            try:
                with session_factory() as s:
                    asked = ledger.heartbeat(s, run_id, me)
            except Exception as exc:  # the ledger out of reach: the run's stages will say so; keep beating
                log.debug("heartbeat of run %s failed: %s", run_id, exc)
                continue
            if asked == "cancel" and not cancelled.is_set():
                cancelled.set()
                log.warning("run %s: cancel requested (loopline cancel); stopping as on Ctrl-C", run_id)
                os.kill(os.getpid(), signal.SIGINT)
            elif asked == "lost" and not lost.is_set():
                lost.set()
                os.kill(os.getpid(), signal.SIGINT)

    def left_at_once(signum: int) -> None:  # (no `finally` below runs)
        stop.set()
        status, reason = how_it_ended(KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum), cancelled.is_set())
        with session_factory() as s:
            ledger.end_run(s, run_id, me, status, reason)

    thread = threading.Thread(target=beat, name=f"heartbeat-{run_id}", daemon=True)
    thread.start()
    error: BaseException | None = None
    try:
        with stop_signals.at_once(left_at_once):
            yield
    except BaseException as exc:
        error = exc
        if lost.is_set():  # stopped by the heartbeat's Ctrl-C, whatever surfaced: its status is the new holder's to write
            with session_factory() as s:
                run = ledger.get_run(s, str(run_id))
            raise LostTheRun.of(run.name, me, run.holder) from None
        raise
    finally:
        stop.set()
        status, reason = how_it_ended(error, cancelled.is_set())
        try:
            with session_factory() as s:
                ledger.end_run(s, run_id, me, status, reason)
        except Exception as exc:  # never raised over the reason the run stops; `loopline runs` will show it stale
            log.warning("could not record in the ledger that run %s ended (%s): %s", run_id, status, exc)
