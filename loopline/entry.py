"""The console scripts' entry points (`loopline`, `envreg`): the CLI's own module is imported under a Ctrl-C guard.

Importing the CLI (typer, rich, the ledger's models) takes ~1.5 s on an idle machine and seconds on a busy one,
before any command's handlers exist: a Ctrl-C there printed a 31-line `KeyboardInterrupt` traceback (45 lines for
`envreg`). Nothing has started by then, so it is one line saying so. This module imports nothing of loopline's."""

from __future__ import annotations

import importlib
import sys

STOPPED_BEFORE = "Ctrl-C: stopped before anything started; nothing was done"


def _run(module: str) -> None:
    try:
        main = importlib.import_module(module).main
    except KeyboardInterrupt:
        sys.stderr.write(STOPPED_BEFORE + "\n")
        raise SystemExit(130) from None
    main()


def loopline() -> None:
    _run("loopline.cli")


def envreg() -> None:
    _run("loopline.envreg")
