"""The modules a user's components live in, imported in every process of a run before anything names them.

A component registers itself when its module is imported (`@POLICY_LOSSES.register("mine")`), and a name is valid
only where its module was imported. A run has many processes: the CLI, the learner's ranks (fresh interpreters,
maybe on other hosts), rollout workers, evaluations. Each one reads the run config (or, a follower rank, hears its
modules from rank 0) and imports what its `imports:` lists, and what `LOOPLINE_IMPORTS` lists, before validating
the rest; an env spec's `imports:` likewise for its sandbox backend.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Iterable

ENV = "LOOPLINE_IMPORTS"  # comma-separated modules every loopline command of this environment imports first
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_imported: list[str] = []  # in the order imported: what a launched process is told to import too


def from_environment() -> list[str]:
    return [m.strip() for m in os.environ.get(ENV, "").split(",") if m.strip()]


def load(modules: Iterable[str] = ()) -> None:
    """Import `LOOPLINE_IMPORTS`' modules, then `modules`, each once per process. ValueError (said where the
    module was named): not a module name, or its import failed, with why."""
    for name in [*from_environment(), *modules]:
        if name in _imported:
            continue
        if not MODULE.match(name):
            raise ValueError(f"{name!r} is not a Python module name (dotted identifiers, e.g. my_package.components)")
        try:
            importlib.import_module(name)
        except Exception as exc:  # (its own error, whatever it is: the one line says which module and why)
            raise ValueError(
                f"cannot import {name!r} ({type(exc).__name__}: {exc}); install it where this process runs "
                f"(pip install) or put its folder on PYTHONPATH"
            ) from None
        _imported.append(name)


def imported() -> list[str]:
    return list(_imported)
