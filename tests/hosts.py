"""Containers as hosts: machines with filesystems of their own on a network of their own, for the multi-host tests.

Each host is a container of the sandbox image (any root filesystem would do) with this machine's /usr, its
Python installation and the repository mounted read-only, as if the same packages were installed on each host.
Everything a host writes (LOOPLINE_HOME, caches, Prefect's home, /tmp) is its own; nothing is shared but the
network the cluster creates. Faults are the engine's own: `pause` (a host that stops answering), `cut` (its
network disconnected), `kill`, and `start` again (a host that reboots with its disk as it was).
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POSTGRES_BIN = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
PYTHON_ROOTS = sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()})
HOME = "/tmp/home"


def _mounts() -> dict:
    """What every host sees as installed: the system's /usr, the Python the tests run with, the code."""
    shared = {"/usr": "/usr"}
    for root in PYTHON_ROOTS:
        if not str(root).startswith("/usr"):  # (pyenv's version folder, a venv)
            shared[str(root)] = str(root)
    shared[str(ROOT)] = str(ROOT)
    return {source: {"bind": target, "mode": "ro"} for source, target in shared.items()}


class Cluster:
    """Hosts on a bridge network of their own; `close` removes every container and the network."""

    def __init__(self, image: str):
        import docker

        self.client = docker.from_env()
        self.image = image
        self.name = f"loopline-hosts-{uuid.uuid4().hex[:8]}"
        self.network = self.client.networks.create(self.name, driver="bridge")
        self.hosts: dict = {}
        self.envs: dict[str, dict[str, str]] = {}

    def env(self, **extra: str) -> dict[str, str]:
        path = ":".join([*(f"{root}/bin" for root in PYTHON_ROOTS), *(str(p) for p in POSTGRES_BIN), "/usr/local/bin:/usr/bin:/bin"])
        return {
            "PATH": path, "HOME": HOME, "LOOPLINE_HOME": HOME, "PYTHONPATH": str(ROOT), "PREFECT_HOME": f"{HOME}/.prefect", "PYTHONDONTWRITEBYTECODE": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", **extra,
        }

    def start(self, name: str, command: str, env: dict[str, str] | None = None, user: str | None = None, ports: dict | None = None, volumes: dict | None = None):
        """A host named `name` (its hostname on the network) running `command` under sh, with `env` besides the
        installation's (`run` on the host gets the same)."""
        self.envs[name] = self.env(**(env or {}))
        container = self.client.containers.run(
            self.image, ["/bin/sh", "-c", f"mkdir -p {HOME} && cd {HOME} && {command}"], name=f"{self.name}-{name}", hostname=name,
            detach=True, network=self.name, environment=self.envs[name], user=user, ports=ports or {},
            volumes={**_mounts(), **(volumes or {})}, working_dir="/tmp",
        )
        self.network.reload()
        self.hosts[name] = container
        return container

    def run(self, name: str, command: str, timeout: int = 600) -> tuple[int, str]:
        """`command` on host `name` (running), to its end: exit status and output."""
        result = self.hosts[name].exec_run(["timeout", "-s", "KILL", str(timeout), "/bin/sh", "-c", f"cd {HOME} && {command}"], environment=self.envs[name])
        return result.exit_code, result.output.decode(errors="replace")

    def logs(self, name: str) -> str:
        return self.hosts[name].logs().decode(errors="replace")

    def running(self, name: str) -> bool:
        self.hosts[name].reload()
        return self.hosts[name].status == "running"

    def exit_code(self, name: str, timeout: float) -> int:
        return int(self.hosts[name].wait(timeout=timeout)["StatusCode"])

    def pause(self, name: str) -> None:
        self.hosts[name].pause()

    def unpause(self, name: str) -> None:
        self.hosts[name].unpause()

    def cut(self, name: str) -> None:
        self.network.disconnect(self.hosts[name])

    def reconnect(self, name: str) -> None:
        self.network.connect(self.hosts[name])

    def kill(self, name: str) -> None:
        self.hosts[name].kill()

    def restart(self, name: str) -> None:
        """The host boots again with its disk as it was, and runs its command again."""
        self.hosts[name].start()

    def close(self) -> None:
        for container in self.hosts.values():
            try:
                container.remove(force=True)
            except Exception:
                pass
        self.network.remove()


def wait_until(condition, timeout: float, what: str, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
