"""Issue 31: a database outage during a run. One shorter than LOOPLINE_RETRY_S is waited out and the run
finishes; a longer one stops the run with one line, and it resumes exactly once the ledger is back. The
outage is a proxy the test cuts (tests/fakes/cuttable_proxy.py), so only this run's connections drop."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml
from sqlalchemy.engine import make_url

from tests.fakes.cuttable_proxy import CuttableProxy
from tests.integration.test_chaos import ROOT, _checked_run, _rows, _small_run
from tests.integration.test_run_lifecycle import _start, _until_version, _version


@pytest.mark.slow
@pytest.mark.timeout(15 * 60)  # (CI's other tests load the machine: measured up to 300 s, the default limit)
def test_a_short_outage_is_waited_out_and_a_long_one_stops_the_run_with_one_line_then_it_resumes(tiny_dirs, database_url, db, tmp_path):
    direct = make_url(database_url)
    proxy = CuttableProxy(direct.host, direct.port or 5432)
    through_proxy = direct.set(port=proxy.port).render_as_string(hide_password=False)
    name = f"outage-{tmp_path.name[-12:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny_dirs["v0"], through_proxy, mode="sync", lease_seconds=5, backend="torch", every=10)
    data = yaml.safe_load(config.read_text())
    data["steps"] = 1000  # more than it gets to: each phase is stopped, and the run finished with --steps
    config.write_text(yaml.safe_dump(data))

    log = tmp_path / "short.log"
    proc = _start({**env, "LOOPLINE_RETRY_S": "60"}, str(config), log=log)
    _until_version(db, name, 1, proc, log)
    proxy.cut(10)  # longer than a lease (5 s): the episodes' leases lapse meanwhile
    time.sleep(10)
    _until_version(db, name, _version(db, name) + 2, proc, log)  # it goes on after the outage
    proc.terminate()
    proc.wait(timeout=120)

    log = tmp_path / "long.log"
    proc = _start({**env, "LOOPLINE_RETRY_S": "5"}, "--resume", name, log=log)
    _until_version(db, name, _version(db, name) + 1, proc, log)
    proxy.cut(20)  # (longer than LOOPLINE_RETRY_S with room for the run to stop while it lasts)
    code = proc.wait(timeout=240)
    errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "the ledger could not be reached" in errors[0], log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
    assert "ledger unreachable, retrying (" in log.read_text()  # the run's bar, meanwhile
    time.sleep(max(0.0, proxy.down_until - time.monotonic()))

    last = _version(db, name) + 1
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "train", "--resume", name, "--steps", str(last)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_id = _checked_run(db, name)
    assert [v for (v,) in _rows(db, "SELECT version FROM policy_version WHERE run_id = :r ORDER BY 1", r=run_id)] == list(range(last + 1))
