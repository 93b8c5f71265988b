"""Prefect servers: a long-lived one for real use (UI, schedules, deployments, work pools), and the
temporary one a `loopline` command starts when none is configured.

Without a configured server, every `loopline` command that runs a flow starts a temporary server of
its own (its history is gone afterwards). loopline starts it itself rather than letting Prefect do
so, for two reasons measured on this stack: Prefect's own temporary server outlives a `loopline train`
killed by its main pid (an OOM kill), and it starts only when the first flow runs, after every
import; loopline's starts first, boots while torch and transformers import, and gets SIGTERM from
the kernel when its parent dies (PR_SET_PDEATHSIG). `loopline server start` runs `prefect server start --background` with Prefect's
database on the same PostgreSQL server as the ledger (database `prefect`, created with the pg_trgm
extension Prefect needs) and points this machine's Prefect profile at it, so later `loopline`
and `prefect` commands report there. With the embedded ledger server (unix socket only, stopped
with its last process) Prefect keeps its default SQLite database instead.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from loopline.failpoints import failpoint
from loopline.holder import die_with_parent, process_alive
from loopline.store import db as store_db
from loopline.errors import LooplineError
from loopline.ports import free_port


@dataclass(frozen=True)
class ServerInfo:
    api_url: str
    ui_url: str
    database: str  # where Prefect keeps its own state, password hidden
    profile: str  # the Prefect profile that now names the server, and its file: "'local' in ~/.prefect/profiles.toml"


def _prefect(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("prefect")), *args]
    # A session of its own and no terminal for stdin (for `server start --background`: the server it leaves
    # behind inherits both): it must outlive the terminal it was started from (it died when that terminal
    # closed: SIGHUP), and not hold that terminal open.
    done = subprocess.run(command, env=env or os.environ.copy(), capture_output=True, text=True, timeout=timeout, start_new_session=True,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise LooplineError(f"`prefect {' '.join(args)}` failed: {(done.stderr or done.stdout).strip()[-800:]}")
    return done


def prefect_database_url(database: str) -> str | None:
    """Create `database` (with pg_trgm) next to the ledger; None when the ledger is the embedded server."""
    if store_db.is_embedded():
        return None
    url = store_db.ensure_database(database, extensions=("pg_trgm",))
    return url.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)


def start(host: str = "127.0.0.1", port: int = 4200, database: str = "prefect", wait_s: float = 90) -> ServerInfo:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the server itself must not try to report to a server
    db_url = prefect_database_url(database)
    if db_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = db_url
    api = f"http://{host}:{port}/api"
    started = False
    try:
        if not healthy(api):
            started = True
            _prefect("server", "start", "--background", "--host", host, "--port", str(port), "--analytics-off", env=env)
            failpoint("server_started")
            deadline = time.monotonic() + wait_s
            while not healthy(api):
                if time.monotonic() > deadline:
                    raise LooplineError(f"the Prefect server did not become healthy at {api} within {wait_s:g} s")
                time.sleep(0.5)
        profile = _updated_profile(_prefect("config", "set", f"PREFECT_API_URL={api}"))
    except BaseException:  # a Ctrl-C while it started, or a server that never came up: none of it is left behind
        if started:  # (Ctrl-C left the server running, its pid file, and the profile pointing at it)
            with contextlib.suppress(Exception):
                stop()
        raise
    shown = sa.engine.make_url(db_url).render_as_string(hide_password=True) if db_url else "SQLite under PREFECT_HOME"
    return ServerInfo(api, f"http://{host}:{port}", shown, profile)


def stop() -> str:
    """Stop the server and unset PREFECT_API_URL in the profile; returns which profile (as `ServerInfo.profile`).
    Either may be done already (a start stopped halfway): that is no failure."""
    _prefect("server", "stop")
    try:
        return _updated_profile(_prefect("config", "unset", "PREFECT_API_URL", "-y"))
    except LooplineError as exc:
        if "is not set in profile" not in str(exc):
            raise
        found = re.search(r"profile '([^']+)'", str(exc))
        return f"'{found.group(1) if found else 'the active profile'}' in {_profiles_path()} (it was not set)"


def _updated_profile(done: subprocess.CompletedProcess) -> str:
    """`prefect config set/unset` writes the active profile of the user's Prefect home, shared by every
    prefect and loopline command of that user: say which, and where."""
    found = re.search(r"Updated profile '([^']+)'", done.stdout)
    return f"'{found.group(1) if found else 'the active profile'}' in {_profiles_path()}"


def _profiles_path() -> Path:
    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser()
    return Path(os.environ.get("PREFECT_PROFILES_PATH", home / "profiles.toml")).expanduser()


def healthy(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# --------------------------------------------------------------------------- the temporary server

TEMP_SERVER_ENV = "LOOPLINE_TEMP_SERVER"  # "prefect": leave the temporary server to Prefect (for comparisons)


def configured_api_url() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile, read without importing Prefect."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    try:
        profiles = tomllib.loads(_profiles_path().read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    return profiles.get("profiles", {}).get(active, {}).get("PREFECT_API_URL")


class TemporaryServer:
    """A Prefect API server for this process only: started now, waited for later, ended with the process."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"prefect-server-{os.getpid()}.log"
        prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent.parent
        env = {
            **os.environ,
            # What Prefect's own temporary server sets (prefect.server.api.server.SubprocessASGIServer).
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        env.pop("PREFECT_API_URL", None)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "uvicorn", "--app-dir", str(prefect_dir), "--factory",
                    "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "error", "--lifespan", "on",
                ],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # A session of its own: a terminal's Ctrl-C (SIGINT to its whole foreground group) or hang-up
                # must reach loopline only, which then ends the run through this server and stops it last;
                # it died with the group, and the run then hung retrying its reports to it.
                start_new_session=True, preexec_fn=die_with_parent(),
            )
        atexit.register(self.stop)

    def wait(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not healthy(self.api_url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-800:]
                raise LooplineError(f"the temporary Prefect server did not start (log {self.log_path}): {tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_path.unlink(missing_ok=True)


def start_temporary_server(log_dir: Path) -> TemporaryServer | None:
    """Start a temporary server unless a server is configured; this process's flows report to it."""
    if configured_api_url() or os.environ.get(TEMP_SERVER_ENV) == "prefect":
        return None
    for old in log_dir.glob("prefect-server-*.log"):  # logs of processes that were killed
        pid = old.stem.rsplit("-", 1)[1]
        if pid.isdigit() and not process_alive(int(pid)):
            old.unlink(missing_ok=True)
    server = TemporaryServer(log_dir)
    os.environ["PREFECT_API_URL"] = server.api_url
    return server
