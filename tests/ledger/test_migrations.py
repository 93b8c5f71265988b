"""Schema upgrades: complete, idempotent, atomic, safe to race, with one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import sqlalchemy as sa

from loopline.store.db import make_engine
from loopline.store.errors import SchemaOutOfDate
from loopline.store.migrate import head_revision, require_current_schema, schema_status, upgrade

CONTRACT_TABLES = {
    "environment", "run", "policy_version", "rollout_group", "slot", "attempt", "trajectory",
    "segment", "consumption", "checkpoint", "metric", "eval_result",
}


def _tables(engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def _cli(*args, url: str | None = None, home=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LOOPLINE_DATABASE_URL"}
    if url:
        env["LOOPLINE_DATABASE_URL"] = url
    if home:
        env["LOOPLINE_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "loopline.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )



def _read(engine, sql: str, *params) -> list:
    """Rows of `sql` on a connection closed at once: one left open (a connection is freed only when the garbage
    collector gets to it) holds a lock the next migration's DDL waits on until its lock timeout."""
    with engine.connect() as conn:
        return conn.exec_driver_sql(sql, params or None).all()

def test_upgrade_creates_the_whole_data_contract_and_is_idempotent(scratch_url):
    engine = make_engine(scratch_url)
    with pytest.raises(SchemaOutOfDate, match="loopline db upgrade"):
        require_current_schema(engine)
    result = upgrade(engine)
    assert result.changed and result.applied_from is None
    assert result.status.up_to_date and result.status.current == head_revision()
    assert CONTRACT_TABLES <= _tables(engine)
    again = upgrade(engine)
    assert not again.changed and again.status.current == head_revision()
    require_current_schema(engine)
    engine.dispose()


def _downgrade(engine, revision: str) -> None:
    from alembic import command

    from loopline.store.migrate import alembic_config

    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def _ledger_with(scratch_url: str, trajectory):
    """A migrated ledger holding one run with one committed trajectory: (engine, run, trajectory id)."""
    from loopline.store import ledger
    from loopline.store.db import session as new_session

    engine = make_engine(scratch_url)
    upgrade(engine)
    with new_session(engine) as s:
        run = ledger.create_run(s, "r", {}, "file:///w")
        ledger.plan_step(s, run.id, 1, ["a"], group_size=1)
        (lease,) = ledger.claim_slots(s, run.id, "w", 1, split="train")
        return engine, run, ledger.commit_trajectory(s, lease.attempt_id, trajectory).trajectory_id



