"""What every ledger module shares: one transaction per call, and raw SQL with named parameters."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import sqlalchemy as sa
from sqlmodel import Session


@contextmanager
def transaction(session: Session) -> Iterator[None]:
    """Commit on success, roll back on any error: each ledger call is one transaction."""
    try:
        yield
        session.commit()
    except BaseException:
        session.rollback()
        raise


def q(session: Session, sql: str, **params: Any) -> sa.CursorResult:
    return session.execute(sa.text(sql), params)


def rows(session: Session, sql: str, **params: Any) -> list[sa.Row]:
    """A read that holds no transaction open afterwards."""
    try:
        return list(q(session, sql, **params).all())
    finally:
        session.rollback()
