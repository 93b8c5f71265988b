"""Registered environment versions: the rows `envregistry` reads and writes, one transaction per call."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from loopline.store.models import Environment


def find(session: Session, name: str, version: int | None = None, spec_hash: str | None = None) -> Environment | None:
    """NAME@VERSION, NAME with that spec hash, or (neither given) NAME's newest version that is not deprecated."""
    query = sa.select(Environment).where(Environment.name == name)
    if version is not None:
        query = query.where(Environment.version == version)
    elif spec_hash is not None:
        query = query.where(Environment.spec_hash == spec_hash)
    else:
        query = query.where(Environment.deprecated.is_(False)).order_by(Environment.version.desc()).limit(1)
    row = session.execute(query.execution_options(populate_existing=True)).scalar_one_or_none()
    session.commit()  # ends the read; with expire_on_commit=False the row stays usable
    return row


def versions(session: Session, name: str) -> list[int]:
    known = session.execute(
        sa.select(Environment.version).where(Environment.name == name).order_by(Environment.version)
    ).scalars().all()
    session.rollback()
    return list(known)


def insert_next_version(session: Session, name: str, spec_hash: str, spec: dict[str, Any], labels: dict[str, str]) -> Environment | None:
    """Register `spec` as NAME's next version; None when another process took that number first (try again)."""
    latest = session.execute(sa.select(sa.func.max(Environment.version)).where(Environment.name == name)).scalar_one()
    row = Environment(name=name, version=(latest or 0) + 1, spec_hash=spec_hash, spec=spec, **labels)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return None
    return row


def set_deprecated(session: Session, row: Environment, deprecated: bool) -> None:
    session.execute(sa.update(Environment).where(Environment.id == row.id).values(deprecated=deprecated))
    session.commit()


def listing(session: Session, include_deprecated: bool) -> list[Environment]:
    query = sa.select(Environment).order_by(Environment.name, Environment.version.desc())
    if not include_deprecated:
        query = query.where(Environment.deprecated.is_(False))
    rows = session.execute(query).scalars().all()
    session.commit()
    return list(rows)
