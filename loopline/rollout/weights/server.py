"""The trainer's weight server: what `trainer://` URIs are fetched from (`weight_store.py`).

The trainer starts it with the run and records its address and a fresh token in the ledger; a rollout worker
(or a host beside an SGLang server) on a machine that does not share the trainer's disk reads both there. It
hands out only the directories the run published (nothing else on the trainer's disk), only to holders of the
token, streamed, with HTTP ranges so a cut download resumes where it stopped.

  GET /manifest?path=DIR              the directory's manifest (what its digest is the sha256 of)
  GET /file?path=DIR&name=FILE        one file of it (Range honoured)
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import socket
from pathlib import Path
from typing import Callable, Iterable

from loopline.rollout.endpoint.threaded_server import serve_on_thread
from loopline.rollout.weights.store import manifest

log = logging.getLogger(__name__)


def address_toward(host: str) -> str:
    """This machine's address on the route to `host` (the ledger's host: whoever reaches the ledger from the
    same network reaches this address too). No packet is sent: a UDP socket's connect only picks the route."""
    try:
        target = socket.gethostbyname(host)
    except OSError:
        return socket.getfqdn()
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.getfqdn()


class WeightServer:
    """Serves the directories `allow` was told of, over HTTP on `host:port` (0: any free port)."""

    def __init__(self, host: str, port: int = 0, published: Callable[[], Iterable[Path]] | None = None):
        self.host = host
        self.token = secrets.token_urlsafe(32)
        self._published = published  # the run's directories the ledger names (read again on a miss: a restart)
        self._allowed: set[Path] = set()
        self._manifests: dict[Path, bytes] = {}
        bind = "127.0.0.1" if host.startswith("127.") or host == "localhost" else "0.0.0.0"
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((bind, port))
        self.port = self._socket.getsockname()[1]
        self._stop: Callable[[], None] | None = None  # once started

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def allow(self, directory: Path) -> None:
        self._allowed.add(Path(directory).resolve())

    def _directory(self, path: str | None) -> Path | None:
        if not path:
            return None
        directory = Path(path)
        if directory not in self._allowed and self._published is not None:
            try:
                self._allowed.update(Path(p).resolve() for p in self._published())
            except Exception as exc:  # (the ledger out of reach: the client tries again)
                log.warning("weight server: could not read the run's published directories: %s", exc)
        return directory if directory in self._allowed and directory.is_dir() else None

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import FileResponse, PlainTextResponse, Response
        from starlette.routing import Route

        async def listing(directory: Path) -> bytes:
            if directory not in self._manifests:  # (hashing a model's files: off the event loop)
                self._manifests[directory] = await asyncio.to_thread(manifest, directory)
            return self._manifests[directory]

        def authorized(request) -> bool:
            given = request.headers.get("authorization", "")
            return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

        async def manifest_of(request):
            if not authorized(request):
                return PlainTextResponse("a bearer token (the ledger's, for this run) is required", 401)
            directory = self._directory(request.query_params.get("path"))
            if directory is None:
                return PlainTextResponse(f"{request.query_params.get('path')} is not a directory this run published here", 404)
            return Response(await listing(directory), media_type="application/json")

        async def file_of(request):
            if not authorized(request):
                return PlainTextResponse("a bearer token (the ledger's, for this run) is required", 401)
            directory = self._directory(request.query_params.get("path"))
            name = request.query_params.get("name", "")
            if directory is None or name not in {item["name"] for item in json.loads(await listing(directory))["files"]}:  # (by name: no path outside the published directory)
                return PlainTextResponse(f"{name} is not a file of a directory this run published here", 404)
            return FileResponse(directory / name, media_type="application/octet-stream")

        return Starlette(routes=[Route("/manifest", manifest_of), Route("/file", file_of)])

    def start(self) -> "WeightServer":
        self._socket.listen(128)
        self._stop = serve_on_thread(self.app(), [self._socket], "loopline-weights", f"the weight server on {self.url}")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None
        self._socket.close()
