"""The Prefect `train` flow end to end on a small config: runs, resumes without redoing work, passes `check`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from loopline.flows.config import load_config
from loopline.errors import LooplineError


@pytest.fixture(scope="module")
def prefect_server():
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield


def _config(tmp_path, policy, **overrides):
    data = {
        "name": f"flow-{tmp_path.name}"[:60].replace("_", "-"),
        "env": str((os.path.dirname(__file__) + "/../../examples/arithmetic_env.yaml")),
        "policy": str(policy),
        "steps": 2,
        "groups_per_step": 2,
        "group_size": 4,
        "concurrency": 8,
        "sampling": {"max_new_tokens": 16},
        "learner": {"lr": 1e-3, "backend": "torch"},
        "eval": {"every": 1, "tasks": 8},
        **overrides,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_train_flow_runs_resumes_and_checks(prefect_server, tiny_dirs, database_url, db, tmp_path, monkeypatch):
    from loopline.flows.train import train
    from loopline.store.check import check_run

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    path = _config(tmp_path, tiny_dirs["v0"])
    first = train(str(path))
    assert first["policy_version"] == 2 and [v for v, _ in first["eval"]] == [0, 1, 2]
    again = train(str(path))  # a finished run: nothing is planned, rolled out, trained or evaluated again
    assert again["policy_version"] == 2 and again["eval"] == first["eval"]  # both read from the ledger
    run_id = first["run_id"]
    counts = db.execute(
        sa.text("SELECT (SELECT count(*) FROM trajectory WHERE run_id = :r), (SELECT count(*) FROM eval_result WHERE run_id = :r)"),
        {"r": run_id},
    ).one()
    db.rollback()
    assert tuple(counts) == (16, 3)
    report = check_run(db, run_id)
    assert report.ok, report.violations
    # the memory plan is stored with the run, beside the peak RSS each learner step measured
    fits, peak = db.execute(
        sa.text("SELECT plan->>'fits', (SELECT max(value) FROM metric WHERE run_id = :r AND name = 'peak_rss_gb') FROM run WHERE id = :r"),
        {"r": run_id},
    ).one()
    db.rollback()
    assert fits == "true" and peak > 0.1

    # replay: step 2 retrained from the records (step 1 replayed first: checkpoint_every 4 kept none before
    # step 2) gives version 2's recorded weights bit for bit; a changed record gives other weights
    from loopline.flows.replay import replay_step

    name = yaml.safe_load(path.read_text())["name"]
    replayed = replay_step(name, 2)
    assert replayed["reproduced"] and replayed["from_step"] == 0, replayed
    # the same from the inspector's Runs page: a `loopline replay` flow run, its verdict shown
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "loopline" / "ui" / "app.py"), default_timeout=300)
    at.query_params.update({"page": "runs", "run": name})
    at.run()
    at.number_input(key="replay-step").set_value(1)
    at.button(key="replay").click().run()
    assert not at.exception, at.exception
    assert [m.value for m in at.success if f"{name} step 1 from the initial weights" in m.value and m.value.endswith("reproduced")], at.error
    db.execute(
        sa.text(
            "UPDATE trajectory SET reward = 1 - reward WHERE id = (SELECT c.trajectory_id FROM consumption c "
            "WHERE c.run_id = :r AND c.learner_step = 1 LIMIT 1)"
        ),
        {"r": run_id},
    )
    db.commit()
    assert not replay_step(name, 2)["reproduced"]  # step 1's batch now has another reward: other weights


def test_bad_run_configs_are_refused_up_front(tmp_path):
    with pytest.raises(LooplineError, match="group_size: .*at least 2"):
        load_config(_config(tmp_path, "tiny", group_size=1))
    with pytest.raises(LooplineError, match="colour: Extra inputs"):
        load_config(_config(tmp_path, "tiny", colour="blue"))
    with pytest.raises(LooplineError, match="steps: Input should be greater than or equal to 1"):
        load_config(_config(tmp_path, "tiny", steps=0))
    with pytest.raises(LooplineError, match="max_staleness: Input should be greater than or equal to 0"):
        load_config(_config(tmp_path, "tiny", mode="async", max_staleness=-1))
    with pytest.raises(LooplineError, match="env: nowhere.yaml not found"):
        load_config(_config(tmp_path, "tiny", env="nowhere.yaml"))


def _scalar_rows(db, sql, **params):
    rows = db.execute(sa.text(sql), params).all()
    db.rollback()
    return rows


def test_a_run_that_cannot_fit_is_refused_before_it_exists(prefect_server, database_url, db, tmp_path, monkeypatch):
    """A 7B-shaped policy (its config.json only) in fp32 on this machine: refused with the plan's table,
    before the run is created or any weights are read."""
    from loopline.flows.train import train

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    path = _config(tmp_path, os.path.dirname(__file__) + "/../../examples/shapes/qwen2.5-7b")
    with pytest.raises(LooplineError, match="would run out of memory") as refused:
        train(str(path))
    assert "does NOT fit" in str(refused.value) and "optimizer states" in str(refused.value)
    name = yaml.safe_load(path.read_text())["name"]
    assert db.execute(sa.text("SELECT count(*) FROM run WHERE name = :n"), {"n": name}).scalar_one() == 0


def test_async_flow_overlaps_rollout_and_learning_within_max_staleness(prefect_server, tiny_dirs, database_url, db, tmp_path, monkeypatch):
    from loopline.flows.train import train
    from loopline.store.check import check_run

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    path = _config(tmp_path, tiny_dirs["v0"], mode="async", max_staleness=1, steps=3, eval={"every": 3, "tasks": 4})
    result = train(str(path))
    assert result["policy_version"] == 3
    lags = _scalar_rows(db, "SELECT learner_step, max(version_lag) FROM consumption WHERE run_id = :r GROUP BY 1 ORDER BY 1", r=result["run_id"])
    # step 1 can only train version-0 samples; later steps train samples started before the previous sync
    assert lags[0] == (1, 0) and max(lag for _, lag in lags) == 1, lags
    recorded = _scalar_rows(db, "SELECT max(value) FROM metric WHERE run_id = :r AND name = 'version_lag_max'", r=result["run_id"])
    assert recorded[0][0] == 1.0
    report = check_run(db, result["run_id"])
    assert report.ok, report.violations


def test_changed_config_is_refused_unless_forked_and_eval_reads_back(prefect_server, tiny_dirs, database_url, db, tmp_path, monkeypatch):
    from loopline.flows.evaluate import evaluate
    from loopline.flows.train import train
    from loopline.store.errors import LedgerConflict

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    path = _config(tmp_path, tiny_dirs["v0"], steps=2, eval={"every": 2, "tasks": 4})
    first = train(str(path))
    name = first["run"]
    assert [v for v, _ in train(resume=name)["eval"]] == [0, 2]  # the stored config resumes a finished run: nothing to do
    changed = _config(
        tmp_path, tiny_dirs["v0"], steps=3, eval={"every": 2, "tasks": 4}, learner={"lr": 5e-4, "backend": "torch", "export_every": 1}
    )
    with pytest.raises(LedgerConflict, match="another config .* --fork NEW_NAME"):
        train(str(changed))
    forked = train(str(changed), fork=f"{name}-b")
    assert forked["run"] == f"{name}-b" and forked["policy_version"] == 3
    parent_v2, fork_v0 = _scalar_rows(
        db,
        "SELECT p.weights_uri FROM policy_version p JOIN run r ON r.id = p.run_id "
        "WHERE (r.name = :a AND p.version = 2) OR (r.name = :b AND p.version = 0) ORDER BY r.name",
        a=name, b=f"{name}-b",
    )
    assert parent_v2 == fork_v0  # the fork starts from the parent's newest policy
    again = evaluate(name)  # v2 was evaluated by the run: read back, not re-run
    assert (again["policy_version"], again["recorded"]) == (2, False)
    with pytest.raises(LooplineError, match="v1 was never written to disk .* versions on disk: 0, 2"):
        evaluate(name, version=1)  # the in-process engine took v1 from the learner's memory
    fresh = evaluate(f"{name}-b", version=1)  # the fork exports every version
    assert fresh["recorded"] and 0.0 <= fresh["success"] <= 1.0
    assert _scalar_rows(db, "SELECT count(*) FROM eval_result e JOIN run r ON r.id = e.run_id WHERE r.name = :a", a=f"{name}-b")[0][0] == 4


@pytest.mark.parametrize("engine_kind", ["local", "sglang"])
def test_learner_flow_fed_by_a_rollout_worker_in_another_process(engine_kind, prefect_server, tiny_dirs, database_url, db, tmp_path, monkeypatch):
    """`loopline worker RUN` builds the run's engine from its stored config: LocalEngine, or a client of the
    run's SGLang servers (here a model-backed stand-in, see tests/fakes/sglang_protocol_server.py)."""
    import signal
    import socket
    import subprocess
    import sys
    import threading
    import time

    from loopline.flows.train import learner

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    servers = None
    engine_config = {"kind": "local"}
    if engine_kind == "sglang":
        from tests.integration.test_sglang_loop import StandIns

        servers = StandIns(tiny_dirs["v0"], 1, tmp_path)
        engine_config = {"kind": "sglang", "servers": servers.urls}
    path = _config(tmp_path, tiny_dirs["v0"], mode="async", local_rollout=False, steps=2, eval={"every": 2, "tasks": 4}, engine=engine_config)
    name = load_config(path)[0].name
    result: dict = {}
    trainer = threading.Thread(target=lambda: result.update(learner(str(path))))
    trainer.start()
    while not _scalar_rows(db, "SELECT count(*) FROM run WHERE name = :n", n=name)[0][0]:
        time.sleep(0.5)
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "worker", name], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        trainer.join(timeout=400)
        assert worker.wait(timeout=120) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        if servers:
            assert [v.split("@")[0] for v in servers.versions()] == ["2"]  # the server ends on the newest version
    finally:
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if servers:
            servers.stop()
    assert result["policy_version"] == 2
    workers = _scalar_rows(db, "SELECT DISTINCT a.worker FROM attempt a JOIN run r ON r.id = a.run_id WHERE r.name = :n", n=name)
    # every rollout came from the other process (holders are host:pid:start-time)
    assert [w.rsplit(":", 1)[0] for (w,) in workers] == [f"{socket.gethostname()}:{worker.pid}"]
