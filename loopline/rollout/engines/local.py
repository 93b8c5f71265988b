"""LocalEngine: the embedded CPU engine, transformers in-process with dynamic batching.

Requests join the running batch between decode steps and leave as they
finish. The running requests' caches live in one buffer (`KVSlab`), a row
each, left-padded to a shared column; a decode step writes each row's new
token there in place (keys are cached after RoPE, so padding on the left
changes nothing — the tests check batched against one-at-a-time). Weights
change only between steps, so every token's version is known exactly.

A prompt's prefill starts from the longest prefix whose keys and values the
engine still holds (`_PrefixCache`), as SGLang's radix cache does: an
episode's next turn extends its last prompt and generation, and every task
of a run shares the system prompt and demonstration turns. With a few-shot
prompt the prefill is most of the compute (SmolLM2 on arithmetic: ~300
prompt tokens a turn, ~15 generated).
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
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from loopline import allocator
from loopline.rollout.engines.base import (
    FULL_VOCAB_TEMPERED,
    TRUNCATED_RENORMALISED,
    ContextOverflow,
    EngineClosed,
    EngineError,
    FinishReason,
    Generation,
    InFlightPolicy,
    LentWeights,
    SamplingParams,
    WeightsSource,
    spans_from_versions,
)
from loopline.errors import LooplineError
from loopline.failpoints import failpoint
from loopline.rollout.engines.kv_slab import KV, KVSlab

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
    stop_text: Callable[[list[int]], bool] | None = None  # whether the tokens so far end with a stop string
    kv: KV | None = None  # its prompt's cache, from the prefill until the slab takes it
    kv_version: int = -1  # the weights its prompt's cache was computed with
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


MIN_SHARED_PREFIX = 16  # tokens a batch's prompts must share beyond the cache for one more forward to pay


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (slices compare in C; a bisection over them)."""
    a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


class _PrefixCache:
    """Keys and values of token sequences computed recently by the current weights: prompts, and finished
    requests' prompt + generation. Least recently used out first, by tokens held; cleared when weights change."""

    def __init__(self, capacity_tokens: int, max_entries: int = 256):
        self.capacity, self.max_entries = capacity_tokens, max_entries  # a lookup scans every entry
        self.entries: collections.OrderedDict[tuple[int, ...], KV] = collections.OrderedDict()
        self.tokens = 0

    def longest(self, ids: Sequence[int]) -> tuple[int, KV | None]:
        """The most tokens of `ids` some entry holds, and that entry's cache (longer than the match)."""
        best, found = 0, None
        for key in self.entries:
            n = common_prefix(key, ids)
            if n > best:
                best, found = n, key
        if found is None:
            return 0, None
        self.entries.move_to_end(found)
        return best, self.entries[found]

    def add(self, ids: Sequence[int], kv: KV) -> None:
        key = tuple(ids)
        if not 0 < len(key) <= self.capacity:
            return
        for other in list(self.entries):
            shared = min(len(other), len(key))
            if other[:shared] == key[:shared]:
                if len(other) >= len(key):  # already held (an entry this one is a prefix of)
                    self.entries.move_to_end(other)
                    return
                self.tokens -= len(other)  # superseded: every match of `other` is one of `key`, at least as long
                del self.entries[other]
        self.entries[key] = [(k.contiguous(), v.contiguous()) for k, v in kv]  # never a view pinning a batch's cache
        self.tokens += len(key)
        while self.tokens > self.capacity or len(self.entries) > self.max_entries:
            oldest, _ = self.entries.popitem(last=False)
            self.tokens -= len(oldest)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0


@dataclass(eq=False)
class _WeightUpdate:
    version: int
    model: object
    policy: InFlightPolicy
    done: asyncio.Future


