"""The Prefect `train` flow end to end on a small config: runs, resumes without redoing work, passes `check`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from loopline.store.uris import WeightsURI, path_on_publisher

from loopline.envregistry.registry import content_hash
from loopline.errors import LooplineError
from loopline.config import load_config
from loopline.policies.sources import SHIPPED_STARTERS, tiny_policy_name
from loopline.store import ledger
from loopline.store.db import make_engine
from loopline.trainer.checkpoint import weights_sha256
from tests.helpers import undescribed_metrics

ENV = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_env.yaml"
STARTER = SHIPPED_STARTERS / tiny_policy_name(content_hash(ENV), 0)


@pytest.fixture(scope="module")
def prefect_server():
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):  # (a busy machine: see loopline/__init__.py)
        yield


def digests_of(db, run_id) -> dict[int, str | None]:
    rows = db.execute(sa.text("SELECT version, sha256 FROM policy_version WHERE run_id = :r"), {"r": run_id}).all()
    db.rollback()
    return dict(rows)


def _config(tmp_path, policy, rollout: dict | None = None, **overrides):
    data = {
        "name": f"flow-{tmp_path.name}"[:60].replace("_", "-"),
        "env": str((os.path.dirname(__file__) + "/../../examples/arithmetic_env.yaml")),
        "policy": str(policy),
        "steps": 2,
        "rollout": {"groups_per_step": 2, "group_size": 4, "concurrency": 8, "sampling": {"max_new_tokens": 16}, **(rollout or {})},
        "learner": {"lr": 1e-3, "backend": "torch"},
        "eval": {"every": 1, "tasks": 8},
        **overrides,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _schema_round_trip(url: str, revision: str) -> None:
    from alembic import command

    from loopline.store.migrate import alembic_config, upgrade

    engine = make_engine(url)
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)
    upgrade(engine)
    engine.dispose()


def test_train_flow_runs_resumes_and_checks(prefect_server, tiny_dirs, database_url, db, tmp_path, monkeypatch):
    from loopline.flows.train import train
    from loopline.store.check import check_run

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    # the shipped starter (it earns rewards, so the policy moves), with KL to the reference (issue 32: it crashed
    # at step 1), which the replay below must reproduce as well
    path = _config(tmp_path, STARTER, learner={"lr": 1e-3, "backend": "torch", "loss": {"kl_coef": 0.05}})
    first = train(str(path))
    assert first["policy_version"] == 2 and [v for v, _ in first["eval"]] == [0, 1, 2]
    kl = dict(db.execute(sa.text("SELECT step, value FROM metric WHERE run_id = :r AND name = 'kl_ref'"), {"r": first["run_id"]}).all())
    db.rollback()
    moved = db.execute(sa.text("SELECT sha256 FROM policy_version WHERE run_id = :r AND version = 1"), {"r": first["run_id"]}).scalar() != weights_sha256(STARTER)
    db.rollback()
    # KL is 0 at step 1 (the policy is its reference), and after only where step 1 moved the weights (where
    # every group earned the same reward, every advantage is 0 and nothing moves)
    assert kl[1] == 0.0 and (kl[2] > 0) == moved, (kl, moved)
    assert not undescribed_metrics(db, first["run_id"])
    again = train(str(path))  # a finished run: nothing is planned, rolled out, trained or evaluated again
    assert again["policy_version"] == 2 and again["eval"] == first["eval"]  # both read from the ledger
    run_id = first["run_id"]
    counts = db.execute(
        sa.text("SELECT (SELECT count(*) FROM trajectory WHERE run_id = :r AND split = 'train'), "
                "(SELECT count(*) FROM eval_result WHERE run_id = :r), (SELECT sum(n_tasks) FROM eval_result WHERE run_id = :r), "
                "(SELECT count(*) FROM trajectory WHERE run_id = :r AND split = 'eval')"),
        {"r": run_id},
    ).one()
    db.rollback()
    assert tuple(counts[:2]) == (16, 3) and counts[3] == counts[2] > 0  # each evaluation's episodes are browsable
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
    # issue 49: the same run after the ledger went back to the schema before linear storage (whole prompts,
    # float8 logprobs: every segment row rewritten) and forward again: `check` passes, step 2 still reproduces
    db.rollback()
    _schema_round_trip(database_url, "e5b7c1d3f926")
    assert check_run(db, run_id).ok
    db.rollback()
    assert replay_step(name, 2)["reproduced"]
    # the same from the inspector's Runs page: a `loopline replay` flow run, its verdict shown
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "loopline" / "ui" / "app.py"), default_timeout=300)
    at.query_params.update({"page": "runs", "run": name})
    at.run()
    at.number_input(key="replay-step").set_value(1)
    at.button(key="replay").click().run()
    assert not at.exception, at.exception
    assert [m.value for m in at.success if f"{name} step 1 from the initial weights" in m.value and m.value.endswith("reproduced")], [e.value for e in at.error]
    # the run's final model as a plain Hugging Face directory, checked against the ledger's sha256
    exported = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "export", name, str(tmp_path / "final")], capture_output=True, text=True, timeout=300,
    )
    assert exported.returncode == 0 and f"run {name} v2 is at {tmp_path / 'final'}" in exported.stdout, exported.stdout + exported.stderr
    assert weights_sha256(tmp_path / "final") == digests_of(db, run_id)[2]
    again = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "export", name, str(tmp_path / "final"), "--version", "9"], capture_output=True, text=True, timeout=300,
    )
    assert again.returncode == 1 and "has no policy version 9" in again.stdout + again.stderr, again.stdout + again.stderr
    for asked, step in ((name, 0), (str(run_id), 1_000_000_000)):  # (said "versions go up to 0"; named the run by its id)
        refused = subprocess.run([sys.executable, "-m", "loopline.cli", "replay", asked, "--step", str(step)], capture_output=True, text=True, timeout=300)
        assert refused.returncode == 1 and refused.stderr.strip() == f"error: run {name} has committed learner steps 1 to 2; replay one of them", refused.stderr
    (tmp_path / "a-file").write_text("")
    for where in (tmp_path / "a-file" / "model", Path("/proc/loopline-export"), tmp_path / "a-file"):  # (were tracebacks)
        refused = subprocess.run(
            [sys.executable, "-m", "loopline.cli", "export", name, str(where)], capture_output=True, text=True, timeout=300,
        )
        lines = [line for line in (refused.stdout + refused.stderr).splitlines() if line.strip()]
        assert refused.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and str(where) in lines[0], refused.stderr
    db.execute(
        sa.text(
            "UPDATE trajectory SET reward = 1 - reward WHERE id = (SELECT c.trajectory_id FROM consumption c "
            "WHERE c.run_id = :r AND c.learner_step = 1 LIMIT 1)"
        ),
        {"r": run_id},
    )
    db.commit()
    assert not replay_step(name, 2)["reproduced"]  # step 1's batch now has another reward: other weights


RECORDED_FLAT = Path(__file__).resolve().parents[1] / "data" / "run_config_stored_at_bd0252b.json"


def test_a_run_whose_config_was_stored_before_sections_resumes_as_the_same_run(prefect_server, tiny_dirs, database_url, db, tmp_path, monkeypatch):
    """A config the ledger stored before the run config had sections (rollout settings at the top level, as
    loopline wrote it at bd0252b: recorded in tests/data) has its lease read, trains from the ledger, is the same
    run as its sectioned file, and is stored in sections once a newer loopline drives it."""
    from loopline.envregistry import registry
    from loopline.flows.train import train
    from loopline.store.queries import list_runs, run_lease

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    recorded = json.loads(RECORDED_FLAT.read_text())
    assert "groups_per_step" in recorded and "rollout" not in recorded  # (the old layout)
    name = f"flat-{tmp_path.name}"[:60].replace("_", "-")
    stored = {**recorded, "name": name, "env": registry.add(db, ENV).ref, "policy": str(tiny_dirs["v0"])}
    run = ledger.create_run(db, name, stored, str(tiny_dirs["v0"]))  # (as the older loopline created it)
    assert _scalar_rows(db, f"SELECT {run_lease()} FROM run WHERE id = :r", r=run.id)[0][0] == 30.0  # (the recorded value, not the default)
    assert {r.name: r.status for r in list_runs(db)}[name] == "created"

    resumed = train(resume=name)  # no file: the stored, flat config
    assert resumed["policy_version"] == 2 and [v for v, _ in resumed["eval"]] == [0, 2]
    again = _config(tmp_path, tiny_dirs["v0"], name=name, rollout={"lease_seconds": 30}, eval={"every": 2, "tasks": 4})
    assert train(str(again))["policy_version"] == 2  # the same run in the new layout: finished, not "another config"
    restated = _scalar_rows(db, "SELECT config FROM run WHERE id = :r", r=run.id)[0][0]
    assert restated["rollout"]["lease_seconds"] == 30.0 and "groups_per_step" not in restated


def test_a_training_step_runs_on_components_registered_outside_loopline(prefect_server, tiny_dirs, database_url, db, tmp_path, monkeypatch):
    """Issue 51: an engine, a sandbox backend, a learner backend, a tracker and the learner's four components, each registered
    by a test module as a plugin would be (test_toy_components.py), are chosen by the run config and env spec
    and are what a step of `train` runs."""
    from loopline.flows.train import train
    from tests.integration import test_toy_components as toys

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    env = yaml.safe_load(ENV.read_text())
    env.update(name="toy-arithmetic", sandbox={"backend": toys.TOY_SANDBOX})
    (tmp_path / "toy_env.yaml").write_text(yaml.safe_dump(env))
    toys.CALLED.clear()
    # the shipped starter earns rewards (the estimator sees no group whose rewards are all equal)
    path = _config(tmp_path, STARTER, env=str(tmp_path / "toy_env.yaml"), steps=1, eval={"every": 1, "tasks": 2},
                   learner=toys.TOY_LEARNER, engine=toys.TOY_ENGINE, tracking=toys.TOY_TRACKING, rollout={"groups_per_step": 4, "sampling": {"max_new_tokens": 48}})
    assert train(str(path))["policy_version"] == 1
    assert toys.CALLED == {"engine", "sandbox", "learner backend", "estimator", "policy loss", "aggregation", "kl", "correction", "tracker"}


def test_bad_run_configs_are_refused_up_front(tmp_path):
    with pytest.raises(LooplineError, match="group_size: .*at least 2"):
        load_config(_config(tmp_path, "tiny", rollout={"group_size": 1}))
    with pytest.raises(LooplineError, match="colour: unknown setting"):
        load_config(_config(tmp_path, "tiny", colour="blue"))
    with pytest.raises(LooplineError, match="steps: Input should be greater than or equal to 1"):
        load_config(_config(tmp_path, "tiny", steps=0))
    with pytest.raises(LooplineError, match="max_staleness: Input should be greater than or equal to 0"):
        load_config(_config(tmp_path, "tiny", rollout={"mode": "async", "max_staleness": -1}))
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
    path = _config(tmp_path, tiny_dirs["v0"], rollout={"mode": "async", "max_staleness": 1}, steps=3, eval={"every": 3, "tasks": 4})
    result = train(str(path))
    assert result["policy_version"] == 3
    lags = _scalar_rows(db, "SELECT learner_step, max(version_lag) FROM consumption WHERE run_id = :r GROUP BY 1 ORDER BY 1", r=result["run_id"])
    # step 1 can only train version-0 samples; later steps train samples started before the previous sync
    assert lags[0] == (1, 0) and max(lag for _, lag in lags) == 1, lags
    recorded = _scalar_rows(db, "SELECT max(value) FROM metric WHERE run_id = :r AND name = 'version_lag_max'", r=result["run_id"])
    assert recorded[0][0] == 1.0 and not undescribed_metrics(db, result["run_id"])
    report = check_run(db, result["run_id"])
    assert report.ok, report.violations


def test_changed_config_is_refused_unless_forked_and_eval_reads_back(prefect_server, tiny_dirs, database_url, db, tmp_path, monkeypatch):
    from loopline.flows.evaluate import evaluate
    from loopline.flows.train import train
    from loopline.store.errors import LedgerConflict

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    path = _config(tmp_path, tiny_dirs["v0"], steps=2, eval={"every": 2, "tasks": 4})
    original = tmp_path / "original.yaml"
    original.write_text(path.read_text())  # (`_config` writes run.yaml again below)
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
    assert train(resume=f"{name}-b")["policy_version"] == 3  # a fork resumes with its stored config (it has its parent's name beside it)
    # a run stored by an older loopline, before a field it does not set existed (here: learner.lora), resumes
    from loopline.store.runs import config_hash

    row = _scalar_rows(db, "SELECT id, config FROM run WHERE name = :n", n=name)[0]
    older = {**row[1], "learner": {k: v for k, v in row[1]["learner"].items() if k != "lora"}}
    db.execute(sa.text("UPDATE run SET config = CAST(:c AS jsonb), config_hash = :h WHERE id = :r"),
               {"c": json.dumps(older), "h": config_hash(older), "r": row[0]})
    db.commit()
    assert train(str(original))["policy_version"] == 2  # the same config, not "another config"
    parent_v2, fork_v0 = _scalar_rows(
        db,
        "SELECT p.weights_uri FROM policy_version p JOIN run r ON r.id = p.run_id "
        "WHERE (r.name = :a AND p.version = 2) OR (r.name = :b AND p.version = 0) ORDER BY r.name",
        a=name, b=f"{name}-b",
    )
    parent_v2, fork_v0 = WeightsURI.parse(parent_v2[0]), WeightsURI.parse(fork_v0[0])  # the fork starts from the parent's newest policy,
    assert (fork_v0.path, fork_v0.digest, fork_v0.run) == (parent_v2.path, parent_v2.digest, f"{name}-b")  # served by its own trainer
    from loopline.store.queries import list_runs

    listed = {r.name: r for r in list_runs(db)}
    assert (listed[f"{name}-b"].parent, listed[name].parent) == (f"{name}@v2", None)  # `loopline runs`: "(fork of NAME@v2)"
    assert listed[name].status == listed[f"{name}-b"].status == "completed"
    again = evaluate(name)  # v2 was evaluated by the run: read back, not re-run
    assert (again["policy_version"], again["recorded"]) == (2, False)
    with pytest.raises(LooplineError, match="v1 was never written to disk .* versions on disk: 0, 2"):
        evaluate(name, version=1)  # the in-process engine took v1 from the learner's memory
    fresh = evaluate(f"{name}-b", version=1)  # the fork exports every version
    assert fresh["recorded"] and 0.0 <= fresh["success"] <= 1.0
    assert _scalar_rows(db, "SELECT count(*) FROM eval_result e JOIN run r ON r.id = e.run_id WHERE r.name = :a", a=f"{name}-b")[0][0] == 4
    # a version the run's pruning deleted (here: by hand), its evaluation not recorded: gone for good, said so
    pruned = _scalar_rows(db, "SELECT p.weights_uri FROM policy_version p JOIN run r ON r.id = p.run_id WHERE r.name = :b AND p.version = 2", b=f"{name}-b")[0][0]
    shutil.rmtree(path_on_publisher(pruned))
    db.execute(sa.text("DELETE FROM eval_result e USING run r WHERE r.id = e.run_id AND r.name = :b AND e.policy_version = 2"), {"b": f"{name}-b"})
    db.commit()
    with pytest.raises(LooplineError, match=r"v2 had its files deleted by the run's pruning .* gone for good; versions on disk: 0, 1, 3"):
        evaluate(f"{name}-b", version=2)


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
    path = _config(tmp_path, tiny_dirs["v0"], rollout={"mode": "async", "local_rollout": False}, steps=2, eval={"every": 2, "tasks": 4}, engine=engine_config)
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
    workers = _scalar_rows(db, "SELECT DISTINCT a.worker FROM attempt a JOIN run r ON r.id = a.run_id JOIN slot s ON s.id = a.slot_id "
                               "WHERE r.name = :n AND s.split = 'train'", n=name)
    # every training rollout came from the other process (holders are host:pid:start-time; evaluations are the trainer's)
    assert [w.rsplit(":", 1)[0] for (w,) in workers] == [f"{socket.gethostname()}:{worker.pid}"]


def test_the_run_configs_knobs_reach_the_optimizer_and_the_sampler(tiny_dirs, tmp_path):
    """Issue 32: warm-up, schedule, weight decay and top-p/top-k, read on the objects a run builds from its config."""
    from loopline.envregistry.spec import load_spec
    from loopline.pipeline.assembly import build_setup
    from loopline.trainer.learner import Learner

    path = _config(
        tmp_path, tiny_dirs["v0"], steps=4, rollout={"sampling": {"max_new_tokens": 16, "top_p": 0.9, "top_k": 20}},
        learner={"lr": 1e-3, "backend": "torch", "minibatches": 2, "warmup_steps": 1, "lr_schedule": "linear", "weight_decay": 0.01},
    )
    config, _ = load_config(path)
    learner = Learner(tiny_dirs["v0"], config.learner_config(), backend="torch")
    optimizer, scheduler = learner.backend.optimizer, learner.backend.scheduler
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    rates = []
    for _ in range(9):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    # 4 steps x 2 minibatches = 8 optimizer steps: 1 of warm-up, then linear to 0 at the 8th
    assert rates == pytest.approx([1e-3 * f for f in (1, 1, 6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7, 0)], abs=1e-12)
    setup = build_setup(config, load_spec(ENV), 1, tiny_dirs["v0"])
    assert (setup.sampling.top_p, setup.sampling.top_k, setup.sampling.temperature) == (0.9, 20, 1.0)


def test_a_run_whose_learning_rate_decays_over_its_steps_is_not_extended(prefect_server, tiny_dirs, database_url, db, tmp_path, monkeypatch):
    from loopline.pipeline.resumption import extend_run
    from loopline.flows.train import train

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    path = _config(tmp_path, tiny_dirs["v0"], steps=1, learner={"lr": 1e-3, "backend": "torch", "lr_schedule": "cosine"}, eval={"every": 1, "tasks": 2})
    name = train(str(path))["run"]
    with pytest.raises(LooplineError, match=f"run {name} decays its learning rate over its 1 steps .* Fork it instead"):
        extend_run(None, name, 3)


def test_a_hugging_face_id_is_read_from_the_local_cache_and_a_missing_one_is_one_line(tiny_dirs, tmp_path):
    """Issue 32: `policy: OWNER/NAME` is looked up in the Hugging Face cache as the hub library lays it out
    (offline here: HF_HUB_OFFLINE); one that is not there says where it looked and what to run."""
    snapshot = tmp_path / "hf" / "models--someone--tiny-calc" / "snapshots" / ("ab" * 20)
    shutil.copytree(tiny_dirs["v0"], snapshot)
    (tmp_path / "hf" / "models--someone--tiny-calc" / "refs").mkdir()
    (tmp_path / "hf" / "models--someone--tiny-calc" / "refs" / "main").write_text("ab" * 20)
    env_file = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_env.yaml"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}

    def plan(policy: str) -> subprocess.CompletedProcess:
        config = tmp_path / "run.yaml"
        config.write_text(f"name: hub\nenv: {env_file}\npolicy: {policy}\n")
        return subprocess.run([sys.executable, "-m", "loopline.cli", "plan", str(config)], env=env, capture_output=True, text=True, timeout=120)

    found = plan("someone/tiny-calc")
    assert found.returncode == 0 and "fits" in found.stdout, found.stdout + found.stderr
    probe = (  # what the train flow starts from
        "import sys\nfrom loopline.config import parse_config\nfrom loopline.pipeline.opening import resolve_policy\n"
        "print(resolve_policy(parse_config({'name': 'hub', 'env': 'e.yaml', 'policy': sys.argv[1]}, 'run.yaml'), None, [], ''))"
    )
    resolved = subprocess.run([sys.executable, "-c", probe, "someone/tiny-calc"], env=env, capture_output=True, text=True, timeout=120)
    assert resolved.stdout.strip() == str(snapshot), resolved.stdout + resolved.stderr
    missing = plan("someone/not-downloaded")
    lines = [line for line in (missing.stdout + missing.stderr).splitlines() if line.strip()]
    assert missing.returncode == 1 and len(lines) == 1, lines
    assert f"not in the Hugging Face cache ({tmp_path / 'hf'}) and HF_HUB_OFFLINE is set" in lines[0] and "hf download someone/not-downloaded" in lines[0]


def test_a_lora_run_checkpoints_adapters_replays_from_them_and_exports_the_merged_model(prefect_server, database_url, db, tmp_path, monkeypatch):
    """`learner.lora` from the run config: the run trains (on DeepSpeed, with KL to the base), its checkpoints
    hold the adapters only, a replay restores one and reproduces the next version's sha256, and an exported
    version is a plain model directory whose sha256 is the ledger's."""
    from loopline.flows.replay import replay_step
    from loopline.flows.train import train
    from loopline.store.check import check_run

    monkeypatch.setenv("LOOPLINE_DATABASE_URL", database_url)
    monkeypatch.setenv("LOOPLINE_HOME", str(tmp_path / "home"))
    learner = {"lr": 1e-2, "backend": "deepspeed", "checkpoint_every": 1, "lora": {"rank": 4}, "loss": {"kl_coef": 0.05}}
    path = _config(tmp_path, STARTER, learner=learner, eval={"every": 2, "tasks": 4}, rollout={"groups_per_step": 4, "sampling": {"max_new_tokens": 48}})
    done = train(str(path))
    run_id, name = done["run_id"], done["run"]
    assert done["policy_version"] == 2 and check_run(db, run_id).ok and not undescribed_metrics(db, run_id)
    digests = digests_of(db, run_id)
    digests[0] = weights_sha256(STARTER)
    signal = dict(db.execute(sa.text(
        "SELECT step, bool_or(name = 'degenerate_groups' AND value < 4) FROM metric WHERE run_id = :r GROUP BY step"), {"r": run_id}).all())
    db.rollback()
    # a step moved the merged model exactly where some group's rewards differed (else every advantage is 0)
    assert [digests[v] != digests[v - 1] for v in (1, 2)] == [signal[1], signal[2]], (digests, signal)
    assert signal[1] and signal[2], signal  # (seeded sampling: both steps have signal)
    checkpoints = sorted((tmp_path / "home" / "runs" / name / "checkpoints").iterdir())
    assert checkpoints
    for ckpt in checkpoints:  # the adapters and their Adam moments, well under the base's weights alone
        assert sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) < (STARTER / "model.safetensors").stat().st_size / 3
    replayed = replay_step(name, 2)
    assert replayed["reproduced"] and replayed["from_step"] == 1, replayed
    uri = db.execute(sa.text("SELECT weights_uri FROM policy_version WHERE run_id = :r AND version = 2"), {"r": run_id}).scalar()
    db.rollback()
    assert weights_sha256(path_on_publisher(uri)) == digests[2]
