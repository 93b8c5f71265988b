"""The console scripts' entry points (`loopline`, `envreg`): the CLI's own module is imported under a Ctrl-C guard.

Importing the CLI (typer, rich, the ledger's models) takes ~1.5 s on an idle machine and seconds on a busy one,
before any command's handlers exist: a Ctrl-C there printed a 31-line `KeyboardInterrupt` traceback (45 lines for
`envreg`). Nothing has started by then, so it is one line saying so. This module imports nothing of loopline's.

A Ctrl-C does not always arrive as `KeyboardInterrupt`: one raised while pydantic builds a model's validator comes
out as pydantic's `SchemaError` (CI saw "SchemaError: ... KeyboardInterrupt"). So the guard's own SIGINT handler
notes the key, and whatever the import then raises is that key's doing."""

from __future__ import annotations

import importlib
import signal
import sys

STOPPED_BEFORE = "Ctrl-C: stopped before anything started; nothing was done"


def _run(module: str) -> None:
    typed: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        typed.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        main = importlib.import_module(module).main
    except BaseException:
        if not typed:
            raise
        sys.stderr.write(STOPPED_BEFORE + "\n")
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGINT, previous)
    main()


def loopline() -> None:
    _run("loopline.cli")


def envreg() -> None:
    _run("loopline.envreg")
