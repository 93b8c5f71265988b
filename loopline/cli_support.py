"""What both CLIs share: one-line errors instead of tracebacks."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, TypeVar

from rich.console import Console

from loopline.store.errors import LooplineError

F = TypeVar("F", bound=Callable)

console = Console(soft_wrap=True)
err_console = Console(stderr=True)


def friendly_errors(fn: F) -> F:
    """A user error is one red line and exit code 1; `LOOPLINE_DEBUG=1` shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LooplineError as exc:
            if os.environ.get("LOOPLINE_DEBUG"):
                raise
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]
