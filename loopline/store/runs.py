"""Runs: their lifecycle (create, start, heartbeat, end, cancel, delete), who drives each (fencing), and
whether that process still lives."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

import sqlalchemy as sa
from psycopg.types.json import Jsonb
from sqlmodel import Session

from loopline.errors import LooplineError
from loopline.holder import application_name
from loopline.store._sql import q, transaction
from loopline.store.errors import LedgerConflict
from loopline.store.fencing import fence
from loopline.store.models import Run
from loopline.store.queries import run_lease, shown_status


def config_hash(config: dict[str, Any]) -> str:
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def create_run(
    session: Session,
    name: str,
    config: dict[str, Any],
    initial_weights_uri: str,
    initial_sha256: str | None = None,
) -> Run:
    """Create a run with policy version 0, or return the existing run of that name if its config matches."""
    digest = config_hash(config)
    with transaction(session):
        q(
            session,
            "INSERT INTO run (id, name, config, config_hash, status) "
            "VALUES (:id, :name, :config, :hash, 'created') ON CONFLICT (name) DO NOTHING",
            id=uuid.uuid4(),
            name=name,
            config=Jsonb(config),
            hash=digest,
        )
        run = session.execute(sa.select(Run).where(Run.name == name).execution_options(populate_existing=True)).scalar_one()
        if run.config_hash != digest:
            raise LedgerConflict(
                f"run {name!r} already exists with a different config; resume it with its own config "
                "or choose another run name"
            )
        q(
            session,
            "INSERT INTO policy_version (run_id, version, learner_step, weights_uri, sha256, published_at) "
            "VALUES (:run, 0, 0, :uri, :sha, now()) ON CONFLICT DO NOTHING",
            run=run.id,
            uri=initial_weights_uri,
            sha=initial_sha256,
        )
    return run


def get_run(session: Session, name_or_id: str | uuid.UUID) -> Run:
    try:
        condition = Run.id == uuid.UUID(str(name_or_id))
    except ValueError:
        condition = Run.name == str(name_or_id)
    # populate_existing: a long-lived session must see status changes made by other calls or processes
    run = session.execute(sa.select(Run).where(condition).execution_options(populate_existing=True)).scalar_one_or_none()
    session.commit()  # ends the read; with expire_on_commit=False the row stays usable
    if run is None:
        raise LooplineError(f"no run named {name_or_id!r}; `loopline runs` lists them")
    return run


def start_run(session: Session, run_id: uuid.UUID, holder: str) -> None:
    """`holder` drives the run from now: running, no reason, no pending cancel, a first sign of life. Refused
    while another process drives it and is alive (two trainers of one run overwrote each other's files);
    the row lock makes two that start at the same moment one refusal."""
    state = (
        "SELECT name, status, holder, extract(epoch FROM now() - heartbeat_at) AS silent_s, "
        f"{run_lease()} AS lease, heartbeat_at FROM run WHERE id = :r"
    )
    with transaction(session):
        before = q(session, state, r=run_id).one()
    if before.holder not in (None, holder) and shown_status(
        before.status, before.holder, float(before.silent_s) if before.silent_s is not None else None, float(before.lease)
    )[0] == "stale":
        end_sessions_of(session, before.holder)
    with transaction(session):
        now = q(session, state + " FOR UPDATE", r=run_id).one()
        silent = float(now.silent_s) if now.silent_s is not None else None
        if now.holder != holder and shown_status(now.status, now.holder, silent, float(now.lease))[0] == "running":
            raise LedgerConflict(
                f"run {now.name} is being trained by {now.holder} (host:pid:start, alive {silent:.0f} s ago); "
                f"wait for it to end, or stop it with `loopline cancel {now.name}`"
            )
        q(
            session,
            "UPDATE run SET status = 'running', status_reason = NULL, holder = :h, heartbeat_at = now(), "
            "cancel_requested_at = NULL WHERE id = :r",
            h=holder, r=run_id,
        )


def end_sessions_of(session: Session, previous: str) -> int:
    """End the database sessions of a run's previous driving process, which was frozen (SIGSTOP, a stalled VM) or
    cut off past its lease, before taking the run over; returns how many. Frozen inside a transaction, it held
    row locks that every write of the new driver waited on: the server's `idle in transaction` limit does not
    end a session whose statement is still open (a COPY the client stopped feeding), and `lock_timeout` then
    failed the new driver instead. Ended, its transaction rolls back; woken, it reconnects and is fenced at its
    next commit (LostTheRun). Sessions of another database role are left to the server's own limits."""
    with transaction(session):
        return q(
            session,
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = :a AND pid <> pg_backend_pid() "
            "AND usename = current_user",
            a=application_name(previous),
        ).scalar_one()


def heartbeat(session: Session, run_id: uuid.UUID, holder: str) -> str | None:
    """The driving process is alive; returns "cancel" when someone asked it to stop (`request_cancel`), "lost"
    when another process drives the run now (this one was frozen or cut off past the lease), else None."""
    with transaction(session):
        cancel = q(
            session, "UPDATE run SET heartbeat_at = now() WHERE id = :r AND holder = :h RETURNING cancel_requested_at IS NOT NULL",
            r=run_id, h=holder,
        ).scalar_one_or_none()
    return "lost" if cancel is None else ("cancel" if cancel else None)


def require_driver(session: Session, run_id: uuid.UUID, driver: str) -> None:
    """Refuse (LostTheRun) unless `driver` still drives the run: a process that lost it must not plan or train on."""
    with transaction(session):
        fence(session, run_id, driver)


def end_run(session: Session, run_id: uuid.UUID, holder: str, status: str, reason: str | None) -> bool:
    """How the run's driving process ended (completed, failed, interrupted, cancelled), unless another
    process has taken the run over since; returns whether the row was written."""
    with transaction(session):
        written = q(
            session, "UPDATE run SET status = :s, status_reason = :why, heartbeat_at = now() WHERE id = :r AND holder = :h",
            s=status, why=reason, r=run_id, h=holder,
        ).rowcount
    return written == 1


def request_cancel(session: Session, run_id: uuid.UUID, reason: str) -> None:
    """Ask the run's driving process to stop at its next heartbeat; a run nobody drives is cancelled at once."""
    with transaction(session):
        q(session, "UPDATE run SET cancel_requested_at = coalesce(cancel_requested_at, now()) WHERE id = :r", r=run_id)
        q(
            session, "UPDATE run SET status = 'cancelled', status_reason = :why WHERE id = :r AND status <> 'running'",
            why=reason, r=run_id,
        )


def mark_abandoned(session: Session, run_id: uuid.UUID, holder: str | None, status: str, reason: str) -> None:
    """A run left 'running' by a process that is gone (killed: it could not write) gets `status` and why."""
    with transaction(session):
        q(
            session, "UPDATE run SET status = :s, status_reason = :why WHERE id = :r AND status = 'running' AND holder IS NOT DISTINCT FROM :h",
            s=status, why=reason, r=run_id, h=holder,
        )


def restate_config(session: Session, run_id: uuid.UUID, config: dict[str, Any]) -> None:
    """The run's stored config (and hash) from now on: more steps (an extended run), or the same config as a
    newer loopline writes it out (with the fields it added, at their defaults)."""
    with transaction(session):
        q(session, "UPDATE run SET config = :c, config_hash = :h WHERE id = :r", c=Jsonb(config), h=config_hash(config), r=run_id)


def delete_run(session: Session, run_id: uuid.UUID) -> None:
    """Every ledger row of the run (each table's run_id cascades)."""
    with transaction(session):
        q(session, "DELETE FROM run WHERE id = :r", r=run_id)


def set_run_plan(session: Session, run_id: uuid.UUID, plan: dict[str, Any]) -> None:
    """The memory estimate for the hardware the run (re)started on; the inspector shows it beside the measured peak."""
    with transaction(session):
        q(session, "UPDATE run SET plan = :p WHERE id = :r", p=Jsonb(plan), r=run_id)


# --------------------------------------------------------------------------- versions and evaluations
