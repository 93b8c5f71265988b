"""The ledger behind a real PgBouncer (Debian's package) in transaction mode, as a deployment with many
rollout workers puts it: more clients than server connections, each transaction on whichever server
connection is free. What breaks there: settings made for a session (loopline's session limits went in the
startup packet, which PgBouncer refuses: "unsupported startup parameter: options"), statements prepared on
the server (psycopg prepares one after 5 uses), session-level advisory locks (the migrations take a
transaction-level one). Loopline applies its limits per transaction and prepares nothing there."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from loopline.store import ledger
from loopline.store.check import check_run
from loopline.store.db import make_engine, session
from loopline.store.migrate import upgrade
from tests.factories import trajectory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pgbouncer(scratch_url):
    """A PgBouncer in transaction mode with 2 server connections, in front of the test's scratch database;
    yields the database's URL through it."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(binary):
        if os.environ.get("CI"):
            pytest.fail("CI must run the PgBouncer test: apt-get install pgbouncer")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    server = make_url(scratch_url)
    port = _free_port()
    home = Path(tempfile.mkdtemp(prefix="loopline-pgbouncer-"))  # (not under pytest's 0700 directory: another user reads it)
    (home / "users.txt").write_text(f'"{server.username}" ""\n')
    (home / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={server.host} port={server.port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {home / 'users.txt'}\n"
        "pool_mode = transaction\ndefault_pool_size = 2\nmax_client_conn = 100\n"
        f"logfile = {home / 'pgbouncer.log'}\n"
    )
    command = [binary, str(home / "pgbouncer.ini")]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        user = pwd.getpwnam("postgres")
        for path in [home, *home.iterdir()]:
            os.chown(path, user.pw_uid, user.pw_gid)
        command = ["runuser", "-u", "postgres", "--", *command]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"pgbouncer did not start: {process.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
    yield server.set(port=port).render_as_string(hide_password=False)
    process.terminate()
    process.wait(timeout=10)
    shutil.rmtree(home, ignore_errors=True)


def test_workers_claim_and_commit_through_pgbouncer_in_transaction_mode(pgbouncer):
    engine = make_engine(pgbouncer)
    upgrade(engine)  # the migrations' advisory lock is a transaction's
    with session(engine) as s:
        run = ledger.create_run(s, "behind-pgbouncer", {}, "file:///w")
        ledger.plan_step(s, run.id, 1, [f"t{i}" for i in range(12)], group_size=4)
    committed, errors = [], []

    def worker(k: int) -> None:  # 6 workers, 2 server connections; each statement used more than 5 times
        own = make_engine(pgbouncer)
        try:
            with session(own) as s:
                while leases := ledger.claim_slots(s, run.id, f"w{k}", 1, split="train"):
                    outcomes = ledger.commit_trajectories(s, [(lease.attempt_id, trajectory(1.0, n_segments=2)) for lease in leases])
                    committed.extend(o.trajectory_id for o in outcomes if o.committed)
        except Exception as exc:  # noqa: BLE001 (the test reports every worker's failure)
            errors.append(f"worker {k}: {exc!r}")
        finally:
            own.dispose()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert len(committed) == len(set(committed)) == 48
    with session(engine) as s:
        report = check_run(s, run.id)
    engine.dispose()
    assert report.ok, report


def test_loopline_s_session_limits_hold_in_each_transaction_and_never_reach_another_client(pgbouncer):
    """With one client's settings on a shared server connection, another client (a psql, a dashboard) would
    run under loopline's lock and statement timeouts, or loopline under none."""
    engine = make_engine(pgbouncer)
    for _ in range(3):
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW lock_timeout").scalar_one() == "2min"
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar_one() == "15min"
    with psycopg.connect(make_url(pgbouncer).set(drivername="postgresql").render_as_string(hide_password=False)) as other:
        for _ in range(4):  # (2 server connections: each is reached)
            with other.transaction():
                assert other.execute("SHOW lock_timeout").fetchone()[0] == "0"
    engine.dispose()


def test_the_inspector_s_read_only_sessions_stay_read_only_behind_pgbouncer(pgbouncer):
    from loopline.store.db import read_only_engine

    upgrade(make_engine(pgbouncer))
    engine = read_only_engine(pgbouncer)
    with engine.connect() as conn:
        with pytest.raises(Exception, match="read-only transaction"):
            conn.exec_driver_sql(f"CREATE TABLE t_{uuid.uuid4().hex[:6]} (a int)")
    engine.dispose()
