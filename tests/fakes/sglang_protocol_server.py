"""A stand-in for an SGLang server: SGLang's HTTP API, with pseudo-random tokens or a real model.

A real SGLang server runs on this CPU only as a slow manual check (docs/sglang-cpu/README.md), so the
tests use this. It validates every /generate request with SGLang's own schema classes
(`sglang.api.v1.api_types`, loaded from the installed wheel's file without importing the heavy
`sglang` package), encodes responses with them, and reproduces what a real SGLang 0.5.23 server was
observed to do (docs/sglang-cpu/README.md): 400 on unknown sampling keys; abort as HTTP 200
with the partial ids; `weight_versions` spans in every response (one span when the weights did not
change); updates that wait for in-flight requests unless paused; pause modes abort / retract /
in_place (in_place + flush_cache -> 400 without advancing the version); `/abort_request` matching
the exact rid; a missing weights directory answered 400 "Failed to get weights iterator ... Name or
service not known" (it is tried as a hub id); `/model_info`'s weight_version ("default" until the
first update); a `stop` string ends a generation whose `output_ids` (and logprobs) run through the token that
completes it, with finish_reason {type: stop, matched: THE STRING} (checked on 2026-12-02: 9 ids where the stop
"\n\nT" was completed by the 9th; the real server trims only its `text`, which this stand-in leaves empty). LoRA (`--enable-lora`), as observed on a real server on 2026-12-02: `/load_lora_adapter`
{lora_name, lora_path} answers `loaded_adapters`; a name loaded once cannot be loaded again (400 "already
loaded"), even after `/unload_lora_adapter`, and a request naming an unloaded adapter is still served by
it; a missing path is 400 "Repo id must be in the form ..." (tried as a hub id); a request naming an
adapter never loaded is 400; unloading an unknown name is 400; `GET /v1/models` lists the base model and
each loaded adapter (with `parent`: the base's path); `weight_version` stays the base's; without
`--enable-lora` a load and a request naming an adapter are 400 ("LoRA is not enabled").

With `model_path` (the subprocess form, `python -m tests.fakes.sglang_protocol_server --model-path
DIR --port N`, which is what loopline's `engine: {kind: sglang, launch: ...}` can start too) tokens
come from that transformers model, sampled as SGLang does (logprobs = log_softmax(logits / T) over
the full vocabulary; greedy below T = 1e-6), and also: `sampling_seed` is ignored unless the server
runs with --enable-deterministic-inference; a retracted request is recomputed on the new weights;
and an update from a corrupt or wrong-shape weights file kills the server process, as the real
updater does (it points the model path at the bad directory before loading, so its rollback fails).
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


class RandomTokens:
    """Pseudo-random tokens (a fake model): fast, for protocol tests."""

    def __init__(self, vocab: int = 1000):
        self.vocab = vocab
        self.eos_ids: frozenset[int] = frozenset()

    def start(self, ids: list[int], sampling, seed: int | None):
        return random.Random(f"{ids}/{seed}")

    def next(self, rng, generated: list[int]) -> tuple[int, float]:
        return rng.randrange(self.vocab), -3 * rng.random()

    def decode(self, ids: list[int]) -> str:
        return ""  # (no text: a stop string never matches)

    def load(self, path: str) -> None:
        pass

    def adapted(self, base_path: str, adapter_path: str) -> object:
        return None


@dataclass(eq=False)
class _Sequence:
    ids: list[int]
    sampling: object
    generator: object
    model: object = None  # the adapted model the request named (lora_path), else the base
    kv: object = None
    kv_weights: int = -1  # which load of the weights the cache was computed with
    logits: object = None


class ModelTokens:
    """A transformers model sampled token by token, one KV cache per request (recomputed when the weights change)."""

    def __init__(self, path: str):
        self.path, self.tokenizer = path, None
        self.load(path)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` (the first weights' tokenizer: updates keep the vocabulary), loaded on first use."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        return self.tokenizer.decode(ids)

    def load(self, path: str) -> None:
        from loopline.rollout.engines.local import load_model

        self.model = load_model(path)
        self.loads = getattr(self, "loads", -1) + 1
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

    def adapted(self, base_path: str, adapter_path: str):
        """The base with a peft adapter merged in (the real server applies it unmerged: it matched the merged
        model's logprobs to 1.2e-7)."""
        import peft

        from loopline.rollout.engines.local import load_model

        return peft.PeftModel.from_pretrained(load_model(base_path), adapter_path).merge_and_unload().eval()

    def start(self, ids: list[int], sampling, seed: int | None, model=None) -> _Sequence:
        import torch

        generator = torch.Generator().manual_seed(seed if seed is not None else random.getrandbits(63))
        return _Sequence(list(ids), sampling, generator, model=model)

    def next(self, seq: _Sequence, generated: list[int]) -> tuple[int, float]:
        import torch

        from loopline.rollout.engines.base import SamplingParams
        from loopline.rollout.engines.local import sample_token

        model = seq.model or self.model
        with torch.inference_mode():
            if seq.kv_weights != self.loads:  # new request, or retracted onto new weights: recompute the prefix
                out = model(torch.tensor([seq.ids + generated]), use_cache=True)
                seq.kv_weights = self.loads
            else:
                out = model(torch.tensor([generated[-1:]]), cache=seq.kv, use_cache=True)
            seq.kv, logits = out.cache, out.logits[0, -1]
        s = seq.sampling
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k and s.top_k > 0 else 0)
        token, logprob, _ = sample_token(logits, params, seq.generator)
        return token, logprob