def test_the_migrations_build_exactly_the_schema_the_models_declare(scratch_url):
    """A column, index or constraint added to a model without a migration (or the other way) is a difference."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlmodel import SQLModel

    import loopline.store.models  # noqa: F401  (the tables)

    engine = make_engine(scratch_url)
    upgrade(engine)
    with engine.connect() as conn:
        differences = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), SQLModel.metadata)
    engine.dispose()
    assert differences == []


def test_slots_planned_before_the_claim_order_index_get_their_groups_order_and_are_claimed_in_plan_order(scratch_url):
    """a8c2e6f1b904: slot.group_index (copied from the slot's group) and the pending index a claim reads."""
    from loopline.store import ledger
    from loopline.store.db import session as new_session

    engine = make_engine(scratch_url)
    upgrade(engine)
    _downgrade(engine, "f3a9d6b2c480")
    with new_session(engine) as s:
        run = ledger.create_run(s, "r", {}, "file:///w").id
    with engine.begin() as conn:  # slots as the older schema planned them: groups 0..2 of step 1, 2 samples each
        for i, task in enumerate(["c", "a", "b"]):
            group = conn.exec_driver_sql(
                "INSERT INTO rollout_group (id, run_id, split, step, group_index, task_id, size, max_attempts) "
                "VALUES (gen_random_uuid(), %s, 'train', 1, %s, %s, 2, 3) RETURNING id", (run, i, task)).scalar_one()
            for k in range(2):
                conn.exec_driver_sql(
                    "INSERT INTO slot (id, run_id, group_id, split, step, task_id, sample_index) "
                    "VALUES (gen_random_uuid(), %s, %s, 'train', 1, %s, %s)", (run, group, task, k))
    upgrade(engine)
    assert _read(engine, "SELECT task_id, group_index FROM slot ORDER BY group_index, sample_index") == [
        ("c", 0), ("c", 0), ("a", 1), ("a", 1), ("b", 2), ("b", 2)]
    with new_session(engine) as s:
        claimed = [(lease.task_id, lease.sample_index) for lease in ledger.claim_slots(s, run, "w", 5, split="train")]
        ledger.plan_step(s, run, 2, [f"t{i}" for i in range(5_000)], group_size=4)  # many pending: an index pays
    assert claimed == [("c", 0), ("c", 1), ("a", 0), ("a", 1), ("b", 0)]
    with engine.connect() as conn:  # and the claim reads them from the index, without sorting
        conn.exec_driver_sql("ANALYZE slot")
        plan = "\n".join(r[0] for r in conn.exec_driver_sql(
            "EXPLAIN SELECT id FROM slot WHERE run_id = %s AND split = 'train' AND state = 'pending' "
            "ORDER BY step, group_index, sample_index LIMIT 8 FOR UPDATE SKIP LOCKED", (run,)))
    engine.dispose()
    assert "ix_slot_pending" in plan and "Sort" not in plan, plan


def test_logprobs_become_float4_and_back_exactly(scratch_url):
    """b3d7f0a2c915: rollout_logprobs real[]. A float32 value widens back exactly; a float64 one is rounded."""
    from tests.factories import segment, trajectory

    engine, _, _ = _ledger_with(scratch_url, trajectory(segments=[segment(n_gen=2, rollout_logprobs=[-0.5, -0.25])]))
    _downgrade(engine, "a8c2e6f1b904")
    assert _read(engine, "SELECT pg_typeof(rollout_logprobs)::text, rollout_logprobs FROM segment") == [("double precision[]", [-0.5, -0.25])]
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE segment SET rollout_logprobs[2] = -0.1")
    upgrade(engine)
    assert _read(engine, "SELECT pg_typeof(rollout_logprobs)::text, rollout_logprobs::float8[] FROM segment") == [("real[]", [-0.5, -0.10000000149011612])]
    engine.dispose()


def test_a_runs_weight_server_is_one_row_each_trainer_replaces_and_the_downgrade_drops(scratch_url):
    """c4e8a1f7d263: weight_server, read by run name (what a host fetching a `trainer://` URI asks)."""
    from loopline.store import ledger
    from loopline.store.db import session as new_session

    engine = make_engine(scratch_url)
    upgrade(engine)
    with new_session(engine) as s:
        run = ledger.create_run(s, "r", {}, "trainer://r/w#sha256=" + "0" * 64)
        assert ledger.weight_server(s, "r") is None
        ledger.record_weight_server(s, run.id, "http://10.0.0.5:41234", "first", "gpu-a:7:1")
        ledger.record_weight_server(s, run.id, "http://10.0.0.6:40000", "second", "gpu-b:9:1")  # (a resumed trainer, elsewhere)
        assert ledger.weight_server(s, "r") == ("http://10.0.0.6:40000", "second")
        assert ledger.published_uris(s, run.id) == ["trainer://r/w#sha256=" + "0" * 64]
    _downgrade(engine, "b3d7f0a2c915")
    assert "weight_server" not in _tables(engine)
    upgrade(engine)
    assert "weight_server" in _tables(engine)
    engine.dispose()


def test_failed_upgrade_applies_nothing(scratch_url):
    engine = make_engine(scratch_url)
    with engine.begin() as conn:  # a clash late in the migration: tables before it get created first
        conn.exec_driver_sql("CREATE TABLE segment (x int)")
    with pytest.raises(Exception, match="nothing was applied"):
        upgrade(engine)
    assert _tables(engine) == {"segment"}
    assert schema_status(engine).current is None
    engine.dispose()


def test_database_from_a_newer_loopline_is_refused(scratch_url):
    engine = make_engine(scratch_url)
    upgrade(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = 'ffffffffffff'")
    with pytest.raises(SchemaOutOfDate, match="newer than this loopline"):
        require_current_schema(engine)
    with pytest.raises(SchemaOutOfDate, match="upgrade loopline"):
        upgrade(engine)
    engine.dispose()


def test_racing_upgrades_both_succeed_and_apply_once(scratch_url):
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "loopline.cli", "db", "upgrade"],
            env={**os.environ, "LOOPLINE_DATABASE_URL": scratch_url},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0, 0], results
    assert sum("upgraded" in out for _, out, _ in results) == 1
    engine = make_engine(scratch_url)
    assert schema_status(engine).up_to_date
    engine.dispose()


