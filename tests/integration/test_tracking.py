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
from pathlib import Path

import httpx
import pytest
import yaml

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

    # MLflow, read back from the server
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    (found,) = client.search_runs([client.get_experiment_by_name("loopline").experiment_id], filter_string=f"tags.`loopline.run_id` = '{run_id}'")
    for metric in names:
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, metric)}
        assert history == {step: value for (step, m), value in ledger.items() if m == metric}, metric
    assert {m.step: m.value for m in client.get_metric_history(found.info.run_id, "eval/success_rate")} == evals
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
    os.environ["TRACKIO_DIR"] = str(tmp_path / "trackio")
    import importlib

    import trackio.sqlite_storage

    importlib.reload(trackio.sqlite_storage)
    logs = trackio.sqlite_storage.SQLiteStorage.get_logs("loopline", name)
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
