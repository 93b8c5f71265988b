"""Many machines for real: hosts that share nothing but the network (containers with filesystems of their own).

The hosts, their commands and their environment are deploy/compose/compose.yaml's, running
examples/arithmetic_hosts.yaml: host `ledger` runs PostgreSQL, `prefect` the Prefect server, `trainer`
`loopline train` (no rollouts of its own), `worker-b` and `worker-c` `loopline worker RUN`. The workers have never seen the trainer's disk:
version 0 and every version after it reach them through the trainer's weight server, by the URI and token the
ledger holds, checked against the digest the ledger recorded. While the run trains: a worker paused for 45 s, a
worker cut from the network for 20 s, a worker killed with episodes in flight (its host then boots again), the
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
from tests.hosts import ROOT, Cluster, wait_until

pytestmark = pytest.mark.slow

COMPOSE = yaml.safe_load((ROOT / "deploy" / "compose" / "compose.yaml").read_text())
CONFIG = yaml.safe_load((ROOT / "examples" / "arithmetic_hosts.yaml").read_text())
RUN, STEPS = CONFIG["name"], CONFIG["steps"]
PER_STEP = CONFIG["rollout"]["groups_per_step"] * CONFIG["rollout"]["group_size"]
ENV = COMPOSE["x-loopline"]["environment"]
HOME = ENV["LOOPLINE_HOME"]


def _command(service: str) -> str:
    return COMPOSE["services"][service]["command"].replace("/config/", f"{ROOT}/examples/")


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


@pytest.mark.timeout(15 * 60)  # (~4 min alone; CI's other tests load the machine)
def test_rollout_workers_on_hosts_without_the_trainers_disk_train_a_run_exactly_through_faults(cluster):
    cluster.start(
        "ledger",  # (compose's postgres:16 image cannot be pulled here: the same server from this machine's packages)
        "mkdir -p /tmp/pg && chown 1000:1000 /tmp/pg && setpriv --reuid=1000 --regid=1000 --clear-groups sh -c \"initdb -D /tmp/pg "
        "-U postgres --auth=trust -E UTF8 --locale=C >/dev/null && echo 'host all all 0.0.0.0/0 trust' >> /tmp/pg/pg_hba.conf && "
        "exec postgres -D /tmp/pg -c listen_addresses='*' -k /tmp\"",
        ports={"5432/tcp": ("127.0.0.1", None)},
    )
    cluster.start("prefect", _command("prefect"), env={"PREFECT_UI_ENABLED": "false"})
    database = wait_until(lambda: _try(lambda: _ledger(cluster)), 60, "PostgreSQL on host ledger")
    wait_until(lambda: cluster.run("prefect", "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:4200/api/health')\"")[0] == 0, 90,
               "the Prefect server on host prefect")
    cluster.start("trainer", _command("trainer"), env=ENV)
    wait_until(lambda: _try(lambda: _newest(database) >= 0 and _scalar(database, "SELECT count(*) FROM weight_server") > 0), 240,
               "the trainer to create the run and serve its weights")
    v0 = _scalar(database, "SELECT weights_uri FROM policy_version WHERE version = 0")
    assert v0.startswith(f"trainer://{RUN}{HOME}/") and "#sha256=" in v0  # (a path on the trainer's disk, by URI)
    for worker in ("worker-b", "worker-c"):  # (its host stays up after its worker ends: the checks below run there)
        cluster.start(worker, f"{_command('worker')}; echo worker exited $?; exec sleep 3600", env=ENV)
    assert cluster.run("worker-b", f"test -e {HOME}/models")[0] != 0  # (the worker host has no model of its own)

    # Each fault must land while the run trains (`_training`): on a machine so fast that the run ends first, raise STEPS.
    # A worker paused for 45 s, three times its lease (its leases expire and its slots are played again). As the pause
    # begins the trainer is killed and started again on its disk: it resumes from the ledger, serving on a new port
    # with a new token, and the workers (which keep their version meanwhile) find it through the ledger. 15 s into
    # the pause the other worker is cut from the network for 20 s (no worker reaches the ledger or the trainer). The
    # run moves only in the pause's last 10 s, at up to ~1 step a second with one worker on this machine.
    wait_until(lambda: _newest(database) >= 1, 300, "v1 with both workers")
    paused = time.monotonic()
    cluster.pause("worker-b")
    cluster.kill("trainer")
    cluster.restart("trainer")
    time.sleep(15)
    cluster.cut("worker-c")
    time.sleep(20)
    cluster.reconnect("worker-c")
    time.sleep(max(0.0, paused + 45 - time.monotonic()))
    cluster.unpause("worker-b")
    _training(database, "a worker's 45 s pause, the trainer's restart and the other worker's 20 s cut")
    # A worker killed with episodes in flight; its host boots again and its worker joins again.
    wait_until(lambda: _episodes_in_flight(database, "worker-b") > 0, 120, "worker-b with episodes in flight", every=0.2)
    cluster.kill("worker-b")
    cluster.restart("worker-b")
    _training(database, "the kill of worker-b")
    assert cluster.exit_code("trainer", timeout=900) == 0, cluster.logs("trainer")[-3000:]
    assert _newest(database) == STEPS

    for worker in ("worker-b", "worker-c"):  # (a worker ends when its run does)
        wait_until(lambda: "worker exited" in cluster.logs(worker), 120, f"{worker}'s worker to end with the run")
        said = cluster.logs(worker)
        assert "worker exited 0" in said, said[-3000:]
        # A worker that needed a new version while the trainer was down and its own network cut may give up (no byte
        # for the fetch deadline): then in one line naming the version's URI, and compose's loop starts it again.
        failures = re.findall(r"^error: .*$", said, re.M)
        assert all(re.fullmatch(rf"error: worker {worker}:\S+ stopped following run {RUN}: trainer://{RUN}/\S+#sha256=\w+: .+", line)
                   for line in failures), failures
        assert _fetched(cluster, worker)  # (its versions came into its own cache)
    consumed, distinct = _scalar(database, "SELECT count(*) FROM consumption"), _scalar(database, "SELECT count(DISTINCT trajectory_id) FROM consumption")
    assert consumed == distinct == STEPS * PER_STEP
    code, out = cluster.run("worker-c", f"loopline check {RUN}")
    assert code == 0, out
    code, out = cluster.run("worker-c", f"loopline replay {RUN} --step {STEPS}")  # (from v0: the worker host has no checkpoint)
    assert code == 0, out
    replayed = re.findall(r"step (\d+) from .*?: sha256 \S+ vs recorded \S+ (\w+)", out)
    assert [int(step) for step, _ in replayed] == list(range(1, STEPS + 1)) and {verdict for _, verdict in replayed} == {"reproduced"}, out


def _training(database, fault: str) -> None:
    assert _newest(database) < STEPS - 2, f"the run was nearly over by the end of {fault}: raise STEPS so that every fault lands mid-run"


def _fetched(cluster: Cluster, worker: str) -> bool:
    code, out = cluster.run(worker, f"ls {HOME}/cache/weights/{RUN}")
    return code == 0 and bool(out.split())


def _try(call):
    try:
        return call()
    except Exception:
        return None


def test_learner_ranks_on_hosts_that_do_not_share_loopline_home_refuse_to_start_in_one_line(cluster):
    """Learner ranks on several hosts share checkpoints and rank 0's result through LOOPLINE_HOME. Two hosts that do
    not share it: the ranks (started as DeepSpeed's launcher starts them on each node) refuse before training,
    naming the rank and host that cannot see the launching host's directory. Sharing it (a volume both mount), they
    get past that check (here into a train flow without a ledger, which fails for that reason instead)."""
    import docker

    scratch = "/tmp/home/tmp/learner-launch-test"
    command = (f"python3 -m loopline.orchestration.learner_rank --result {scratch}/result.json --parent launcher:1:1 "
               f"--config {ROOT}/examples/arithmetic_hosts.yaml; echo rank exited $?; exec sleep 600")
    rank = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "learner-a", "MASTER_PORT": "29511", "DS_ACCELERATOR": "cpu",
            "LOOPLINE_DATABASE_URL": "postgresql+psycopg://postgres@nowhere:5432/postgres", "PREFECT_API_URL": "http://nowhere:4200/api"}

    def result(shared: dict | None) -> str:
        for host in ("learner-a", "learner-b"):
            cluster.hosts.pop(host, None)
        cluster.start("learner-a", f"mkdir -p {scratch} && {command}", env={**rank, "RANK": "0"}, volumes=shared)
        cluster.start("learner-b", command, env={**rank, "RANK": "1"}, volumes=shared)
        wait_until(lambda: cluster.run("learner-a", f"test -s {scratch}/result.json")[0] == 0, 240, "rank 0's result")
        return cluster.run("learner-a", f"cat {scratch}/result.json")[1]

    refused = result(None)
    assert "rank 1 on learner-b cannot see /tmp/home/tmp/learner-launch-test" in refused and "mounts at the same path" in refused, refused
    wait_until(lambda: "rank exited" in cluster.logs("learner-b"), 60, "rank 1 to exit")
    said = [line for line in cluster.logs("learner-b").splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "rank 1 on learner-b cannot see" in said[0] and "rank exited 1" in cluster.logs("learner-b"), cluster.logs("learner-b")[-2000:]
    for name in ("learner-a", "learner-b"):
        cluster.hosts[name].remove(force=True)
    volume = docker.from_env().volumes.create(f"{cluster.name}-home-tmp")
    try:
        shared = result({volume.name: {"bind": "/tmp/home/tmp", "mode": "rw"}})
        assert "cannot see" not in shared and "error" in shared, shared  # (past the check: the flow's own failure)
    finally:
        for name in ("learner-a", "learner-b"):
            if name in cluster.hosts:
                cluster.hosts.pop(name).remove(force=True)
        volume.remove(force=True)
