"""The one fencing rule: a process writes for a run only while it drives it. A process frozen past its lease
(SIGSTOP, a stalled VM) may wake after another took the run over; its next plan, learner claim or commit is
refused in the transaction that would write."""

from __future__ import annotations

import uuid

from sqlmodel import Session

from loopline.store._sql import q
from loopline.store.errors import LostTheRun


def fence(session: Session, run_id: uuid.UUID, driver: str) -> None:
    """Refuse (LostTheRun) unless `driver` still drives the run, inside the caller's transaction: the write that
    follows lands only if the run was still this process's when it did."""
    now = q(session, "SELECT name, holder FROM run WHERE id = :r", r=run_id).one()
    if now.holder != driver:
        raise LostTheRun.of(now.name, driver, now.holder)
