"""A real Prefect server on Postgres, the deployments served by `loopline deploy`, triggered with run_deployment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml
from loopline.ports import free_port

ROOT = Path(__file__).resolve().parents[2]



def _cli(*args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "loopline.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_server_deployments_and_run_deployment(database_url, tiny_dirs, db, tmp_path):
    prefect_db = f"prefect_test_{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {
        **os.environ, "LOOPLINE_DATABASE_URL": database_url, "LOOPLINE_HOME": str(tmp_path / "home"),
        "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "COLUMNS": "400",  # (rich would wrap the long lines checked below)
    }
    env.pop("PREFECT_API_URL", None)
    name = f"served-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "env": str(ROOT / "examples" / "arithmetic_env.yaml"), "policy": str(tiny_dirs["v0"]), "steps": 1,
        "rollout": {"groups_per_step": 2, "group_size": 4, "concurrency": 8, "sampling": {"max_new_tokens": 16}},
        "learner": {"lr": 1e-3, "backend": "torch"}, "eval": {"every": 5, "tasks": 4},
    }))
    started = _cli("server", "start", "--port", str(port), "--database", prefect_db, env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "state in postgresql+asyncpg://" in started.stdout
    said = started.stdout
    assert f"PREFECT_API_URL is set in Prefect profile 'ephemeral' in {tmp_path / 'prefect' / 'profiles.toml'}" in said, said
    served = None
    try:
        served = subprocess.Popen(
            [sys.executable, "-m", "loopline.cli", "deploy", "--config", str(config)], env=env, cwd=ROOT,
            stdout=(tmp_path / "deploy.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        trigger = textwrap.dedent(f"""
            import time
            from prefect.deployments import run_deployment
            from prefect.exceptions import ObjectNotFound
            for _ in range(60):  # the serving process registers its deployments within a few seconds
                try:
                    train = run_deployment("train/loopline-train", timeout=300)
                    break
                except ObjectNotFound:
                    time.sleep(1)
            evaluate = run_deployment("evaluate/loopline-evaluate", parameters={{"run": "{name}", "version": 1}}, timeout=300)
            print(train.state.type.value, evaluate.state.type.value)
            # what the flows returned, read by the caller (persisted results: not a MissingResult)
            trained, evaluated = train.state.result(), evaluate.state.result()
            print(trained["run"], trained["policy_version"], evaluated["policy_version"])
        """)
        triggered = subprocess.run([sys.executable, "-c", trigger], env=env, capture_output=True, text=True, timeout=600)
        assert triggered.returncode == 0, triggered.stderr[-3000:] + (tmp_path / "deploy.log").read_text()[-3000:]
        assert triggered.stdout.split() == ["COMPLETED", "COMPLETED", name, "1", "1"], (tmp_path / "deploy.log").read_text()[-3000:]
        evaluated = db.execute(
            sa.text("SELECT e.policy_version FROM eval_result e JOIN run r ON r.id = e.run_id WHERE r.name = :n ORDER BY 1"), {"n": name}
        ).scalars().all()
        db.rollback()
        assert evaluated == [0, 1]  # v0 and the final v1 by the training run; the evaluate deployment read v1's back
        tables = sa.create_engine(sa.engine.make_url(database_url).set(database=prefect_db))
        with tables.connect() as conn:  # Prefect's own state lives on Postgres
            runs = conn.exec_driver_sql("SELECT count(*) FROM flow_run WHERE state_type = 'COMPLETED'").scalar_one()
        tables.dispose()
        assert runs >= 2
    finally:
        if served is not None:
            os.killpg(served.pid, signal.SIGKILL)
        stopped = _cli("server", "stop", env=env)
        admin = sa.create_engine(sa.engine.make_url(database_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{prefect_db}" WITH (FORCE)')
        admin.dispose()
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"PREFECT_API_URL unset in Prefect profile 'ephemeral' in {tmp_path / 'prefect' / 'profiles.toml'}" in stopped.stdout


def test_deploy_against_a_prefect_server_that_does_not_answer_says_so_in_one_line(tmp_path):
    """Was a 200-line httpx ConnectError traceback (a server stopped, or a profile pointing at an old one)."""
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api", "LOOPLINE_HOME": str(tmp_path / "home")}
    done = _cli("deploy", env=env, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"error: the Prefect server at {env['PREFECT_API_URL']} does not answer; start it (`loopline server start`), or point "
        "PREFECT_API_URL at one that runs"
    ]
