"""The E2B backend: a cloud sandbox per episode through the real `e2b` SDK.

Resources come from the E2B template (they cannot be set per sandbox), so
`resources` in the spec documents intent only, but for `pids`, which holds the
agent's code under test. Network access follows `network`. Commands get the
same `timeout -s KILL` wrapper as on Docker, so a command that outlives its
timeout is killed inside the sandbox, not merely abandoned by the client. The
agent's commands run as E2B's unprivileged `user`. Its outputs are copied out
through envd's file API (no process needed: an agent that used up its
sandbox's process table cannot stop it) into a fresh sandbox, which is first
probed (`PROBE`): a template in which `user` can become root (sudo, setuid
programs, as E2B's own provisioning sets up) or write where root runs programs
is refused (`loopline.envregistry.e2b_template` is a recipe that passes). The
verifier runs there as `root` in `/verify` (mode 0700, a tmpfs of its own where
the sandbox allows mounting) and runs the agent's code only through `setpriv`
back to `user`, held to `pids` processes and first in line for the OOM killer.

An agent program (an env's `agent`) reaches the model over the internet: its sandbox is made with every
outbound address denied but the host of the endpoint's public URL (E2B's `network` allow list, which
takes precedence over the deny list), and the episode's unguessable key in the URL is what admits it.
"""

from __future__ import annotations

import asyncio
import posixpath
import shlex
import time
from urllib.parse import urlsplit

from loopline.envregistry import spec as env_spec
from loopline.envregistry.sandbox.base import (
    MAX_PROGRAM_S, ROLE_LABEL, UTF8, VERIFIER_ROLE, ExecResult, InfraFailure, ModelEndpoint, Outputs, VerifierRun, choose_outputs,
    verifier_env,
)

AGENT = "user"  # E2B's default unprivileged user
VERIFIER = "root"
VERIFY_DIR = "/verify"
STDIN_FILE = "/run/loopline/stdin"
OUTPUT_LIMIT = 64 * 1024
SANDBOX_LIFETIME_S = 3600  # E2B kills an idle-forgotten sandbox after this, even if close() never ran
_CLIENT_GRACE_S = 10  # how much longer the SDK waits than the in-sandbox kill timer
MAX_DEPTH = 64  # how deep in the workdir outputs are looked for
# Run as root in a new sandbox before the verifier gets it: one line per way the agent's user could become root or
# plant what root runs (nothing printed: none found). The agent's code runs there while it is tested.
PROBE = r"""
u=$(id -u user) g=$(id -g user)
as_user() { setpriv --reuid="$u" --regid="$g" --init-groups -- "$@"; }
if command -v sudo >/dev/null 2>&1 && as_user sudo -n true >/dev/null 2>&1; then
  echo "user runs commands as root with sudo, without a password"
fi
found=$(find / -xdev \( -perm -4000 -o -perm -2000 \) -type f 2>/dev/null | head -n 3 | tr '\n' ' ')
[ -z "$found" ] || echo "setuid or setgid programs let user change identity: $found"
found=$(as_user find $(echo "$PATH" | tr ':' ' ') /usr /etc /opt /bin /sbin /lib /lib64 -xdev -writable ! -type l 2>/dev/null | head -n 3 | tr '\n' ' ')
[ -z "$found" ] || echo "user can write where root runs programs: $found"
"""


