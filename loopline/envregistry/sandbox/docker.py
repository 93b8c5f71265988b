"""The Docker backend: one hardened container per episode, driven through the docker SDK.

No network, a read-only root with tmpfs working directories, memory / cpu /
pids limits, and a per-command timeout (`timeout -s KILL`, since exec has
none). Every command of the agent runs with no capabilities as a uid of its
container's own, drawn at random (no other container's agent shares it), so
that RLIMIT_NPROC, which Linux counts per uid across the host, holds the agent
to `pids` processes and leaves root a few of the container's own to copy its
outputs out or end it, whatever the agent forked. The verifier runs in a fresh
container (`ROLE_LABEL`) as root (capabilities only to drop to the agent's uid,
kill its processes and mark them the OOM killer's first choice) in `/verify`, a
tmpfs of its own that the agent's uid can neither read nor write. Containers
carry labels naming their owner process, so `cleanup_orphans` removes those
whose owner died without closing them, and each process removes its own as it exits.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import io
import os
import posixpath
import secrets
import shlex
import socket
import tarfile
import threading
import time
from typing import Iterator

from loopline.envregistry import spec as env_spec
from loopline.envregistry.images import BUILD_COMMAND
from loopline.envregistry.sandbox.base import (
    LOOPBACK_URL, MAX_PROGRAM_S, READ_LIMIT, ROLE_LABEL, UTF8, VERIFIER_ROLE, ExecResult, InfraFailure, ModelEndpoint, Outputs,
    SandboxExhausted, VerifierRun, blocking, choose_outputs, program_script, verifier_env,
)
from loopline.holder import process_alive

LABEL = "loopline.sandbox"
VERIFIER = "0:0"
AGENT_UIDS = (1 << 20, 1 << 31)  # the range a container's agent uid is drawn from: no host user, no other container's
ROOT_PIDS = 32  # processes the container keeps for root beyond the agent's `pids`
OPEN_FILES = 4096  # per process: bounds the pipes (kernel memory no process shows) an agent can hold
VERIFIER_MEMORY_MB = 256  # a verifier's container: room for the verifier beside all the agent's code under test can hold
VERIFY_DIR = "/verify"
MODEL_SOCKET = "/run/loopline-model.sock"  # an agent program's endpoint, bind-mounted (not removable from inside)
PLUMBING_DIR = "/run/loopline"  # loopline's own files for the agent's commands (stdin): root's, readable, not fillable
OUTPUT_LIMIT = 64 * 1024
COPY_OUT = "copy the agent's outputs out"
_WRITE_CHUNK = 48 * 1024  # base64 text per exec argument, well under the kernel's per-argument limit


def _shm_mb(res: env_spec.Resources) -> int:
    """Shared memory the agent may hold (SysV and /dev/shm each): a quarter of the sandbox's memory."""
    return max(res.memory_mb // 4, 1)


def _inodes(res: env_spec.Resources) -> int:
    """Files the agent may make in its workdir and in /tmp (each): ~1 KB of kernel memory apiece, charged to the
    container, so at most an eighth of its memory in all; 8192 for 256 MB."""
    return max(res.memory_mb * 32, 1024)


_sdk_import = threading.Lock()


def _import_sdk() -> None:
    """The Docker SDK, imported by one thread at a time: its modules import each other, and two threads importing
    them at once (two episodes' sandboxes created together) saw each other's half-initialised package and failed
    with `ImportError: cannot import name ... from partially initialized module 'docker.types'` (measured)."""
    with _sdk_import:
        import docker.errors  # noqa: F401
        import docker.types  # noqa: F401


def _client():
    _import_sdk()
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=60)
        client.ping()
    except DockerException as exc:
        raise InfraFailure(
            f"the Docker daemon is not reachable ({exc}); start it (e.g. `dockerd &`) or use another backend"
        ) from None
    return client


