"""What both CLIs share: one-line errors instead of tracebacks."""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Callable, TypeVar

from rich.console import Console
from rich.text import Text

from loopline.envregistry.sandbox.base import InfraFailure
from loopline.errors import LooplineError
from loopline.rollout.engine import EngineError
from loopline.store.errors import is_database_outage

F = TypeVar("F", bound=Callable)

console = Console(soft_wrap=True)
err_console = Console(stderr=True)


def print_error(message: str) -> None:
    """The message as plain text: a user's `[...]` or a regex in it is not rich markup."""
    err_console.print(Text("error: ", style="bold red") + Text(message), highlight=False, soft_wrap=True)


class _UserErrorsOnce(logging.Filter):
    """Prefect logs a flow's or task's exception with its traceback, and again in the state it ended in; a
    user error (LooplineError) is printed once, as one line, by `friendly_errors` instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], LooplineError):
            return False
        # each retry's line, without its traceback: failures outside loopline's code, which `friendly_errors` says once
        if record.exc_info and (is_database_outage(record.exc_info[1]) or isinstance(record.exc_info[1], (EngineError, InfraFailure))):
            record.exc_info, record.exc_text = None, None
        message = record.getMessage()
        return not any(f"{name}:" in message or f"{name}(" in message for name in _user_error_names())


def _user_error_names(kind: type = LooplineError) -> set[str]:
    return {kind.__name__}.union(*(_user_error_names(sub) for sub in kind.__subclasses__()))


def friendly_errors(fn: F) -> F:
    """A user error is one red line and exit code 1; `LOOPLINE_DEBUG=1` shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not os.environ.get("LOOPLINE_DEBUG"):
            for name in ("prefect.flow_runs", "prefect.task_runs"):
                logger = logging.getLogger(name)
                if not any(isinstance(f, _UserErrorsOnce) for f in logger.filters):
                    logger.addFilter(_UserErrorsOnce())
            # a connection lost in an outage is dropped by the pool (a traceback each time, nothing to act on)
            logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)
        try:
            return fn(*args, **kwargs)
        except LooplineError as exc:
            if os.environ.get("LOOPLINE_DEBUG"):
                raise
            print_error(str(exc))
            sys.exit(1)
        except EngineError as exc:  # the engine still failing after the retries: its message names the server and why
            if os.environ.get("LOOPLINE_DEBUG"):
                raise
            print_error(f"{exc}; fix that and run the command again (nothing committed is lost; a run resumes where it stopped)")
            sys.exit(1)
        except InfraFailure as exc:  # a sandbox still failing after the retries (an evaluation's episode)
            if os.environ.get("LOOPLINE_DEBUG"):
                raise
            print_error(
                f"a sandbox kept failing: {str(exc).strip()}; check the environment on its own (`envreg test ENV`), then run "
                "the command again (nothing committed is lost; a run resumes where it stopped)"
            )
            sys.exit(1)
        except Exception as exc:
            if os.environ.get("LOOPLINE_DEBUG") or not is_database_outage(exc):
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print_error(
                f"the ledger could not be reached ({first}); nothing it committed is lost: once it is back, run the "
                "command again (a run resumes with `loopline train --resume RUN`)"
            )
            sys.exit(1)

    return wrapper  # type: ignore[return-value]