class SGLangProtocolServer:
    def __init__(
        self, token_delay_s: float = 0.005, context_length: int = 512, vocab: int = 1000, model_path: str | None = None,
        deterministic: bool = False, die_on_bad_weights: bool = False, enable_lora: bool = False,
    ):
        self.api = load_api_types()
        if self.api is None:
            raise RuntimeError("sglang is not installed: pip install --no-deps sglang==0.5.23 msgspec")
        self.tokens = ModelTokens(model_path) if model_path else RandomTokens(vocab)
        if model_path:
            context_length = int(getattr(self.tokens.model.config, "max_position_embeddings", context_length))
        self.token_delay_s, self.context_length = token_delay_s, context_length
        self.deterministic, self.die_on_bad_weights = deterministic, die_on_bad_weights
        self.weight_version = "default"
        self.model_path = model_path or "/models/initial"
        self.base_path = self.model_path  # what adapters apply to
        self.paused: str | None = None
        self.running: dict[str, _Running] = {}
        self.requests: list[dict] = []  # every validated /generate body, for assertions
        self.enable_lora = enable_lora
        self.adapters: dict[str, str] = {}  # loaded: name -> path
        self.adapter_models: dict[str, object] = {}  # every name ever loaded (unloading does not free the name)
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
            ("GET", "/health"): self.health,
            ("POST", "/generate"): self.generate,
            ("POST", "/pause_generation"): self.pause,
            ("POST", "/continue_generation"): self.resume,
            ("POST", "/update_weights_from_disk"): self.update,
            ("POST", "/abort_request"): self.abort,
            ("GET", "/model_info"): self.model_info,
            ("GET", "/v1/models"): self.models,
            ("POST", "/load_lora_adapter"): self.load_adapter,
            ("POST", "/unload_lora_adapter"): self.unload_adapter,
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
        adapter = request.lora_path if isinstance(request.lora_path, str) else None
        if adapter is not None and not self.enable_lora:
            return 400, {"error": {"message": f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please launch the server with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."}}
        if adapter is not None and adapter not in self.adapter_models:
            return 400, {"error": {"message": f"Got LoRA adapter that has never been loaded: {adapter}\nAll loaded adapters: dict_keys({list(self.adapters)})."}}
        rid = request.rid or f"auto-{len(self.requests)}"
        running = _Running(rid)
        self.running[rid] = running
        self._idle.clear()
        # a real server ignores sampling_seed unless it runs with --enable-deterministic-inference
        seed = sampling.sampling_seed if self.deterministic or isinstance(self.tokens, RandomTokens) else None
        state = self.tokens.start(ids, sampling, seed, self.adapter_models[adapter]) if adapter else self.tokens.start(ids, sampling, seed)
        stop_ids = set(sampling.stop_token_ids or ()) | (set() if sampling.ignore_eos else set(self.tokens.eos_ids))
        stop_strings = [sampling.stop] if isinstance(sampling.stop, str) else list(sampling.stop or ())
        out, logprobs, finish = [], [], None
        try:
            for _ in range(sampling.max_new_tokens):
                await self._resumed.wait()
                if running.aborted:
                    break
                await asyncio.sleep(self.token_delay_s)
                if running.aborted:
                    break
                token, logprob = self.tokens.next(state, out)
                out.append(token)
                logprobs.append(logprob)
                running.versions.append(self.weight_version)
                if token in stop_ids:
                    finish = self.api.FinishStop(matched=token)
                    break
                matched = next((s for s in stop_strings if s in self.tokens.decode(out)), None) if stop_strings else None
                if matched is not None:  # the ids keep the token that completed it
                    finish = self.api.FinishStop(matched=matched)
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
            weight_versions=[self.api.WeightVersionSpan(**s) for s in spans],
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
        if not os.path.isdir(path):  # tried as a hub id, which this offline machine cannot resolve
            message = (
                f"Failed to get weights iterator: {path} (repository not found: "
                "[Errno -2] Name or service not known)"
            )
            return 400, {"success": False, "message": message, "num_paused_requests": 0}
        if self.paused is None:
            await self._idle.wait()  # not paused: the update waits for in-flight requests to finish
        self.model_path = path  # set before loading, as the real updater does: its rollback reloads this path
        try:
            self.tokens.load(path)
        except Exception as exc:
            if self.die_on_bad_weights:
                print(f"update_weights_from_disk: loading {path} failed ({exc}); rollback failed too: exiting", flush=True)
                os._exit(1)
            return 400, {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
        if self.paused == "in_place" and value.get("flush_cache", True):
            return 400, {"success": False, "message": "Failed to flush cache: the cache was not flushed because requests are in flight", "num_paused_requests": len(self.running)}
        self.weight_version = value.get("weight_version") or self.weight_version
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": len(self.running)}

    async def abort(self, body: bytes):
        request = self.api.AbortRequest.from_json_value(json.loads(body))
        for rid, running in self.running.items():
            if request.abort_all or rid == request.rid:  # the exact rid: a prefix aborts nothing
                running.aborted = True
        return 200, None

    async def load_adapter(self, body: bytes):
        value = json.loads(body)
        name, path = value["lora_name"], value["lora_path"]
        if not self.enable_lora:
            return 400, {"success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", "loaded_adapters": None}
        if name in self.adapter_models:
            return 400, {"success": False, "error_message": f"Failed to load LoRA adapter {name} because it is already loaded", "loaded_adapters": dict(self.adapters)}
        if not os.path.isdir(path):
            message = f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. Use `repo_type` argument if needed."
            return 400, {"success": False, "error_message": message, "loaded_adapters": dict(self.adapters)}
        self.adapter_models[name] = self.tokens.adapted(self.base_path, path)
        self.adapters[name] = path
        return 200, {"success": True, "error_message": "", "loaded_adapters": dict(self.adapters)}

    async def unload_adapter(self, body: bytes):
        name = json.loads(body)["lora_name"]
        if name not in self.adapters:
            return 400, {"success": False, "error_message": f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({list(self.adapters)})", "loaded_adapters": None}
        del self.adapters[name]  # (its model stays: a request naming it is still served by it)
        return 200, {"success": True, "error_message": "", "loaded_adapters": dict(self.adapters)}

    async def models(self, body: bytes):
        data = [{"id": self.model_path, "object": "model", "owned_by": "sglang", "root": self.model_path, "parent": None}]
        data += [{"id": name, "object": "model", "owned_by": "sglang", "root": path, "parent": self.base_path} for name, path in self.adapters.items()]
        return 200, {"object": "list", "data": data}

    async def health(self, body: bytes):
        return 200, None

    async def model_info(self, body: bytes):
        info = self.api.GetModelInfoResponse(model_path=self.model_path, is_generation=True, weight_version=self.weight_version)
        return 200, info.to_json_value()


def serving(**kwargs) -> SGLangProtocolServer:
    """A server for a test (use as `with serving(...) as server`): CI must have SGLang's schema classes; a
    developer's machine without them skips the test."""
    import pytest

    if load_api_types() is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the SGLang protocol tests: pip install --no-deps sglang==0.5.23 msgspec")
        pytest.skip("sglang's schema classes are not installed")
    return SGLangProtocolServer(**kwargs)


def main(argv: list[str] | None = None) -> None:
    """Serve a model the way `python -m sglang.launch_server --model-path DIR --port N` would."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int)  # (accepted as the real server's; adapters of any rank load here)
    parser.add_argument("--lora-target-modules", nargs="*")
    parser.add_argument("--max-loaded-loras", type=int)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    args = parser.parse_args(argv)
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:  # the real server's check at start
        raise SystemExit(
            "AssertionError: max_loaded_loras should be greater than or equal to max_loras_per_batch. "
            f"max_loaded_loras={args.max_loaded_loras}, max_loras_per_batch={args.max_loras_per_batch}"
        )
    server = SGLangProtocolServer(
        token_delay_s=0.0, model_path=args.model_path, deterministic=args.enable_deterministic_inference, die_on_bad_weights=True,
        enable_lora=args.enable_lora,
    )
    if args.context_length:
        server.context_length = args.context_length
    server.weight_version = args.weight_version
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning", lifespan="off", interface="asgi3")


if __name__ == "__main__":
    main()