@pytest.mark.parametrize(
    "url, expected",
    [
        ("postgresql+psycopg://postgres@127.0.0.1:1/loopline", "cannot connect"),
        ("sqlite:///ledger.db", "needs PostgreSQL"),
        ("not a url", "is not a database URL"),
    ],
)
def test_bad_database_url_is_one_clear_line(url, expected):
    result = _cli("db", "upgrade", url=url)
    assert result.returncode == 1
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_status_of_an_unmigrated_database_says_what_to_run(scratch_url):
    result = _cli("db", "status", url=scratch_url)
    assert result.returncode == 1
    assert "run `loopline db upgrade`" in result.stderr
    assert "Traceback" not in result.stderr


def test_embedded_server_when_no_url_is_set(tmp_path):
    home = tmp_path / "home"
    first = _cli("db", "upgrade", home=home)
    assert first.returncode == 0, first.stderr
    assert "embedded server" in first.stdout and "upgraded" in first.stdout
    second = _cli("db", "status", home=home)  # a new process reuses the same data directory
    assert second.returncode == 0, second.stderr
    assert "schema up to date" in second.stdout
    assert (home / "pgdata" / "PG_VERSION").exists()
    # the last process using the server stopped it on exit
    assert not (home / "pgdata" / "postmaster.pid").exists()


def test_a_new_users_first_commands_on_the_embedded_ledger_need_no_upgrade(tmp_path):
    """`loopline runs` and `loopline db status` before any `train` (which migrates) asked for `loopline db
    upgrade`; the embedded ledger is loopline's own and brings itself up to date."""
    home = tmp_path / "home"
    runs = _cli("runs", home=home)
    assert runs.returncode == 0 and "no runs yet" in runs.stdout, runs.stderr
    status = _cli("db", "status", home=home)
    assert status.returncode == 0 and "schema up to date" in status.stdout, status.stderr


def test_open_ledger_refuses_an_unmigrated_database(scratch_url):
    from loopline.store.migrate import open_ledger

    with pytest.raises(SchemaOutOfDate, match="run `loopline db upgrade`"):
        open_ledger(scratch_url)
    engine = make_engine(scratch_url)
    upgrade(engine)
    open_ledger(scratch_url).dispose()
    engine.dispose()


def test_per_step_checkpoint_rows_become_one_per_checkpoint_written_and_back(scratch_url):
    """Before d7e1b3c9a4f2 every learner step had a checkpoint row naming the newest checkpoint ('' before
    the first); the upgrade keeps the rows of checkpoints written, the downgrade brings the others back."""
    engine = make_engine(scratch_url)
    upgrade(engine, "c3f9a2d5e817")
    per_step = [(1, ""), (2, "/c/2"), (3, "/c/2"), (4, "/c/4"), (5, "/c/4")]
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO run (id, name, config, config_hash, status) VALUES ('00000000-0000-0000-0000-000000000001', 'r', '{}', 'h', 'running')")
        for version in range(6):
            conn.exec_driver_sql(
                f"INSERT INTO policy_version (run_id, version, learner_step) VALUES ('00000000-0000-0000-0000-000000000001', {version}, {version})"
            )
        for step, uri in per_step:
            conn.exec_driver_sql(
                "INSERT INTO checkpoint (run_id, learner_step, policy_version, uri, complete) "
                f"VALUES ('00000000-0000-0000-0000-000000000001', {step}, {step}, '{uri}', true)"
            )
    rows = lambda: _read(engine, "SELECT learner_step, uri FROM checkpoint ORDER BY learner_step")  # noqa: E731
    upgrade(engine)
    assert [tuple(r) for r in rows()] == [(2, "/c/2"), (4, "/c/4")]
    _downgrade(engine, "c3f9a2d5e817")
    assert [tuple(r) for r in rows()] == per_step
    engine.dispose()


def test_a_loopline_home_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    result = _cli("runs", home=tmp_path / "a-file" / "home")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().startswith("error: the loopline home") and "set LOOPLINE_HOME" in result.stderr


