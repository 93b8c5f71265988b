"""The E2B backend: a cloud sandbox per episode through the real `e2b` SDK.

Resources come from the E2B template (they cannot be set per sandbox), so
`resources` in the spec documents intent only; network access follows
`network`. Commands get the same `timeout -s KILL` wrapper as on Docker, so a
command that outlives its timeout is killed inside the sandbox, not merely
abandoned by the client.
"""

from __future__ import annotations

import posixpath
import shlex
import time

from loopline.envregistry import spec as env_spec
from loopline.envregistry.sandbox.base import ExecResult, InfraFailure

OUTPUT_LIMIT = 64 * 1024
SANDBOX_LIFETIME_S = 3600  # E2B kills an idle-forgotten sandbox after this, even if close() never ran
_CLIENT_GRACE_S = 10  # how much longer the SDK waits than the in-sandbox kill timer


class E2BSandbox:
    def __init__(self, spec: env_spec.Sandbox, sandbox):
        self.spec, self.sandbox = spec, sandbox

    @classmethod
    async def create(cls, spec: env_spec.Sandbox, labels: dict[str, str] | None = None) -> "E2BSandbox":
        from e2b import AsyncSandbox
        from e2b.exceptions import AuthenticationException, SandboxException, ServiceBusyException

        try:
            sandbox = await AsyncSandbox.create(
                template=spec.template,
                timeout=SANDBOX_LIFETIME_S,
                metadata=labels or {},
                allow_internet_access=spec.network,
            )
        except (SandboxException, AuthenticationException, ServiceBusyException) as exc:
            raise InfraFailure(f"could not create an E2B sandbox from template {spec.template!r}: {exc}") from None
        box = cls(spec, sandbox)
        made = await box.exec(f"mkdir -p {shlex.quote(spec.workdir)}", timeout_s=30, cwd="/")
        if not made.ok:
            await box.close()
            raise InfraFailure(f"could not create {spec.workdir} in the E2B sandbox: {made.stderr.strip()}")
        return box

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else posixpath.join(self.spec.workdir, path)

    async def exec(
        self, command: str, timeout_s: float, stdin: str | None = None, cwd: str | None = None
    ) -> ExecResult:
        from e2b import CommandExitException
        from e2b.exceptions import (
            SandboxException,
            SandboxNotRunningException,
            SandboxUnreachableException,
            TimeoutException,
        )

        if stdin is not None:
            await self.write_file("/tmp/.loopline-stdin", stdin)
            command = f"({command}) < /tmp/.loopline-stdin"
        wrapped = f"timeout -s KILL {timeout_s:g} sh -c {shlex.quote(command)}"
        start = time.monotonic()
        try:
            result = await self.sandbox.commands.run(
                wrapped, cwd=cwd or self.spec.workdir, timeout=timeout_s + _CLIENT_GRACE_S
            )
            code, out, err = result.exit_code, result.stdout, result.stderr
        except CommandExitException as exc:  # a non-zero exit is a result, not a failure
            code, out, err = exc.exit_code, exc.stdout, exc.stderr
        except (SandboxNotRunningException, SandboxUnreachableException) as exc:  # TimeoutException subclasses
            raise InfraFailure(f"E2B sandbox is gone: {exc}") from None
        except TimeoutException:
            code, out, err = 137, "", ""
        except SandboxException as exc:
            raise InfraFailure(f"E2B sandbox failed: {exc}") from None
        seconds = time.monotonic() - start
        return ExecResult(
            exit_code=code,
            stdout=(out or "")[:OUTPUT_LIMIT],
            stderr=(err or "")[:OUTPUT_LIMIT],
            seconds=seconds,
            timed_out=code == 137 and seconds >= timeout_s * 0.9,
        )

    async def write_file(self, path: str, content: str) -> None:
        from e2b.exceptions import SandboxException

        try:
            await self.sandbox.files.write(self._path(path), content)
        except SandboxException as exc:
            raise InfraFailure(f"could not write {path} in the E2B sandbox: {exc}") from None

    async def read_file(self, path: str) -> str:
        from e2b.exceptions import NotFoundException, SandboxException

        try:
            return await self.sandbox.files.read(self._path(path))
        except NotFoundException:
            raise FileNotFoundError(path) from None
        except SandboxException as exc:
            raise InfraFailure(f"could not read {path} in the E2B sandbox: {exc}") from None

    async def close(self) -> None:
        from e2b.exceptions import SandboxException

        try:
            await self.sandbox.kill()
        except SandboxException:
            pass  # already gone; E2B also ends it after SANDBOX_LIFETIME_S
