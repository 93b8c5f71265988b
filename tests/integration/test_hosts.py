"""Many machines for real: hosts that share nothing but the network (containers with filesystems of their own).

Host `ledger` runs PostgreSQL and the Prefect server; host `trainer` runs `loopline train` (no rollouts of its
own); hosts `worker-b` and `worker-c` run `loopline worker RUN`. The workers have never seen the trainer's disk:
version 0 and every version after it reach them through the trainer's weight server, by the URI and token the
ledger holds, checked against the digest the ledger recorded. While the run trains: a worker paused for 90 s, a
worker cut from the network for 30 s, a worker killed with episodes in flight (its host then boots again), the
trainer killed and started again (it resumes). The run must end with `loopline check` clean, every trajectory
trained once, and every step replayed on a worker's host to the recorded sha256.
"""

from __future__ import annotations

import re
import time

import pytest
import sqlalchemy as sa
import yaml

from loopline.store.db import make_engine
from tests.hosts import HOME, ROOT, Cluster, wait_until

pytestmark = pytest.mark.slow

RUN = "multihost"
STEPS = 24
PER_STEP = 8 * 4  # groups_per_step x group_size


def _config() -> dict:
    return {
        "name": RUN, "env": str(ROOT / "examples" / "arithmetic_env.yaml"), "policy": "tiny", "steps": STEPS,
        "rollout": {
            "mode": "async", "local_rollout": False, "max_staleness": 1, "groups_per_step": 8, "group_size": 4,
            "concurrency": 8, "lease_seconds": 15, "sampling": {"temperature": 1.0, "max_new_tokens": 48},
        },
        "learner": {"lr": 3.0e-4, "backend": "deepspeed", "checkpoint_every": 4},
        "eval": {"every": 100, "tasks": 20, "temperature": 0.0},
    }


@pytest.fixture
def cluster(docker_image):
    hosts = Cluster(docker_image)
    yield hosts
    hosts.close()


def _ledger(cluster: Cluster):
    """The ledger as the test reads it: host `ledger`'s PostgreSQL through a port published on this machine."""
    cluster.hosts["ledger"].reload()
    port = cluster.hosts["ledger"].ports["5432/tcp"][0]["HostPort"]
    return make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres")


def _scalar(database, sql: str, **params):
    with database.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def _newest(database) -> int:
    return _scalar(database, "SELECT coalesce(max(p.version), -1) FROM policy_version p JOIN run ON run.id = p.run_id WHERE run.name = :n", n=RUN) or 0


def _episodes_in_flight(database, worker_host: str) -> int:
    return _scalar(
        database, "SELECT count(*) FROM slot JOIN run ON run.id = slot.run_id WHERE run.name = :n AND slot.state = 'leased' "
        "AND slot.lease_owner LIKE :h", n=RUN, h=f"{worker_host}:%",
    )


def test_rollout_workers_on_hosts_without_the_trainers_disk_train_a_run_exactly_through_faults(cluster, tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_config()))
    db_url = "postgresql+psycopg://postgres@ledger:5432/postgres"
    services = {"LOOPLINE_DATABASE_URL": db_url, "PREFECT_API_URL": "http://ledger:4200/api"}
    cluster.start(
        "ledger",
        "mkdir -p /tmp/pg && chown 1000:1000 /tmp/pg && setpriv --reuid=1000 --regid=1000 --clear-groups sh -c \"initdb -D /tmp/pg "
        "-U postgres --auth=trust -E UTF8 --locale=C >/dev/null && echo 'host all all 0.0.0.0/0 trust' >> /tmp/pg/pg_hba.conf && exec postgres -D /tmp/pg "
        "-c listen_addresses='*' -k /tmp\" & prefect server start --host 0.0.0.0 --port 4200",
        env={"PREFECT_UI_ENABLED": "false"}, ports={"5432/tcp": ("127.0.0.1", None)},
    )
    database = wait_until(lambda: _try(lambda: _ledger(cluster)), 60, "PostgreSQL on host ledger")
    wait_until(lambda: cluster.run("ledger", "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:4200/api/health')\"")[0] == 0, 90,
               "the Prefect server on host ledger")
    cluster.start("trainer", "loopline train /config/run.yaml", env=services, volumes={str(tmp_path): {"bind": "/config", "mode": "ro"}})
    wait_until(lambda: _try(lambda: _newest(database) >= 0 and _scalar(database, "SELECT count(*) FROM weight_server") > 0), 240,
               "the trainer to create the run and serve its weights")
    v0 = _scalar(database, "SELECT weights_uri FROM policy_version WHERE version = 0")
    assert v0.startswith(f"trainer://{RUN}{HOME}/") and "#sha256=" in v0  # (a path on the trainer's disk, by URI)
    for worker in ("worker-b", "worker-c"):
        cluster.start(worker, f"loopline worker {RUN}", env=services)
    assert cluster.run("worker-b", f"test -e {HOME}/models")[0] != 0  # (the worker host has no model of its own)

    # A worker paused for 90 s (its leases expire and its slots are played again); 30 s into the pause the other is
    # cut from the network for 30 s, so for that while no worker reaches the ledger or the trainer.
    wait_until(lambda: _newest(database) >= 1, 300, "v1 with both workers")
    cluster.pause("worker-b")
    time.sleep(30)
    cluster.cut("worker-c")
    time.sleep(30)
    cluster.reconnect("worker-c")
    time.sleep(30)
    cluster.unpause("worker-b")
    # A worker killed with episodes in flight; its host boots again and its worker joins again.
    wait_until(lambda: _episodes_in_flight(database, "worker-b") > 0, 120, "worker-b with episodes in flight", every=0.2)
    cluster.kill("worker-b")
    cluster.restart("worker-b")
    # The trainer killed mid-run and started again: it resumes from the ledger, on the same disk.
    at = wait_until(lambda: (n := _newest(database)) >= 1 and n < STEPS - 2 and n, 300, "the trainer mid-run")
    cluster.kill("trainer")
    cluster.restart("trainer")
    assert cluster.exit_code("trainer", timeout=900) == 0, cluster.logs("trainer")[-3000:]
    assert _newest(database) == STEPS and at < STEPS

    for worker in ("worker-b", "worker-c"):  # (a worker ends when its run does)
        assert cluster.exit_code(worker, timeout=120) == 0, cluster.logs(worker)[-3000:]
        assert _fetched(cluster, worker)  # (its versions came into its own cache)
    consumed, distinct = _scalar(database, "SELECT count(*) FROM consumption"), _scalar(database, "SELECT count(DISTINCT trajectory_id) FROM consumption")
    assert consumed == distinct == STEPS * PER_STEP
    code, out = cluster.run("worker-c", f"loopline check {RUN}")
    assert code == 0, out
    code, out = cluster.run("worker-c", f"loopline replay {RUN} --step {STEPS}")  # (from v0: the worker host has no checkpoint)
    assert code == 0, out
    replayed = re.findall(r"step (\d+) from .*?: sha256 \S+ vs recorded \S+ (\w+)", out)
    assert [int(step) for step, _ in replayed] == list(range(1, STEPS + 1)) and {verdict for _, verdict in replayed} == {"reproduced"}, out


def _fetched(cluster: Cluster, worker: str) -> bool:
    code, out = cluster.run(worker, f"ls {HOME}/cache/weights/{RUN}")
    return code == 0 and bool(out.split())


def _try(call):
    try:
        return call()
    except Exception:
        return None
