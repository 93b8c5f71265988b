"""The HTTP side of `openai_api`: `/v1/chat/completions`, `/v1/completions`, `/v1/responses` (`openai_responses`) and `/v1/models` for every open episode, served by
uvicorn on a thread of its own (the engine is an `EngineThread`, callable from any loop).

An episode is addressed by its key: in the path (`/episodes/KEY/v1`, what `base_url(key)` gives: an agent
needs only OPENAI_BASE_URL) or as the API key on `/v1` (`Authorization: Bearer KEY`). An unknown key is
401, as OpenAI answers a bad API key; an error of the request or a spent budget is 400 in OpenAI's shape,
so that the SDK raises it in the agent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
from typing import Any, Callable

from loopline.rollout.engines.base import EngineClosed, EngineError
from loopline.store.nul import unicode
from loopline.rollout.endpoint.api import LARGE_REQUEST_BYTES, AgentEpisode, RequestError, chat_chunks, hand_back_memory, text_chunks
from loopline.rollout.endpoint import responses as openai_responses
from loopline.rollout.endpoint.threaded_server import serve_on_thread


MAX_BODY_BYTES = 16 << 20  # a request's body (a long agent conversation is ~1 MB of JSON)
MAX_REQUESTS_PER_EPISODE = 16  # open at once; past it the episode ends (its own failure, not the others')
MAX_CONNECTIONS = 1024  # open at once, over all episodes (each holds a file descriptor of this process)
IDLE_S = 30.0  # a connection that sends nothing for this long after a response is closed
HEADERS_S = 10.0  # a request's headers must be complete this long after its connection opened or its first byte came
_log = logging.getLogger(__name__)


def _error(message: str, kind: str, status: int):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": kind}}, status_code=status)


def _parsed(raw: bytes) -> dict:
    try:
        body = _valid_unicode(json.loads(raw))
    except (ValueError, UnicodeDecodeError):
        raise RequestError("the request body is not JSON") from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def _body(request) -> bytes:
    """The request's body, refused past MAX_BODY_BYTES before more of it is read (an agent streamed 1 GB)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(f"the request body is {int(declared):,} bytes; at most {MAX_BODY_BYTES:,}", "request_too_large", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(f"the request body is over {MAX_BODY_BYTES:,} bytes", "request_too_large", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _data(chunks: list[dict]) -> list[str]:
    """Chunks as the chat and completions streams frame them: each a `data:` line, then `[DONE]`."""
    return [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]


def _valid_unicode(value: Any) -> Any:
    """A JSON value with each lone surrogate (a "\\ud800" escape: no character, no UTF-8, no token) replaced by
    U+FFFD, as a UTF-8 pipeline would; the tokenizer cannot take it."""
    if isinstance(value, str):
        return unicode(value)
    if isinstance(value, list):
        return [_valid_unicode(v) for v in value]
    if isinstance(value, dict):
        return {unicode(k): _valid_unicode(v) for k, v in value.items()}
    return value