class DockerSandbox:
    def __init__(self, spec: env_spec.DockerSettings, container, client, model_socket: str | None, agent_uid: int):
        self.spec, self.container, self.client, self.model_socket = spec, container, client, model_socket
        self.agent = f"{agent_uid}:{agent_uid}"
        self.agent_exec = ["setpriv", f"--reuid={agent_uid}", f"--regid={agent_uid}", "--clear-groups", "--"]  # util-linux, in minbase
        self.verifies = container.labels.get(ROLE_LABEL) == VERIFIER_ROLE
        if self.verifies:  # the agent's code under test goes first when memory runs out (and cannot change that)
            self.agent_exec = ["choom", "-n", "1000", "--", *self.agent_exec]
        self._oom_baseline = self._oom_kills()

    @classmethod
    async def create(cls, spec: env_spec.DockerSettings, labels: dict[str, str] | None = None, model_socket: str | None = None) -> "DockerSandbox":
        return await blocking(cls._create, spec, labels or {}, model_socket)

    @classmethod
    def _create(cls, spec: env_spec.DockerSettings, labels: dict[str, str], model_socket: str | None) -> "DockerSandbox":
        with _creations.started():
            return cls._create_now(spec, labels, model_socket)

    @classmethod
    def _create_now(cls, spec: env_spec.DockerSettings, labels: dict[str, str], model_socket: str | None) -> "DockerSandbox":
        _import_sdk()
        from docker.errors import APIError, ImageNotFound
        from docker.types import Ulimit

        client = _client()
        try:
            client.images.get(spec.image)
        except ImageNotFound:
            raise InfraFailure(f"sandbox image {spec.image!r} is missing; build it with `{BUILD_COMMAND}`") from None
        res = spec.resources
        agent_uid = secrets.randbelow(AGENT_UIDS[1] - AGENT_UIDS[0]) + AGENT_UIDS[0]
        verifies = labels.get(ROLE_LABEL) == VERIFIER_ROLE
        # A verifier's container holds the verifier beside the agent's code under test: what that code can pin
        # (its filesystems, shared memory) and its processes (the OOM killer's first choice there) come on top.
        memory_mb = res.memory_mb + (_pinnable_mb(res) + VERIFIER_MEMORY_MB if verifies else 0)
        try:
            container = client.containers.run(
                spec.image,
                ["sleep", "infinity"],
                detach=True,
                init=True,
                user=VERIFIER,  # the container's own process; every agent command is exec'd as its agent uid
                working_dir=spec.workdir,
                network_mode="bridge" if spec.network else "none",
                read_only=True,
                tmpfs={
                    spec.workdir: f"rw,exec,size={res.disk_mb}m,nr_inodes={_inodes(res)},mode=1777",
                    "/tmp": f"rw,size={res.disk_mb}m,nr_inodes={_inodes(res)},mode=1777",
                    # Its own filesystem: an agent that fills the disk cannot starve the verifier.
                    VERIFY_DIR: f"rw,exec,size={res.disk_mb}m,mode=0700",
                    PLUMBING_DIR: f"rw,size={res.disk_mb}m,mode=0755",
                    # Shared memory outlives the processes that made it and counts toward the container's memory.
                    # /dev/shm is capped at a quarter of the memory and, like every tmpfs the agent writes, in
                    # inodes: each costs the container ~1 KB of kernel memory whatever its size.
                    "/dev/shm": f"rw,nosuid,nodev,noexec,size={_shm_mb(res)}m,nr_inodes={_inodes(res) // 8},mode=1777",
                },
                # SysV segments go with their last process (shm_rmid_forced) and are capped like /dev/shm.
                ipc_mode="private",
                sysctls={
                    "kernel.shm_rmid_forced": "1",
                    "kernel.shmmax": str(_shm_mb(res) << 20),
                    "kernel.shmall": str((_shm_mb(res) << 20) // 4096),
                },
                mem_limit=f"{memory_mb}m",
                memswap_limit=f"{memory_mb}m",
                nano_cpus=int(res.cpus * 1e9),
                # The agent's uid is its container's alone, so RLIMIT_NPROC (counted per uid) holds it to `pids`;
                # root is exempt and keeps ROOT_PIDS of the container's own. Open files bound the pipes it can hold.
                pids_limit=res.pids + ROOT_PIDS,
                ulimits=[Ulimit(name="nproc", soft=res.pids, hard=res.pids), Ulimit(name="nofile", soft=OPEN_FILES, hard=OPEN_FILES)],
                cap_drop=["ALL"],
                # Effective for root only: the agent's uid gets none, and no-new-privileges keeps it from gaining
                # any. A verifier's root may also raise its children's OOM score for good (choom).
                cap_add=["SETUID", "SETGID", "KILL", *(["SYS_RESOURCE"] if verifies and _bounded_by(CAP_SYS_RESOURCE) else [])],
                security_opt=["no-new-privileges"],
                # an agent program's model endpoint: the one socket a container without a network can reach
                volumes={model_socket: {"bind": MODEL_SOCKET, "mode": "rw"}} if model_socket else None,
                labels={LABEL: "1", "loopline.owner_pid": str(os.getpid()), "loopline.owner_host": socket.gethostname(), **labels},
            )
        except APIError as exc:
            raise InfraFailure(f"could not start a sandbox container: {exc.explanation or exc}") from None
        return cls(spec, container, client, model_socket, agent_uid)

    def _oom_kills(self) -> int:
        """The container cgroup's OOM-kill counter: an exec'd process killed by OOM exits 137 without OOMKilled."""
        for path in (
            f"/sys/fs/cgroup/memory/docker/{self.container.id}/memory.oom_control",
            f"/sys/fs/cgroup/system.slice/docker-{self.container.id}.scope/memory.events",
        ):
            try:
                with open(path) as f:
                    for line in f:
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
            except OSError:
                continue
        return 0

    def _run(
        self, command: str, timeout_s: float, user: str, workdir: str | None = None, environment: dict[str, str] | None = None
    ) -> tuple[int, bytes, bytes, float, bool]:
        """exit code, stdout, stderr, seconds, OOM-killed."""
        from docker.errors import APIError, NotFound

        start = time.monotonic()
        wrapped = ["timeout", "-s", "KILL", f"{timeout_s:g}", "sh", "-c", command]
        try:
            code, (out, err) = self.container.exec_run(
                wrapped,
                demux=True,
                workdir=workdir or self.spec.workdir,
                user=user,
                environment={**UTF8, **(environment or {})},
            )
        except (APIError, NotFound) as exc:
            raise InfraFailure(f"sandbox container failed: {exc}") from None
        oom = self._oom_kills()
        oom_killed, self._oom_baseline = oom > self._oom_baseline, oom
        return code, out or b"", err or b"", time.monotonic() - start, oom_killed

    def _exec(
        self,
        command: str,
        timeout_s: float,
        limit: int | None = OUTPUT_LIMIT,
        user: str | None = None,
        workdir: str | None = None,
        environment: dict[str, str] | None = None,
    ) -> ExecResult:
        code, out, err, seconds, oom_killed = self._run(command, timeout_s, user or self.agent, workdir, environment)
        return ExecResult(
            exit_code=code,
            stdout=out[:limit].decode(errors="replace"),
            stderr=err[:limit].decode(errors="replace"),
            seconds=seconds,
            timed_out=code == 137 and not oom_killed and seconds >= timeout_s * 0.9,
            oom_killed=oom_killed,
        )

    async def exec(self, command: str, timeout_s: float, stdin: str | None = None) -> ExecResult:
        if stdin is not None:  # written by root where the agent cannot fill the disk, read by the agent
            await self.write_file(f"{PLUMBING_DIR}/stdin", stdin, user=VERIFIER)
            command = f"({command}) < {PLUMBING_DIR}/stdin"
        return await blocking(self._exec, command, timeout_s)

    def model_url(self, endpoint: ModelEndpoint) -> str:
        return LOOPBACK_URL

    async def run_program(self, command: str, stdin: str, env: dict[str, str], endpoint: ModelEndpoint) -> ExecResult:
        """As the agent, in a container whose only way out is the endpoint's socket, mounted when the container
        was made (`open_sandbox(model=...)`)."""
        if self.model_socket != endpoint.socket:
            raise InfraFailure("this sandbox was made without the model endpoint mounted; an agent program cannot reach it")
        await self.write_file(f"{PLUMBING_DIR}/stdin", stdin, user=VERIFIER)
        script = f"({program_script(command, MODEL_SOCKET)}) < {PLUMBING_DIR}/stdin"
        try:
            return await blocking(self._exec, script, MAX_PROGRAM_S, OUTPUT_LIMIT, self.agent, None, {"HOME": self.spec.workdir, **env})
        except asyncio.CancelledError:  # the episode's budget is spent: the program and what it started go now
            await blocking(self._kill_agent)
            raise

    async def write_file(self, path: str, content: str, user: str | None = None) -> None:
        # put_archive cannot write into a tmpfs under a read-only root, so files go through exec arguments.
        target = shlex.quote(path)
        data = base64.b64encode(content.encode()).decode()
        chunks = [data[i : i + _WRITE_CHUNK] for i in range(0, len(data), _WRITE_CHUNK)] or [""]
        parent = shlex.quote(os.path.dirname(path) or ".")
        for i, chunk in enumerate(chunks):
            redirect = ">" if i == 0 else ">>"
            result = await blocking(
                self._exec, f"mkdir -p {parent} && printf %s {chunk} | base64 -d {redirect} {target}", 30, OUTPUT_LIMIT, user
            )
            if not result.ok:
                raise InfraFailure(f"could not write {path} in the sandbox: {result.stderr.strip()}")

    async def read_file(self, path: str, user: str | None = None) -> str:
        quoted = shlex.quote(path)
        result = await blocking(self._exec, f"test -f {quoted} && head -c {READ_LIMIT} {quoted}", 30, None, user)
        if not result.ok:
            raise FileNotFoundError(f"{path}: {result.stderr.strip()}")
        return result.stdout

    def _kill_agent(self) -> None:
        """As root, SIGKILL every process of the agent's uid until none is left. Not `kill -1` as the agent: at
        its process limit, a new process of its uid cannot even start."""
        uid = self.agent.split(":")[0]
        script = (  # (a zombie shows until its new parent, the container's init, reaps it: a few rounds, with pauses)
            f"n=0; while p=$(find /proc -mindepth 1 -maxdepth 1 -user {uid} -name '[0-9]*' -printf '%f ' 2>/dev/null); [ -n \"$p\" ]; do "
            "n=$((n + 1)); if [ $n -gt 100 ]; then echo \"still running: $p\" >&2; exit 1; fi; kill -9 $p 2>/dev/null; sleep 0.05; done"
        )
        self._as_root(script, "end the agent's processes", 30)

    async def end_agent(self) -> None:
        await blocking(self._kill_agent)

    async def collect_outputs(self, patterns: tuple[str, ...] | None) -> Outputs:
        await self.end_agent()
        workdir = shlex.quote(self.spec.workdir)
        listing, unnamed = [], {}
        for entry in (await blocking(self._as_root, f"find {workdir} -xdev -type f -printf '%s %P\\0'", COPY_OUT)).split(b"\0")[:-1]:
            size, _, raw = entry.partition(b" ")
            try:
                listing.append((raw.decode(), int(size)))
            except UnicodeDecodeError:
                unnamed[raw.decode(errors="replace")] = "its name is not UTF-8"
        chosen, left_out = choose_outputs(listing, patterns)
        if not chosen:
            return Outputs(left_out=left_out | unnamed)
        await self.write_file(f"{PLUMBING_DIR}/outputs", "\0".join(chosen), user=VERIFIER)
        archive = await blocking(
            self._as_root, f"tar -C {workdir} -cf - --null --no-recursion -T {PLUMBING_DIR}/outputs | head -c {env_spec.MAX_OUTPUT_BYTES * 2}",
            COPY_OUT,
        )
        return _read_outputs(archive, set(chosen), left_out | unnamed)

    def _as_root(self, command: str, what: str, timeout_s: float = 60) -> bytes:
        """stdout of a command loopline runs as root after the agent's last action, to do `what`: the agent's
        exhaustion of the container shows as SandboxExhausted (its failure), any other as InfraFailure."""
        code, out, err, _, oom_killed = self._run(command, timeout_s, VERIFIER, "/")
        if oom_killed:
            raise SandboxExhausted(f"no memory was left to {what}")
        if code:
            raise InfraFailure(f"could not {what} (exit {code}): {err.decode(errors='replace').strip()[-300:]}")
        return out

    async def put_outputs(self, outputs: Outputs) -> None:
        if outputs.files:
            await blocking(self._put_outputs, outputs)

    def _put_outputs(self, outputs: Outputs) -> None:
        """One tar through the stdin of an exec, unpacked as the agent (its own files, as it left them)."""
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            for path, data in outputs.files.items():
                info = tarfile.TarInfo(path)
                info.size, info.mode = len(data), 0o755 if path in outputs.executable else 0o644
                tar.addfile(info, io.BytesIO(data))
        command = ["tar", "-x", "-C", self.spec.workdir, "--no-same-owner", "--no-same-permissions", "-f", "-"]
        api = self.client.api
        exec_id = api.exec_create(self.container.id, command, stdin=True, user=self.agent)["Id"]
        stream = api.exec_start(exec_id, socket=True)
        raw = getattr(stream, "_sock", stream)
        try:
            raw.sendall(archive.getvalue())
            raw.shutdown(socket.SHUT_WR)
            while raw.recv(65536):
                pass
        finally:
            raw.close()
        code = api.exec_inspect(exec_id)["ExitCode"]
        if code:
            raise InfraFailure(f"could not copy the agent's outputs into the verifier's sandbox (tar exit {code})")

    async def run_verifier(self, files: dict[str, str], command: str, timeout_s: float) -> VerifierRun:
        for path, text in files.items():
            await self.write_file(posixpath.join(VERIFY_DIR, path), text, user=VERIFIER)
        env = verifier_env(VERIFY_DIR, self.spec.workdir, self.agent_exec)
        result = await blocking(self._exec, command, timeout_s, OUTPUT_LIMIT, VERIFIER, VERIFY_DIR, env)
        await self.end_agent()  # (what the agent's code started while tested must not outlive the reading)
        try:
            verdict = await self.read_file(env["LOOPLINE_VERDICT_FILE"], user=VERIFIER)
        except FileNotFoundError:
            verdict = None
        return VerifierRun(result, verdict)

    async def close(self) -> None:
        await blocking(self._remove)

    def _remove(self) -> None:
        from docker.errors import NotFound

        try:
            self.container.remove(force=True)
        except NotFound:
            pass


CAP_SYS_RESOURCE = 24


def _bounded_by(capability: int) -> bool:
    """Whether this host's processes may hold `capability` at all (a host that is itself a container may lack
    some, and Docker then refuses a container asking for it). Docker's daemon is taken to run on this host."""
    try:
        with open("/proc/self/status") as f:
            bounding = next(int(line.split()[1], 16) for line in f if line.startswith("CapBnd:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(bounding >> capability & 1)


def _pinnable_mb(res: env_spec.Resources) -> int:
    """Memory the agent's code can hold without a process to show for it: its filesystems and shared memory."""
    return 2 * res.disk_mb + 2 * _shm_mb(res)


def _read_outputs(archive: bytes, chosen: set[str], left_out: dict[str, str]) -> Outputs:
    """The regular files of a tar that are `chosen` (a member that is anything else, e.g. a link made between
    listing and reading, is left out)."""
    files: dict[str, bytes] = {}
    executable: set[str] = set()
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
            for member in tar:
                name = posixpath.normpath(member.name)
                if name not in chosen or name in files:
                    continue
                if not member.isreg():
                    left_out[name] = "not a regular file"
                    continue
                data = tar.extractfile(member)
                files[name] = data.read() if data else b""
                if member.mode & 0o111:
                    executable.add(name)
    except tarfile.TarError as exc:
        raise InfraFailure(f"could not read the agent's outputs: {exc}") from None
    for name in chosen - files.keys() - left_out.keys():
        left_out[name] = "gone before it could be copied"
    return Outputs(files, frozenset(executable), left_out)


class _Creations:
    """Containers being created by this process's threads, and the sweep at its exit. Ctrl-C cancels an episode
    while its thread still waits on the daemon for a container; the daemon makes it anyway, and nobody closes
    it (seen: `envreg test` stopped by Ctrl-C left one running)."""

    WAIT_S = 5.0  # what the exit gives a creation in flight to finish (a container starts in ~0.5 s)

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._in_flight = 0
        self._sweeps = False

    @contextlib.contextmanager
    def started(self) -> Iterator[None]:
        with self._changed:
            self._in_flight += 1
            if not self._sweeps:
                atexit.register(self.sweep)
                self._sweeps = True
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    def sweep(self) -> None:
        """Every sandbox container this process started and did not close, once the creations in flight are
        done (those a SIGKILL leaves are `cleanup_orphans`' work)."""
        from docker.errors import DockerException

        with self._changed:
            self._changed.wait_for(lambda: self._in_flight == 0, timeout=self.WAIT_S)
        try:
            mine = [LABEL, f"loopline.owner_pid={os.getpid()}", f"loopline.owner_host={socket.gethostname()}"]
            for container in _client().containers.list(all=True, filters={"label": mine}):
                container.remove(force=True)
        except (DockerException, InfraFailure):
            pass  # (the daemon gone: nothing of ours runs there)


_creations = _Creations()


def cleanup_orphans() -> list[str]:
    """Remove sandbox containers on this host whose owning process is gone (it crashed before closing them)."""
    client = _client()
    removed = []
    host = socket.gethostname()
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        labels = container.labels
        if labels.get("loopline.owner_host") != host:
            continue
        pid = int(labels.get("loopline.owner_pid", "0"))
        if pid and process_alive(pid):
            continue
        container.remove(force=True)
        removed.append(container.short_id)
    return removed

