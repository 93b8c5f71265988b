"""The inspector's reads: one query per view, on a read-only connection (`db.read_only_engine`).

Each returns plain rows (`Table`: column names and tuples) or one mapping; the UI turns them into
frames. PostgreSQL refuses any write on these connections, so a view cannot change the ledger.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from loopline.store.prompts import StoredPromptBroken, decode
from loopline.store.nul import restored
from loopline.store.queries import run_lease, shown_status
from loopline.store.uris import path_on_publisher
from loopline.store.versions import INITIAL_WEIGHTS


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[tuple]


def _table(conn: sa.Connection, sql: str, **params: Any) -> Table:
    result = conn.execute(sa.text(sql), params)
    return Table(list(result.keys()), [tuple(r) for r in result.fetchall()])


def _one(conn: sa.Connection, sql: str, **params: Any) -> dict | None:
    row = conn.execute(sa.text(sql), params).mappings().first()
    return dict(row) if row is not None else None


# --------------------------------------------------------------------------- runs


def runs(conn: sa.Connection) -> Table:
    """Every run; `status` is the one `loopline runs` shows (stale: running with no live process), `reason` why it stopped."""
    found = _table(
        conn,
        "SELECT r.name, r.id, r.status, r.created_at, "
        "(SELECT coalesce(max(version), 0) FROM policy_version p WHERE p.run_id = r.id) AS policy_version, "
        "(SELECT count(*) FROM trajectory t WHERE t.run_id = r.id) AS trajectories, "
        "(SELECT count(*) FROM consumption c WHERE c.run_id = r.id) AS consumed, r.status_reason AS reason, r.holder, "
        f"extract(epoch FROM now() - r.heartbeat_at)::float AS silent_s, {run_lease('r')} AS lease "
        "FROM run r ORDER BY r.created_at DESC",
    )
    rows = []
    for row in found.rows:
        record = dict(zip(found.columns, row))
        status, stale = shown_status(record.pop("status"), record.pop("holder"), record.pop("silent_s"), record.pop("lease"))
        record.update(status=status, reason=stale or record["reason"])
        rows.append(record)
    columns = ["name", "id", "status", "created_at", "policy_version", "trajectories", "consumed", "reason"]
    return Table(columns, [tuple(r[c] for c in columns) for r in rows])


def run_id(conn: sa.Connection, name: str) -> uuid.UUID | None:
    row = _one(conn, "SELECT id FROM run WHERE name = :n", n=name)
    return row["id"] if row else None


def metrics(conn: sa.Connection, run: uuid.UUID) -> Table:
    """Long form: (step, name, value) per learner-step metric."""
    return _table(conn, "SELECT step, name, value FROM metric WHERE run_id = :r", r=run)


def run_plan(conn: sa.Connection, run: uuid.UUID) -> dict | None:
    """The memory plan the run started with, and the training process's measured peak RSS (bytes)."""
    row = _one(
        conn,
        "SELECT r.plan, (SELECT max(m.value) FROM metric m WHERE m.run_id = r.id AND m.name = 'peak_rss_gb') AS peak_gb FROM run r WHERE r.id = :r",
        r=run,
    )
    if row is None or row["plan"] is None:
        return None
    return {**row["plan"], "measured_peak": None if row["peak_gb"] is None else row["peak_gb"] * 1e9}


def evals(conn: sa.Connection, run: uuid.UUID) -> Table:
    """Held-out success (and mean reward) per version, with when it was measured and how many tokens had been trained by then."""
    return _table(
        conn,
        "SELECT e.policy_version, e.success_rate, (e.details->>'mean_reward')::float8 AS mean_reward, e.n_tasks, "
        "extract(epoch FROM e.created_at - r.created_at)::float8 AS seconds, "
        "coalesce((SELECT sum(m.value) FROM metric m WHERE m.run_id = e.run_id AND m.name = 'tokens_trained' "
        "          AND m.step <= e.policy_version), 0)::float8 AS tokens_trained "
        "FROM eval_result e JOIN run r ON r.id = e.run_id WHERE e.run_id = :r ORDER BY e.policy_version",
        r=run,
    )


