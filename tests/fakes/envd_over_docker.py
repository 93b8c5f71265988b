"""A local stand-in for E2B's in-sandbox daemon (envd), backed by a real Docker container.

E2B's cloud is unreachable from here. With `E2B_DEBUG=true` the real `e2b`
SDK skips the cloud API and talks straight to envd on localhost:49983; this
module serves the part of envd's protocol the SDK uses — the Connect RPC
`process.Process/Start` (with the SDK's own server-side classes) and the
`/files` HTTP API — and carries every call out in a Docker container. So the
E2B backend's real SDK code path runs against a real sandbox; only the cloud
control plane is missing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import shlex
from email.parser import BytesParser
from email.policy import default as email_policy
from urllib.parse import parse_qs

from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import Process, ProcessASGIApplication
from protobuf import Oneof

from loopline.envregistry.sandbox.docker import DockerSandbox
from loopline.envregistry.spec import Sandbox
from tests.fakes.asgi import BackgroundServer, read_body

ENVD_PORT = 49983  # e2b.ConnectionConfig.envd_port: where the SDK looks for envd in debug mode


# envd runs each call as the user the SDK names (`user`, E2B's unprivileged default, or `root`), with that
# user's HOME: `docker exec --user NAME` does the same from the container's /etc/passwd. The sandbox image
# gets E2B's `user` (uid 1000, home /home/user) in a layer of the stand-in's (`e2b_like`). Its home is writable
# and is the sandbox's working directory, as in E2B (/home/user is both): here a link to the container's
# writable /workspace (its root is read-only).
USERS = {"root": "root", "user": "user"}
HOMES = {"root": "/root", "user": "/home/user"}
_E2B_USER = "RUN echo 'user:x:1000:1000::/home/user:/bin/bash' >> /etc/passwd && mkdir -p /home && ln -s /workspace /home/user\n"


def _user(name: str | None) -> str:
    return USERS[name or "user"]


def e2b_like(image: str) -> str:
    """`image` with E2B's default user, built once (a local `docker build` FROM the local image: no registry)."""
    import io

    import docker
    from docker.errors import ImageNotFound

    layer = f"FROM {image}\n{_E2B_USER}"
    tag = f"{image.replace(':', '-')}:e2b-{hashlib.sha256(layer.encode()).hexdigest()[:12]}"
    client = docker.from_env()
    try:
        client.images.get(tag)
    except ImageNotFound:
        client.images.build(fileobj=io.BytesIO(layer.encode()), tag=tag, rm=True)
    return tag


def _basic_auth_user(headers) -> str | None:
    """The SDK sends `Authorization: Basic base64("NAME:")` to choose the user of a process call."""
    for key, value in headers.items():
        if key.lower() == "authorization" and value.startswith("Basic "):
            return base64.b64decode(value[6:]).decode().split(":", 1)[0]
    return None


class _DockerProcess(Process):
    def __init__(self, box: DockerSandbox):
        self.box = box

    async def start(self, request, ctx):
        config = request.process
        argv = [config.cmd, *config.args]
        cwd = config.cwd if config.has_field("cwd") and config.cwd else self.box.spec.workdir
        command = f"cd {shlex.quote(cwd)} && exec {shlex.join(argv)}"
        user = _user(_basic_auth_user(ctx.request_headers))
        yield _event("start", process_pb.ProcessEvent.StartEvent(pid=1))
        env = {"HOME": HOMES[user], **dict(config.envs)}  # (envd's HOME is the user's home; a call's envs override it)
        result = await asyncio.to_thread(self.box._exec, command, 3600, None, user, None, env)
        for stream in ("stdout", "stderr"):
            text = getattr(result, stream)
            if text:
                yield _event("data", process_pb.ProcessEvent.DataEvent(output=Oneof(stream, text.encode())))
        end = process_pb.ProcessEvent.EndEvent(
            exit_code=result.exit_code, exited=True, status=f"exit status {result.exit_code}"
        )
        yield _event("end", end)


def _event(field: str, value) -> process_pb.StartResponse:
    return process_pb.StartResponse(event=process_pb.ProcessEvent(event=Oneof(field, value)))


class EnvdOverDocker:
    """Serves envd on 127.0.0.1:49983 for one Docker container (debug-mode sandboxes all share it)."""

    def __init__(self, image: str):
        self.image = image
        self.requests: list[str] = []

    def _new_container(self, image: str | None = None, network: bool = False) -> DockerSandbox:
        spec = Sandbox(backend="docker", image=e2b_like(image or self.image), network=network)
        return asyncio.run(DockerSandbox.create(spec, {"loopline.purpose": "envd-shim"}))

    def reset(self, image: str | None = None, network: bool = False) -> None:
        """A fresh container: debug-mode sandboxes are never created or killed through the API, so they share one.
        `network`: on Docker's bridge, where an agent program reaches loopline's endpoint by its public URL (the
        allow list E2B's cloud would apply to it is not stood in)."""
        old, self.box = self.box, self._new_container(image, network)
        self.process.box = self.box
        asyncio.run(old.close())

    def __enter__(self) -> "EnvdOverDocker":
        self.box = self._new_container()
        self.process = _DockerProcess(self.box)
        rpc = ProcessASGIApplication(self.process)

        async def app(scope, receive, send):
            self.requests.append(scope["path"])
            if scope["path"].startswith("/process.Process/"):
                await rpc(scope, receive, send)
            elif scope["path"] == "/files":
                await self._files(scope, receive, send)
            elif scope["path"] == "/health":
                await _respond(send, 204, b"")
            else:
                await _respond(send, 404, b"not implemented by the local envd")

        self.server = BackgroundServer(app, ENVD_PORT)
        try:
            self.server.start(f"local envd on port {ENVD_PORT}")
        except BaseException:  # (the port taken, e.g. by another test session: its container must not outlive it)
            asyncio.run(self.box.close())
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()
        asyncio.run(self.box.close())

    async def _files(self, scope, receive, send) -> None:
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        body = await read_body(receive)
        user = _user(query.get("username"))
        if scope["method"] == "GET":
            result = await asyncio.to_thread(self.box._exec, f"base64 {shlex.quote(query['path'])}", 30, None, user)
            if not result.ok:
                await _respond(send, 404, json.dumps({"message": result.stderr.strip(), "code": 404}).encode())
                return
            await _respond(send, 200, base64.b64decode(result.stdout), "application/octet-stream")
            return
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type", b"").decode()
        message = BytesParser(policy=email_policy).parsebytes(
            f"Content-Type: {content_type}\r\n\r\n".encode() + body
        )
        written = []
        for part in message.iter_parts():
            path = query.get("path") or part.get_filename()
            await self.box.write_file(path, part.get_payload(decode=True).decode(), user=user)
            written.append({"name": path.rsplit("/", 1)[-1], "type": "file", "path": path})
        await _respond(send, 200, json.dumps(written).encode(), "application/json")


async def _respond(send, status: int, body: bytes, content_type: str = "application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type.encode())]})
    await send({"type": "http.response.body", "body": body})
