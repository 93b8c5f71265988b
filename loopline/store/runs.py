"""Runs, their policy versions and evaluations, and where a run stands on resume."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import sqlalchemy as sa
from psycopg.types.json import Jsonb
from sqlmodel import Session

from loopline.errors import LooplineError
from loopline.holder import application_name
from loopline.store._sql import q, transaction
from loopline.store.commits import write_eval_episodes
from loopline.store.errors import LedgerConflict
from loopline.store.fencing import fence
from loopline.store.learning import group_state_counts, groups_of_step
from loopline.store.models import Run
from loopline.store.queries import shown_status
from loopline.store.records import CheckpointInfo, ResumeState
from loopline.types import TrajectoryRecord


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
        "coalesce((config->>'lease_seconds')::float, 60) AS lease, heartbeat_at FROM run WHERE id = :r"
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


@dataclass(frozen=True)
class VersionWeights:
    version: int
    uri: str | None  # None: committed without an export (only the learner that made it held the weights)
    sha256: str | None = None  # of the weights' tensors (`trainer/checkpoint.tensors_sha256`), recorded at the commit
    adapter_uri: str | None = None  # LoRA on SGLang: the version's adapter, what the servers load


def version_weights(session: Session, run_id: uuid.UUID, version: int | None = None) -> VersionWeights:
    """Where a policy version's weights are (the newest version when `version` is None): one query, what a
    rollout process asks every second to follow the learner."""
    row = q(
        session,
        "SELECT version, weights_uri, sha256, adapter_uri FROM policy_version WHERE run_id = :r "
        "AND (CAST(:v AS int) IS NULL OR version = :v) "
        "ORDER BY version DESC LIMIT 1",
        r=run_id,
        v=version,
    ).first()
    session.rollback()
    if row is None:
        raise LooplineError(f"run {run_id} has no policy version {version}")
    return VersionWeights(row.version, row.weights_uri, row.sha256, row.adapter_uri)


def record_rebuild(
    session: Session, run_id: uuid.UUID, version: int, sha256: str, recorded_sha256: str, device: str, threads: int | None
) -> None:
    """`version`'s weights were rebuilt with another sha256 than its commit recorded; the run goes on from them."""
    with transaction(session):
        q(
            session,
            "INSERT INTO weight_rebuild (run_id, version, sha256, recorded_sha256, device, learner_threads) "
            "VALUES (:r, :v, :s, :rs, :d, :t)",
            r=run_id, v=version, s=sha256, rs=recorded_sha256, d=device, t=threads,
        )


def rebuilt_digests(session: Session, run_id: uuid.UUID, version: int) -> list[str]:
    """The sha256 of each rebuild of `version` that differed from its commit's, oldest first."""
    digests = list(
        q(session, "SELECT sha256 FROM weight_rebuild WHERE run_id = :r AND version = :v ORDER BY id", r=run_id, v=version).scalars()
    )
    session.rollback()
    return digests


def named_files(session: Session, run_id: uuid.UUID) -> set[str]:
    """Every checkpoint and export path the run's ledger rows name (a learner's own directories that no row
    names were left by one whose commit never landed)."""
    rows = q(
        session,
        "SELECT weights_uri FROM policy_version WHERE run_id = :r AND weights_uri IS NOT NULL "
        "UNION SELECT adapter_uri FROM policy_version WHERE run_id = :r AND adapter_uri IS NOT NULL "
        "UNION SELECT uri FROM checkpoint WHERE run_id = :r",
        r=run_id,
    )
    named = set(rows.scalars())
    session.rollback()
    return named


def exported_versions(session: Session, run_id: uuid.UUID) -> list[int]:
    """The versions whose weights are on disk (what a process other than the learner can load): written, and not
    deleted since by the learner's pruning (`learner.keep_exports`)."""
    rows = q(session, "SELECT version, weights_uri FROM policy_version WHERE run_id = :r AND weights_uri IS NOT NULL ORDER BY version", r=run_id)
    versions = [version for version, uri in rows if "://" in uri or Path(uri).is_dir()]
    session.rollback()
    return versions


def record_export(session: Session, run_id: uuid.UUID, version: int, uri: str) -> None:
    """A version committed without an export was exported later (a resume does it for the newest)."""
    with transaction(session):
        q(session, "UPDATE policy_version SET weights_uri = :u WHERE run_id = :r AND version = :v", u=uri, r=run_id, v=version)


def owed_evaluations(
    session: Session, run_id: uuid.UUID, scheduled: Callable[[int], bool], through: int
) -> list[VersionWeights]:
    """Versions up to `through` whose scheduled evaluation is not in the ledger yet, oldest first."""
    rows = q(
        session,
        "SELECT p.version, p.weights_uri FROM policy_version p WHERE p.run_id = :r AND p.version <= :upto "
        "AND NOT EXISTS (SELECT 1 FROM eval_result e WHERE e.run_id = p.run_id AND e.policy_version = p.version) "
        "ORDER BY p.version",
        r=run_id,
        upto=through,
    ).all()
    session.rollback()
    return [VersionWeights(r.version, r.weights_uri) for r in rows if scheduled(r.version)]


def initial_weights(session: Session, run_id: uuid.UUID) -> str:
    """Where the run's version 0 came from (the learner and tokenizer start there)."""
    uri = q(session, "SELECT weights_uri FROM policy_version WHERE run_id = :r AND version = 0", r=run_id).scalar_one()
    session.rollback()
    return uri


