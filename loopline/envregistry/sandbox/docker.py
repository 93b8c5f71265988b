"""The Docker backend: one hardened container per episode, driven through the docker SDK.

No network, a read-only root with tmpfs working directories, memory / cpu /
pids limits, and a per-command timeout (`timeout -s KILL`, since exec has
none). Every command of the agent runs as uid 1000 with no capabilities. The
verifier runs as root (capabilities only to drop to the agent's uid and to
kill its processes) in `/verify`, a tmpfs of its own that uid 1000 can neither
read nor write, after every process of uid 1000 has been killed. Containers
carry labels naming their owner process, so `cleanup_orphans` removes those
whose owner died without closing them, and each process removes its own as it exits.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import os
import posixpath
import shlex
import socket
import threading
import time
from typing import Iterator

from loopline.envregistry import spec as env_spec
from loopline.envregistry.images import BUILD_COMMAND
from loopline.envregistry.sandbox.base import (
    LOOPBACK_URL, MAX_PROGRAM_S, READ_LIMIT, UTF8, ExecResult, InfraFailure, ModelEndpoint, VerifierRun, blocking, collect_verdict, program_script,
    verifier_env,
)
from loopline.holder import process_alive

LABEL = "loopline.sandbox"
AGENT = "1000:1000"
VERIFIER = "0:0"
VERIFY_DIR = "/verify"
MODEL_SOCKET = "/run/loopline-model.sock"  # an agent program's endpoint, bind-mounted (not removable from inside)
PLUMBING_DIR = "/run/loopline"  # loopline's own files for the agent's commands (stdin): root's, readable, not fillable
AGENT_EXEC = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "--"]  # util-linux, in Debian's minbase
OUTPUT_LIMIT = 64 * 1024
_WRITE_CHUNK = 48 * 1024  # base64 text per exec argument, well under the kernel's per-argument limit


def _shm_mb(res: env_spec.Resources) -> int:
    """Shared memory the agent may hold (SysV and /dev/shm each): a quarter of the sandbox's memory."""
    return max(res.memory_mb // 4, 1)


def _inodes(res: env_spec.Resources) -> int:
    """Files the agent may make in its workdir and in /tmp (each): ~1 KB of kernel memory apiece, charged to the
    container, so at most an eighth of its memory in all; 8192 for 256 MB."""
    return max(res.memory_mb * 32, 1024)


def _client():
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
    def __init__(self, spec: env_spec.Sandbox, container, client, model_socket: str | None = None):
        self.spec, self.container, self.client, self.model_socket = spec, container, client, model_socket
        self._oom_baseline = self._oom_kills()

    @classmethod
    async def create(cls, spec: env_spec.Sandbox, labels: dict[str, str] | None = None, model_socket: str | None = None) -> "DockerSandbox":
        return await blocking(cls._create, spec, labels or {}, model_socket)

    @classmethod
    def _create(cls, spec: env_spec.Sandbox, labels: dict[str, str], model_socket: str | None) -> "DockerSandbox":
        with _creations.started():
            return cls._create_now(spec, labels, model_socket)

    @classmethod
    def _create_now(cls, spec: env_spec.Sandbox, labels: dict[str, str], model_socket: str | None) -> "DockerSandbox":
        from docker.errors import APIError, ImageNotFound

        client = _client()
        try:
            client.images.get(spec.image)
        except ImageNotFound:
            raise InfraFailure(f"sandbox image {spec.image!r} is missing; build it with `{BUILD_COMMAND}`") from None
        res = spec.resources
        try:
            container = client.containers.run(
                spec.image,
                ["sleep", "infinity"],
                detach=True,
                init=True,
                user=VERIFIER,  # the container's own process; every agent command is exec'd as AGENT
                working_dir=spec.workdir,
                network_mode="bridge" if spec.network else "none",
                read_only=True,
                tmpfs={
                    spec.workdir: f"rw,exec,size={res.disk_mb}m,nr_inodes={_inodes(res)},mode=1777",
                    "/tmp": f"rw,size={res.disk_mb}m,nr_inodes={_inodes(res)},mode=1777",
                    # Its own filesystem: an agent that fills the disk cannot starve the verifier.
                    VERIFY_DIR: f"rw,exec,size={res.disk_mb}m,mode=0700",
                    PLUMBING_DIR: f"rw,size={res.disk_mb}m,mode=0755",
                    # Shared memory outlives the processes that made it and counts toward the container's memory,
                    # which the verifier shares: a policy that pinned it got its verifier OOM-killed (an infra
                    # failure, so never a 0). /dev/shm is capped at a quarter of the memory (emptied before
                    # verifying) and, like every tmpfs the agent writes, in inodes: each costs the container
                    # ~1 KB of kernel memory whatever its size (275k empty files OOM-killed the verifier).
                    "/dev/shm": f"rw,nosuid,nodev,noexec,size={_shm_mb(res)}m,nr_inodes={_inodes(res) // 8},mode=1777",
                },
                # SysV segments go with their last process (shm_rmid_forced) and are capped like /dev/shm.
                ipc_mode="private",
                sysctls={
                    "kernel.shm_rmid_forced": "1",
                    "kernel.shmmax": str(_shm_mb(res) << 20),
                    "kernel.shmall": str((_shm_mb(res) << 20) // 4096),
                },
                mem_limit=f"{res.memory_mb}m",
                memswap_limit=f"{res.memory_mb}m",
                nano_cpus=int(res.cpus * 1e9),
                pids_limit=res.pids,
                cap_drop=["ALL"],
                # Effective for root (the verifier) only: uid 1000 processes get none, and no-new-privileges
                # keeps them from gaining any.
                cap_add=["SETUID", "SETGID", "KILL"],
                security_opt=["no-new-privileges"],
                # an agent program's model endpoint: the one socket a container without a network can reach
                volumes={model_socket: {"bind": MODEL_SOCKET, "mode": "rw"}} if model_socket else None,
                labels={LABEL: "1", "loopline.owner_pid": str(os.getpid()), "loopline.owner_host": socket.gethostname(), **labels},
            )
        except APIError as exc:
            raise InfraFailure(f"could not start a sandbox container: {exc.explanation or exc}") from None
        return cls(spec, container, client, model_socket)

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

    def _exec(
        self,
        command: str,
        timeout_s: float,
        limit: int | None = OUTPUT_LIMIT,
        user: str = AGENT,
        workdir: str | None = None,
        environment: dict[str, str] | None = None,
    ) -> ExecResult:
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
        seconds = time.monotonic() - start
        oom = self._oom_kills()
        oom_killed, self._oom_baseline = oom > self._oom_baseline, oom
        return ExecResult(
            exit_code=code,
            stdout=(out or b"")[:limit].decode(errors="replace"),
            stderr=(err or b"")[:limit].decode(errors="replace"),
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
        """As uid 1000, in a container whose only way out is the endpoint's socket, mounted when the container
        was made (`open_sandbox(model=...)`)."""
        if self.model_socket != endpoint.socket:
            raise InfraFailure("this sandbox was made without the model endpoint mounted; an agent program cannot reach it")
        await self.write_file(f"{PLUMBING_DIR}/stdin", stdin, user=VERIFIER)
        script = f"({program_script(command, MODEL_SOCKET)}) < {PLUMBING_DIR}/stdin"
        try:
            return await blocking(self._exec, script, MAX_PROGRAM_S, OUTPUT_LIMIT, AGENT, None, {"HOME": self.spec.workdir, **env})
        except asyncio.CancelledError:  # the episode's budget is spent: the program and what it started go now
            await blocking(self._kill_agent)
            raise

    async def write_file(self, path: str, content: str, user: str = AGENT) -> None:
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

    async def read_file(self, path: str, user: str = AGENT) -> str:
        quoted = shlex.quote(path)
        result = await blocking(self._exec, f"test -f {quoted} && head -c {READ_LIMIT} {quoted}", 30, None, user)
        if not result.ok:
            raise FileNotFoundError(f"{path}: {result.stderr.strip()}")
        return result.stdout

    def _kill_agent(self) -> None:
        from docker.errors import APIError, NotFound

        try:  # as uid 1000, `kill -1` reaches every process of the agent and nothing else
            self.container.exec_run(["sh", "-c", "kill -9 -1"], user=AGENT)
        except (APIError, NotFound) as exc:
            raise InfraFailure(f"sandbox container failed: {exc}") from None

    async def end_agent(self) -> None:
        await blocking(self._kill_agent)

    async def run_verifier(self, files: dict[str, str], command: str, timeout_s: float) -> VerifierRun:
        await self.end_agent()
        cleared = await blocking(
            self._exec, f"find {VERIFY_DIR} /dev/shm -mindepth 1 -delete", 30, OUTPUT_LIMIT, VERIFIER
        )
        if not cleared.ok:
            raise InfraFailure(f"could not prepare {VERIFY_DIR}: {cleared.stderr.strip()}")
        for path, text in files.items():
            await self.write_file(posixpath.join(VERIFY_DIR, path), text, user=VERIFIER)
        env = verifier_env(VERIFY_DIR, self.spec.workdir, AGENT_EXEC)
        result = await blocking(self._exec, command, timeout_s, OUTPUT_LIMIT, VERIFIER, VERIFY_DIR, env)
        return await collect_verdict(self, result, env["LOOPLINE_VERDICT_FILE"], VERIFIER)

    async def close(self) -> None:
        await blocking(self._remove)

    def _remove(self) -> None:
        from docker.errors import NotFound

        try:
            self.container.remove(force=True)
        except NotFound:
            pass


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

