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


def _read(session: Session, sql: str, params: dict[str, Any], take):
    """A read that holds no transaction open afterwards: a process frozen after it keeps no snapshot or locks."""
    try:
        return take(q(session, sql, **params))
    finally:
        session.rollback()


def rows(session: Session, sql: str, **params: Any) -> list[sa.Row]:
    return _read(session, sql, params, lambda r: list(r.all()))


def one_row(session: Session, sql: str, **params: Any) -> sa.Row:
    return _read(session, sql, params, lambda r: r.one())


def first_row(session: Session, sql: str, **params: Any) -> sa.Row | None:
    return _read(session, sql, params, lambda r: r.first())


def scalar(session: Session, sql: str, **params: Any) -> Any:
    return _read(session, sql, params, lambda r: r.scalar_one())


def scalar_or_none(session: Session, sql: str, **params: Any) -> Any:
    return _read(session, sql, params, lambda r: r.scalar_one_or_none())


def column(session: Session, sql: str, **params: Any) -> list[Any]:
    return _read(session, sql, params, lambda r: list(r.scalars().all()))
