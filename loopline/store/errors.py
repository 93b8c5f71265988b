"""Errors of the ledger (the base, `LooplineError`, is shared by every layer: loopline/errors.py)."""

from loopline.errors import LooplineError


class DatabaseUnavailable(LooplineError):
    pass


class SchemaOutOfDate(LooplineError):
    pass


class LedgerConflict(LooplineError):
    """The ledger refuses a write that would break an invariant (double training, version gap, ...)."""


class LostTheRun(LedgerConflict):
    """Another process drives the run now: this one's learner commit is refused (fencing)."""

    @classmethod
    def of(cls, name: str, driver: str, holder: str | None) -> "LostTheRun":
        return cls(
            f"run {name}: this process ({driver}) no longer drives it, {holder} took it over (this one was stopped or "
            "cut off for longer than the lease); it stops, and keeps nothing it trained since"
        )


def is_outage(exc: BaseException) -> bool:
    """The database could not be reached (the same write may succeed later), as opposed to a write it
    refused (data it cannot hold, a broken invariant: the same write fails again)."""
    return is_database_outage(exc) or isinstance(exc, (ConnectionError, TimeoutError))


def is_database_outage(exc: BaseException) -> bool:
    """The database driver's own "could not reach / lost the server" errors."""
    import psycopg
    import sqlalchemy.exc

    return isinstance(
        exc,
        (DatabaseUnavailable, sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, psycopg.OperationalError,
         psycopg.InterfaceError),
    )