def latest_policy_version(session: Session, run_id: uuid.UUID) -> int:
    """The learner's newest version (what the staleness gate compares the engines' versions with)."""
    version = q(session, "SELECT coalesce(max(version), 0) FROM policy_version WHERE run_id = :r", r=run_id).scalar_one()
    session.rollback()
    return version


def record_eval_result(
    session: Session,
    run_id: uuid.UUID,
    policy_version: int,
    env_name: str,
    env_version: int,
    n_tasks: int,
    n_success: int,
    details: dict[str, Any] | None = None,
    episodes: Sequence[tuple[str, TrajectoryRecord]] = (),
    worker: str = "",
) -> bool:
    """Store a policy version's held-out success once, with the episodes (task id, trajectory) it was measured on
    (commits.write_eval_episodes); returns False if it was already recorded."""
    with transaction(session):
        inserted = q(
            session,
            "INSERT INTO eval_result (run_id, policy_version, env_name, env_version, n_tasks, n_success, success_rate, details) "
            "VALUES (:r, :v, :e, :ev, :n, :k, :rate, :d) ON CONFLICT DO NOTHING",
            r=run_id, v=policy_version, e=env_name, ev=env_version, n=n_tasks, k=n_success,
            rate=n_success / n_tasks if n_tasks else 0.0, d=Jsonb(details or {}),
        ).rowcount
        if inserted == 1 and episodes:
            write_eval_episodes(session, run_id, policy_version, [t for _, t in episodes], [i for i, _ in episodes], worker)
    return inserted == 1


def mark_published(session: Session, run_id: uuid.UUID, version: int, timings: dict[str, float] | None = None) -> None:
    """Record that every engine now serves `version` (weight sync finished), and what the first sync took."""
    with transaction(session):
        q(
            session,
            "UPDATE policy_version SET published_at = coalesce(published_at, now()), "
            "sync_timings = CASE WHEN published_at IS NULL THEN :t ELSE sync_timings END "
            "WHERE run_id = :r AND version = :v",
            r=run_id,
            v=version,
            t=Jsonb(timings or {}),
        )


def record_served(session: Session, run_id: uuid.UUID, holder: str, urls: list[str], version: int) -> None:
    """`holder` generates on the servers at `urls`, which now serve `version` (registering them if new)."""
    with transaction(session):
        for url in urls:
            q(
                session,
                "INSERT INTO engine_server (run_id, url, holder, served_version) VALUES (:r, :u, :h, :v) "
                "ON CONFLICT (run_id, url, holder) DO UPDATE SET served_version = :v, seen_at = now(), released_at = NULL",
                r=run_id, u=url, h=holder, v=version,
            )


def release_servers(session: Session, run_id: uuid.UUID, holder: str) -> None:
    """`holder` stopped generating on its servers (it shut its engine down)."""
    with transaction(session):
        q(
            session, "UPDATE engine_server SET released_at = now() WHERE run_id = :r AND holder = :h AND released_at IS NULL",
            r=run_id, h=holder,
        )


def serving_servers(session: Session, run_id: uuid.UUID) -> list[tuple[str, str, int]]:
    """(url, holder, served version) of the servers some process still generates on (not released)."""
    rows = q(
        session,
        "SELECT url, holder, served_version FROM engine_server WHERE run_id = :r AND released_at IS NULL ORDER BY url, holder",
        r=run_id,
    ).all()
    session.rollback()
    return [tuple(row) for row in rows]


# --------------------------------------------------------------------------- resume


def consumed_trajectory_ids(session: Session, run_id: uuid.UUID) -> set[uuid.UUID]:
    ids = q(session, "SELECT trajectory_id FROM consumption WHERE run_id = :r", r=run_id).scalars().all()
    session.rollback()
    return set(ids)


def resume_state(session: Session, run_id: uuid.UUID) -> ResumeState:
    """Where a run stands in the ledger: the newest full checkpoint to restore (the steps after it are replayed)
    and what the next learner step is."""
    with transaction(session):
        ckpt = q(
            session,
            "SELECT learner_step, policy_version, uri FROM checkpoint WHERE run_id = :r AND complete "
            "ORDER BY learner_step DESC LIMIT 1",
            r=run_id,
        ).first()
        latest = q(
            session,
            "SELECT version, learner_step, weights_uri, adapter_uri FROM policy_version WHERE run_id = :r ORDER BY version DESC LIMIT 1",
            r=run_id,
        ).first()
        if latest is None:
            raise LooplineError(f"run {run_id} has no policy version; create it with create_run")
        next_step = latest.learner_step + 1
        consumed = q(session, "SELECT count(*) FROM consumption WHERE run_id = :r", r=run_id).scalar_one()
        pending = groups_of_step(session, run_id, next_step, "claimed")
        states = group_state_counts(session, run_id)
    return ResumeState(
        run_id=run_id,
        last_checkpoint=CheckpointInfo(*ckpt) if ckpt else None,
        policy_version=latest.version,
        weights_uri=latest.weights_uri,
        adapter_uri=latest.adapter_uri,
        next_learner_step=next_step,
        consumed_trajectories=consumed,
        pending_learner_groups=pending,
        group_states=states,
    )
