"""What every sandbox backend offers, and how its failures are classified."""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import json
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from loopline.envregistry import spec as env_spec


# A sandbox's blocking calls (Docker's API: an exec blocks a thread for as long as its command, an agent program
# for its whole episode) get threads of their own: in the event loop's default executor (min(32, CPUs + 4)
# threads) a few long programs occupied them all, and the ledger's lease renewals queued behind them until
# the leases of live episodes expired. Threads that wait on a socket cost little.
_BLOCKING = ThreadPoolExecutor(max_workers=256, thread_name_prefix="loopline-sandbox")


async def blocking(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a sandbox thread (see `_BLOCKING`)."""
    return await asyncio.get_running_loop().run_in_executor(_BLOCKING, functools.partial(fn, *args, **kwargs))


class InfraFailure(Exception):
    """The sandbox, not the agent, failed (crash, OOM of the sandbox itself, daemon error, missing image).

    Never turned into a reward: the ledger retries the slot with a new attempt.
    """


class SandboxExhausted(Exception):
    """The agent used up its own sandbox (memory, processes) so that nothing more could run there: the agent's
    doing, so a task failure with this reason, never an infra failure (which a policy would learn to cause)."""


# A sandbox made for a verifier carries this label (value VERIFIER_ROLE): a backend may size it differently (room
# for the verifier beside the agent's code under test); one that ignores the label still gives a fresh sandbox.
ROLE_LABEL = "loopline.role"
VERIFIER_ROLE = "verifier"


@dataclass(frozen=True)
class Outputs:
    """The agent's files a verifier gets: regular files only, by path relative to the workdir."""

    files: dict[str, bytes] = field(default_factory=dict)
    executable: frozenset[str] = frozenset()
    left_out: dict[str, str] = field(default_factory=dict)  # path -> why it was not copied


def choose_outputs(listing: Iterable[tuple[str, int]], patterns: tuple[str, ...] | None) -> tuple[list[str], dict[str, str]]:
    """Of the workdir's regular files (relative path, size), those `patterns` name (all, if None), in path order
    within MAX_OUTPUT_FILES and MAX_OUTPUT_BYTES; and the named ones left out, with why."""
    chosen: list[str] = []
    left_out: dict[str, str] = {}
    total = 0
    for path, size in sorted(listing):
        if patterns is not None and not any(fnmatch.fnmatchcase(path, p) for p in patterns):
            continue
        if len(chosen) >= env_spec.MAX_OUTPUT_FILES:
            left_out[path] = f"over the {env_spec.MAX_OUTPUT_FILES:,} files a verifier receives"
        elif total + size > env_spec.MAX_OUTPUT_BYTES:
            left_out[path] = f"over the {env_spec.MAX_OUTPUT_BYTES >> 20} MiB a verifier receives"
        else:
            chosen.append(path)
            total += size
    return chosen, left_out


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    oom_killed: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


@dataclass(frozen=True)
class VerifierRun:
    """What a command verifier left: its process result (for error messages) and the verdict file's text."""

    result: ExecResult
    verdict: str | None

    @property
    def exhausted(self) -> bool:
        """No verdict because the verifier was killed before its time was up: only the OOM killer does that, and
        in a verifier's sandbox only the agent's code under test could have used the memory up (the verifier has
        room of its own), so it is a task failure, not an infra failure (which a policy would learn to cause)."""
        result = self.result
        return self.verdict is None and (result.oom_killed or (result.exit_code == 137 and not result.timed_out))


READ_LIMIT = 16 << 20  # what `read_file` returns of a file (one the agent made, its answer, may be any size)
UTF8 = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}  # the same text semantics on every backend (e.g. `wc -m`)


def verifier_env(verify_dir: str, workdir: str, agent_exec: list[str]) -> dict[str, str]:
    """The environment of a command verifier: the contract documented on `spec.Verifier`. Its HOME and temp
    dir are its private directory and Python's user site is off, so nothing the agent wrote (a
    usercustomize.py or .pth under a HOME it could write) is on the verifier's import path."""
    return {
        **UTF8,
        "HOME": verify_dir,
        "TMPDIR": verify_dir,
        "PYTHONNOUSERSITE": "1",
        "LOOPLINE_VERIFY_DIR": verify_dir,
        "LOOPLINE_WORKDIR": workdir,
        "LOOPLINE_AGENT_EXEC": json.dumps(agent_exec),
        "LOOPLINE_ANSWER_FILE": f"{verify_dir}/{env_spec.ANSWER_FILE}",
        "LOOPLINE_VERDICT_FILE": f"{verify_dir}/{env_spec.VERDICT_FILE}",
    }


