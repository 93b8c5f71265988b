"""`tracking:` sends the ledger's numbers to the trackers people run: a 2-step run reports to a real MLflow
tracking server, TensorBoard event files, W&B (offline) and trackio, and each holds the ledger's values at
the ledger's steps. A tracker that fails is one warning line, and changing the trackers does not make a run
"another config"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from loopline.metrics import METRICS
from loopline.tracking import trackio_run_name
from loopline.ports import free_port
from tests.integration.test_chaos import _rows, _small_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--default-artifact-root", str(tmp_path / "artifacts"),
         "--workers", "1"],
        stdout=(tmp_path / "mlflow.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (tmp_path / "mlflow.log").read_text()[-2000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the MLflow server did not start"
        time.sleep(0.5)
    yield url
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (wandb 0.31 ships no reader: LevelDB's log format, after a 7-byte
    ":W&B" header; 32 KiB blocks of records with a 7-byte header: crc, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
        elif kind == 0:
            pending = b""
    return records


def _trackio_logs(store: Path, run: str) -> list[dict]:
    """A run's rows in trackio's local store, read by trackio in a process of its own: trackio reads TRACKIO_DIR
    once, at its first import (a second test in this process read the first test's store)."""
    read = "import json, sys; from trackio.sqlite_storage import SQLiteStorage; print(json.dumps(SQLiteStorage.get_logs('loopline', sys.argv[1])))"
    done = subprocess.run([sys.executable, "-c", read, run], env={**os.environ, "TRACKIO_DIR": str(store)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_trackio_keeps_a_run_trained_again_under_the_same_name_apart(tmp_path):
    """trackio finds a run by name: a run deleted and trained again under the same name went on in the old one's
    trackio run (every point twice, some with the old values). Each loopline run (its id) is a trackio run of its own."""
    play = ("import sys, uuid; from loopline.tracking import Trackio, tracker_settings\n"
            "for run_id, value in ((uuid.UUID(sys.argv[1]), 0.25), (uuid.UUID(sys.argv[2]), 0.5)):\n"
            "    t = Trackio('again', run_id, __import__('pathlib').Path(sys.argv[3]), {}, tracker_settings('trackio'))\n"
            "    t.log(1, {'reward_mean': value}); t.close()\n")
    first, second = uuid.uuid4(), uuid.uuid4()
    done = subprocess.run([sys.executable, "-c", play, str(first), str(second), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")})
    assert done.returncode == 0, done.stderr[-2000:]
    for run_id, value in ((first, 0.25), (second, 0.5)):
        rows = _trackio_logs(tmp_path / "trackio", trackio_run_name("again", run_id))
        assert [(row["step"], row["reward_mean"]) for row in rows if "reward_mean" in row] == [(1, value)]


def _train(config: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loopline.cli", "train", str(config)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_every_tracker_holds_the_ledgers_numbers_at_the_ledgers_steps(tiny_dirs, database_url, db, tmp_path, mlflow_server):
    name = f"tracked-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode="sync", lease_seconds=5, backend="torch", every=2)
    data = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**data, "steps": 2, "tracking": ["tensorboard", "mlflow", "wandb", "trackio"]}))
    env = {**env, "MLFLOW_TRACKING_URI": mlflow_server, "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_MODE", None)
    done = _train(config, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the run goes on without it" not in done.stdout + done.stderr, "a tracker failed"
    run_id = _rows(db, "SELECT id FROM run WHERE name = :n", n=name)[0][0]
    ledger = {(step, metric): value for step, metric, value in _rows(db, "SELECT step, name, value FROM metric WHERE run_id = :r", r=run_id)}
    evals = dict(_rows(db, "SELECT policy_version, success_rate FROM eval_result WHERE run_id = :r", r=run_id))
    assert {s for s, _ in ledger} == {1, 2} and set(evals) == {0, 2}
    names = {m for _, m in ledger}
    assert {"reward_mean", "loss", "grad_norm", "learner_s"} <= names
    assert names <= set(METRICS), names - set(METRICS)  # (each described in the docs' metric reference)

    # MLflow, read back from the server
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    (found,) = client.search_runs([client.get_experiment_by_name("loopline").experiment_id], filter_string=f"tags.`loopline.run_id` = '{run_id}'")
    for metric in names:
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, metric)}
        assert history == {step: value for (step, m), value in ledger.items() if m == metric}, (metric, done.stderr[-3000:])
    assert {m.step: m.value for m in client.get_metric_history(found.info.run_id, "eval/success_rate")} == evals
    seconds = dict(_rows(db, "SELECT policy_version, (details->>'seconds')::float8 FROM eval_result WHERE run_id = :r", r=run_id))
    assert {m.step: m.value for m in client.get_metric_history(found.info.run_id, "timing_s/eval")} == pytest.approx(seconds)
    assert all(0 < s < 600 for s in seconds.values()), seconds
    assert found.data.params["steps"] == "2" and found.data.params["learner.backend"] == "torch"
    assert "config.json" in {Path(a.path).name for a in client.list_artifacts(found.info.run_id, "model")}
    assert found.info.status == "FINISHED"

    # TensorBoard's event files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "home" / "runs" / name / "tensorboard"))
    events.Reload()
    rewards = {step: value for (step, m), value in ledger.items() if m == "reward_mean"}
    assert {e.step: e.value for e in events.Scalars("reward_mean")} == pytest.approx(rewards, rel=1e-6)  # (stored as float32)

    # W&B, offline: the history records of its run file
    (offline,) = (tmp_path / "home" / "runs" / name / "wandb").glob("offline-run-*/*.wandb")
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in _wandb_records(offline) if record.WhichOneof("record_type") == "history"
    ]
    assert {row["_step"]: row["reward_mean"] for row in history if "reward_mean" in row} == pytest.approx(rewards)
    assert {row["_step"]: row["eval/success_rate"] for row in history if "eval/success_rate" in row} == pytest.approx(evals)

    # trackio's local store
    logs = _trackio_logs(tmp_path / "trackio", trackio_run_name(name, run_id))
    assert {row["step"]: row["reward_mean"] for row in logs if "reward_mean" in row} == pytest.approx(rewards)


@pytest.mark.slow
def test_a_failing_tracker_is_one_warning_and_trackers_are_not_the_runs_identity(tiny_dirs, database_url, db, tmp_path):
    name = f"tracked-bad-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode="sync", lease_seconds=5, backend="torch", every=1)
    data = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**data, "steps": 1, "tracking": ["mlflow"]}))
    done = _train(config, {**env, "MLFLOW_TRACKING_URI": "nosuchscheme://x"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "tracker mlflow" in line]
    assert len(warnings) == 1 and "the run goes on without it" in warnings[0], warnings
    config.write_text(yaml.safe_dump({**data, "steps": 1, "tracking": ["tensorboard"]}))  # other trackers: the same run
    again = _train(config, env)
    assert again.returncode == 0 and "another config" not in again.stdout + again.stderr, again.stdout[-2000:] + again.stderr[-2000:]
    assert _rows(db, "SELECT count(*) FROM run WHERE name = :n", n=name)[0][0] == 1


def test_mlflow_on_its_default_store_holds_the_steps_and_a_resume_goes_on_in_the_same_run(tmp_path, monkeypatch):
    """With no MLFLOW_TRACKING_URI set (a user's default), mlflow 3 refuses its old default file store ("in
    maintenance mode": one warning, nothing logged). loopline's default is a SQLite store in the run's directory."""
    import uuid

    from mlflow.tracking import MlflowClient

    from loopline.config import parse_config
    from loopline.tracking import MLflow, tracker_settings

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # (nothing may land in the current directory either)
    run_id, workdir = uuid.uuid4(), tmp_path / "runs" / "r"
    first = MLflow("r", run_id, workdir, {"lr": 0.001}, tracker_settings("mlflow"))
    first.log(1, {"reward/mean": 0.25})
    first.close()
    again = MLflow("r", run_id, workdir, {"lr": 0.001}, tracker_settings("mlflow"))  # a resume
    again.log(2, {"reward/mean": 0.5})
    again.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    assert again.run == first.run
    assert [(m.step, m.value) for m in client.get_metric_history(first.run, "reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert client.get_run(first.run).data.params == {"lr": "0.001"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert client.get_experiment(client.get_run(first.run).info.experiment_id).name == "loopline"
    # its own setting, from `tracking: [{kind: mlflow, experiment: NAME}]`: another experiment, another run
    settings = parse_config({"name": "r", "env": "e.yaml", "tracking": [{"kind": "mlflow", "experiment": "ablations"}]}, "run.yaml").tracking[0]
    elsewhere = MLflow("r", run_id, workdir, {"lr": 0.001}, settings)
    elsewhere.close()
    assert client.get_experiment(client.get_run(elsewhere.run).info.experiment_id).name == "ablations" and elsewhere.run != first.run
    many = MLflow("many", uuid.uuid4(), workdir, {f"p{i}": i for i in range(150)}, tracker_settings("mlflow"))  # (sent 100 to a request)
    many.close()
    assert client.get_run(many.run).data.params == {f"p{i}": str(i) for i in range(150)}


@pytest.mark.slow
def test_a_run_killed_after_a_commit_then_resumed_leaves_every_step_once_in_each_tracker(tiny_dirs, database_url, db, tmp_path):
    """The crash window: SIGKILL after step 2 committed, before its trackers heard of it (TensorBoard and trackio held
    steps 1, 3: step 2 was lost). On resume each tracker gets what it lacks from the ledger, in order, none twice."""
    from tests.integration.test_chaos import _train as _train_killed

    name = f"tracked-crash-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode="sync", lease_seconds=5, backend="torch", every=3)
    data = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**data, "steps": 3, "tracking": ["tensorboard", "trackio"]}))
    env = {**env, "TRACKIO_DIR": str(tmp_path / "trackio")}
    assert _train_killed(config, env, "weight_sync:2", tmp_path / "killed.log") == -9, (tmp_path / "killed.log").read_text()[-3000:]
    assert _train_killed(config, env, None, tmp_path / "resumed.log") == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    run_id = _rows(db, "SELECT id FROM run WHERE name = :n", n=name)[0][0]
    rewards = dict(_rows(db, "SELECT step, value FROM metric WHERE run_id = :r AND name = 'reward_mean'", r=run_id))
    assert sorted(rewards) == [1, 2, 3]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "home" / "runs" / name / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert sorted(s for s, _ in logged) == [1, 2, 3], logged  # every step, once
    assert dict(logged) == pytest.approx(rewards, rel=1e-6)

    logs = [(row["step"], row["reward_mean"]) for row in _trackio_logs(tmp_path / "trackio", trackio_run_name(name, run_id)) if "reward_mean" in row]
    assert sorted(s for s, _ in logs) == [1, 2, 3], logs
    assert dict(logs) == pytest.approx(rewards)