def throughput(conn: sa.Connection, run: uuid.UUID) -> Table:
    """Training trajectories committed per minute since the run started."""
    return _table(
        conn,
        "SELECT floor(extract(epoch FROM t.created_at - r.created_at) / 60)::int AS minute, count(*) AS trajectories "
        "FROM trajectory t JOIN run r ON r.id = t.run_id WHERE t.run_id = :r AND t.split = 'train' GROUP BY 1 ORDER BY 1",
        r=run,
    )


def step_timings(conn: sa.Connection, run: uuid.UUID) -> Table:
    """Seconds per learner step, part by part: rollout (first attempt to last commit of the step's
    train groups, wall time), the learner's own parts (metrics), and publishing the new version to the engines.
    Also the tokens generated for the step, for a tokens/s."""
    return _table(
        conn,
        "SELECT p.version AS step, "
        "(SELECT extract(epoch FROM max(a.ended_at) - min(a.started_at))::float8 FROM attempt a JOIN slot s ON s.id = a.slot_id "
        " JOIN rollout_group g ON g.id = s.group_id WHERE g.run_id = p.run_id AND g.step = p.version AND g.split = 'train') AS rollout_s, "
        "(SELECT coalesce(sum(cardinality(sg.generated_ids)), 0) FROM segment sg JOIN trajectory t ON t.id = sg.trajectory_id "
        " JOIN rollout_group g ON g.id = t.group_id WHERE g.run_id = p.run_id AND g.step = p.version AND g.split = 'train') AS tokens, "
        "(SELECT value FROM metric m WHERE m.run_id = p.run_id AND m.step = p.version AND m.name = 'learner_s') AS learner_s, "
        "(SELECT value FROM metric m WHERE m.run_id = p.run_id AND m.step = p.version AND m.name = 'checkpoint_s') AS checkpoint_s, "
        "(SELECT value FROM metric m WHERE m.run_id = p.run_id AND m.step = p.version AND m.name = 'export_s') AS export_s, "
        "(p.sync_timings->>'check_s')::float8 AS sync_check_s, "
        "coalesce((p.sync_timings->>'load_s')::float8, 0) + coalesce((p.sync_timings->>'swap_s')::float8, 0) AS sync_load_s, "
        "(p.sync_timings->>'confirm_s')::float8 AS sync_confirm_s, (p.sync_timings->>'total_s')::float8 AS sync_s, "
        "extract(epoch FROM p.created_at)::float8 AS committed_at "
        "FROM policy_version p WHERE p.run_id = :r AND p.version > 0 ORDER BY p.version",
        r=run,
    )


def written_versions(conn: sa.Connection, run: uuid.UUID) -> dict[str, int]:
    """How many weight exports (versions after 0 written to disk) and full checkpoints the run wrote: its
    disk traffic, whatever was pruned since."""
    return _one(
        conn,
        "SELECT (SELECT count(*) FROM policy_version WHERE run_id = :r AND version > 0 AND weights_uri IS NOT NULL) AS exports, "
        "(SELECT count(*) FROM checkpoint WHERE run_id = :r) AS checkpoints",
        r=run,
    )


def version_lags(conn: sa.Connection, run: uuid.UUID) -> Table:
    return _table(conn, "SELECT version_lag, count(*) AS samples FROM consumption WHERE run_id = :r GROUP BY 1 ORDER BY 1", r=run)


def failure_classes(conn: sa.Connection, run: uuid.UUID) -> Table:
    """Per planned step: attempts that ended in success, task failure, truncation or infra failure."""
    return _table(
        conn,
        "SELECT s.step, CASE WHEN a.status = 'ok' AND t.truncated THEN 'truncated' "
        "WHEN a.status = 'ok' THEN 'succeeded or scored' ELSE a.status END AS class, count(*) AS attempts "
        "FROM attempt a JOIN slot s ON s.id = a.slot_id LEFT JOIN trajectory t ON t.attempt_id = a.id "
        "WHERE a.run_id = :r AND a.status <> 'running' GROUP BY 1, 2 ORDER BY 1",
        r=run,
    )


