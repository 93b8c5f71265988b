"""The local backend: a private temporary directory and subprocesses.

Commands run inside `bwrap` with every namespace unshared (no network, its own pid and IPC namespaces:
nothing an agent starts outlives the command that started it) and no capabilities, seeing a read-only
minimal system (/usr, /etc) and their workdir, nothing else of the host: no home directories, no task
files, no sockets (Docker's, PostgreSQL's, X11, D-Bus), no other process in /proc. When loopline runs as
root the agent runs as the unprivileged host uid `AGENT_UID` (bwrap alone would map it to host root);
otherwise as loopline's own uid. Limits hold per command: `pids` (RLIMIT_NPROC inside the command's own
user namespace, so it counts the sandbox's processes only) and `memory_mb` (RLIMIT_AS of each process, and
what memory its filesystems may hold: /tmp half of it, /dev/shm a quarter, / and /dev read-only, no user
namespace inside in which to mount another).
`cpus` and `disk_mb` cannot be enforced here: a spec that sets them (to other than the default) is refused.
Without bubblewrap, or with network on, commands would run unisolated on the host: that needs
`sandbox.unsafe_host: true`.

The verifier runs on the host in a private directory outside the sandbox (hidden from bwrap'd commands
by their private /tmp), with a HOME and TMPDIR there and no user site-packages, so nothing the agent
wrote is on its import path; the agent's code runs only through the same bwrap prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from loopline.envregistry import spec as env_spec
from loopline.envregistry.sandbox.base import (
    LOOPBACK_URL, MAX_PROGRAM_S, READ_LIMIT, UTF8, ExecResult, InfraFailure, ModelEndpoint, Outputs, VerifierRun, choose_outputs,
    program_script, verifier_env,
)
from loopline.holder import process_alive

OUTPUT_LIMIT = 64 * 1024
PROGRAM_SOCKET = "/tmp/.loopline-model.sock"  # where an agent program's sandbox sees the model endpoint
AGENT_UID = 65534  # nobody: the agent's host uid (and gid) when loopline runs as root
PREFIX = "loopline-sandbox-"
VERIFY_PREFIX = "loopline-verify-"


class LocalSandbox:
    def __init__(self, spec: env_spec.LocalSettings):
        self.spec = spec
        self.isolated = not spec.network and shutil.which("bwrap") is not None
        # The owner's pid in the name lets `cleanup_orphans` find directories of processes that crashed.
        self.as_root = self.isolated and os.geteuid() == 0  # then the agent is AGENT_UID, and owns its workdir
        if self.as_root and (problem := agent_cannot_reach(Path(tempfile.gettempdir()))):
            raise InfraFailure(problem)
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self._files = self.root
        self._holder: subprocess.Popen | None = None
        if self.as_root and not self.isolated:
            os.chown(self.root, AGENT_UID, AGENT_UID)
        self._groups: set[int] = set()  # unsafe_host: process groups of commands, killed by end_agent

    def _hold_a_workdir(self) -> None:
        """The workdir is a tmpfs of `disk_mb` of its own, not the host's disk (an agent that filled TMPDIR's
        filesystem failed every other episode there): mounted in a mount namespace (and, not as root, a user
        namespace) held by a process that lives as long as this sandbox, or as this process (its stdin is ours,
        so it ends when we do). Commands enter it; this process reaches the files through /proc/PID/root."""
        res = self.spec.resources
        owner = f" && chown {AGENT_UID}:{AGENT_UID} {self.root}" if self.as_root else ""
        script = (
            f"mount -t tmpfs -o size={res.disk_mb}m,nr_inodes={max(res.memory_mb * 32, 1024)},mode=0755 tmpfs {self.root}{owner} "
            "&& echo ready && read _"
        )
        namespaces = ["--mount"] if self.as_root else ["--user", "--map-root-user", "--mount"]
        try:
            self._holder = subprocess.Popen(
                ["unshare", *namespaces, "--propagation", "private", "--", "sh", "-c", script],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
        except OSError as exc:
            raise InfraFailure(f"could not make the local sandbox's workdir: unshare: {exc}") from None
        assert self._holder.stdout is not None and self._holder.stderr is not None
        if self._holder.stdout.readline() != b"ready\n":
            problem = self._holder.stderr.read().decode(errors="replace").strip()
            self._holder.wait()
            self._holder = None  # (never the host's directory in its place: the next use tries again)
            raise InfraFailure(f"could not make the local sandbox's workdir (a tmpfs of its own): {problem[-300:]}")
        self._files = Path(f"/proc/{self._holder.pid}/root") / self.root.relative_to("/")

    @property
    def files(self) -> Path:
        """Where this process reads and writes the workdir (made on first need: built-in tools need none)."""
        if self.isolated and self._holder is None:
            self._hold_a_workdir()
        return self._files

    def _resolve(self, path: str) -> Path:
        """`path` in the workdir as this process reaches it, links the agent made followed as its commands would
        see them (not Path.resolve(): through /proc/PID/root an absolute link would land on this host's files);
        PermissionError for one that leaves the workdir."""
        files, inside = self.files, str(self.root)
        parts = [p for p in path.removeprefix(inside).split("/") if p not in ("", ".")]
        done: list[str] = []
        for _ in range(256):
            if not parts:
                return files.joinpath(*done)
            part = parts.pop(0)
            if part == "..":
                if not done:
                    raise PermissionError(f"path {path!r} leaves the sandbox")
                done.pop()
                continue
            here = files.joinpath(*done, part)
            if not here.is_symlink():
                done.append(part)
                continue
            target = os.readlink(here)
            if target.startswith("/"):
                if target != inside and not target.startswith(inside + "/"):
                    raise PermissionError(f"path {path!r} leaves the sandbox")
                done, target = [], target[len(inside) :]
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
        raise PermissionError(f"path {path!r}: too many links")

    def agent_prefix(self) -> list[str]:
        """argv that runs a command as the agent: unprivileged, in bwrap, seeing /usr, /etc and its workdir."""
        if not self.isolated:
            if not self.spec.unsafe_host:  # built-in tools need no process: only commands need bubblewrap
                raise InfraFailure(
                    "the local backend needs bubblewrap to isolate commands (apt-get install -y bubblewrap); "
                    "set `sandbox.unsafe_host: true` to run them unisolated on this host"
                )
            return []
        limits = self.spec.resources
        self.files  # noqa: B018 (the workdir exists before a command enters it)
        assert self._holder is not None
        enter = ["nsenter", f"--target={self._holder.pid}", "--mount"]
        if self.as_root:
            prefix = [*enter, "--", "setpriv", f"--reuid={AGENT_UID}", f"--regid={AGENT_UID}", "--clear-groups", "--"]
        else:  # (in the holder's user namespace this process is root: bwrap maps the agent back to our uid)
            prefix = [*enter, "--user", "--preserve-credentials", "--"]
        memory = limits.memory_mb * 1024 * 1024
        # Every filesystem the agent writes but its workdir is memory: a tmpfs of half the host's RAM by default,
        # which RLIMIT_AS does not bound (one call with memory_mb 512 stored 3 GB). /tmp and /dev/shm get sizes
        # from memory_mb, the rest is read-only, and no user namespace can be made inside to mount another.
        prefix += [
            "bwrap", *([] if self.as_root else ["--uid", str(os.getuid()), "--gid", str(os.getgid())]),
            "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            *_minimal_system(), "--dev", "/dev", "--proc", "/proc",
            "--size", str(memory // 2), "--tmpfs", "/tmp", "--size", str(memory // 4), "--tmpfs", "/dev/shm",
        ]
        if Path(tempfile.gettempdir()).resolve() != Path("/tmp"):  # verifier directories live there: hide them
            prefix += ["--size", str(1 << 20), "--tmpfs", str(Path(tempfile.gettempdir()).resolve())]  # (the workdir's mount point)
        return prefix + [
            "--bind", str(self.root), str(self.root), "--remount-ro", "/dev", "--remount-ro", "/",
            "--chdir", str(self.root),
            "prlimit", f"--nproc={limits.pids}:{limits.pids}", f"--as={memory}:{memory}", "--",
        ]

    def _limits(self) -> None:
        """unsafe_host only (no bwrap, so no prlimit inside it): the memory cap on the command itself."""
        memory = self.spec.resources.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    async def _run(
        self, argv: list[str], cwd: Path, timeout_s: float, stdin: str | None, env: dict[str, str], limited: bool = False
    ) -> ExecResult:
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=cwd,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                preexec_fn=self._limits if limited else None,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **UTF8, **env},
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise InfraFailure(f"could not start a local sandbox process: {exc}") from exc
        if not self.isolated:
            self._groups.add(proc.pid)
        timed_out = False
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = await proc.communicate()
        except asyncio.CancelledError:  # the caller gave up (a worker stopping): nothing it started may outlive it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        code = 137 if timed_out else proc.returncode
        assert code is not None  # (communicate() waited for the process)
        return ExecResult(
            exit_code=code,
            stdout=out[:OUTPUT_LIMIT].decode(errors="replace"),
            stderr=err[:OUTPUT_LIMIT].decode(errors="replace"),
            seconds=time.monotonic() - start,
            timed_out=timed_out,
        )

    async def exec(self, command: str, timeout_s: float, stdin: str | None = None) -> ExecResult:
        argv = [*self.agent_prefix(), "/bin/sh", "-c", command]  # (isolated: the limits are in the prefix)
        return await self._run(argv, self.root, timeout_s, stdin, {"HOME": str(self.root)}, limited=not self.isolated)

    def model_url(self, endpoint: ModelEndpoint) -> str:
        return LOOPBACK_URL

    async def run_program(self, command: str, stdin: str, env: dict[str, str], endpoint: ModelEndpoint) -> ExecResult:
        """In bwrap's empty network namespace the endpoint's socket is bound in as one file (the agent can
        neither replace it nor reach any other socket) and a forwarder on the sandbox's own loopback gives the
        program a plain http://127.0.0.1:PORT, so that any HTTP client works unchanged."""
        if not self.isolated:
            raise InfraFailure("an agent program runs only in the local backend's isolated sandbox (bubblewrap, network off)")
        prefix = self.agent_prefix()
        at = prefix.index("--chdir")
        prefix[at:at] = ["--bind", endpoint.socket, PROGRAM_SOCKET]  # (a bind mount: not removable from inside)
        script = program_script(command, PROGRAM_SOCKET)
        return await self._run([*prefix, "/bin/sh", "-c", script], self.root, MAX_PROGRAM_S, stdin, {"HOME": str(self.root), **env})

    async def end_agent(self) -> None:
        # In bwrap every command has its own pid namespace, gone when the command ends. Unisolated
        # (unsafe_host), the commands' process groups are killed; a process that left its group escapes.
        for group in self._groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._groups.clear()

    async def collect_outputs(self, patterns: tuple[str, ...] | None) -> Outputs:
        await self.end_agent()
        listing = dict(_regular_files(self.files))
        chosen, left_out = choose_outputs(((path, size) for path, (size, _) in listing.items()), patterns)
        files, executable = {}, set()
        for path in chosen:
            try:
                with open(self.files / path, "rb", opener=_regular_only_nofollow) as f:
                    files[path] = f.read(env_spec.MAX_OUTPUT_BYTES + 1)[: listing[path][0]]
            except OSError as exc:
                left_out[path] = f"could not be read: {exc.strerror or exc}"
                continue
            if listing[path][1]:
                executable.add(path)
        return Outputs(files, frozenset(executable), left_out)

    async def put_outputs(self, outputs: Outputs) -> None:
        for path, data in outputs.files.items():
            await self.write_file(path, data)
            if path in outputs.executable:
                (self.files / path).chmod(0o755)

    async def run_verifier(self, files: dict[str, str], command: str, timeout_s: float) -> VerifierRun:
        await self.end_agent()
        prefix = self.agent_prefix()
        private = Path(tempfile.mkdtemp(prefix=f"{VERIFY_PREFIX}{os.getpid()}-"))  # mode 0700
        try:
            for path, text in files.items():
                target = (private / path).resolve()
                if not target.is_relative_to(private.resolve()):
                    raise InfraFailure(f"verifier file {path!r} leaves the verifier's directory")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
            # (none of the agent's limits: what the agent's processes use cannot starve the verifier)
            env = verifier_env(str(private), str(self.files), prefix)
            result = await self._run(["/bin/sh", "-c", command], private, timeout_s, None, env)
            await self.end_agent()
            verdict_file = Path(env["LOOPLINE_VERDICT_FILE"])
            verdict = verdict_file.read_text(errors="replace") if verdict_file.is_file() else None
            return VerifierRun(result, verdict)
        finally:
            shutil.rmtree(private, ignore_errors=True)

    async def write_file(self, path: str, content: str | bytes) -> None:
        target = self._resolve(path)
        missing = [p for p in [target.parent, *target.parent.parents] if p.is_relative_to(self.files) and not p.exists()]
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
        if self.as_root:  # the agent's own files, as if it had written them
            for written in [target, *missing]:
                os.chown(written, AGENT_UID, AGENT_UID)

    async def read_file(self, path: str) -> str:
        """A file the agent may have made: a regular file inside the workdir (not a link out of it, a FIFO that
        never ends, a device), its first READ_LIMIT bytes, invalid UTF-8 replaced; else FileNotFoundError."""
        target = self._resolve(path)
        try:
            with open(target, "rb", opener=_regular_only) as f:
                return f.read(READ_LIMIT).decode(errors="replace")
        except OSError as exc:
            raise FileNotFoundError(f"{path}: {exc.strerror or exc}") from None

    async def close(self) -> None:
        if self._holder is not None and self._holder.poll() is None:
            self._holder.kill()  # (its mount namespace, and the workdir's memory, go with it)
            self._holder.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _regular_files(root: Path):
    """(relative path, (size, executable)) of every regular file under `root`, links neither followed nor listed;
    a name that is not UTF-8 cannot be a pattern's, and is skipped."""
    for directory, dirnames, filenames in os.walk(root):  # (os.walk does not follow links to directories)
        for name in filenames:
            path = Path(directory) / name
            st = path.lstat()
            relative = str(path.relative_to(root))
            try:
                relative.encode()
            except UnicodeEncodeError:  # (a name that is not UTF-8 decodes to lone surrogates)
                continue
            if stat.S_ISREG(st.st_mode):
                yield relative, (st.st_size, bool(st.st_mode & 0o111))


def _regular_only_nofollow(path: str, flags: int) -> int:
    return _regular_only(path, flags | os.O_NOFOLLOW)


def _regular_only(path: str, flags: int) -> int:
    """open(2) that neither waits on a FIFO nor accepts anything but a regular file."""
    fd = os.open(path, flags | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EINVAL, "not a regular file")
    return fd


def agent_cannot_reach(directory: Path) -> str | None:
    """Why the agent's uid could not enter a workdir made under `directory` (None if it can): as root, bwrap
    binds the workdir as the agent's uid, which must be able to pass through every directory above it."""
    for step in [directory.resolve(), *directory.resolve().parents]:
        st = step.stat()
        bit = 0o100 if st.st_uid == AGENT_UID else 0o010 if st.st_gid == AGENT_UID else 0o001
        if not st.st_mode & bit:
            return (
                f"the local sandbox's workdirs go under {directory}, but its agent (uid {AGENT_UID}, as loopline runs as "
                f"root) cannot pass through {step} (mode {st.st_mode & 0o777:o}): set TMPDIR to a directory every user "
                "can enter (e.g. /tmp), or chmod o+x it"
            )
    return None


def _minimal_system() -> list[str]:
    """bwrap arguments for a read-only /usr and /etc, and the top-level directories that are links into /usr
    (merged /usr) or, on older layouts, directories of their own."""
    args = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def cleanup_orphans() -> list[str]:
    """Remove local sandbox directories whose owning process is gone."""
    removed = []
    for prefix in (PREFIX, VERIFY_PREFIX):
        for path in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
            pid = path.name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit() and not process_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
    return removed
