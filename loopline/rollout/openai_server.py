"""The HTTP side of `openai_api`: `/v1/chat/completions`, `/v1/completions` and `/v1/models` for every open episode, served by
uvicorn on a thread of its own (the engine is an `EngineThread`, callable from any loop).

An episode is addressed by its key: in the path (`/episodes/KEY/v1`, what `base_url(key)` gives: an agent
needs only OPENAI_BASE_URL) or as the API key on `/v1` (`Authorization: Bearer KEY`). An unknown key is
401, as OpenAI answers a bad API key; an error of the request or a spent budget is 400 in OpenAI's shape,
so that the SDK raises it in the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import threading
import time
from typing import Any

from loopline.rollout.engine import EngineError
from loopline.rollout.openai_api import AgentEpisode, RequestError, chat_chunks, text_chunks


def _error(message: str, kind: str, status: int):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": kind}}, status_code=status)


class OpenAIServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, unix_path: str | None = None):
        """`unix_path`: also listen there (what an agent program's sandbox is given: it has no network)."""
        self.host = host
        self.episodes: dict[str, AgentEpisode] = {}
        # (proto named: asyncio turns Nagle's algorithm off only on sockets whose proto is IPPROTO_TCP, and
        # socket.create_server's is 0: every response then waited ~40 ms for a delayed ACK; measured)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._socket.listen(128)
        self.port = self._socket.getsockname()[1]
        self.unix_path = unix_path
        self._sockets = [self._socket]
        if unix_path is not None:
            unix = socket.socket(socket.AF_UNIX)
            unix.bind(unix_path)
            os.chmod(unix_path, 0o777)  # (an agent runs as another uid when loopline runs as root)
            unix.listen(128)
            self._sockets.append(unix)
        self._server: Any = None  # a uvicorn.Server once started
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, key: str) -> str:
        return f"{self.url}/episodes/{key}/v1"

    def open(self, episode: AgentEpisode) -> str:
        """Serve `episode` under a new key (unguessable: another episode's agent cannot write into it)."""
        key = f"ep-{secrets.token_urlsafe(18)}"
        self.episodes[key] = episode
        return key

    def close(self, key: str) -> AgentEpisode | None:
        return self.episodes.pop(key, None)

    # ------------------------------------------------------------------ app

    def _episode(self, request) -> AgentEpisode | None:
        key = request.path_params.get("key")
        if key is None:
            auth = request.headers.get("authorization", "")
            key = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        return self.episodes.get(key) if key else None

    async def _chat(self, request):
        return await self._serve(request, lambda episode: episode.complete, chat_chunks)

    async def _text(self, request):
        return await self._serve(request, lambda episode: episode.complete_text, text_chunks)

    async def _serve(self, request, method, chunks):
        from starlette.responses import JSONResponse, StreamingResponse

        episode = self._episode(request)
        if episode is None:
            return _error("unknown or ended episode: use the base URL or API key loopline gave this episode", "invalid_api_key", 401)
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error("the request body is not JSON", "invalid_request_error", 400)
        if not isinstance(body, dict):
            return _error("the request body must be a JSON object", "invalid_request_error", 400)
        try:
            response = await method(episode)(body)
        except RequestError as exc:
            return _error(str(exc), exc.code, exc.status)
        except EngineError as exc:  # the engine failed: the agent sees a server error, the episode is retried as infra
            episode.exhausted = episode.exhausted or "engine"
            episode.engine_error = str(exc)
            return _error(f"the model server failed: {exc}", "server_error", 503)
        if not body.get("stream"):
            return JSONResponse(response)

        async def events():
            for chunk in chunks(response):
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _models(self, request):
        from starlette.responses import JSONResponse

        episode = self._episode(request)
        if episode is None:
            return _error("unknown or ended episode: use the base URL or API key loopline gave this episode", "invalid_api_key", 401)
        return JSONResponse({"object": "list", "data": [{"id": episode.model_name, "object": "model", "created": 0, "owned_by": "loopline"}]})

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[
            Route("/episodes/{key}/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/episodes/{key}/v1/completions", self._text, methods=["POST"]),
            Route("/v1/completions", self._text, methods=["POST"]),
            Route("/episodes/{key}/v1/models", self._models, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ])

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "OpenAIServer":
        import uvicorn

        # (log_config None: uvicorn's own dictConfig would install handlers on the process's logging, bound
        # to the stream of the moment; its records go where the process sends warnings)
        config = uvicorn.Config(self.app(), log_level="warning", log_config=None, lifespan="off", access_log=False)
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=self._sockets)), name="loopline-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI-compatible endpoint did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        for sock in self._sockets:
            sock.close()
        if self.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
