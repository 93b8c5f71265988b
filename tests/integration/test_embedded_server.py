"""Every command that starts or joins the embedded PostgreSQL leaves it as the README promises, whichever
way it ends (normal exit, Ctrl-C, SIGTERM): the last process using it stops it, a process still using it
keeps it alive, and a SIGKILLed user's server is stopped by the next process to leave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from loopline.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
# a process that joins the embedded server and holds it until it is signalled
HOLDER = (
    "import time; from loopline.store.db import make_engine; from loopline.store.migrate import upgrade; "
    "upgrade(make_engine()); print('joined', flush=True); time.sleep(600)"
)


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOOPLINE_DATABASE_URL", "PREFECT_API_URL")}
    return {**env, "LOOPLINE_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def _postgres_of(home: Path) -> list[int]:
    """pids of PostgreSQL servers running on this home's data directory."""
    pgdata = str(home / "pgdata")
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"postgres") and pgdata.encode() in args:
            found.append(int(cmdline.parent.name))
    return found


def _gone_within(home: Path, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while _postgres_of(home):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _joined(home: Path, pid: int) -> bool:
    """Whether process `pid` is listed as a user of the home's embedded server (the library's own list)."""
    try:
        return pid in json.loads((home / "pgdata" / ".handle_pids.json").read_text())
    except (OSError, ValueError):
        return False


def _holder(home: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], env=_env(home), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "joined"
    return proc


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_stopping_the_inspector_stops_the_embedded_server_unless_another_process_uses_it(stop, tmp_path):
    home = tmp_path / "home"
    port = free_port()
    other = _holder(home)  # a second user of the server, started first
    inspector = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "inspect", "--port", str(port)], env=_env(home), cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
            break
        except OSError:
            assert inspector.poll() is None and time.monotonic() < deadline, "the inspector did not come up"
            time.sleep(0.5)
    inspector.send_signal(stop)
    assert inspector.wait(timeout=30) != 0 or stop == signal.SIGINT
    time.sleep(1)
    assert _postgres_of(home), "the server stopped while another process still used it"
    other.send_signal(signal.SIGINT)  # (a plain Python process runs its exit handlers on Ctrl-C, not on SIGTERM)
    other.wait(timeout=30)
    assert _gone_within(home), "the last user left and the embedded server kept running"


@pytest.mark.parametrize("command", [["runs"], ["db", "status"]], ids=["runs", "db-status"])
def test_a_sigkilled_users_server_is_stopped_by_the_next_command(command, tmp_path):
    home = tmp_path / "home"
    killed = _holder(home)
    killed.kill()
    killed.wait()
    assert _postgres_of(home)  # nobody could stop it
    out = subprocess.run([sys.executable, "-m", "loopline.cli", *command], env=_env(home), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _gone_within(home), f"`loopline {' '.join(command)}` left the server a SIGKILLed process had started running"


def test_a_user_sigkilled_beside_the_last_one_does_not_keep_the_server_running(tmp_path):
    home = tmp_path / "home"
    killed, last = _holder(home), _holder(home)
    killed.kill()
    killed.wait()
    last.send_signal(signal.SIGINT)
    last.wait(timeout=30)
    assert _gone_within(home), "the server outlived its last live user because a SIGKILLed one was still listed"


@pytest.fixture(scope="module")
def trained_home(tiny_dirs, tmp_path_factory):
    """A loopline home whose embedded ledger holds a finished 2-step run (every version on disk), trained by
    `loopline train`; its normal exit must have stopped the server."""
    home = tmp_path_factory.mktemp("embedded") / "home"
    config = home.parent / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": "held", "env": str(ROOT / "examples" / "arithmetic_env.yaml"), "policy": str(tiny_dirs["v0"]),
        "steps": 2, "rollout": {"groups_per_step": 2, "group_size": 4, "concurrency": 4, "sampling": {"max_new_tokens": 8}},
        "learner": {"backend": "torch", "export_every": 1}, "eval": {"every": 10, "tasks": 4},
    }))
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "train", str(config)], env=_env(home), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert _gone_within(home), "`loopline train` ended normally and left the embedded server running"
    return home


COMMANDS = {
    "train": ["train", "--resume", "held", "--steps", "50"],
    "eval": ["eval", "held", "--version", "1"],
    "worker": ["worker", "held"],
    "replay": ["replay", "held", "--step", "2"],
    "runs": ["runs"],
    "db-status": ["db", "status"],
}


@pytest.mark.slow
@pytest.mark.timeout(15 * 60)
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("command", list(COMMANDS), ids=list(COMMANDS))
def test_a_command_stopped_by_a_signal_once_it_joined_leaves_no_server_behind(command, stop, trained_home, tmp_path):
    log = tmp_path / "command.log"
    proc = subprocess.Popen([sys.executable, "-m", "loopline.cli", *COMMANDS[command]], env=_env(trained_home), cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not _joined(trained_home, proc.pid) and proc.poll() is None:  # (a quick command may be done first)
        assert time.monotonic() < deadline, f"`loopline {command}` did not join the server within 120 s"
        time.sleep(0.05)
    proc.send_signal(stop)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"`loopline {command}` did not stop within 60 s of {stop.name}")
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    assert _gone_within(trained_home), f"`loopline {command}` stopped by {stop.name} left the embedded server running"