class LocalEngine:
    def __init__(
        self, model_dir: str | Path, version: int = 0, max_batch: int = 16, request_timeout_s: float = 900.0,
        prefix_cache_mb: float = 1024.0,
    ):
        self.model = load_model(model_dir)
        self.model_dir = Path(model_dir)
        self._tokenizer: Any = None  # loaded by the first request with stop strings
        self._version = version
        self.max_batch = max_batch
        self.request_timeout_s = request_timeout_s
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._pending: collections.deque[_Request] = collections.deque()
        self._active: list[_Request] = []
        self._slab = KVSlab(max_batch)  # the running requests' caches
        self._update: _WeightUpdate | None = None
        self._release: str | None = None  # (`release_memory`: "caches" or "weights", dropped when next idle)
        self._shapes: dict[str, torch.Size] | None = None  # the parameters' shapes while the weights are released
        self._wake = asyncio.Event()  # (a new one with each scheduling task: `_kick`)
        self._task: asyncio.Task | None = None
        self._seeds = itertools.count(1)
        self.batch_sizes: list[int] = []  # per decode step, for benchmarks and tests
        self.kv_tokens: list[int] = []  # per decode step: tokens the running requests' KV caches hold (occupancy)
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        token_bytes = config.num_hidden_layers * 2 * heads * head_dim * 4
        self._prefixes = _PrefixCache(int(prefix_cache_mb * 2**20 // token_bytes))
        self.prefill_tokens = {"computed": 0, "reused": 0}  # prompt tokens run through the model vs taken from the cache

    def version(self) -> int:
        return self._version

    def server_urls(self) -> list[str]:
        return []  # generates in this process

    # ------------------------------------------------------------------ API

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> Generation:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if self._shapes is not None:
            raise EngineError(f"this engine's weights were released for the learner (release_memory); update_weights to a version after v{self._version} first")
        if len(prompt_ids) + sampling.max_new_tokens > self.max_context:
            raise ContextOverflow(
                f"prompt of {len(prompt_ids)} tokens + {sampling.max_new_tokens} new tokens exceeds "
                f"the model's context of {self.max_context}"
            )
        generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else next(self._seeds))
        request = _Request(
            request_id, list(prompt_ids), sampling, asyncio.get_running_loop().create_future(), generator,
            frozenset(sampling.stop_token_ids) | self.eos_ids, self._stop_text(sampling.stop) if sampling.stop else None,
        )
        self._pending.append(request)
        self._kick()
        try:
            return await asyncio.wait_for(asyncio.shield(request.future), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise EngineError(f"request {request_id} did not finish within {self.request_timeout_s:g} s") from None

    def _stop_text(self, stop: tuple[str, ...]) -> Callable[[list[int]], bool] | None:
        """A check that the text of a request's newest tokens holds one of `stop`: decoded over a window wide
        enough for the longest (a character is at most 4 bytes, a byte-level token at least one), so a
        step's check costs the same however long the generation is. None where the weights came without
        their tokenizer: the request then runs to its length and its caller cuts it."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            except (OSError, ValueError) as exc:
                log.warning("stop strings are checked after generation: no tokenizer in %s (%s)", self.model_dir, exc)
                return None
        tokenizer, window = self._tokenizer, 4 * max(len(s) for s in stop) + 1
        return lambda tokens: any(s in tokenizer.decode(tokens[-window:]) for s in stop)

    async def update_weights(self, version: int, weights: WeightsSource, in_flight: InFlightPolicy = "finish") -> dict[str, float]:
        """Returns the seconds spent loading the weights and waiting to swap them in (after the batch in flight).
        `weights`: an exported model directory, or the learner's tensors by name (this engine runs in the
        learner's process): copied here, before this returns, so the learner may change its own afterwards."""
        started = time.monotonic()
        new_model = await asyncio.to_thread(self._load, weights)
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

    def _load(self, weights: WeightsSource):
        failpoint("weight_load")
        return load_model(weights) if isinstance(weights, (str, Path)) else self._copy_with(weights)

    def _copy_with(self, tensors: Mapping[str, torch.Tensor]):
        """A copy of the served model holding `tensors` (the served one keeps generating meanwhile; one whose
        weights were released is copied bare and its parameters made again, tied ones once). Lent tensors of the
        served dtype are served as they are (`LentWeights`: the learner's, not copied)."""
        model, shapes = copy.deepcopy(self.model), self._shapes
        if shapes is not None:
            for name, parameter in model.named_parameters():
                parameter.data = torch.empty(shapes[name], dtype=parameter.dtype)
        lent = isinstance(tensors, LentWeights) and all(
            name not in tensors or tensors[name].dtype == parameter.dtype for name, parameter in model.named_parameters()
        )
        try:
            model.load_state_dict(tensors, strict=True, assign=lent)
        except RuntimeError as exc:
            raise LooplineError(f"the learner's weights do not fit the served model: {exc}") from None
        return model

    async def release_memory(self, weights: bool = False) -> None:
        """Drop the caches (the running batch's slab, the prefix cache) when no request runs. A sync step's
        learner runs in this process after its rollouts: the slab (its rows' keys and values, ~1 GB at 32 rows of
        600 tokens of SmolLM2) and up to `prefix_cache_mb` of cached prefixes would sit under the learner's peak,
        and the weights the step makes leave the prefix cache stale anyway. The next request builds them again.
        With `weights`, the weights too (SmolLM2's 0.5 GiB in fp32): the step's version replaces them whole
        (`update_weights`) before anything is generated again; a request before that fails, never runs on none."""
        self._release = "weights" if weights else (self._release or "caches")
        self._kick()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for request in [*self._pending, *self._active]:
            if not request.future.done():
                request.future.set_exception(EngineClosed("engine closed"))
                request.future.exception()  # (its caller may be gone, cancelled by the same stop: nothing to log)
        self._pending.clear()
        self._active.clear()
        self._slab.clear()

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
                if self._release:
                    self._slab.clear()
                    self._prefixes.clear()
                    if self._release == "weights" and self._shapes is None:
                        self._shapes = {name: parameter.shape for name, parameter in self.model.named_parameters()}
                        for parameter in self.model.parameters():  # (a tied parameter is one object: freed once)
                            parameter.data = torch.empty(0, dtype=parameter.dtype)
                    self._release = None
                    allocator.give_back()  # (the cached prefixes' small tensors were freed inside the heap)
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
                self._slab.clear()
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
            self._slab.clear()
        elif update.policy == "finish" and self._active:
            return  # keep stepping the old batch; new requests wait
        self.model, self._version, self._update, self._shapes = update.model, update.version, None, None
        self._prefixes.clear()  # keys and values of the old weights
        if not update.done.done():
            update.done.set_result(None)

    # ------------------------------------------------------------------ model work (worker thread)

    @torch.inference_mode()
    def _step(self, admit: list[_Request]) -> list[_Request]:
        if admit:
            self._prefill(admit)
            for request in admit:
                assert request.kv is not None  # (the prefill gave it)
                self._slab.place(request, request.kv)
                request.kv = None  # the slab's row holds it now
        self._active.extend(admit)

        finished: list[_Request] = []
        running: list[_Request] = []
        for request in self._active:
            token, logprob, truncated = sample_token(request.next_logits, request.sampling, request.generator)
            request.tokens.append(token)
            request.logprobs.append(logprob)
            if truncated is not None:
                request.sampling_logprobs.append(truncated)
            request.versions.append(request.logits_version)
            if token in request.stop_ids or (request.stop_text is not None and request.stop_text(request.tokens)):
                request.finish = "stop"
            elif len(request.tokens) >= request.sampling.max_new_tokens:
                request.finish = "length"
            (finished if request.finish else running).append(request)
            if not request.finish:
                continue
            if request.kv_version == self._version and self._prefixes.capacity:  # the next turn's prompt starts with this
                self._prefixes.add(request.prompt_ids + request.tokens[:-1], self._slab.take(request))
            else:
                self._slab.free(request)
        self._active = running
        if running:
            self.batch_sizes.append(len(running))
            self.kv_tokens.append(sum(r.length for r in running))
            self._decode(running)
        return finished

    def _prefill(self, batch: list[_Request]) -> None:
        """One forward over the distinct new prompts (a group's samples share one prompt: it runs once),
        each from the longest prefix the cache holds; logits only at the last position."""
        distinct: dict[tuple[int, ...], int] = {}
        for request in batch:
            distinct.setdefault(tuple(request.prompt_ids), len(distinct))
        prompts = list(distinct)
        if len(prompts) > 1 and self._prefixes.capacity:  # e.g. the first turns of many tasks: their system prompt and demonstrations, once
            shared = prompts[0][: min(common_prefix(prompts[0], p) for p in prompts[1:])]
            cached, kv = self._prefixes.longest(shared)
            if len(shared) - cached >= MIN_SHARED_PREFIX:
                [(shared_kv, _)] = self._forward([(shared, min(cached, len(shared) - 1), kv)])
                self._prefixes.add(shared, shared_kv)
        rows = []
        for prompt in prompts:
            cached, kv = self._prefixes.longest(prompt)
            rows.append((prompt, min(cached, len(prompt) - 1), kv))  # at least the last token runs: its logits
        results = self._forward(rows)
        for prompt, (kv, _) in zip(prompts, results):
            self._prefixes.add(prompt, kv)
        for request in batch:
            kv, logits = results[distinct[tuple(request.prompt_ids)]]
            request.kv, request.next_logits = kv, logits
            request.logits_version = request.kv_version = self._version

    def _forward(self, rows: Sequence[tuple[Sequence[int], int, Any]]) -> list[tuple[KV, torch.Tensor]]:
        """Run each row's ids after its first `cached` ones, whose keys and values `kv` holds; return each
        row's whole cache and last logits. Layout per row: [pad][cached][pad][new], the pads masked out."""
        from transformers import DynamicCache

        longest_cached = max(cached for _, cached, _ in rows)
        longest_new = max(len(ids) - cached for ids, cached, _ in rows)
        cache = DynamicCache(config=self.model.config)
        if longest_cached:
            template = next(kv for _, cached, kv in rows if cached)
            for layer in range(len(template)):
                parts = []
                for index in (0, 1):  # keys, values
                    empty = template[layer][index][:, :, :0]
                    parts.append(torch.cat([
                        F.pad((kv[layer][index] if cached else empty)[:, :, :cached], (0, 0, longest_cached - cached, 0))
                        for _, cached, kv in rows
                    ]))
                cache.update(parts[0], parts[1], layer)
        ids, mask, positions = [], [], []
        for prompt, cached, _ in rows:
            fresh = len(prompt) - cached
            pad = longest_new - fresh
            ids.append([0] * pad + list(prompt[cached:]))
            mask.append([0] * (longest_cached - cached) + [1] * cached + [0] * pad + [1] * fresh)
            positions.append([0] * pad + list(range(cached, len(prompt))))
            self.prefill_tokens["computed"] += fresh
            self.prefill_tokens["reused"] += cached
        out = self.model(
            torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions), cache=cache,
            use_cache=True, logits_to_keep=1,
        )
        total = longest_cached + longest_new
        results = []
        for i, (prompt, cached, _) in enumerate(rows):
            held = slice(longest_cached - cached, longest_cached)
            new = slice(total - (len(prompt) - cached), total)
            kv = [
                (torch.cat((l.keys[i : i + 1, :, held], l.keys[i : i + 1, :, new]), dim=2),
                 torch.cat((l.values[i : i + 1, :, held], l.values[i : i + 1, :, new]), dim=2))
                for l in out.cache.layers
            ]
            results.append((kv, out.logits[i, -1]))
        return results

    def _decode(self, batch: list[_Request]) -> None:
        """One forward for every running request, each attending to its row of the slab."""
        cache, ids, mask, positions, rows = self._slab.decode_inputs({r: r.tokens[-1] for r in batch})
        out = self.model(ids, cache=cache, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        self._slab.advance(batch)
        for request, row in zip(batch, rows):
            request.next_logits, request.logits_version = out.logits[row, -1], self._version
