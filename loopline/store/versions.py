"""A run's policy versions: their weights and digests, exports, rebuilds, the evaluations owed and recorded, and
the inference servers that serve them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from psycopg.types.json import Jsonb
from sqlmodel import Session

from loopline.errors import LooplineError
from loopline.store._sql import first_row, q, rows, scalar, transaction
from loopline.store.commits import write_eval_episodes
from loopline.store.uris import TRAINER, WeightsURI
from loopline.types import TrajectoryRecord


@dataclass(frozen=True)
class VersionWeights:
    version: int
    uri: str | None  # None: committed without an export (only the learner that made it held the weights)
    sha256: str | None = None  # of the weights' tensors (`trainer/checkpoint.tensors_sha256`), recorded at the commit
    adapter_uri: str | None = None  # LoRA on SGLang: the version's adapter, what the servers load


def version_weights(session: Session, run_id: uuid.UUID, version: int | None = None) -> VersionWeights:
    """Where a policy version's weights are (the newest version when `version` is None): one query, what a
    rollout process asks every second to follow the learner."""
    row = first_row(
        session,
        "SELECT version, weights_uri, sha256, adapter_uri FROM policy_version WHERE run_id = :r "
        "AND (CAST(:v AS int) IS NULL OR version = :v) "
        "ORDER BY version DESC LIMIT 1",
        r=run_id,
        v=version,
    )
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
    """The versions whose weights can be had (what a process other than the learner can load): written, and not
    deleted since by the learner's pruning (`learner.keep_exports`); a trainer's own are checked on this host."""
    rows = q(session, "SELECT version, weights_uri FROM policy_version WHERE run_id = :r AND weights_uri IS NOT NULL ORDER BY version", r=run_id)
    versions = [version for version, uri in rows if (u := WeightsURI.parse(uri)).on_this_host() or u.scheme not in ("", TRAINER, "file")]
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
    found = rows(
        session,
        "SELECT p.version, p.weights_uri FROM policy_version p WHERE p.run_id = :r AND p.version <= :upto "
        "AND NOT EXISTS (SELECT 1 FROM eval_result e WHERE e.run_id = p.run_id AND e.policy_version = p.version) "
        "ORDER BY p.version",
        r=run_id,
        upto=through,
    )
    return [VersionWeights(r.version, r.weights_uri) for r in found if scheduled(r.version)]


INITIAL_WEIGHTS = "SELECT weights_uri FROM policy_version WHERE run_id = :r AND version = 0"  # (the inspector's view too)


def initial_weights(session: Session, run_id: uuid.UUID) -> str:
    """Where the run's version 0 came from (the learner and tokenizer start there)."""
    uri = scalar(session, INITIAL_WEIGHTS, r=run_id)
    return uri


def latest_policy_version(session: Session, run_id: uuid.UUID) -> int:
    """The learner's newest version (what the staleness gate compares the engines' versions with)."""
    version = scalar(session, "SELECT coalesce(max(version), 0) FROM policy_version WHERE run_id = :r", r=run_id)
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


def record_weight_server(session: Session, run_id: uuid.UUID, url: str, token: str, holder: str) -> None:
    """The trainer `holder` serves the run's `trainer://` weights at `url` to holders of `token` (from now on)."""
    with transaction(session):
        q(
            session,
            "INSERT INTO weight_server (run_id, url, token, holder) VALUES (:r, :u, :t, :h) "
            "ON CONFLICT (run_id) DO UPDATE SET url = :u, token = :t, holder = :h, started_at = now()",
            r=run_id, u=url, t=token, h=holder,
        )


def weight_server(session: Session, run: str) -> tuple[str, str] | None:
    """(url, token) of the weight server of the run named `run`, as its newest trainer recorded it."""
    row = first_row(session, "SELECT w.url, w.token FROM weight_server w JOIN run ON run.id = w.run_id WHERE run.name = :n", n=run)
    return (row.url, row.token) if row else None


def published_uris(session: Session, run_id: uuid.UUID) -> list[str]:
    """Every weights and adapter URI the run's versions name (what its weight server may hand out)."""
    found = rows(
        session,
        "SELECT weights_uri FROM policy_version WHERE run_id = :r AND weights_uri IS NOT NULL "
        "UNION SELECT adapter_uri FROM policy_version WHERE run_id = :r AND adapter_uri IS NOT NULL",
        r=run_id,
    )
    return [row[0] for row in found]


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


def serving_servers(session: Session, run_id: uuid.UUID) -> list[tuple[str, str, int, float]]:
    """(url, holder, served version, seconds since its last sign of life) of the servers some process still
    generates on (not released)."""
    found = rows(
        session,
        "SELECT url, holder, served_version, extract(epoch FROM now() - seen_at) FROM engine_server "
        "WHERE run_id = :r AND released_at IS NULL ORDER BY url, holder",
        r=run_id,
    )
    return [(row[0], row[1], row[2], float(row[3])) for row in found]


# --------------------------------------------------------------------------- resume
