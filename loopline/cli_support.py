"""What both CLIs share: one-line errors instead of tracebacks."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, TypeVar

from rich.console import Console
from rich.text import Text

from loopline.errors import LooplineError

F = TypeVar("F", bound=Callable)

console = Console(soft_wrap=True)
err_console = Console(stderr=True)


def print_error(message: str) -> None:
    """The message as plain text: a user's `[...]` or a regex in it is not rich markup."""
    err_console.print(Text("error: ", style="bold red") + Text(message), highlight=False, soft_wrap=True)


def friendly_errors(fn: F) -> F:
    """A user error is one red line and exit code 1; `LOOPLINE_DEBUG=1` shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LooplineError as exc:
            if os.environ.get("LOOPLINE_DEBUG"):
                raise
            print_error(str(exc))
            sys.exit(1)

    return wrapper  # type: ignore[return-value]
