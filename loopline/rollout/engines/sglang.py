"""SGLangEngine: SGLang's native HTTP API, token ids in and out (the contract as checked against a real
server: docs/sglang-cpu/README.md).

One client for one or more servers (replicas, or a single router URL).
Requests go to the replica with the fewest in flight; each replica's weight
version is tracked, and `version()` is the oldest one serving, so a staleness
gate never trusts a replica that has not been updated yet.

Weight versions are integers in loopline and strings in SGLang. With a `tag`
(the run's), loopline labels version 3 `"3@TAG"`: a version number means
something only within one run, and a server left serving another run's v5
must not pass for this run's v5 (found against a real server: a second run
trusted the first run's weights). A label of another tag, or a bare number,
is an unknown version (-1) that the next weight sync replaces. A server
still on its startup version (`"default"`) serves the weights it was started
with: `initial_version` if its model path is `initial_path` (or no path was
given), else unknown. A new client asks the servers on `refresh_versions()`.

Every weights directory is checked against the served model's tensor layout
before any server sees it (`weights.check_weights`): a bad file kills a real
SGLang server.

With `adapters` (a LoRA run), the servers keep the run's initial model and each
version v >= 1 is the LoRA adapter the learner wrote for it, loaded with
`/load_lora_adapter` under the name `label(v)` and named by every request
(`lora_path`); version 0 is the base model itself. A request's adapter is fixed
when it starts, so its version is that adapter's (SGLang's `weight_versions`
spans name the base's). Observed on a real server (0.5.23): a name once loaded
cannot be loaded again, even after `/unload_lora_adapter` (a request naming an
unloaded adapter was still served by it), so names are never reused; adapters
older than the previous version are unloaded, which does not disturb requests
in flight. `GET /v1/models` lists the loaded adapters: what a new client reads
to know which version a server serves.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from loopline.rollout.engines.base import (
    SGLANG_REQUEST_TIMEOUT_S,
    FULL_VOCAB_TEMPERED,
    TRUNCATED_RENORMALISED,
    ContextOverflow,
    EngineError,
    Generation,
    InFlightPolicy,
    SamplingParams,
    VersionSpan,
    WeightsSource,
)
from loopline.errors import LooplineError
from loopline.rollout.weights.check import Layout, check_adapter, check_weights

# in_flight policy -> /pause_generation mode (None: no pause; the update waits for in-flight requests)
_PAUSE_MODE = {"finish": None, "abort": "abort", "continue": "retract"}


@dataclass
class Replica:
    url: str
    version: int
    inflight: int = 0
    # what "default" means on this replica: the weights it was started with
    default_version: int = 0
    default_path: str | None = None


def sampling_body(sampling: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.stop:  # (its output ids run through the token that completes the string; only its text is trimmed)
        body["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        body["sampling_seed"] = sampling.seed
    return body


def _same_path(a: str, b: str) -> bool:
    """The same directory, however written (a relative path, a trailing slash, a symlink)."""
    return a.rstrip("/") == b.rstrip("/") or os.path.realpath(a) == os.path.realpath(b)


class SGLangEngine:
    def __init__(
        self, urls: Sequence[str], initial_version: int = 0, timeout_s: float = SGLANG_REQUEST_TIMEOUT_S, initial_path: str | None = None,
        served_layout: Layout | None = None, tag: str | None = None, adapters: bool = False,
    ):
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        if adapters:
            initial_version = 0  # the servers serve the base model; versions >= 1 are adapters on it
        self.initial_version, self.tag, self.adapters = initial_version, tag, adapters
        self.replicas = [Replica(u.rstrip("/"), initial_version, default_version=initial_version, default_path=initial_path) for u in urls]
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.served_layout = served_layout  # the tensors every weights directory must match (None: not checked)

    def version(self) -> int:
        return min(r.version for r in self.replicas)

    def server_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def label(self, version: int) -> str:
        """The weight_version string a server is given for `version`."""
        return f"{version}@{self.tag}" if self.tag else str(version)

    def _parse_version(self, value: str | None, replica: Replica | None = None, model_path: str | None = None) -> int:
        if value is None:
            return self.initial_version
        number, at, tag = value.partition("@")
        if number.isdigit():
            return int(number) if self.tag is None or (at and tag == self.tag) else -1
        # "default" (or a label loopline never gives): the weights the server started with
        if replica is None:
            return self.initial_version
        if replica.default_path is None or model_path is None or _same_path(model_path, replica.default_path):
            return replica.default_version
        return -1  # started with other weights than this run's: the next sync replaces them

    async def _post(self, replica: Replica, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self.client.post(f"{replica.url}{path}", json=body)
        except httpx.TimeoutException:
            raise EngineError(f"SGLang at {replica.url} did not answer {path} in time") from None
        except httpx.HTTPError as exc:
            raise EngineError(f"SGLang at {replica.url} is unreachable ({type(exc).__name__}: {exc})") from None

    @staticmethod
    def _error_text(response: httpx.Response) -> str:
        try:
            payload = response.json()
        except ValueError:
            return response.text[:300]
        if isinstance(payload, dict):
            error = payload.get("error") or payload.get("message") or payload
            return error.get("message", str(error)) if isinstance(error, dict) else str(error)
        return str(payload)[:300]

    async def _get(self, replica: Replica, path: str) -> dict[str, Any]:
        try:
            response = await self.client.get(f"{replica.url}{path}")
        except httpx.HTTPError as exc:
            raise EngineError(f"SGLang at {replica.url} is unreachable ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise EngineError(f"SGLang at {replica.url} answered {path} with {response.status_code}")
        return response.json()

    async def refresh_versions(self) -> list[int]:
        """Ask every replica which weights it serves (GET /model_info; with adapters, also GET /v1/models)."""
        for replica in self.replicas:
            info = await self._get(replica, "/model_info")
            replica.version = self._parse_version(info.get("weight_version"), replica, info.get("model_path"))
            if self.adapters:
                if replica.version != 0:
                    raise EngineError(
                        f"SGLang at {replica.url} serves {info.get('model_path')} (weight version {info.get('weight_version')}), not "
                        f"this run's initial model {replica.default_path}: a LoRA run's servers serve its base model and load adapters"
                    )
                listed = (await self._get(replica, "/v1/models")).get("data") or []
                loaded = [self._parse_version(m.get("id")) for m in listed if m.get("parent")]  # adapters name their base
                replica.version = max([0, *loaded])
        return [r.version for r in self.replicas]

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> Generation:
        replica = min(self.replicas, key=lambda r: r.inflight)
        body: dict[str, Any] = {
            "input_ids": list(prompt_ids),
            "rid": request_id,
            "return_logprob": True,
            "logprob_start_len": -1,
            "sampling_params": sampling_body(sampling),
        }
        adapter = replica.version if self.adapters else None
        if adapter:
            body["lora_path"] = self.label(adapter)
        if sampling.truncated:
            body["return_sampling_mask"] = True
        replica.inflight += 1
        try:
            response = await self._post(replica, "/generate", body)
        finally:
            replica.inflight -= 1
        if response.status_code != 200:
            message = self._error_text(response)
            if response.status_code == 400 and "context length" in message.lower():
                raise ContextOverflow(message)
            raise EngineError(f"SGLang at {replica.url} answered /generate with {response.status_code}: {message}")
        return self._generation(response.json(), request_id, replica, adapter)

    def _generation(self, payload: dict[str, Any], request_id: str, replica: Replica, adapter: int | None = None) -> Generation:
        meta = payload.get("meta_info") or {}
        ids = tuple(payload.get("output_ids") or ())
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != len(ids) or any(int(e[1]) != t for e, t in zip(entries, ids)):
            raise EngineError(f"SGLang response for {request_id}: output_token_logprobs do not align with output_ids")
        finish = (meta.get("finish_reason") or {}).get("type", "abort")
        if finish not in ("stop", "length", "abort"):
            raise EngineError(f"SGLang response for {request_id}: unknown finish reason {finish!r}")
        spans = meta.get("weight_versions") or []
        version_spans: tuple[VersionSpan, ...]
        if adapter is not None:  # the adapter named when the request started, for all of it
            version_spans = (VersionSpan(adapter, 0, len(ids)),) if ids else ()
        elif spans:
            version_spans = tuple(VersionSpan(self._parse_version(s["version"], replica), s["start"], s["end"]) for s in spans)
        else:
            version_spans = (VersionSpan(self._parse_version(meta.get("weight_version"), replica), 0, len(ids)),) if ids else ()
        sampling_lp = meta.get("output_token_sampling_logprobs")
        return Generation(
            token_ids=ids,
            logprobs=tuple(float(e[0]) for e in entries),
            finish_reason=finish,
            version_spans=version_spans,
            logprob_semantics=FULL_VOCAB_TEMPERED,
            sampling_logprobs=tuple(float(e[0] if isinstance(e, list) else e) for e in sampling_lp) if sampling_lp else None,
            meta={
                "request_id": request_id,
                "replica": replica.url,
                "sampling_logprob_semantics": TRUNCATED_RENORMALISED if sampling_lp else None,
            },
        )

    async def abort(self, request_id: str) -> None:
        """Abort one request on every replica. SGLang matches the exact rid (a prefix aborts nothing)."""
        for replica in self.replicas:
            response = await self._post(replica, "/abort_request", {"rid": request_id})
            if response.status_code != 200:
                raise EngineError(f"SGLang at {replica.url} refused /abort_request: {self._error_text(response)}")

    async def update_weights(self, version: int, weights: WeightsSource, in_flight: InFlightPolicy = "finish") -> dict[str, float]:
        """Load the directory `weights` as `version` on every replica that does not serve it yet, one at a time; raises
        on the first that fails. Returns the seconds spent: check (the files, before any server sees them),
        load (every replica's update, which in `finish` mode includes waiting for its requests in flight)
        and confirm (asking every replica what it serves)."""
        if not isinstance(weights, (str, os.PathLike)):
            raise LooplineError("SGLang servers load weights from an exported directory, not from the learner's memory")
        weights_dir = str(weights)
        if self.adapters:
            return await self._load_adapter(version, str(weights_dir), in_flight)
        started = time.monotonic()
        if self.served_layout is not None:
            check_weights(weights_dir, self.served_layout)
        checked = time.monotonic()
        mode = _PAUSE_MODE[in_flight]
        for replica in self.replicas:
            if replica.version == version:
                continue  # an earlier, partly failed sync reached this one already
            if mode is not None:
                await self._expect_ok(replica, "/pause_generation", {"mode": mode})
            try:
                await self._expect_ok(
                    replica,
                    "/update_weights_from_disk",
                    {"model_path": str(weights_dir), "weight_version": self.label(version), "flush_cache": True},
                )
                replica.version = version
            finally:
                if mode is not None:
                    await self._expect_ok(replica, "/continue_generation", {})
        loaded = time.monotonic()
        versions = await self.refresh_versions()
        if any(v != version for v in versions):
            raise EngineError(f"after the update the replicas serve versions {versions}, not {version}")
        return {"check_s": checked - started, "load_s": loaded - checked, "confirm_s": time.monotonic() - loaded, "replicas": float(len(self.replicas))}

    async def _load_adapter(self, version: int, adapter_dir: str, in_flight: InFlightPolicy) -> dict[str, float]:
        """Load `adapter_dir` as `version` on every replica that lacks it; new requests name it from then on.
        Requests in flight finish on the adapter they started with (`continue` cannot switch them: a
        request's adapter is fixed); `abort` aborts them. The previous version stays loaded (a request may
        just have named it); older ones are unloaded."""
        started = time.monotonic()
        if self.served_layout is not None:
            check_adapter(adapter_dir, self.served_layout)
        checked = time.monotonic()
        name = self.label(version)
        for replica in self.replicas:
            if replica.version == version:
                continue
            if in_flight == "abort":
                await self._expect_ok(replica, "/pause_generation", {"mode": "abort"})
            try:
                await self.load_adapter(replica, name, adapter_dir)
                previous, replica.version = replica.version, version
            finally:
                if in_flight == "abort":
                    await self._expect_ok(replica, "/continue_generation", {})
            await self._unload_older(replica, min(previous, version - 1))
        loaded = time.monotonic()
        versions = await self.refresh_versions()
        if any(v != version for v in versions):
            raise EngineError(f"after loading adapter {name} the replicas serve versions {versions}, not {version}")
        return {"check_s": checked - started, "load_s": loaded - checked, "confirm_s": time.monotonic() - loaded, "replicas": float(len(self.replicas))}

    async def load_adapter(self, replica: Replica, name: str, adapter_dir: str) -> None:
        response = await self._post(replica, "/load_lora_adapter", {"lora_name": name, "lora_path": adapter_dir})
        payload = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        if response.status_code == 200 and payload.get("success", True):
            return
        if (payload.get("loaded_adapters") or {}).get(name) == adapter_dir:
            return  # loaded already (an earlier, partly failed sync, or a process before this one)
        message = payload.get("error_message") or self._error_text(response)
        if "LoRA is not enabled" in message:
            message = (
                f"the server was started without LoRA: start it with --enable-lora --max-lora-rank RANK --lora-target-modules all "
                f"(servers loopline launches get them), or set engine.lora_sync: merged; SGLang said: {message}"
            )
        elif "Repo id must be" in message:  # SGLang tries a path it cannot find as a hub id
            message = f"{adapter_dir} does not exist on the server's machine (do the learner and it share that filesystem?); SGLang said: {message}"
        raise EngineError(f"SGLang at {replica.url} refused /load_lora_adapter {name} ({response.status_code}): {message}")

    async def _unload_older(self, replica: Replica, keep_from: int) -> None:
        """Unload this run's adapters older than `keep_from` (best effort: a leftover costs memory, not correctness)."""
        listed = (await self._get(replica, "/v1/models")).get("data") or []
        for model in listed:
            version = self._parse_version(model.get("id"))
            if model.get("parent") and 0 < version < keep_from:
                await self._post(replica, "/unload_lora_adapter", {"lora_name": model["id"]})

    async def _expect_ok(self, replica: Replica, path: str, body: dict[str, Any]) -> None:
        response = await self._post(replica, path, body)
        payload = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        if response.status_code != 200 or (isinstance(payload, dict) and payload.get("success") is False):
            message = self._error_text(response)
            if "weights iterator" in message and "Name or service not known" in message:
                # SGLang tries a path it cannot find as a hub id: say what it means
                message = f"{body.get('model_path')} does not exist on the server's machine (do the learner and it share that filesystem?); SGLang said: {message}"
            raise EngineError(f"SGLang at {replica.url} refused {path} ({response.status_code}): {message}")

    async def close(self) -> None:
        await self.client.aclose()
