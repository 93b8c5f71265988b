"""Errors of the ledger (the base, `LooplineError`, is shared by every layer: loopline/errors.py)."""

from loopline.errors import LooplineError


class DatabaseUnavailable(LooplineError):
    pass


class SchemaOutOfDate(LooplineError):
    pass


class LedgerConflict(LooplineError):
    """The ledger refuses a write that would break an invariant (double training, version gap, ...)."""