def test_segments_start_no_chain_after_the_upgrade_and_a_ledger_holding_chains_is_not_downgraded(scratch_url):
    """e5b7c1d3f926: segment.starts_chain (issue 48: every chain of an episode is trained). Existing segments
    each extend the one before: false. Downgraded, the older schema could not tell a chain from a re-tokenised
    history: refused while any trajectory holds one."""
    from tests.factories import trajectory

    engine, _, _ = _ledger_with(scratch_url, trajectory(n_segments=2))

    def downgrade() -> None:
        _downgrade(engine, "d7e1b3c9a4f2")

    downgrade()  # one chain each: nothing lost
    upgrade(engine)
    with engine.begin() as conn:
        assert conn.exec_driver_sql("SELECT array_agg(starts_chain ORDER BY seq) FROM segment").scalar_one() == [False, False]
        with pytest.raises(sa.exc.IntegrityError, match="ck_segment_first_starts_no_chain"):
            with conn.begin_nested():
                conn.exec_driver_sql("UPDATE segment SET starts_chain = true WHERE seq = 0")
        conn.exec_driver_sql("UPDATE segment SET starts_chain = true, prompt_prefix_len = 0 WHERE seq = 1")
    with pytest.raises(RuntimeError, match="several chains"):
        downgrade()
    assert schema_status(engine).current == head_revision()  # (refused whole: still at the head)
    engine.dispose()


def test_stored_prompts_become_suffixes_and_back_and_every_reader_gets_the_same_ids(scratch_url):
    """f3a9d6b2c480 (issue 49): a segment stores only the prompt ids its chain's previous segment does not hold.
    Whole prompts (as before) are converted by the upgrade and written back by the downgrade, id for id."""
    from loopline.store import ledger
    from loopline.store.db import session as new_session
    from tests.factories import conversation, segment, trajectory

    rewritten = segment(seed=9, starts_chain=True)  # a second chain: its first segment stores its whole prompt
    segments = [*conversation(5, seed=3), rewritten, segment(seed=10, after=rewritten)]
    engine, run, trajectory_id = _ledger_with(scratch_url, trajectory(segments=segments))
    whole = [list(x.prompt_ids) for x in segments]
    stored = lambda: [r[0] for r in _read(engine, "SELECT prompt_ids FROM segment WHERE trajectory_id = %s ORDER BY seq", trajectory_id)]  # noqa: E731
    suffixes = stored()
    assert sum(map(len, suffixes)) < sum(map(len, whole)) / 2 and suffixes[5] == whole[5]  # (a chain's first: whole)
    _downgrade(engine, "e5b7c1d3f926")
    assert stored() == whole  # the older schema's whole prompts, id for id
    upgrade(engine)
    assert stored() == suffixes
    with new_session(engine) as s:
        (loaded,) = ledger.load_trajectories(s, [trajectory_id])
    assert [list(x.prompt_ids) for x in loaded.segments] == whole
    engine.dispose()


def test_prompts_stored_as_pieces_are_written_whole_by_the_downgrade_and_read_the_same_after(scratch_url):
    """d5f9b2c8e417 (issue 63): a segment that starts a chain stores its prompt as pieces of earlier calls'
    ids. Downgraded, those prompts are written whole (the older schema's form for a chain's first call), id for id."""
    import dataclasses

    from loopline.store import ledger
    from loopline.store.db import session as new_session
    from tests.factories import segment, trajectory

    talk = [segment(n_prompt=40, seed=50)]  # (a copy is at least 16 ids: shorter runs are stored as they are)
    for k in range(3):
        talk.append(segment(n_prompt=20, seed=51 + k, after=talk[-1]))
    trimmed = dataclasses.replace(  # the history's first prompt and its last call, its middle dropped
        segment(seed=11), prompt_ids=[*talk[0].prompt_ids, *talk[3].prompt_ids[-20:], *talk[3].generated_ids, 7, 7, 7], starts_chain=True
    )
    segments = [*talk, trimmed, segment(seed=12, after=trimmed)]
    engine, _, trajectory_id = _ledger_with(scratch_url, trajectory(segments=segments))
    pieces = lambda: _read(engine, "SELECT prompt_copies, cardinality(prompt_ids) FROM segment WHERE trajectory_id = %s AND seq = 4", trajectory_id)[0]  # noqa: E731
    copies, stored = pieces()
    assert copies is not None and stored == 3  # (only its 3 new ids; the rest are copies)

    def whole() -> list[list[int]]:
        with new_session(engine) as s:
            (loaded,) = ledger.load_trajectories(s, [trajectory_id])
        return [list(x.prompt_ids) for x in loaded.segments]

    assert whole() == [list(x.prompt_ids) for x in segments]
    _downgrade(engine, "c4e8a1f7d263")
    assert _read(engine, "SELECT prompt_ids FROM segment WHERE trajectory_id = %s AND seq = 4", trajectory_id)[0][0] == list(trimmed.prompt_ids)
    upgrade(engine)
    assert pieces() == (None, len(trimmed.prompt_ids)) and whole() == [list(x.prompt_ids) for x in segments]
    engine.dispose()
