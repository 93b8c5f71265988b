"""The Prefect `train` flow end to end on a small config: runs, resumes without redoing work, passes `check`."""

from __future__ import annotations

import os

import pytest
import sqlalchemy as sa
import yaml

from loopline.flows.config import load_config
from loopline.store.errors import LooplineError


@pytest.fixture(scope="module")
def prefect_server():
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield


def _config(tmp_path, policy, **overrides):
    data = {
        "name": f"flow-{tmp_path.name}"[:60].replace("_", "-"),
        "env": str((os.path.dirname(__file__) + "/../examples/arithmetic_env.yaml")),
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
    again = train(str(path))  # a finished run: nothing is planned, rolled out or trained again
    assert again["policy_version"] == 2 and again["eval"] == []
    run_id = first["run_id"]
    counts = db.execute(
        sa.text("SELECT (SELECT count(*) FROM trajectory WHERE run_id = :r), (SELECT count(*) FROM eval_result WHERE run_id = :r)"),
        {"r": run_id},
    ).one()
    db.rollback()
    assert tuple(counts) == (16, 3)
    report = check_run(db, run_id)
    assert report.ok, report.violations


def test_bad_run_configs_are_refused_up_front(tmp_path):
    with pytest.raises(LooplineError, match="group_size: .*at least 2"):
        load_config(_config(tmp_path, "tiny", group_size=1))
    with pytest.raises(LooplineError, match="colour: Extra inputs"):
        load_config(_config(tmp_path, "tiny", colour="blue"))
    with pytest.raises(LooplineError, match="steps: Input should be greater than or equal to 1"):
        load_config(_config(tmp_path, "tiny", steps=0))
