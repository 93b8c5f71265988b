"""Errors a user acts on: each message says what is wrong and what to run."""


class LooplineError(Exception):
    """Printed as one line by the CLIs, never as a traceback."""


class DatabaseUnavailable(LooplineError):
    pass


class SchemaOutOfDate(LooplineError):
    pass


class LedgerConflict(LooplineError):
    """The ledger refuses a write that would break an invariant (double training, version gap, ...)."""
