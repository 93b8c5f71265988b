"""A stop signal whose exception is replaced on its way up still stops the run (loopline/stop_signals.py).

Seen in a run: a SIGTERM that landed inside a ledger query left psycopg's pipeline busy; the query's cleanup
raised `OperationalError: cannot exit pipeline mode while busy` over it, the task retried that as an outage,
and the run trained on. Here the signal is real (sent to this process) and its exception is replaced the same
way, by an error the retry rule would otherwise retry.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import psycopg
import pytest

from loopline import stop_signals
from loopline.flows.lifecycle import how_it_ended
from loopline.tasks.loop import transient, waiting_out_outages


class Bridge(BaseException):
    """What Prefect's SIGTERM handler raises inside a flow run (its TerminationSignal)."""


def _bridge(signum, frame):
    raise Bridge(signum)


def _raise(exc: BaseException):
    raise exc


def _signal_lost_in_a_cleanup(sig: int) -> BaseException:
    """The signal arrives mid-query; the query's cleanup fails and raises over the signal's exception."""
    try:
        try:
            os.kill(os.getpid(), sig)
            time.sleep(5)  # (the handler runs at once: never reached)
        finally:
            raise psycopg.OperationalError("sending query failed: cannot exit pipeline mode while busy")
    except psycopg.OperationalError as exc:
        return exc
    raise AssertionError("the cleanup's error did not replace the signal's")


@pytest.fixture
def prefect_like_sigterm():
    before = signal.signal(signal.SIGTERM, _bridge)
    yield
    signal.signal(signal.SIGTERM, before)


def test_a_sigterm_replaced_by_an_outage_error_is_not_retried_says_terminated_and_is_raised_again(prefect_like_sigterm):
    with stop_signals.noted():
        error = _signal_lost_in_a_cleanup(signal.SIGTERM)
        assert transient(None, None, SimpleNamespace(data=error)) is False  # (an outage error: retried when not told to stop)
        calls = []
        with pytest.raises(psycopg.OperationalError):  # nor waited out by the flow's own reads
            waiting_out_outages(lambda: calls.append(1) or _raise(error))
        assert calls == [1]
        assert how_it_ended(error, cancelled=False) == ("interrupted", "terminated (SIGTERM); resume with loopline train --resume RUN")
        with pytest.raises(Bridge):
            stop_signals.raise_if_received()  # the loop's next step: the handler's own exception again
    # outside: the handler in place again, nothing remembered (a later run in this process starts unasked)
    assert signal.getsignal(signal.SIGTERM) is _bridge
    assert stop_signals.received() is None
    assert transient(None, None, SimpleNamespace(data=error)) is True
    assert how_it_ended(error, cancelled=False)[0] == "failed"


def test_a_ctrl_c_replaced_by_another_error_says_interrupted_and_is_raised_again():
    with stop_signals.noted():
        error = _signal_lost_in_a_cleanup(signal.SIGINT)
        assert how_it_ended(error, cancelled=False) == ("interrupted", "interrupted (Ctrl-C); resume with loopline train --resume RUN")
        with pytest.raises(KeyboardInterrupt):
            stop_signals.raise_if_received()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    stop_signals.raise_if_received()  # (nothing noted outside: returns)


def test_a_run_inside_a_run_leaves_the_noting_to_the_outer_one(prefect_like_sigterm):
    with stop_signals.noted():
        outer = signal.getsignal(signal.SIGTERM)
        with stop_signals.noted():
            assert signal.getsignal(signal.SIGTERM) is outer
        _signal_lost_in_a_cleanup(signal.SIGTERM)  # the inner one's exit forgot nothing
        assert stop_signals.received() == signal.SIGTERM
