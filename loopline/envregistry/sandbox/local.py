"""The local backend: a private temporary directory and subprocesses, for trusted, side-effect-free tools.

When bubblewrap is installed and the spec turns the network off, commands run
inside `bwrap` with every namespace unshared (no network, private /tmp,
read-only host); otherwise they run as plain subprocesses. Memory is capped
with RLIMIT_AS; a timeout kills the whole process group.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import tempfile
import time
from pathlib import Path

from loopline.envregistry import spec as env_spec
from loopline.envregistry.sandbox.base import ExecResult, InfraFailure, process_alive

OUTPUT_LIMIT = 64 * 1024
PREFIX = "loopline-sandbox-"


class LocalSandbox:
    def __init__(self, spec: env_spec.Sandbox):
        self.spec = spec
        # The owner's pid in the name lets `cleanup_orphans` find directories of processes that crashed.
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self.isolated = not spec.network and shutil.which("bwrap") is not None

    def _resolve(self, path: str) -> Path:
        target = (self.root / path.lstrip("/")).resolve()
        if not target.is_relative_to(self.root.resolve()):
            raise ValueError(f"path {path!r} leaves the sandbox")
        return target

    def _argv(self, command: str) -> list[str]:
        if not self.isolated:
            return ["/bin/sh", "-c", command]
        return [
            "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--bind", str(self.root), str(self.root), "--chdir", str(self.root),
            "/bin/sh", "-c", command,
        ]

    def _limits(self) -> None:
        memory = self.spec.resources.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    async def exec(self, command: str, timeout_s: float, stdin: str | None = None) -> ExecResult:
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv(command),
                cwd=self.root,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                preexec_fn=self._limits,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root), "LANG": "C.UTF-8"},
            )
        except OSError as exc:
            raise InfraFailure(f"could not start a local sandbox process: {exc}") from exc
        timed_out = False
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = await proc.communicate()
        return ExecResult(
            exit_code=proc.returncode if not timed_out else 137,
            stdout=out[:OUTPUT_LIMIT].decode(errors="replace"),
            stderr=err[:OUTPUT_LIMIT].decode(errors="replace"),
            seconds=time.monotonic() - start,
            timed_out=timed_out,
        )

    async def write_file(self, path: str, content: str) -> None:
        target = self._resolve(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)

    async def read_file(self, path: str) -> str:
        return self._resolve(path).read_text()

    async def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def cleanup_orphans() -> list[str]:
    """Remove local sandbox directories whose owning process is gone."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed
