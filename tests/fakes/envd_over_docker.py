"""A local stand-in for E2B: its control plane and its in-sandbox daemon (envd), each sandbox a Docker container.

E2B's cloud is unreachable from here. The real `e2b` SDK is pointed at this process (E2B_API_URL and
E2B_SANDBOX_URL, which the SDK honours): `POST /v2/sandboxes` starts a container for the template and
`DELETE /sandboxes/ID` removes it, and envd's calls, routed by the `E2b-Sandbox-Id` header the SDK sends, are
carried out in that sandbox's container: the Connect RPCs `process.Process/Start` and
`filesystem.Filesystem/ListDir` (with the SDK's own server-side classes) and the `/files` HTTP API. So every
sandbox is a new one, as in E2B, and the E2B backend's real SDK code path runs against real processes; only
the cloud is missing.

What an E2B sandbox is, as observed and stood in here:
- a VM whose root is root: a writable root filesystem, setuid programs that work (no no-new-privileges), root's
  usual powers; its disk and memory bounded (here: tmpfs for the workdir and /tmp, a memory limit) and its
  process table too (a pids limit standing for the VM's);
- a template as E2B builds it (`provisioned_image`): after the template's own steps, E2B's finalize step gives
  `user` (home /home/user) sudo without a password, empties root's and user's passwords and makes
  /usr/local writable by all (its infra repository's `configure.sh` and `provision.sh`, reproduced step by
  step); loopline's recipe (`e2b_template.HARDEN`) then runs as root, as E2B runs a template's start command;
- envd serves files in its own process: reading, writing and listing start no process in the sandbox, so they
  work when the agent has used up its process table. Here they are done from the host through
  /proc/PID/root (the container's own mounts, tmpfs included), which needs root on the host.
- a kernel of its own per sandbox, whose process counts are its own: here a `user` of a uid no other sandbox has.
Not stood in: E2B's network allow list (a sandbox with any network is on Docker's bridge).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import secrets
import shlex
import stat
import uuid
from email.parser import BytesParser
from email.policy import default as email_policy
from pathlib import Path
from urllib.parse import parse_qs

import docker
from docker.errors import ImageNotFound, NotFound
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.filesystem.filesystem_connect import Filesystem, FilesystemASGIApplication
from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import Process, ProcessASGIApplication
from protobuf import Oneof

from loopline.envregistry.e2b_template import HARDEN
from tests.fakes.asgi import BackgroundServer, read_body

HOMES = {"root": "/root", "user": "/home/user"}
LABEL = "loopline.e2b-stand-in"

# E2B's template build, in the order it runs: provision.sh (`passwd -d root`), then the finalize step's
# configure.sh for the default user. sudo is installed as E2B's provisioning installs its required packages.
PROVISION = (
    "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends sudo >/dev/null "
    "&& rm -rf /var/lib/apt/lists/*\n"
    "RUN passwd -d root && (id -u user >/dev/null 2>&1 || useradd -m -s /bin/bash user) "
    "&& usermod -aG sudo user && passwd -d user && echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' >> /etc/sudoers "
    "&& mkdir -p /home/user && chown -R user:user /home/user && chmod -R 777 /usr/local && mkdir -p /code && chmod -R 777 /code\n"
)


def provisioned_image(base: str, harden: bool) -> str:
    """`base` built into an E2B template as E2B builds one; `harden`: with loopline's recipe on top. Built once
    (a local `docker build`; sudo from Debian's mirror)."""
    script = base64.b64encode(HARDEN.encode()).decode()  # (a Dockerfile line holds no newline)
    layers = f"FROM {base}\n{PROVISION}" + (f"RUN echo {script} | base64 -d | sh\n" if harden else "")
    tag = f"{base.replace(':', '-')}:e2b-{'hardened' if harden else 'provisioned'}-{hashlib.sha256(layers.encode()).hexdigest()[:12]}"
    client = docker.from_env()
    try:
        client.images.get(tag)
    except ImageNotFound:
        client.images.build(fileobj=io.BytesIO(layers.encode()), tag=tag, rm=True)
    return tag


def _cap_sys_resource() -> list[str]:
    """A VM's root may raise its children's OOM score for good (CAP_SYS_RESOURCE), where this host allows it."""
    from loopline.envregistry.sandbox.docker import CAP_SYS_RESOURCE, _bounded_by

    return ["SYS_RESOURCE"] if _bounded_by(CAP_SYS_RESOURCE) else []


class _Box:
    """One sandbox: its container and, for envd's file calls, its root as the host sees it."""

    def __init__(self, container):
        self.container = container
        container.reload()
        self.root = Path(f"/proc/{container.attrs['State']['Pid']}/root")
        passwd = (self.root / "etc/passwd").read_text().splitlines()
        self.uids = {"root": 0, "user": next(int(line.split(":")[2]) for line in passwd if line.startswith("user:"))}

    def resolve(self, path: str, follow_last: bool = True) -> Path:
        """`path` inside the sandbox, links resolved inside it (not against the host's root)."""
        parts = [p for p in path.split("/") if p not in ("", ".")]
        done: list[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                done = done[:-1]
                continue
            here = self.root.joinpath(*done, part)
            if (parts or follow_last) and here.is_symlink():
                hops += 1
                if hops > 40:
                    raise OSError("too many links")
                target = os.readlink(here)
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                if target.startswith("/"):
                    done = []
                continue
            done.append(part)
        return self.root.joinpath(*done)


def _may(uid: int, st: os.stat_result, bit: int) -> bool:
    """Whether `uid` has permission `bit` (4 read, 2 write) by the mode's owner or other bits (the stand-in's
    envd, run as root, answers as the user asked for would be answered)."""
    if uid == 0:
        return True
    return bool(st.st_mode & (bit << 6)) if st.st_uid == uid else bool(st.st_mode & bit)


class _Processes(Process):
    def __init__(self, stand_in: "E2BOverDocker"):
        self.stand_in = stand_in

    async def start(self, request, ctx):
        box = self.stand_in.box(ctx.request_headers)
        config = request.process
        user = _basic_auth_user(ctx.request_headers) or "user"
        cwd = config.cwd if config.has_field("cwd") and config.cwd else HOMES[user]
        command = f"cd {shlex.quote(cwd)} && exec {shlex.join([config.cmd, *config.args])}"
        yield _event("start", process_pb.ProcessEvent.StartEvent(pid=1))
        env = {"HOME": HOMES[user], **dict(config.envs)}  # (envd's HOME is the user's home; a call's envs override it)
        code, (out, err) = await asyncio.to_thread(box.container.exec_run, ["sh", "-c", command], demux=True, user=user, environment=env)
        for stream, data in (("stdout", out), ("stderr", err)):
            if data:
                yield _event("data", process_pb.ProcessEvent.DataEvent(output=Oneof(stream, data)))
        yield _event("end", process_pb.ProcessEvent.EndEvent(exit_code=code, exited=True, status=f"exit status {code}"))


class _Files(Filesystem):
    def __init__(self, stand_in: "E2BOverDocker"):
        self.stand_in = stand_in

    async def list_dir(self, request, ctx):
        box = self.stand_in.box(ctx.request_headers)
        top = box.resolve(request.path)
        entries = []

        def walk(directory: Path, inside: str, depth: int) -> None:
            for child in sorted(directory.iterdir()):
                st = child.lstat()
                link = stat.S_ISLNK(st.st_mode)
                kind = filesystem_pb.FileType.DIRECTORY if stat.S_ISDIR(st.st_mode) else filesystem_pb.FileType.FILE
                path = f"{inside.rstrip('/')}/{child.name}"
                entries.append(filesystem_pb.EntryInfo(
                    name=child.name, type=kind, path=path, size=st.st_size, mode=st.st_mode & 0o7777,
                    permissions=stat.filemode(st.st_mode), owner=str(st.st_uid), group=str(st.st_gid), is_symlink=link,
                ))
                if kind == filesystem_pb.FileType.DIRECTORY and not link and depth > 1:
                    walk(child, path, depth - 1)

        walk(top, request.path, request.depth or 1)
        return filesystem_pb.ListDirResponse(entries=entries)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class E2BOverDocker:
    """Serves E2B's control plane and envd on one port of 127.0.0.1 (a free one: test sessions may run side by
    side); `templates` maps a template id to its image."""

    def __init__(self, templates: dict[str, str]):
        self.port = _free_port()
        self.templates = dict(templates)
        self.boxes: dict[str, _Box] = {}
        self.requests: list[str] = []
        self.client = docker.from_env()

    def box(self, headers) -> _Box:
        sandbox_id = next((v for k, v in headers.items() if k.lower() == "e2b-sandbox-id"), None)
        return self.boxes[sandbox_id]

    def _create(self, body: dict) -> dict:
        template = body["templateID"]
        network = body.get("allow_internet_access") or (body.get("network") or {}).get("allowOut")
        container = self.client.containers.run(
            self.templates[template], ["sleep", "infinity"], detach=True, init=True, user="0:0",
            network_mode="bridge" if network else "none",
            tmpfs={"/workspace": "rw,exec,size=256m,mode=1777", "/tmp": "rw,exec,size=256m,mode=1777", "/dev/shm": "rw,size=128m,mode=1777"},
            mem_limit="1g", memswap_limit="1g", pids_limit=1024, cap_add=_cap_sys_resource(),
            labels={LABEL: "1", "loopline.owner_pid": str(os.getpid())},
        )
        # Each E2B sandbox is a VM with its own kernel, which counts a uid's processes (RLIMIT_NPROC) for that VM
        # alone; containers share the host's count, so each gets a `user` of a uid no other one has.
        uid = 100_000 + len(self.boxes) + secrets.randbelow(1 << 24)
        code, out = container.exec_run(["sh", "-c", f"usermod -u {uid} user && groupmod -g {uid} user"], user="0:0")
        assert code == 0, out
        sandbox_id = f"sb{uuid.uuid4().hex[:12]}"
        self.boxes[sandbox_id] = _Box(container)
        return {"templateID": template, "sandboxID": sandbox_id, "clientID": "local", "envdVersion": "0.5.7"}

    def _kill(self, sandbox_id: str) -> int:
        box = self.boxes.pop(sandbox_id, None)
        if box is None:
            return 404
        try:
            box.container.remove(force=True)
        except NotFound:
            pass
        return 204

    def __enter__(self) -> "E2BOverDocker":
        rpc = ProcessASGIApplication(_Processes(self))
        files_rpc = FilesystemASGIApplication(_Files(self))

        async def app(scope, receive, send):
            path = scope["path"]
            self.requests.append(path)
            if path == "/v2/sandboxes" and scope["method"] == "POST":
                created = await asyncio.to_thread(self._create, json.loads(await read_body(receive)))
                await _respond(send, 201, json.dumps(created).encode())
            elif path.startswith("/sandboxes/") and scope["method"] == "DELETE":
                await _respond(send, await asyncio.to_thread(self._kill, path.rsplit("/", 1)[1]), b"")
            elif path.startswith("/process.Process/"):
                await rpc(scope, receive, send)
            elif path.startswith("/filesystem.Filesystem/"):
                await files_rpc(scope, receive, send)
            elif path == "/files":
                await self._files(scope, receive, send)
            elif path == "/health":
                await _respond(send, 204, b"")
            else:
                await _respond(send, 404, b'{"message": "not implemented by the stand-in", "code": 404}')

        self.server = BackgroundServer(app, self.port)
        self.server.start(f"the E2B stand-in on port {self.port}")
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()
        for sandbox_id in list(self.boxes):
            self._kill(sandbox_id)

    def environment(self) -> dict[str, str]:
        """What points the SDK here."""
        url = f"http://127.0.0.1:{self.port}"
        return {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": "e2b_stand_in"}

    async def _files(self, scope, receive, send) -> None:
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        body = await read_body(receive)
        box = self.box({k.decode(): v.decode() for k, v in scope["headers"]})
        user = query.get("username") or "user"
        if scope["method"] == "GET":
            try:
                target = box.resolve(query["path"])
                st = target.stat()
                if not stat.S_ISREG(st.st_mode) or not _may(box.uids[user], st, 4):
                    raise PermissionError(query["path"])
                data = target.read_bytes()
            except FileNotFoundError:
                await _respond(send, 404, json.dumps({"message": f"{query['path']}: no such file", "code": 404}).encode())
                return
            except OSError as exc:
                await _respond(send, 403, json.dumps({"message": f"{query['path']}: {exc}", "code": 403}).encode())
                return
            await _respond(send, 200, data, "application/octet-stream")
            return
        content_type = dict(scope["headers"]).get(b"content-type", b"").decode()
        message = BytesParser(policy=email_policy).parsebytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
        written = []
        owner = box.uids[user]
        for part in message.iter_parts():
            path = query.get("path") or part.get_filename()
            target = box.resolve(path)
            made = [p for p in [target.parent, *target.parent.parents] if p.is_relative_to(box.root) and not p.exists()]
            target.parent.mkdir(parents=True, exist_ok=True)
            for directory in made:
                os.chown(directory, owner, owner)
            if not _may(owner, (target if target.exists() else target.parent).stat(), 2):
                await _respond(send, 403, json.dumps({"message": f"{path}: permission denied", "code": 403}).encode())
                return
            target.write_bytes(part.get_payload(decode=True))
            os.chown(target, owner, owner)
            written.append({"name": path.rsplit("/", 1)[-1], "type": "file", "path": path})
        await _respond(send, 200, json.dumps(written).encode(), "application/json")


def _basic_auth_user(headers) -> str | None:
    """The SDK sends `Authorization: Basic base64("NAME:")` to choose the user of a process call."""
    for key, value in headers.items():
        if key.lower() == "authorization" and value.startswith("Basic "):
            return base64.b64decode(value[6:]).decode().split(":", 1)[0]
    return None


def _event(field: str, value) -> process_pb.StartResponse:
    return process_pb.StartResponse(event=process_pb.ProcessEvent(event=Oneof(field, value)))


async def _respond(send, status: int, body: bytes, content_type: str = "application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type.encode())]})
    await send({"type": "http.response.body", "body": body})