def _protocol():
    """uvicorn's HTTP/1.1 protocol, bounded so that no agent can keep another's connections out:
    - a request's headers must be complete within HEADERS_S of its connection opening (or, on a kept-alive
      connection, of its first byte), however slowly they trickle: 1,040 requests sending a header byte every
      5 s held every connection for as long as they liked (uvicorn's idle timer restarts at each byte);
    - at most MAX_CONNECTIONS open: a new one evicts the connection that has waited longest without a request
      in flight (half-sent headers, or idle after a response); only if every one has a request in flight is the
      new one closed (said once in the log). An episode's requests in flight are bounded (MAX_REQUESTS_PER_EPISODE).
    - a connection idle IDLE_S after a response is closed (uvicorn's keep-alive)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Bounded(H11Protocol):
        refused = False

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._headers_timer = None
            self._waiting_since = self.loop.time()
            if len(self.connections) > MAX_CONNECTIONS and not self._evict_one():
                if not Bounded.refused:
                    _log.warning("the agent endpoint has %d connections open, each with a request in flight: closing new ones", MAX_CONNECTIONS)
                    Bounded.refused = True
                transport.close()
                return
            Bounded.refused = False
            self._expect_headers()

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _evict_one(self) -> bool:
            waiting = [c for c in self.connections if c is not self and getattr(c, "_waiting_since", None) is not None
                       and c._between_requests() and not c.transport.is_closing()]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c._waiting_since)
            oldest.transport.close()
            return True

        def _expect_headers(self) -> None:
            """From now, a request's headers have HEADERS_S to arrive whole."""
            if self._headers_timer is None:
                self._headers_timer = self.loop.call_later(HEADERS_S, self._headers_late, self.cycle)

        def _headers_late(self, cycle) -> None:
            self._headers_timer = None
            if self.cycle is cycle and self._between_requests() and not self.transport.is_closing():
                self.transport.close()  # (no new request began since the clock started)

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._expect_headers()
            super().data_received(data)
            if not self._between_requests() and self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None
                self._waiting_since = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._waiting_since = self.loop.time()

        def connection_lost(self, exc) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
            super().connection_lost(exc)

    return Bounded


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
        self._stop: Callable[[], None] | None = None  # once started

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
        return await self._serve(request, lambda episode: episode.complete, lambda r: _data(chat_chunks(r)))

    async def _text(self, request):
        return await self._serve(request, lambda episode: episode.complete_text, lambda r: _data(text_chunks(r)))

    async def _responses(self, request):
        def respond(episode: AgentEpisode):
            async def serve(body: dict) -> dict:
                asked = await episode.offload(openai_responses.chat_request, body)
                return openai_responses.response(await episode.complete(asked), body)
            return serve

        return await self._serve(request, respond, lambda r: openai_responses.sse(openai_responses.events(r)))

    async def _serve(self, request, method, frames):
        episode = self._episode(request)
        if episode is None:
            return _error("unknown or ended episode: use the base URL or API key loopline gave this episode", "invalid_api_key", 401)
        if episode.requests_open >= MAX_REQUESTS_PER_EPISODE:  # (its calls are served one at a time anyway)
            if episode.exhausted != "requests":
                _log.warning("episode %s had %d requests open at once: its episode ends", episode.request_id, MAX_REQUESTS_PER_EPISODE)
            episode.exhausted = episode.exhausted or "requests"
            return _error(f"more than {MAX_REQUESTS_PER_EPISODE} requests open at once: the episode ends", "rate_limit_exceeded", 429)
        episode.requests_open += 1
        try:
            return await self._answer(request, episode, method, frames)
        finally:
            episode.requests_open -= 1

    async def _answer(self, request, episode: AgentEpisode, method, frames):
        from starlette.responses import JSONResponse, StreamingResponse

        raw = b""
        try:
            raw = await _body(request)
            body = await episode.offload(_parsed, raw)
            response = await method(episode)(body)
        except RequestError as exc:
            episode.refuse(exc)
            return _error(str(exc), exc.code, exc.status)
        except EngineError as exc:  # the engine failed: the agent sees a server error, the episode is retried as infra
            episode.exhausted = episode.exhausted or "engine"
            episode.engine_error = str(exc)
            episode.engine_closed = isinstance(exc, EngineClosed)
            return _error(f"the model server failed: {exc}", "server_error", 503)
        finally:
            if len(raw) > LARGE_REQUEST_BYTES:  # (what its rendering and tokenising took is free by now)
                with contextlib.suppress(EngineClosed):  # (the process is exiting: the system takes it all back)
                    await episode.offload(hand_back_memory)
        if not body.get("stream"):
            return JSONResponse(response)

        async def events():
            for frame in frames(response):
                yield frame

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
            Route("/episodes/{key}/v1/responses", self._responses, methods=["POST"]),
            Route("/v1/responses", self._responses, methods=["POST"]),
            Route("/episodes/{key}/v1/models", self._models, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/{path:path}", self._not_served, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        ])

    async def _not_served(self, request):
        """Any other path, in OpenAI's error shape naming what is served (a bare 404 told its user nothing)."""
        episode = self._episode(request)
        asked = "/v1/" + request.url.path.split("/v1/", 1)[1] if "/v1/" in request.url.path else request.url.path
        error = RequestError(f"{request.method} {asked} is not served; loopline serves /v1/chat/completions, /v1/completions, /v1/responses and /v1/models", "not_found", 404)
        if episode is not None:
            episode.refuse(error)
        return _error(str(error), error.code, error.status)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "OpenAIServer":
        self._stop = serve_on_thread(
            self.app(), self._sockets, "loopline-openai", f"the OpenAI-compatible endpoint on {self.url}",
            http=_protocol(), timeout_keep_alive=int(IDLE_S),
        )
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None
        for sock in self._sockets:
            sock.close()
        if self.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
