"""The inspector's reads: one function per view, each a read-only transaction on the ledger.

Sessions here are opened with `default_transaction_read_only`, so the inspector cannot write to the
ledger even by mistake: PostgreSQL refuses any write in them.
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pandas as pd
import sqlalchemy as sa

from loopline.store import db as store_db


class Ledger:
    def __init__(self, url: str | None = None):
        self.engine = store_db.make_engine(url, connect_args={"options": "-c default_transaction_read_only=on"})

    @contextmanager
    def connect(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn:
            yield conn
            conn.rollback()

    def frame(self, sql: str, **params: Any) -> pd.DataFrame:
        with self.connect() as conn:
            result = conn.execute(sa.text(sql), params)
            return pd.DataFrame(result.fetchall(), columns=list(result.keys()))

    def one(self, sql: str, **params: Any):
        with self.connect() as conn:
            return conn.execute(sa.text(sql), params).mappings().first()

    # ------------------------------------------------------------------ runs

    def runs(self) -> pd.DataFrame:
        return self.frame(
            "SELECT r.name, r.id, r.status, r.created_at, "
            "(SELECT coalesce(max(version), 0) FROM policy_version p WHERE p.run_id = r.id) AS policy_version, "
            "(SELECT count(*) FROM trajectory t WHERE t.run_id = r.id) AS trajectories, "
            "(SELECT count(*) FROM consumption c WHERE c.run_id = r.id) AS consumed "
            "FROM run r ORDER BY r.created_at DESC"
        )

    def run_id(self, name: str) -> uuid.UUID | None:
        row = self.one("SELECT id FROM run WHERE name = :n", n=name)
        return row["id"] if row else None

    def metrics(self, run_id: uuid.UUID) -> pd.DataFrame:
        """One row per learner step, one column per metric."""
        long = self.frame("SELECT step, name, value FROM metric WHERE run_id = :r", r=run_id)
        if long.empty:
            return long
        return long.pivot_table(index="step", columns="name", values="value").reset_index()

    def evals(self, run_id: uuid.UUID) -> pd.DataFrame:
        """Held-out success per version, with when it was measured and how many tokens had been trained by then."""
        return self.frame(
            "SELECT e.policy_version, e.success_rate, e.n_tasks, "
            "extract(epoch FROM e.created_at - r.created_at)::float8 AS seconds, "
            "coalesce((SELECT sum(m.value) FROM metric m WHERE m.run_id = e.run_id AND m.name = 'tokens_trained' "
            "          AND m.step <= e.policy_version), 0)::float8 AS tokens_trained "
            "FROM eval_result e JOIN run r ON r.id = e.run_id WHERE e.run_id = :r ORDER BY e.policy_version",
            r=run_id,
        )

    def throughput(self, run_id: uuid.UUID) -> pd.DataFrame:
        """Trajectories committed per minute since the run started."""
        return self.frame(
            "SELECT floor(extract(epoch FROM t.created_at - r.created_at) / 60)::int AS minute, count(*) AS trajectories "
            "FROM trajectory t JOIN run r ON r.id = t.run_id WHERE t.run_id = :r GROUP BY 1 ORDER BY 1",
            r=run_id,
        )

    def version_lags(self, run_id: uuid.UUID) -> pd.DataFrame:
        return self.frame(
            "SELECT version_lag, count(*) AS samples FROM consumption WHERE run_id = :r GROUP BY 1 ORDER BY 1", r=run_id
        )

    def failure_classes(self, run_id: uuid.UUID) -> pd.DataFrame:
        """Per planned step: attempts that ended in success, task failure, truncation or infra failure."""
        return self.frame(
            "SELECT s.step, CASE WHEN a.status = 'ok' AND t.truncated THEN 'truncated' "
            "WHEN a.status = 'ok' THEN 'succeeded or scored' ELSE a.status END AS class, count(*) AS attempts "
            "FROM attempt a JOIN slot s ON s.id = a.slot_id LEFT JOIN trajectory t ON t.attempt_id = a.id "
            "WHERE a.run_id = :r AND a.status <> 'running' GROUP BY 1, 2 ORDER BY 1",
            r=run_id,
        )

    # ------------------------------------------------------------------ trajectories

    def trajectories(self, run_id: uuid.UUID, limit: int = 1000) -> pd.DataFrame:
        return self.frame(
            "SELECT t.id, t.task_id, t.env_name || '@' || t.env_version AS environment, t.split, t.reward, "
            "coalesce(t.failure_type, 'passed') AS failure_class, "
            "(t.info->>'generated_tokens')::int AS generated_tokens, "  # the harness records it: no segment reads
            "c.version_lag, c.learner_step IS NOT NULL AS consumed, t.policy_version_min AS policy_version, "
            "g.step, g.group_index, t.group_id, t.created_at "
            "FROM trajectory t JOIN rollout_group g ON g.id = t.group_id "
            "LEFT JOIN consumption c ON c.trajectory_id = t.id AND c.run_id = t.run_id "
            "WHERE t.run_id = :r ORDER BY g.step, g.group_index, t.created_at LIMIT :n",
            r=run_id,
            n=limit,
        )

    def trajectory(self, trajectory_id: uuid.UUID):
        return self.one(
            "SELECT t.*, r.name AS run_name, c.learner_step, c.version_lag, g.step, g.group_index "
            "FROM trajectory t JOIN run r ON r.id = t.run_id JOIN rollout_group g ON g.id = t.group_id "
            "LEFT JOIN consumption c ON c.trajectory_id = t.id AND c.run_id = t.run_id WHERE t.id = :t",
            t=trajectory_id,
        )

    def segments(self, trajectory_id: uuid.UUID) -> list[dict]:
        with self.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT * FROM segment WHERE trajectory_id = :t ORDER BY seq"), {"t": trajectory_id}
            ).mappings().all()
        return [dict(r) for r in rows]

    def attempts(self, slot_id: uuid.UUID) -> pd.DataFrame:
        return self.frame(
            "SELECT id, worker, status, error_class, error_text, started_at, ended_at FROM attempt "
            "WHERE slot_id = :s ORDER BY started_at",
            s=slot_id,
        )

    def group(self, group_id: uuid.UUID) -> pd.DataFrame:
        return self.frame(
            "SELECT t.id, s.sample_index, t.reward, coalesce(t.failure_type, 'passed') AS failure_class, "
            "(SELECT sum(cardinality(x.generated_ids)) FROM segment x WHERE x.trajectory_id = t.id) AS generated_tokens, "
            "t.policy_version_min AS policy_version, c.learner_step IS NOT NULL AS consumed "
            "FROM trajectory t JOIN slot s ON s.id = t.slot_id LEFT JOIN consumption c ON c.trajectory_id = t.id "
            "WHERE t.group_id = :g ORDER BY s.sample_index",
            g=group_id,
        )

    def initial_weights(self, run_id: uuid.UUID) -> str | None:
        row = self.one("SELECT weights_uri FROM policy_version WHERE run_id = :r AND version = 0", r=run_id)
        return row["weights_uri"] if row else None

    def run_config(self, run_id: uuid.UUID) -> dict:
        row = self.one("SELECT config FROM run WHERE id = :r", r=run_id)
        return dict(row["config"]) if row else {}

    # ------------------------------------------------------------------ environments

    def environments(self) -> pd.DataFrame:
        return self.frame(
            "SELECT name, version, env_version, verifier_version, harness_version, deprecated, created_at, spec_hash "
            "FROM environment ORDER BY name, version"
        )

    def environment_spec(self, name: str, version: int) -> dict:
        row = self.one("SELECT spec FROM environment WHERE name = :n AND version = :v", n=name, v=version)
        return dict(row["spec"]) if row else {}


@dataclass(frozen=True)
class Token:
    """One token as the inspector shows it."""

    id: int
    text: str
    action: bool  # loss mask 1: generated by the policy and trained on
    logprob: float | None  # the rollout logprob (action tokens only)
    version: int | None  # the policy version that generated it


def segment_tokens(segment: dict, decode) -> tuple[list[Token], list[Token]]:
    """(prompt tokens, generated tokens) of a segment; `decode` turns one id into its text."""
    prompt = [Token(i, decode(i), False, None, None) for i in segment["prompt_ids"]]
    versions: list[int | None] = []
    for span in segment.get("version_spans") or []:
        versions += [span["version"]] * (span["end"] - span["start"])
    generated = []
    for k, (i, mask, lp) in enumerate(zip(segment["generated_ids"], segment["action_loss_mask"], segment["rollout_logprobs"])):
        version = versions[k] if k < len(versions) else segment["policy_version"]
        generated.append(Token(i, decode(i), bool(mask), lp if mask else None, version))
    return prompt, generated