class E2BSandbox:
    def __init__(self, spec: env_spec.E2BSettings, sandbox, verifies: bool = False):
        self.spec, self.sandbox, self.verifies = spec, sandbox, verifies
        self.agent_ids: tuple[str, str] | None = None  # the agent's uid and gid, read as root on first need

    @classmethod
    async def create(cls, spec: env_spec.E2BSettings, labels: dict[str, str] | None = None, model: ModelEndpoint | None = None) -> "E2BSandbox":
        from e2b import ALL_TRAFFIC, AsyncSandbox
        from e2b.exceptions import AuthenticationException, SandboxException, ServiceBusyException

        if model is None:
            network: dict = {"allow_internet_access": spec.network}
        elif not model.public_url:
            raise InfraFailure("an agent program in an E2B sandbox needs the model endpoint's public URL (LOOPLINE_AGENT_ENDPOINT_URL)")
        else:  # (the spec has `network: false` for an agent program: the endpoint is its only way out)
            network = {"network": {"deny_out": [ALL_TRAFFIC], "allow_out": [urlsplit(model.public_url).hostname]}}
        try:
            sandbox = await AsyncSandbox.create(template=spec.template, timeout=SANDBOX_LIFETIME_S, metadata=labels or {}, **network)
        except (SandboxException, AuthenticationException, ServiceBusyException) as exc:
            raise InfraFailure(f"could not create an E2B sandbox from template {spec.template!r}: {exc}") from None
        box = cls(spec, sandbox, verifies=(labels or {}).get(ROLE_LABEL) == VERIFIER_ROLE)
        if box.verifies:
            try:
                await box._refuse_a_way_to_root()
            except BaseException:
                await box.close()
                raise
        workdir = shlex.quote(spec.workdir)
        made = await box.exec(
            f"mkdir -p {workdir} && (chown {AGENT}: {workdir} 2>/dev/null || chmod 1777 {workdir})",
            timeout_s=30,
            cwd="/",
            user=VERIFIER,
        )
        if not made.ok:
            await box.close()
            raise InfraFailure(f"could not create {spec.workdir} in the E2B sandbox: {made.stderr.strip()}")
        return box

    async def _refuse_a_way_to_root(self) -> None:
        found = (await self._as_root(PROBE, "probe the template")).stdout.strip().splitlines()
        if found:
            raise InfraFailure(
                f"E2B template {self.spec.template!r} lets the agent's code rule its verifier ({'; '.join(found)}): build it "
                "from loopline's recipe (`envreg e2b-template build`, docs/concepts/sandboxes-verifiers.md)"
            )

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else posixpath.join(self.spec.workdir, path)

    async def exec(
        self,
        command: str,
        timeout_s: float,
        stdin: str | None = None,
        cwd: str | None = None,
        user: str = AGENT,
        envs: dict[str, str] | None = None,
    ) -> ExecResult:
        from e2b import CommandExitException
        from e2b.exceptions import (
            SandboxException,
            SandboxNotRunningException,
            SandboxUnreachableException,
            TimeoutException,
        )

        if stdin is not None:  # written by root where the agent cannot fill the disk, read by the agent
            await self.write_file(STDIN_FILE, stdin, user=VERIFIER)
            command = f"({command}) < {STDIN_FILE}"
        wrapped = f"timeout -s KILL {timeout_s:g} sh -c {shlex.quote(command)}"
        start = time.monotonic()
        try:
            result = await self.sandbox.commands.run(
                wrapped,
                cwd=cwd or self.spec.workdir,
                timeout=timeout_s + _CLIENT_GRACE_S,
                user=user,
                envs={**UTF8, **(envs or {})},
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

    async def write_file(self, path: str, content: str, user: str = AGENT) -> None:
        from e2b.exceptions import SandboxException

        try:
            await self.sandbox.files.write(self._path(path), content, user=user)
        except SandboxException as exc:
            raise InfraFailure(f"could not write {path} in the E2B sandbox: {exc}") from None

    async def read_file(self, path: str, user: str = AGENT) -> str:
        from e2b.exceptions import NotFoundException, SandboxException

        try:
            return await self.sandbox.files.read(self._path(path), user=user)
        except NotFoundException:
            raise FileNotFoundError(path) from None
        except SandboxException as exc:
            raise InfraFailure(f"could not read {path} in the E2B sandbox: {exc}") from None

    def model_url(self, endpoint: ModelEndpoint) -> str:
        assert endpoint.public_url is not None  # (checked when the sandbox was made)
        return endpoint.public_url.rstrip("/")

    async def run_program(self, command: str, stdin: str, env: dict[str, str], endpoint: ModelEndpoint) -> ExecResult:
        """As `user`, in a sandbox whose network reaches only the endpoint's host (`create(model=...)`)."""
        try:
            return await self.exec(command, MAX_PROGRAM_S, stdin=stdin, envs={"HOME": self.spec.workdir, **env})
        except asyncio.CancelledError:  # the episode's budget is spent: the program and what it started go now
            await asyncio.shield(self.end_agent())
            raise

    async def end_agent(self) -> None:
        # `kill -1` as the agent's uid reaches every process of the agent (the kernel signals them all at once:
        # nothing forks past it); run by root, so that no file of the agent's is read on the way.
        uid, gid = await self._agent_ids()
        await self._as_root(f"setpriv --reuid={uid} --regid={gid} --clear-groups -- sh -c 'kill -9 -1' || true", "end the agent's processes")

    async def _agent_ids(self) -> tuple[str, str]:
        """The agent's uid and gid, from /etc/passwd as root (never asked of the agent: its shell profile answers)."""
        if self.agent_ids is None:
            ids = await self._as_root(f"id -u {AGENT} && id -g {AGENT}", f"look up the uid of {AGENT!r}")
            found = ids.stdout.split()
            if len(found) != 2 or not all(part.isdigit() for part in found) or found[0] == "0":
                raise InfraFailure(f"the E2B template's user {AGENT!r} is not an unprivileged user (id: {ids.stdout.strip()!r})")
            self.agent_ids = found[0], found[1]
        return self.agent_ids

    async def _as_root(self, command: str, what: str) -> ExecResult:
        result = await self.exec(command, timeout_s=30, cwd="/", user=VERIFIER)
        if not result.ok:
            raise InfraFailure(f"could not {what} in the E2B sandbox: {result.stderr.strip()[-300:]}")
        return result

    async def collect_outputs(self, patterns: tuple[str, ...] | None) -> Outputs:
        """Through envd's file API, as the agent's user: no process is started (the agent may have left none to
        spare), and a file swapped for a link meanwhile is read with the agent's own rights."""
        from e2b import FileType
        from e2b.exceptions import SandboxException

        root = self.spec.workdir.rstrip("/") + "/"
        try:
            entries = await self.sandbox.files.list(self.spec.workdir, depth=MAX_DEPTH, user=VERIFIER)
        except SandboxException as exc:
            raise InfraFailure(f"could not list the agent's outputs in the E2B sandbox: {exc}") from None
        regular = {e.path[len(root):]: e for e in entries if e.type == FileType.FILE and e.path.startswith(root)}
        chosen, left_out = choose_outputs(((path, e.size) for path, e in regular.items()), patterns)
        files: dict[str, bytes] = {}
        for path in chosen:
            try:
                data = await self.sandbox.files.read(root + path, format="bytes", user=AGENT)
            except SandboxException as exc:
                left_out[path] = f"could not be read: {exc}"
                continue
            files[path] = bytes(data)
        return Outputs(files, frozenset(p for p in files if regular[p].mode & 0o111), left_out)

    async def put_outputs(self, outputs: Outputs) -> None:
        from e2b.exceptions import SandboxException

        for path, data in outputs.files.items():
            try:
                await self.sandbox.files.write(self._path(path), data, user=AGENT)
            except SandboxException as exc:
                raise InfraFailure(f"could not copy {path} into the verifier's E2B sandbox: {exc}") from None
        if outputs.executable:
            await self._as_root(f"chmod +x {' '.join(shlex.quote(self._path(p)) for p in outputs.executable)}", "mark outputs executable")

    async def run_verifier(self, files: dict[str, str], command: str, timeout_s: float) -> VerifierRun:
        size = self.spec.resources.disk_mb
        await self._as_root(
            f"mkdir -p {VERIFY_DIR} && chmod 700 {VERIFY_DIR} && "
            f"(mountpoint -q {VERIFY_DIR} || mount -t tmpfs -o size={size}m,mode=0700 tmpfs {VERIFY_DIR} || true)",
            f"prepare {VERIFY_DIR}",
        )
        for path, text in files.items():
            await self.write_file(posixpath.join(VERIFY_DIR, path), text, user=VERIFIER)
        uid, gid = await self._agent_ids()
        pids = self.spec.resources.pids
        # first in line for the OOM killer (for good: root may lower it, the agent not), and `pids` processes at most
        agent_exec = [
            "choom", "-n", "1000", "--", "prlimit", f"--nproc={pids}:{pids}", "--",
            "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
        ]
        env = verifier_env(VERIFY_DIR, self.spec.workdir, agent_exec)
        result = await self.exec(command, timeout_s, cwd=VERIFY_DIR, user=VERIFIER, envs=env)
        try:  # (the file API: the agent's code may have left no process to spare)
            verdict = await self.read_file(env["LOOPLINE_VERDICT_FILE"], user=VERIFIER)
        except FileNotFoundError:
            verdict = None
        return VerifierRun(result, verdict)

    async def close(self) -> None:
        from e2b.exceptions import SandboxException

        try:
            await self.sandbox.kill()
        except SandboxException:
            pass  # already gone; E2B also ends it after SANDBOX_LIFETIME_S
