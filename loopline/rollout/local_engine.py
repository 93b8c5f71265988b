"""LocalEngine: the embedded CPU engine, transformers in-process with dynamic batching.

Requests join the running batch between decode steps and leave as they
finish. Each request keeps its own KV cache; a decode step left-pads the
caches into one batch (keys are cached after RoPE, so padding on the left
changes nothing — the tests check batched against one-at-a-time), runs one
forward, and splits the caches back. Weights change only between steps, so
every token's version is known exactly.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from loopline.rollout.engine import (
    FULL_VOCAB_TEMPERED,
    TRUNCATED_RENORMALISED,
    ContextOverflow,
    EngineError,
    FinishReason,
    Generation,
    InFlightPolicy,
    SamplingParams,
    WeightsSource,
    spans_from_versions,
)
from loopline.errors import LooplineError

log = logging.getLogger(__name__)
_COMPATIBLE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def load_model(model_dir: str | Path):
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise EngineError(f"{path} is not a model directory (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a broken directory
        raise EngineError(f"could not load weights from {path}: {type(exc).__name__}: {exc}") from None
    return model.eval()


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[int, float, float | None]:
    """Pick the next token; return it, its FULL_VOCAB_TEMPERED logprob, and the truncated one when truncating."""
    logits = logits.float()
    if sampling.greedy:
        logprobs = F.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logprobs[token]), None
    scaled = logits / sampling.temperature
    logprobs = F.log_softmax(scaled, dim=-1)
    if not sampling.truncated:
        token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
        return token, float(logprobs[token]), None
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if sampling.top_k > 0:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
        keep &= scaled >= kth
    if sampling.top_p < 1.0:
        probs, order = torch.sort(logprobs.exp(), descending=True)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        kept = torch.zeros_like(keep)
        kept[order] = before < sampling.top_p
        keep &= kept
    truncated = F.log_softmax(scaled.masked_fill(~keep, -math.inf), dim=-1)
    token = int(torch.multinomial(truncated.exp(), 1, generator=generator))
    return token, float(logprobs[token]), float(truncated[token])


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    generator: torch.Generator
    stop_ids: frozenset[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, shape [1, heads, length, dim]
    next_logits: torch.Tensor | None = None
    logits_version: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    def result(self) -> Generation:
        return Generation(
            token_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            finish_reason=self.finish or "abort",
            version_spans=spans_from_versions(self.versions),
            logprob_semantics=FULL_VOCAB_TEMPERED,
            sampling_logprobs=tuple(self.sampling_logprobs) if self.sampling.truncated else None,
            meta={
                "request_id": self.request_id,
                "sampling_logprob_semantics": TRUNCATED_RENORMALISED if self.sampling.truncated else None,
            },
        )


@dataclass(eq=False)
class _WeightUpdate:
    version: int
    model: object
    policy: InFlightPolicy
    done: asyncio.Future


class LocalEngine:
    def __init__(self, model_dir: str | Path, version: int = 0, max_batch: int = 16, request_timeout_s: float = 900.0):
        self.model = load_model(model_dir)
        self._version = version
        self.max_batch = max_batch
        self.request_timeout_s = request_timeout_s
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._pending: collections.deque[_Request] = collections.deque()
        self._active: list[_Request] = []
        self._update: _WeightUpdate | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._seeds = itertools.count(1)
        self.batch_sizes: list[int] = []  # per decode step, for benchmarks and tests
        self.kv_tokens: list[int] = []  # per decode step: tokens the running requests' KV caches hold (occupancy)

    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ API

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> Generation:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) + sampling.max_new_tokens > self.max_context:
            raise ContextOverflow(
                f"prompt of {len(prompt_ids)} tokens + {sampling.max_new_tokens} new tokens exceeds "
                f"the model's context of {self.max_context}"
            )
        generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else next(self._seeds))
        request = _Request(
            request_id, list(prompt_ids), sampling, asyncio.get_running_loop().create_future(), generator,
            frozenset(sampling.stop_token_ids) | self.eos_ids,
        )
        self._pending.append(request)
        self._kick()
        try:
            return await asyncio.wait_for(asyncio.shield(request.future), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise EngineError(f"request {request_id} did not finish within {self.request_timeout_s:g} s") from None

    async def update_weights(self, version: int, weights: WeightsSource, in_flight: InFlightPolicy = "finish") -> dict[str, float]:
        """Returns the seconds spent loading the weights and waiting to swap them in (after the batch in flight).
        `weights`: an exported model directory, or the learner's tensors by name (this engine runs in the
        learner's process): copied here, before this returns, so the learner may change its own afterwards."""
        started = time.monotonic()
        if isinstance(weights, (str, Path)):
            new_model = await asyncio.to_thread(load_model, weights)
        else:
            new_model = await asyncio.to_thread(self._copy_with, weights)
        loaded = time.monotonic()
        mismatched = [
            k for k in _COMPATIBLE_KEYS if getattr(new_model.config, k, None) != getattr(self.model.config, k, None)
        ]
        if mismatched:
            raise EngineError(f"weights in {weights} do not match the served model ({', '.join(mismatched)} differ)")
        if version <= self._version:
            raise EngineError(f"weight version {version} is not newer than the served version {self._version}")
        update = _WeightUpdate(version, new_model, in_flight, asyncio.get_running_loop().create_future())
        self._update = update
        self._kick()
        await update.done
        return {"load_s": loaded - started, "swap_s": time.monotonic() - loaded}

    def _copy_with(self, tensors: Mapping[str, torch.Tensor]):
        """A copy of the served model holding `tensors` (the served one keeps generating meanwhile)."""
        model = copy.deepcopy(self.model)
        try:
            model.load_state_dict(tensors, strict=True)
        except RuntimeError as exc:
            raise LooplineError(f"the learner's weights do not fit the served model: {exc}") from None
        return model

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for request in [*self._pending, *self._active]:
            if not request.future.done():
                request.future.set_exception(EngineError("engine closed"))
        self._pending.clear()
        self._active.clear()

    # ------------------------------------------------------------------ scheduling loop

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._maybe_apply_update()
            admit: list[_Request] = []
            if self._update is None:
                while self._pending and len(self._active) + len(admit) < self.max_batch:
                    admit.append(self._pending.popleft())
            if not admit and not self._active:
                self._wake.clear()
                if self._update is None and not self._pending:
                    await self._wake.wait()
                continue
            try:
                finished = await asyncio.to_thread(self._step, admit)
            except Exception as exc:  # a crash of the model fails the requests, never the caller's process
                log.exception("LocalEngine step failed")
                for request in [*admit, *self._active]:
                    if not request.future.done():
                        request.future.set_exception(EngineError(f"engine step failed: {type(exc).__name__}: {exc}"))
                self._active = []
                continue
            for request in finished:
                if not request.future.done():
                    request.future.set_result(request.result())

    def _maybe_apply_update(self) -> None:
        update = self._update
        if update is None:
            return
        if update.policy == "abort":
            for request in self._active:
                request.finish = "abort"
                if not request.future.done():
                    request.future.set_result(request.result())
            self._active = []
        elif update.policy == "finish" and self._active:
            return  # keep stepping the old batch; new requests wait
        self.model, self._version, self._update = update.model, update.version, None
        if not update.done.done():
            update.done.set_result(None)

    # ------------------------------------------------------------------ model work (worker thread)

    @torch.inference_mode()
    def _step(self, admit: list[_Request]) -> list[_Request]:
        if admit:
            self._prefill(admit)
        self._active.extend(admit)

        finished, running = [], []
        for request in self._active:
            token, logprob, truncated = sample_token(request.next_logits, request.sampling, request.generator)
            request.tokens.append(token)
            request.logprobs.append(logprob)
            if truncated is not None:
                request.sampling_logprobs.append(truncated)
            request.versions.append(request.logits_version)
            if token in request.stop_ids:
                request.finish = "stop"
            elif len(request.tokens) >= request.sampling.max_new_tokens:
                request.finish = "length"
            (finished if request.finish else running).append(request)
        self._active = running
        if running:
            self.batch_sizes.append(len(running))
            self.kv_tokens.append(sum(r.length for r in running))
            self._decode(running)
        return finished

    def _prefill(self, batch: list[_Request]) -> None:
        """One forward over the distinct new prompts, left-padded together (a group's samples share one
        prompt: it runs once); each request keeps its unpadded cache. Logits only at the last position."""
        from transformers import DynamicCache

        distinct: dict[tuple[int, ...], int] = {}
        for request in batch:
            distinct.setdefault(tuple(request.prompt_ids), len(distinct))
        prompts = list(distinct)
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            ids, attention_mask=mask, position_ids=positions, cache=DynamicCache(config=self.model.config), use_cache=True,
            logits_to_keep=1,
        )
        layers = out.cache.layers
        for request in batch:
            i = distinct[tuple(request.prompt_ids)]
            pad = longest - len(request.prompt_ids)
            request.kv = [(l.keys[i : i + 1, :, pad:], l.values[i : i + 1, :, pad:]) for l in layers]
            request.next_logits, request.logits_version = out.logits[i, -1], self._version

    def _decode(self, batch: list[_Request]) -> None:
        """One forward for every running request, on caches left-padded to a common length."""
        from transformers import DynamicCache

        lengths = [r.length - 1 for r in batch]  # cached positions (all but the token just sampled)
        longest = max(lengths)
        cache = DynamicCache(config=self.model.config)
        for layer in range(len(batch[0].kv)):
            keys = [F.pad(r.kv[layer][0], (0, 0, longest - n, 0)) for r, n in zip(batch, lengths)]
            values = [F.pad(r.kv[layer][1], (0, 0, longest - n, 0)) for r, n in zip(batch, lengths)]
            cache.update(torch.cat(keys), torch.cat(values), layer)
        mask = torch.tensor([[0] * (longest - n) + [1] * (n + 1) for n in lengths])
        out = self.model(
            torch.tensor([[r.tokens[-1]] for r in batch]),
            cache=cache,
            attention_mask=mask,
            position_ids=torch.tensor([[n] for n in lengths]),
            use_cache=True,
            logits_to_keep=1,
        )
        layers = out.cache.layers
        for i, (request, n) in enumerate(zip(batch, lengths)):
            # n + 1 positions now: the padding on the left is dropped again
            request.kv = [(l.keys[i : i + 1, :, longest - n :], l.values[i : i + 1, :, longest - n :]) for l in layers]
            request.next_logits, request.logits_version = out.logits[i, -1], self._version