def episode_timings(conn: sa.Connection, run: uuid.UUID) -> Table:
    """Each committed trajectory's sandbox start, verification and whole-episode seconds, as the harness timed them."""
    return _table(
        conn,
        "SELECT (timings->>'sandbox_start_s')::float AS sandbox_start_s, (timings->>'verify_s')::float AS verify_s, "
        "(timings->>'episode_s')::float AS episode_s, reward FROM trajectory WHERE run_id = :r",
        r=run,
    )


def engine_servers(conn: sa.Connection, run: uuid.UUID) -> Table:
    """The inference servers the run's processes generate on: what each serves, who syncs it, whether it is released."""
    return _table(
        conn,
        "SELECT url, holder AS synced_by, served_version, seen_at, released_at FROM engine_server WHERE run_id = :r "
        "ORDER BY released_at IS NOT NULL, url, holder",
        r=run,
    )


def initial_weights(conn: sa.Connection, run: uuid.UUID) -> str | None:
    """Where version 0 is on the trainer's host (its tokenizer decodes the run's tokens)."""
    row = _one(conn, INITIAL_WEIGHTS, r=run)
    return path_on_publisher(row["weights_uri"]) if row else None


def run_config(conn: sa.Connection, run: uuid.UUID) -> dict:
    row = _one(conn, "SELECT config FROM run WHERE id = :r", r=run)
    return dict(row["config"]) if row else {}


# --------------------------------------------------------------------------- trajectories


def trajectories(conn: sa.Connection, run: uuid.UUID, limit: int = 1000) -> Table:
    return _table(
        conn,
        "SELECT t.id, t.task_id, t.env_name || '@' || t.env_version AS environment, t.split, t.reward, "
        "coalesce(t.failure_type, 'passed') AS failure_class, "
        "(t.info->>'generated_tokens')::int AS generated_tokens, "  # the harness records it: no segment reads
        "c.version_lag, c.learner_step IS NOT NULL AS consumed, t.policy_version_min AS policy_version, "
        "g.step, g.group_index, t.group_id, t.created_at "
        "FROM trajectory t JOIN rollout_group g ON g.id = t.group_id "
        "LEFT JOIN consumption c ON c.trajectory_id = t.id AND c.run_id = t.run_id "
        "WHERE t.run_id = :r ORDER BY g.step, g.group_index, t.created_at LIMIT :n",
        r=run,
        n=limit,
    )


def trajectory(conn: sa.Connection, trajectory_id: uuid.UUID) -> dict | None:
    row = _one(
        conn,
        "SELECT t.*, r.name AS run_name, c.learner_step, c.version_lag, g.step, g.group_index "
        "FROM trajectory t JOIN run r ON r.id = t.run_id JOIN rollout_group g ON g.id = t.group_id "
        "LEFT JOIN consumption c ON c.trajectory_id = t.id AND c.run_id = t.run_id WHERE t.id = :t",
        t=trajectory_id,
    )
    return {**row, "info": restored(row["info"])} if row else None


def segments(conn: sa.Connection, trajectory_id: uuid.UUID) -> list[dict]:
    """The trajectory's segments as the inspector shows them, in memory linear in what is stored (a 128-turn
    trajectory's whole prompts are 4.3M ids): `prompt_ids` is a call's whole prompt where it starts a chain, else
    only the ids it adds after the `continues` ids of the call before it; `prompt_len` is its whole prompt's
    length; the last call of each chain carries the chain's ids (`chain_ids`: its prompt and generation hold every
    call of the chain), so a re-tokenisation check reads each token once."""
    rows = conn.execute(
        sa.text("SELECT *, rollout_logprobs::float8[] AS logprobs_exact FROM segment WHERE trajectory_id = :t ORDER BY seq"), {"t": trajectory_id}
    ).all()
    try:
        decoded = decode(rows)
    except StoredPromptBroken:  # (a corrupted row: each shown as stored, a chain of its own; `loopline check` names it)
        decoded = None
    out = []
    for i, r in enumerate(rows):
        if decoded is None:
            continues, prompt_len, prompt = 0, len(r.prompt_ids), list(r.prompt_ids)
            chain_ids: list[int] | None = [*r.prompt_ids, *r.generated_ids]
        else:
            call, starts = decoded.calls[i], i == 0 or r.starts_chain
            chain = decoded.chains[call.chain]
            previous = decoded.calls[i - 1] if i else None
            continues = 0 if starts or previous is None else previous.prompt_len + len(rows[i - 1].generated_ids)
            prompt_len, prompt = call.prompt_len, chain[continues : call.prompt_len].tolist()
            last = i + 1 == len(rows) or rows[i + 1].starts_chain
            chain_ids = chain[: call.prompt_len + len(r.generated_ids)].tolist() if last else None
        out.append({
            **{k: v for k, v in r._mapping.items() if k not in ("logprobs_exact", "prompt_copies", "prompt_prefix_len")},
            "prompt_ids": prompt, "prompt_len": prompt_len, "continues": continues, "chain_ids": chain_ids,
            "rollout_logprobs": r.logprobs_exact, "tool_events": restored(r.tool_events),
        })
    return out