@dataclass(frozen=True)
class ModelEndpoint:
    """Where an agent program's sandbox reaches the model: local and Docker sandboxes have no network and get
    the endpoint's unix socket mounted; a cloud sandbox (E2B) reaches it over the internet at `public_url`,
    the only address its network allows."""

    socket: str
    public_url: str | None = None


PROGRAM_PORT = 8000  # an agent program reaches the model at http://127.0.0.1:PORT on its sandbox's own loopback
LOOPBACK_URL = f"http://127.0.0.1:{PROGRAM_PORT}"
MAX_PROGRAM_S = 24 * 3600.0  # (the caller enforces the episode's budget; this only bounds a forgotten one)
# Runs inside the sandbox with its python3: accepts on 127.0.0.1:PORT and relays each connection to the socket.
FORWARDER = """
import socket, sys, threading
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
open("/tmp/.loopline-forwarding", "w").close()
while True:
    client, _ = listener.accept()
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (else each reply waits ~40 ms for a delayed ACK)
    upstream = socket.socket(socket.AF_UNIX)
    upstream.connect(sys.argv[2])
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
"""


def program_script(command: str, socket_path: str) -> str:
    """A shell script that starts the forwarder from PROGRAM_PORT to the endpoint's socket (mounted at
    `socket_path`), waits until it listens, then becomes the agent program: a sandbox without a network
    still has its loopback, so any HTTP client reaches the model at a plain http:// address."""
    return (
        f"python3 -c {shlex.quote(FORWARDER)} {PROGRAM_PORT} {socket_path} >/dev/null 2>&1 & "
        f"for _ in $(seq 100); do [ -e /tmp/.loopline-forwarding ] && break; sleep 0.05; done; exec /bin/sh -c {shlex.quote(command)}"
    )


class Sandbox(Protocol):
    async def exec(self, command: str, timeout_s: float, stdin: str | None = None) -> ExecResult:
        """Run a shell command in the working directory; a timeout or OOM is a result, not an exception."""

    async def write_file(self, path: str, content: str) -> None:
        """Write a file (relative paths are under the working directory)."""

    async def read_file(self, path: str) -> str:
        """A regular file's first READ_LIMIT bytes as text (invalid UTF-8 replaced); FileNotFoundError for
        anything else (missing, a FIFO, a device, a link out of the sandbox): the agent may have made it."""

    def model_url(self, endpoint: ModelEndpoint) -> str:
        """The base URL at which a program in this sandbox reaches `endpoint` (its only way out)."""

    async def run_program(self, command: str, stdin: str, env: dict[str, str], endpoint: ModelEndpoint) -> ExecResult:
        """Run the user's agent program (an env's `agent`) to its end, with `env` set, the model `endpoint`
        reachable at `model_url(endpoint)` and nothing else on the network (the sandbox was opened with
        it). Its time limit is the caller's: it cancels the call, which kills the program."""

    async def end_agent(self) -> None:
        """Kill every process the agent started (a background process must not outlive its episode)."""

    async def collect_outputs(self, patterns: tuple[str, ...] | None) -> Outputs:
        """After the agent's last action: end its processes, then copy out the regular files of its workdir that
        `patterns` name (`choose_outputs`), links and anything else left where it is. SandboxExhausted if the
        agent left no room to do so."""

    async def put_outputs(self, outputs: Outputs) -> None:
        """Into a fresh sandbox: write `outputs` into the workdir as the agent's own files."""

    async def run_verifier(self, files: dict[str, str], command: str, timeout_s: float) -> VerifierRun:
        """In a fresh sandbox holding the agent's outputs: run `command` as an identity the agent's code cannot
        act as, in a private directory holding `files` that the agent's code can neither read nor write; return
        its verdict file."""

    async def close(self) -> None:
        """Release everything; safe to call twice."""
