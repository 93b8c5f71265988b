"""Scale-out on a Prefect work pool, as the README's "many machines" section runs it.

A real Prefect server on PostgreSQL; `loopline deploy --pool` registers the deployments on a process work
pool; two `prefect worker start --pool` processes (two "machines") run what the pool is given; `loopline
train` on an async run with `rollout: {local_rollout: false, workers: 2}` submits two rollout_worker flow
runs through the deployment. Mid-run one machine is lost (its Prefect worker and the flow run it started,
SIGKILLed): its leased slots come back, the run completes, and `check` finds nothing trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from tests.conftest import create_scratch_database, drop_scratch_database
from loopline.ports import free_port
from tests.helpers import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
POOL = "loopline-test-pool"



def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def prefect_on_postgres(tmp_path):
    """`prefect server start` on a scratch PostgreSQL database of its own, with a Prefect home of its own."""
    from sqlalchemy.engine import make_url

    url = create_scratch_database("prefect_test")
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    admin.dispose()
    port = free_port()
    env = {
        **os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": make_url(url).set(drivername="postgresql+asyncpg").render_as_string(hide_password=False),
    }
    env.pop("PREFECT_API_URL", None)
    log = (tmp_path / "prefect-server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--analytics-off"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api"
    wait_healthy(f"{api}/health", server, tmp_path / "prefect-server.log")
    try:
        yield {"api": api, "home": str(tmp_path / "prefect-home")}
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        drop_scratch_database(url)


class Pool:
    """A run config for `rollout.workers: 2`, the deployments on the test pool, and the processes started
    (each in its own session, all killed at the end): `machine(...)` a Prefect worker, `train()` the trainer."""

    def __init__(self, prefect: dict, tiny_dirs, database_url: str, tmp_path: Path):
        self.name, self.tmp = f"pool-{tmp_path.name[-10:]}".replace("_", "-"), tmp_path
        self.config = tmp_path / "run.yaml"
        self.config.write_text(yaml.safe_dump({
            "name": self.name, "env": str(ROOT / "examples" / "arithmetic_env.yaml"), "policy": str(tiny_dirs["v0"]),
            "steps": 6, "rollout": {"mode": "async", "local_rollout": False, "workers": 2, "max_staleness": 1, "groups_per_step": 4,
                                    "group_size": 4, "concurrency": 4, "lease_seconds": 5, "sampling": {"max_new_tokens": 16}},
            "learner": {"lr": 1e-3, "backend": "torch"}, "eval": {"every": 6, "tasks": 4},
        }))
        self.api = prefect["api"]
        self.env = {
            **os.environ, "PREFECT_API_URL": prefect["api"], "PREFECT_HOME": prefect["home"],
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2",
            "LOOPLINE_DATABASE_URL": database_url, "LOOPLINE_HOME": str(tmp_path / "home"),
        }
        self.processes: list[subprocess.Popen] = []

    def deploy(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "loopline.cli", "deploy", "--pool", POOL, *args], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def start(self, args: list[str], log: str, **extra: str) -> subprocess.Popen:
        out = (self.tmp / log).open("a")
        proc = subprocess.Popen(args, env={**self.env, **extra}, cwd=self.tmp, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(proc)
        return proc

    def machine(self, name: str, **extra: str) -> subprocess.Popen:
        """A Prefect worker on the pool running one flow run at a time: one "machine"."""
        return self.start([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--limit", "1", "--name", name], f"{name}.log", **extra)

    def train(self) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "loopline.cli", "train", str(self.config)], "train.log")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def worker_flow_runs(self) -> list[dict]:
        """The rollout_worker flow runs submitted for this run (by the tag the train flow gives them)."""
        import httpx

        body = {"flow_runs": {"tags": {"all_": [f"loopline-run:{self.name}"]}}}
        return httpx.post(f"{self.api}/flow_runs/filter", json=body, timeout=30).json()

    def kill_all(self) -> None:
        for proc in self.processes:
            for pid in [*_descendants(proc.pid), proc.pid]:
                _kill(pid)


@pytest.fixture
def pool(prefect_on_postgres, tiny_dirs, database_url, tmp_path):
    made = Pool(prefect_on_postgres, tiny_dirs, database_url, tmp_path)
    try:
        yield made
    finally:
        made.kill_all()


def _running_flow_run(pool: Pool, machine: subprocess.Popen) -> tuple[int, str] | None:
    """(pid, flow run id) of the worker flow run the server shows RUNNING in a child process of `machine`."""
    pids = {str(pid) for pid in _children(machine.pid)}
    for run in pool.worker_flow_runs():
        pid = (run["infrastructure_pid"] or "").split(":")[-1]
        if run["state_type"] == "RUNNING" and pid in pids:
            return int(pid), run["id"]
    return None


def _run_id(db, name: str):
    return _rows(db, "SELECT id FROM run WHERE name = :n", n=name)[0][0]


def _consumed_once(db, run_id) -> None:
    from loopline.store.check import check_run

    report = check_run(db, run_id)
    assert report.ok, report.violations
    consumed, distinct = _rows(db, "SELECT count(*), count(DISTINCT trajectory_id) FROM consumption WHERE run_id = :r", r=run_id)[0]
    assert consumed == distinct == 6 * 4 * 4  # every step's groups, each trajectory once


@pytest.mark.slow
def test_two_prefect_workers_feed_a_run_and_losing_one_loses_nothing(pool, db):
    for attempt in ("create", "again"):  # the second is a no-op for the pool and updates the deployments in place
        assert "rollout_worker/loopline-rollout-worker" in pool.deploy(), attempt
    # two "machines", one flow run at a time each; machine 1's flow run dies after its third trajectory
    machine_1 = pool.machine("machine-1", LOOPLINE_FAILPOINT="rollout_commit:3")
    pool.machine("machine-2")
    trainer = pool.train()
    # machine 1's flow run: the one the server shows RUNNING in a process of that worker (a worker also starts
    # short-lived helper processes, so "its first child" is not necessarily a flow run)
    deadline, running = time.monotonic() + 300, None
    while running is None:
        assert trainer.poll() is None and time.monotonic() < deadline, pool.logs()
        running = _running_flow_run(pool, machine_1)
        time.sleep(0.2)
    first = running[0]
    while Path(f"/proc/{first}").exists():  # it came and went (the failpoint)
        assert trainer.poll() is None and time.monotonic() < deadline, pool.logs()
        time.sleep(0.2)
    for pid in [*_descendants(machine_1.pid), machine_1.pid]:  # ... and then the whole machine is gone (a flow run
        _kill(pid)  # resubmitted in place of the crashed one may have started there)
    assert trainer.wait(timeout=600) == 0, pool.logs()
    run_id = _run_id(db, pool.name)
    _consumed_once(db, run_id)
    holders = {int(w.split(":")[1]) for (w,) in _rows(
        db, "SELECT DISTINCT a.worker FROM attempt a JOIN slot s ON s.id = a.slot_id WHERE a.run_id = :r AND s.split = 'train'", r=run_id)}
    assert first in holders and holders - {first}, (first, holders, pool.logs())  # both machines generated for the run
    assert trainer.pid not in holders  # only the pool's flow runs did (the trainer evaluates, on the eval split)
    # what machine 1 held when it died came back: through its leases (another machine), or at once here, where its
    # processes are seen to be gone (same host); nothing of it is left running. (It may have died holding nothing
    # but the slot it had just committed: at most 4 in flight, and the staleness gate may have offered fewer.)
    held = _rows(db, "SELECT status, error_class FROM attempt WHERE run_id = :r AND worker LIKE :w AND status NOT IN ('ok', 'task_failed')",
                 r=run_id, w=f"%:{first}:%")
    assert all(error in ("LeaseExpired", "HolderDied") for _, error in held), held


@pytest.mark.slow
def test_a_resumed_trainer_adopts_the_worker_flow_runs_still_running(pool, db):
    """The workers outlive a killed trainer (they stop when the run ends); the resume must not submit two more,
    which here could never start (each machine runs one flow run at a time) and would wait forever."""
    pool.deploy()
    pool.machine("machine-1")
    pool.machine("machine-2")
    trainer = pool.train()
    deadline = time.monotonic() + 300
    while not _rows(db, "SELECT 1 FROM policy_version p JOIN run r ON r.id = p.run_id WHERE r.name = :n AND p.version >= 1", n=pool.name):
        assert trainer.poll() is None and time.monotonic() < deadline, pool.logs()
        time.sleep(0.5)
    os.killpg(trainer.pid, signal.SIGKILL)
    trainer.wait()
    running = [r["id"] for r in pool.worker_flow_runs() if r["state_type"] == "RUNNING"]
    assert len(running) == 2, pool.logs()
    assert pool.train().wait(timeout=600) == 0, pool.logs()
    assert sorted(r["id"] for r in pool.worker_flow_runs()) == sorted(running)
    assert "adopting them" in (pool.tmp / "home" / "runs" / pool.name / "train.log").read_text()  # (the run's log: Prefect's lines)
    _consumed_once(db, _run_id(db, pool.name))


@pytest.mark.slow
def test_a_machine_that_vanishes_with_its_flow_run_gets_it_marked_crashed(pool, db):
    """Power or network lost: the Prefect worker and its flow run die at once and nothing reports the crash. Once
    the flow run's heartbeats stop, the automation `loopline deploy --pool` installs marks it Crashed (so that
    the train flow resubmits it); meanwhile the other machine finishes the run and nothing is trained twice."""
    pool.deploy("--silent-after", "40")
    machine_1 = pool.machine("machine-1")
    pool.machine("machine-2")
    trainer = pool.train()
    deadline, lost = time.monotonic() + 300, None
    while lost is None:  # machine 1's flow run, once it runs
        assert trainer.poll() is None and time.monotonic() < deadline, pool.logs()
        running = _running_flow_run(pool, machine_1)
        lost = running and running[1]
        time.sleep(0.5)
    for pid in [*_descendants(machine_1.pid), machine_1.pid]:
        _kill(pid)
    deadline = time.monotonic() + 150
    while (state := _flow_run(pool, lost)["state"])["type"] != "CRASHED":
        assert state["type"] == "RUNNING" and time.monotonic() < deadline, (state, pool.logs())
        time.sleep(2)
    assert "no heartbeat for 40 s" in state["message"]
    assert trainer.wait(timeout=600) == 0, pool.logs()
    _consumed_once(db, _run_id(db, pool.name))


def _flow_run(pool: Pool, flow_run_id: str) -> dict:
    import httpx

    return httpx.get(f"{pool.api}/flow_runs/{flow_run_id}", timeout=30).json()


def _rows(db, sql, **params):
    rows = db.execute(sa.text(sql), params).all()
    db.rollback()
    return rows


def test_a_kubernetes_pool_is_created_with_the_shipped_template(prefect_on_postgres, tmp_path):
    """What can be checked without a cluster: the real server accepts deploy/k8s/base-job-template.json and the
    deployments register on the pool (no Kubernetes worker runs here)."""
    env = {**os.environ, "PREFECT_API_URL": prefect_on_postgres["api"], "PREFECT_HOME": prefect_on_postgres["home"]}
    template = ROOT / "deploy" / "k8s" / "base-job-template.json"
    args = [sys.executable, "-m", "loopline.cli", "deploy", "--pool", "k8s-rollout", "--pool-type", "kubernetes", "--base-job-template", str(template)]
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "inspect", "k8s-rollout", "--output", "json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    pool = json.loads(shown.stdout)
    assert pool["type"] == "kubernetes" and pool["base_job_template"] == json.loads(template.read_text())
    wrong = subprocess.run([*args[:-4], "--pool-type", "process"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0 and "exists with type kubernetes" in wrong.stdout + wrong.stderr