def learner_logprobs(conn: sa.Connection, trajectory_id: uuid.UUID) -> list[float] | None:
    """π_old at the trajectory's action tokens as the learner recomputed it (None: not trained, or trained
    before loopline stored it)."""
    row = _one(conn, "SELECT logprobs FROM learner_logprob WHERE trajectory_id = :t", t=trajectory_id)
    return list(row["logprobs"]) if row else None


def logprob_gaps(conn: sa.Connection, run_id: uuid.UUID) -> Table:
    """Per consumed trajectory: its learner step and mean and max |π_old - μ| over its action tokens."""
    return _table(
        conn,
        "SELECT c.learner_step AS step, c.trajectory_id AS id, (c.training->>'logprob_abs_diff_mean')::float8 AS mean_abs_diff, "
        "(c.training->>'logprob_abs_diff_max')::float8 AS max_abs_diff FROM consumption c "
        "WHERE c.run_id = :r AND c.training->>'logprob_abs_diff_max' IS NOT NULL "
        "ORDER BY c.learner_step, c.trajectory_id",
        r=run_id,
    )


def attempts(conn: sa.Connection, slot_id: uuid.UUID) -> Table:
    return _table(
        conn,
        "SELECT id, worker, status, error_class, error_text, started_at, ended_at FROM attempt "
        "WHERE slot_id = :s ORDER BY started_at",
        s=slot_id,
    )


def group(conn: sa.Connection, group_id: uuid.UUID) -> Table:
    """The group's samples; once trained, with the advantage and normalisation the learner used (stored, not recomputed)."""
    return _table(
        conn,
        "SELECT t.id, s.sample_index, t.reward, coalesce(t.failure_type, 'passed') AS failure_class, "
        "(SELECT sum(cardinality(x.generated_ids)) FROM segment x WHERE x.trajectory_id = t.id) AS generated_tokens, "
        "t.policy_version_min AS policy_version, c.learner_step IS NOT NULL AS consumed, c.advantage, "
        "(c.training->>'group_mean')::float8 AS group_mean, (c.training->>'group_std')::float8 AS group_std, "
        "(c.training->>'degenerate')::boolean AS degenerate, (c.training->>'trained')::boolean AS trained, "
        "(c.training->>'rejected_tokens')::int AS rejected_tokens, "
        "(c.training->>'correction_weight_mean')::float8 AS correction_weight_mean "
        "FROM trajectory t JOIN slot s ON s.id = t.slot_id LEFT JOIN consumption c ON c.trajectory_id = t.id "
        "WHERE t.group_id = :g ORDER BY s.sample_index",
        g=group_id,
    )


# --------------------------------------------------------------------------- environments


def environments(conn: sa.Connection) -> Table:
    return _table(
        conn,
        "SELECT name, version, env_version, verifier_version, harness_version, deprecated, created_at, spec_hash "
        "FROM environment ORDER BY name, version",
    )


def environment_spec(conn: sa.Connection, name: str, version: int) -> dict:
    row = _one(conn, "SELECT spec FROM environment WHERE name = :n AND version = :v", n=name, v=version)
    return dict(row["spec"]) if row else {}
