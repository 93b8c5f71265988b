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
from loopline.tracking import trackio_run_name, wandb_rows
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
    history = list(wandb_rows(offline))
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
def test_a_run_sigkilled_at_each_failpoint_then_resumed_leaves_every_step_once_in_each_tracker(tiny_dirs, database_url, db, tmp_path):
    """SIGKILL after step 2's commit (before its trackers heard of it) and at v3's evaluation, then a resume: each
    tracker, read back through its own store, holds every ledger step and evaluation exactly once. Before: W&B
    lost step 1 and v0's evaluation for good (its rows wait in its service process; the tracker counted a step as
    held when `log` returned), trackio the last step sent, TensorBoard and trackio missed step 2 (the crash window)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.integration.test_chaos import _train as _train_killed

    name = f"tracked-crash-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], database_url, mode="sync", lease_seconds=5, backend="torch", every=1)
    data = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**data, "steps": 3, "tracking": ["tensorboard", "mlflow", "wandb", "trackio"]}))
    env = {**env, "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_SILENT": "true"}
    for key in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE"):  # (each tracker on its default store)
        env.pop(key, None)
    for kill in ("weight_sync:2", "evaluate:2"):
        log = tmp_path / f"{kill}.log"
        assert _train_killed(config, env, kill, log) == -9, log.read_text()[-3000:]
    assert _train_killed(config, env, None, tmp_path / "resumed.log") == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    run_id = _rows(db, "SELECT id FROM run WHERE name = :n", n=name)[0][0]
    rewards = dict(_rows(db, "SELECT step, value FROM metric WHERE run_id = :r AND name = 'reward_mean'", r=run_id))
    evals = dict(_rows(db, "SELECT policy_version, success_rate FROM eval_result WHERE run_id = :r", r=run_id))
    assert sorted(rewards) == [1, 2, 3] and sorted(evals) == [0, 1, 2, 3]
    workdir = tmp_path / "home" / "runs" / name

    def once(points: list[tuple[int, float]], expected: dict) -> None:
        said = "".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
        assert sorted(step for step, _ in points) == sorted(expected), (points, said)  # every step, none twice
        assert dict(points) == pytest.approx(expected, rel=1e-6)  # (TensorBoard stores float32)

    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    once([(e.step, e.value) for e in events.Scalars("reward_mean")], rewards)
    once([(e.step, e.value) for e in events.Scalars("eval/success_rate")], evals)

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("loopline").experiment_id], filter_string=f"tags.`loopline.run_id` = '{run_id}'")
    once([(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "reward_mean")], rewards)
    once([(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "eval/success_rate")], evals)

    rows = [row for path in sorted(workdir.glob("wandb/offline-run-*/*.wandb")) for row in wandb_rows(path)]  # (every attempt's file)
    once([(row["_step"], row["reward_mean"]) for row in rows if "reward_mean" in row], rewards)
    once([(row["_step"], row["eval/success_rate"]) for row in rows if "eval/success_rate" in row], evals)

    logs = _trackio_logs(tmp_path / "trackio", trackio_run_name(name, run_id))
    once([(row["step"], row["reward_mean"]) for row in logs if "reward_mean" in row], rewards)
    once([(row["step"], row["eval/success_rate"]) for row in logs if "eval/success_rate" in row], evals)


@pytest.mark.parametrize("kind", ["tensorboard", "mlflow", "wandb", "trackio"])
def test_each_tracker_reads_what_its_own_store_holds(kind, tmp_path):
    """What a resume sends a tracker starts from what the tracker's store holds (`holds()`), not from the run's note
    of what was sent: W&B and trackio buffer what `log` was given, and a SIGKILL lost it."""
    play = (
        "import pathlib, sys, uuid; from loopline.tracking import TRACKERS, tracker_settings\n"
        "kind, workdir, run_id = sys.argv[1], pathlib.Path(sys.argv[2]), uuid.UUID(sys.argv[3])\n"
        "start = lambda: TRACKERS[kind]('r', run_id, workdir, {'lr': 0.1}, tracker_settings(kind))\n"
        "t = start(); print(t.holds())\n"
        "t.log(0, {'eval/success_rate': 0.5, 'eval/tasks': 4.0}); t.log(1, {'reward_mean': 0.1}); t.log(2, {'reward_mean': 0.2})\n"
        "t.log(2, {'eval/success_rate': 0.75, 'eval/tasks': 4.0}); t.log(3, {'reward_mean': 0.3}); t.close()\n"
        "print(start().holds())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE")}
    done = subprocess.run([sys.executable, "-c", play, kind, str(tmp_path / "run"), str(uuid.uuid4())], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**env, "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_SILENT": "true"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("(")] == ["(0, -1)", "(3, 2)"], done.stdout[-2000:]


def test_a_step_torn_by_a_kill_is_not_held_by_tensorboard(tmp_path):
    """A SIGKILL while TensorBoard wrote a step left part of it in the event file: the resume took the step as held
    and never sent the rest (CI: step 3's reward_mean lost for good). Each cut of the file after step 1 reads as
    step 1 held, or step 2 held whole."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from loopline.tracking import TensorBoard, tracker_settings

    metrics = {f"metric_{i}": float(i) for i in range(12)}
    tracker = TensorBoard("r", uuid.uuid4(), tmp_path / "run", {"lr": 0.1}, tracker_settings("tensorboard"))
    tracker.log(1, metrics)
    (path,) = tracker.directory.glob("events.out.tfevents.*")
    after_step_1 = path.stat().st_size
    tracker.log(2, metrics)
    tracker.close()
    whole = path.read_bytes()
    cut = tmp_path / "cut" / "tensorboard"
    cut.mkdir(parents=True)
    for end in range(after_step_1, len(whole) + 1):
        (cut / path.name).write_bytes(whole[:end])
        tracker.directory = cut
        held, _ = tracker.holds()
        tags = {v.tag for e in EventFileLoader(str(cut / path.name)).Load() if e.step == 2 for v in e.summary.value}
        assert (held, tags) in ((1, set()), (2, set(metrics))), end

