"""Trackers are projections of the ledger (loopline/tracking.py): a tracker that hangs or is down never
holds up the run, and on the next start each gets what it lacks from the ledger, in order, none twice.

Measured before: an MLflow server killed mid-run froze the run for 4 min 8 s and steps 3-6 never reached it;
a crash between a learner commit and the tracker call left every tracker with steps 1, 3, 4."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from loopline import tracking
from loopline.tracking import Trackers
from loopline.ports import free_port
from loopline.store.db import session as new_session


def _commit_steps(db, run_id: uuid.UUID, steps: range) -> None:
    """What a learner commit leaves in the ledger: its step's metrics."""
    for step in steps:
        for name, value in (("reward_mean", step / 10), ("loss", 1.0 / step)):
            db.execute(sa.text("INSERT INTO metric (run_id, step, name, value) VALUES (:r, :k, :n, :v)"), {"r": run_id, "k": step, "n": name, "v": value})
    db.commit()


def _until(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Recording:
    sent: list[tuple[int, dict]] = []

    def __init__(self, *_):
        pass

    def log(self, step, metrics):
        Recording.sent.append((step, metrics))

    def artifact(self, directory):
        pass

    def close(self):
        pass


class Hanging(Recording):
    release = threading.Event()

    def log(self, step, metrics):
        if step > 1:
            Hanging.release.wait()  # a server that takes the request and never answers


@pytest.fixture
def fakes(monkeypatch):
    Recording.sent = []
    Hanging.release.clear()
    tracking.TRACKERS.register("recording")(Recording)  # as a user's own tracker registers itself
    tracking.TRACKERS.register("hanging")(Hanging)
    yield
    Hanging.release.set()


def test_a_hanging_tracker_holds_up_neither_the_run_nor_the_others_and_a_resume_sends_only_what_is_missing(fakes, engine, db, run, tmp_path):
    warnings: list[str] = []
    factory = lambda: new_session(engine)  # noqa: E731
    _commit_steps(db, run.id, range(1, 4))
    trackers = Trackers(["hanging", "recording"], "r", run.id, tmp_path, {}, factory, warn=warnings.append)
    _until(lambda: [s for s, _ in Recording.sent] == [1, 2, 3])  # (the hanging one is first in line: not waited for)
    assert Recording.sent[0] == (1, {"loss": 1.0, "reward_mean": 0.1})
    started = time.monotonic()
    trackers.close()
    assert time.monotonic() - started < tracking.STUCK_S + 2
    assert any("tracker hanging did not answer in time" in w for w in warnings), warnings

    _commit_steps(db, run.id, range(4, 6))  # the run resumes and trains on
    Hanging.release.set()
    again = Trackers(["recording"], "r", run.id, tmp_path, {}, factory, warn=warnings.append)
    _until(lambda: len(Recording.sent) == 5)
    again.close()
    assert [s for s, _ in Recording.sent] == [1, 2, 3, 4, 5]  # none twice, none missing


def test_a_step_committed_just_before_a_crash_reaches_the_trackers_on_the_next_start(fakes, engine, db, run, tmp_path):
    factory = lambda: new_session(engine)  # noqa: E731
    _commit_steps(db, run.id, range(1, 3))
    first = Trackers(["recording"], "r", run.id, tmp_path, {}, factory)
    _until(lambda: len(Recording.sent) == 2)
    first.close()
    _commit_steps(db, run.id, range(3, 5))  # committed, then the process died before waking its trackers
    resumed = Trackers(["recording"], "r", run.id, tmp_path, {}, factory)
    _until(lambda: len(Recording.sent) == 4)
    resumed.close()
    assert [s for s, _ in Recording.sent] == [1, 2, 3, 4]
    other = uuid.uuid4()  # a run deleted and its name reused: its marks are not the new run's
    assert Trackers([], "r", other, tmp_path, {}, factory)._read_marks() == {}


def _mlflow_server(port: int, store: Path, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--backend-store-uri",
         f"sqlite:///{store / 'mlflow.db'}", "--default-artifact-root", str(store / "artifacts"), "--workers", "1"],
        stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True,
    )

    def up() -> bool:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _until(up, 120)
    return proc


@pytest.mark.slow
def test_an_mlflow_server_killed_mid_run_is_one_warning_and_holds_every_step_once_after_it_returns(engine, db, run, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    port, store = free_port(), tmp_path / "mlflow"
    store.mkdir()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)  # (the defaults loopline sets)
    server = _mlflow_server(port, store, tmp_path / "mlflow.log")
    warnings: list[str] = []
    factory = lambda: new_session(engine)  # noqa: E731
    try:
        _commit_steps(db, run.id, range(1, 3))
        trackers = Trackers(["mlflow"], "r", run.id, tmp_path / "run", {"lr": 0.1}, factory, warn=warnings.append)
        client = MlflowClient(tracking_uri=url)

        def found() -> list:
            experiment = client.get_experiment_by_name("loopline")  # (made by the tracker)
            return client.search_runs([experiment.experiment_id], filter_string=f"tags.`loopline.run_id` = '{run.id}'") if experiment else []

        def steps_held() -> list[int]:
            return [m.step for m in client.get_metric_history(found()[0].info.run_id, "reward_mean")] if found() else []

        _until(lambda: steps_held() == [1, 2])
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        _commit_steps(db, run.id, range(3, 7))  # the run trains on: every wake returns at once
        started = time.monotonic()
        for _ in range(4):
            trackers.wake()
        assert time.monotonic() - started < 0.5
        _until(lambda: any("tracker mlflow failed at step 3" in w for w in warnings), 60)
        trackers.close()
        assert len([w for w in warnings if "tracker mlflow" in w]) == 1, warnings

        server = _mlflow_server(port, store, tmp_path / "mlflow.log")  # back; the run resumes
        resumed = Trackers(["mlflow"], "r", run.id, tmp_path / "run", {"lr": 0.1}, factory, warn=warnings.append)
        _until(lambda: steps_held() == [1, 2, 3, 4, 5, 6], 60)
        resumed.close()
        assert len(found()) == 1 and found()[0].info.status == "FINISHED"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
