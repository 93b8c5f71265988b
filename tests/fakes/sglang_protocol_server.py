"""A protocol-faithful stand-in for an SGLang server (no SGLang can run here: it needs CUDA packages).

It validates every /generate request with SGLang's own schema classes
(`sglang.api.v1.api_types`, loaded from the installed wheel's file without
importing the heavy `sglang` package), encodes responses with them, and
reproduces the behaviours verified against a real server in
shared/notes/sglang.md: 400 on unknown sampling keys, abort as HTTP 200 with
the partial ids, per-token `weight_versions` spans, updates that wait for
in-flight requests unless paused, pause modes abort / retract / in_place
(in_place + flush_cache -> 400 without advancing the version), rid prefix
matching in /abort_request, and /model_info's weight_version. Tokens are
pseudo-random: the model is fake, the protocol is not.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path

from tests.fakes.asgi import BackgroundServer, read_body


def load_api_types():
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "api" / "v1" / "api_types.py"
    module_spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@dataclass(eq=False)
class _Running:
    rid: str
    aborted: bool = False
    versions: list[str] = field(default_factory=list)


class SGLangProtocolServer:
    def __init__(self, token_delay_s: float = 0.005, context_length: int = 512, vocab: int = 1000):
        self.api = load_api_types()
        if self.api is None:
            raise RuntimeError("sglang is not installed: pip install --no-deps sglang==0.5.23 msgspec")
        self.token_delay_s, self.context_length, self.vocab = token_delay_s, context_length, vocab
        self.weight_version = "default"
        self.model_path = "/models/initial"
        self.paused: str | None = None
        self.running: dict[str, _Running] = {}
        self.requests: list[dict] = []  # every validated /generate body, for assertions
        self._resumed: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "SGLangProtocolServer":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = BackgroundServer(self.app, self.port)
        self.server.start("SGLang protocol server")
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    # ------------------------------------------------------------------ ASGI

    async def app(self, scope, receive, send) -> None:
        if self._resumed is None:
            self._resumed, self._idle = asyncio.Event(), asyncio.Event()
            self._resumed.set()
            self._idle.set()
        body = await read_body(receive)
        route = (scope["method"], scope["path"])
        handlers = {
            ("POST", "/generate"): self.generate,
            ("POST", "/pause_generation"): self.pause,
            ("POST", "/continue_generation"): self.resume,
            ("POST", "/update_weights_from_disk"): self.update,
            ("POST", "/abort_request"): self.abort,
            ("GET", "/model_info"): self.model_info,
        }
        handler = handlers.get(route)
        if handler is None:
            status, payload = 404, {"error": {"message": f"no route {scope['path']}"}}
        else:
            status, payload = await handler(body)
        raw = b"" if payload is None else json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": raw})

    # ------------------------------------------------------------------ endpoints

    async def generate(self, body: bytes):
        try:
            value = json.loads(body)
            request = self.api.GenerateRequest.from_json_value(value)
        except (ValueError, self.api.JsonContractError) as exc:
            return 400, {"error": {"message": str(exc)}}
        if request.input_ids is None:
            return 400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
        self.requests.append(value)
        sampling = request.sampling_params or self.api.SamplingParams()
        ids = list(request.input_ids)
        if len(ids) + sampling.max_new_tokens > self.context_length:
            return 400, {"error": {"message": f"Requested token count exceeds the model's maximum context length of {self.context_length} tokens."}}
        rid = request.rid or f"auto-{len(self.requests)}"
        running = _Running(rid)
        self.running[rid] = running
        self._idle.clear()
        rng = random.Random(f"{ids}/{sampling.sampling_seed}")
        out, logprobs, finish = [], [], None
        try:
            for _ in range(sampling.max_new_tokens):
                await self._resumed.wait()
                if running.aborted:
                    break
                await asyncio.sleep(self.token_delay_s)
                if running.aborted:
                    break
                token = rng.randrange(self.vocab)
                out.append(token)
                logprobs.append(-3 * rng.random())
                running.versions.append(self.weight_version)
                if token in (sampling.stop_token_ids or ()):
                    finish = self.api.FinishStop(matched=token)
                    break
            else:
                finish = self.api.FinishLength(length=len(out))
        finally:
            del self.running[rid]
            if not self.running:
                self._idle.set()
        if running.aborted:
            finish = self.api.FinishAbort(message="Aborted", status_code=200, err_type=None)
        spans = []
        for i, version in enumerate(running.versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": version, "start": i, "end": i + 1})
        meta = self.api.GenerateMetaInfo(
            id=rid,
            prompt_tokens=len(ids),
            completion_tokens=len(out),
            finish_reason=finish,
            output_token_logprobs=[self.api.LogprobEntry(logprob=lp, token_id=t, text=None) for lp, t in zip(logprobs, out)] if request.return_logprob else None,
            weight_version=self.weight_version,
            weight_versions=[self.api.WeightVersionSpan(**s) for s in spans] if len(spans) > 1 else [],
        )
        payload = self.api.GenerateResponse(text="", meta_info=meta, output_ids=out).to_json_value()
        return 200, payload

    async def pause(self, body: bytes):
        if not body:
            return 400, {"error": {"message": "missing request body"}}
        mode = json.loads(body).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return 400, {"error": {"message": f"unknown mode {mode!r}"}}
        self.paused = mode
        self._resumed.clear()
        if mode == "abort":
            for running in self.running.values():
                running.aborted = True
            self._resumed.set()  # let aborted requests return; new ones wait in `update` below
            self._resumed = asyncio.Event()
        return 200, {"success": True}

    async def resume(self, body: bytes):
        self.paused = None
        self._resumed.set()
        return 200, {"success": True}

    async def update(self, body: bytes):
        value = json.loads(body)
        path = value.get("model_path", "")
        if not os.path.isdir(path):
            return 400, {"success": False, "message": f"Failed to get weights iterator: {path} is not a directory", "num_paused_requests": 0}
        if self.paused is None:
            await self._idle.wait()  # not paused: the update waits for in-flight requests to finish
        self.model_path = path
        if self.paused == "in_place" and value.get("flush_cache", True):
            return 400, {"success": False, "message": "Failed to flush cache: the cache was not flushed because requests are in flight", "num_paused_requests": len(self.running)}
        self.weight_version = value.get("weight_version") or self.weight_version
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": len(self.running)}

    async def abort(self, body: bytes):
        request = self.api.AbortRequest.from_json_value(json.loads(body))
        for rid, running in self.running.items():
            if request.abort_all or rid.startswith(request.rid):  # SGLang matches by prefix
                running.aborted = True
        return 200, None

    async def model_info(self, body: bytes):
        info = self.api.GetModelInfoResponse(model_path=self.model_path, is_generation=True, weight_version=self.weight_version)
        return 200, info.to_json_value()
