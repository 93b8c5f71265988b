"""An OpenAI-compatible endpoint over the run's engine, so that an agent program written against the `openai`
SDK (or LangGraph, smolagents, curl) plays episodes unchanged, and every call it makes is recorded as a
token-exact segment.

The trap it avoids is re-tokenisation: the API speaks text, and tokenising the conversation again for
training gives other tokens than the model sampled. So an episode keeps the ids of its last call (prompt +
generated) and, when the next call's messages extend that conversation (the agent appended the reply it got
and what followed: tool results, a new user turn), the new prompt is exactly those ids followed by the
template's rendering of what was appended, as the built-in harness builds its turns (`ChatFormat`). The
sampled ids are never decoded and encoded again. A call whose messages do not extend the previous call's
(the agent rewrote or trimmed its history) starts a new chain of segments: the episode's trajectory is then
its last chain, and the calls before it are counted (`discarded_calls`), not trained.

`/v1/completions` (a prompt the agent builds itself, as ReAct loops do) chains the same way: a prompt that
starts with the previous call's prompt and the text of the ids it generated continues those ids, and only the
text after them is tokenised; a prompt given as token ids is taken as it is.

Sampling is the run's, whatever the request asks (`temperature`, `top_p`, ...): the learner's ratios are
computed against the behaviour policy the run names. `max_tokens` is honoured within the episode's token
budget; the episode's call budget is its `max_turns`. `stop` strings end a reply where one first appears:
the agent gets the text before it (as OpenAI returns it) and the trajectory keeps the tokens sampled up to
and including the stop string's, never those after (both engines stop there; were one to generate on,
what follows would be dropped). A call past a budget gets HTTP 400 with an error the SDK raises, and the episode ends as
truncated. `n` is 1: an episode is one line of play; more samples of a prompt are more episodes (the
group).

Each episode is reached through its own base URL (`/episodes/KEY/v1`) or with its key as the API key on
`/v1`; a key belongs to one episode and dies with it.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from loopline.rollout.chat import ChatFormat
from loopline.rollout.engine import ContextOverflow, EngineError, Sampler, SamplingParams
from loopline.types import SegmentRecord

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class RequestError(Exception):
    """An error the agent is told (HTTP 400, OpenAI's error shape): its request, or a spent budget."""

    def __init__(self, message: str, code: str = "invalid_request_error", status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


@dataclass(frozen=True)
class Budget:
    max_calls: int  # the env's max_turns: one model call is one turn
    max_tokens: int  # generated tokens over the whole episode


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _normalised(message: dict[str, Any]) -> dict[str, Any]:
    """What a message means for the prompt, as an SDK may send it back (it adds `refusal`, `annotations`,
    `type`, turns a missing content into null, and arguments into a JSON string)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        calls.append((call.get("id"), function.get("name"), json.dumps(_arguments(function.get("arguments")), sort_keys=True)))
    content = message.get("content")
    if isinstance(content, list):  # content parts: the text ones
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {"role": message.get("role"), "content": content or "", "tool_calls": calls, "tool_call_id": message.get("tool_call_id")}


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it (tool-call arguments as objects, content a string)."""
    out = {"role": message["role"], "content": _normalised(message)["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "id": c.get("id"), "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in message["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def parse_tool_calls(text: str, tools: list[dict]) -> tuple[str, list[dict]]:
    """The `<tool_call>{"name", "arguments"}</tool_call>` blocks of a reply (Hermes/Qwen convention) that
    name one of `tools`, as OpenAI tool calls; the text before the first is the content. A block that is not
    such a call stays in the content: the agent sees what the model wrote."""
    names = {t.get("function", {}).get("name") for t in tools}
    calls = []
    for found in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(found.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or call.get("name") not in names:
            return text, []
        arguments = call.get("arguments", {})
        calls.append({
            "id": f"call_{secrets.token_hex(8)}", "type": "function",
            "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        })
    content = text[: text.find("<tool_call>")].strip() if calls else text
    return content, calls


@dataclass
class AgentEpisode:
    """One episode's model calls, recorded as segments. Calls are served one at a time (an agent that calls
    concurrently gets them in arrival order: an episode is one conversation)."""

    engine: Sampler
    chat: ChatFormat
    sampling: SamplingParams
    budget: Budget
    request_id: str
    model_name: str = "policy"
    segments: list[SegmentRecord] = field(default_factory=list)
    discarded_calls: int = 0
    generated: int = 0
    calls: int = 0
    exhausted: str | None = None  # what ended the episode's calls ("turns", "tokens", "context", "engine")
    engine_error: str | None = None  # the engine failed a call: the episode is an infra failure, retried
    model_seconds: float = 0.0  # time the agent spent waiting for its calls (not its own: the wall-time budget excludes it)
    _last: tuple[list[dict], list[dict], list[int], list[int]] | None = None  # messages (ours), tools, ids, generated
    _last_text: tuple[str | None, list[int], list[int]] | None = None  # /v1/completions: prompt, ids, generated
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def _render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        extra = {"tools": tools} if tools else {}
        return self.chat.tokenizer.apply_chat_template(
            [_for_template(m) for m in messages], tokenize=False, add_generation_prompt=generation_prompt, **extra
        )

    def prompt_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        """The ids the model sees for `messages`: the previous call's ids and what was appended since, or, when
        the conversation was not extended, a fresh rendering that starts a new chain."""
        if self._last is not None:
            previous, previous_tools, ids, generated = self._last
            extends = (
                tools == previous_tools
                and len(messages) > len(previous)
                and [_normalised(m) for m in messages[: len(previous)]] == [_normalised(m) for m in previous]
            )
            if extends:
                conversation = previous + messages[len(previous) :]  # our own copy of what the model said
                head = self._render(previous, tools, False)
                full = self._render(conversation, tools, True)
                if full.startswith(head) and head.endswith(self.chat.turn_close):
                    return ids + self.chat.continuation_ids(full[len(head) :], generated)
        return self.chat.tokenizer.encode(self._render(messages, tools, True), add_special_tokens=False)

    def _chained(self, ids: list[int]) -> list[int]:
        """`ids`, after ending the chain of segments when they do not extend its last call's ids."""
        if self.segments:
            last = self.segments[-1]
            head = list(last.prompt_ids) + list(last.generated_ids)
            if ids[: len(head)] != head:
                self.discarded_calls += len(self.segments)
                self.segments = []
        return ids

    async def _timed(self, serve, body: dict[str, Any]) -> dict[str, Any]:
        arrived = time.monotonic()
        try:
            return await serve(body)
        finally:
            self.model_seconds += time.monotonic() - arrived

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """`/v1/chat/completions` (without streaming: `stream` is the server's framing of the same answer)."""
        return await self._timed(self._chat, body)

    async def complete_text(self, body: dict[str, Any]) -> dict[str, Any]:
        """`/v1/completions`: the agent's own prompt, chained to the previous call's ids where it extends them."""
        return await self._timed(self._text, body)

    async def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        messages, tools = body.get("messages"), body.get("tools") or []
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("messages: a non-empty list of {role, content} objects")
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise RequestError("tool_choice: only 'auto' and 'none' (the policy decides whether to call a tool)")
        if body.get("tool_choice") == "none":
            tools = []
        call = _Call.of(body)
        async with self._lock:
            reply = await self._sample(call, lambda: self.prompt_ids(messages, tools))
            content, calls = parse_tool_calls(reply.text, tools) if tools else (reply.text, [])
            if calls:
                self.segments[-1] = replace(self.segments[-1], tool_events=[{"openai_tool_calls": [c["function"] for c in calls]}])
            message = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
            self._last = (list(messages) + [message], tools, reply.ids + reply.kept, reply.kept)
            self._last_text = None
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else reply.finish}
        if call.logprobs:
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": lp, "bytes": None, "top_logprobs": []} for token, lp in zip(reply.tokens(self.chat), reply.logprobs)
            ]}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
            "choices": [choice], "usage": reply.usage(),
        }

    async def _text(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise RequestError("prompt: one prompt per call (an episode is one line of play); a batch of prompts is several episodes")
            prompt = prompt[0]
        if isinstance(prompt, list) and (not prompt or not all(isinstance(t, int) and 0 <= t < len(self.chat.tokenizer) for t in prompt)):
            raise RequestError(f"prompt: a string or one list of token ids below the vocabulary size {len(self.chat.tokenizer)}")
        if not isinstance(prompt, (str, list)) or not prompt:
            raise RequestError("prompt: a non-empty string or one list of token ids")
        if body.get("echo"):
            raise RequestError("echo: not served (the prompt is the agent's own text)")
        call = _Call.of(body)
        async with self._lock:
            reply = await self._sample(call, lambda: self.text_prompt_ids(prompt))
            self._last_text = ((prompt if isinstance(prompt, str) else None), reply.ids + reply.kept, reply.kept)
            self._last = None
        choice: dict[str, Any] = {"index": 0, "text": reply.text, "finish_reason": reply.finish, "logprobs": None}
        if call.logprobs:
            tokens = reply.tokens(self.chat)
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": reply.logprobs, "top_logprobs": None, "text_offset": None}
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": self.model_name,
            "choices": [choice], "usage": reply.usage(),
        }

    def text_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's ids: given ids as they are; a string that starts with the previous call's
        prompt and the text of every id it generated continues those ids; any other string is tokenised
        whole, starting a new chain."""
        if isinstance(prompt, list):
            return list(prompt)
        if self._last_text is not None and self._last_text[0] is not None:
            previous, previous_ids, generated = self._last_text
            head = previous + self.chat.tokenizer.decode(generated)  # (special tokens too: an eos the agent dropped breaks the chain)
            if prompt.startswith(head):
                return previous_ids + self.chat.tokenizer.encode(prompt[len(head) :], add_special_tokens=False)
        return self.chat.tokenizer.encode(prompt, add_special_tokens=False)

    async def _sample(self, call: "_Call", prompt_ids) -> "_Reply":
        """One model call within the episode's budgets, recorded as a segment (under the episode's lock)."""
        if self.exhausted:
            raise RequestError(f"the episode's budget is spent ({self.exhausted}); the agent should give its answer", "budget_exhausted")
        if self.calls >= self.budget.max_calls:
            self.exhausted = "turns"
            raise RequestError(f"the episode's {self.budget.max_calls} model calls are spent", "budget_exhausted")
        remaining = self.budget.max_tokens - self.generated
        if remaining <= 0:
            self.exhausted = "tokens"
            raise RequestError(f"the episode's {self.budget.max_tokens} generated tokens are spent", "budget_exhausted")
        ids = self._chained(prompt_ids())
        asked = call.max_tokens or self.sampling.max_new_tokens
        sampling = replace(self.sampling, max_new_tokens=max(1, min(asked, self.sampling.max_new_tokens, remaining)), stop=call.stop)
        rid = f"{self.request_id}/c{self.calls}/"  # prefix-free (SGLang aborts by prefix)
        self.calls += 1
        started = _now()
        try:
            gen = await self.engine.generate(ids, sampling, rid)
        except ContextOverflow:
            self.exhausted = "context"
            raise RequestError("the conversation is longer than the model's context", "context_length_exceeded") from None
        if gen.finish_reason == "abort":
            raise EngineError(f"request {rid} was aborted by the engine (weight update or shutdown)")
        generated = list(gen.token_ids)
        self.generated += len(generated)  # (all of it: the engine spent them)
        kept, text, stopped = cut_at_stop(self.chat, generated, call.stop)
        logprobs = list(gen.logprobs[: len(kept)])
        self.segments.append(SegmentRecord(
            request_id=rid, policy_version=gen.policy_version, tokenizer_version=self.chat.version, prompt_ids=ids,
            generated_ids=kept, action_loss_mask=[1] * len(kept), rollout_logprobs=logprobs,
            logprob_semantics=gen.logprob_semantics, sampling_config=sampling.to_dict(),
            version_spans=gen.recorded_spans(len(kept)), started_at=started, ended_at=_now(),
        ))
        return _Reply(ids, kept, text, logprobs, "length" if gen.finish_reason == "length" and not stopped else "stop")


@dataclass(frozen=True)
class _Call:
    """What a request asks of its one sample."""

    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool

    @classmethod
    def of(cls, body: dict[str, Any]) -> "_Call":
        if int(body.get("n") or 1) != 1:
            raise RequestError("n: an episode samples one reply per call (n: 1); sample more episodes for more samples")
        stop = body.get("stop")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop: a non-empty string or a list of up to 4 of them")
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None and (not isinstance(asked, int) or asked < 1):
            raise RequestError("max_tokens: a positive integer")
        return cls(asked, stop, bool(body.get("logprobs")))


@dataclass(frozen=True)
class _Reply:
    ids: list[int]  # the prompt
    kept: list[int]  # what the trajectory keeps of the sample (through a stop string)
    text: str  # what the agent gets
    logprobs: list[float]
    finish: str

    def tokens(self, chat: ChatFormat) -> list[str]:
        return [chat.tokenizer.convert_ids_to_tokens(t) for t in self.kept]

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.ids), "completion_tokens": len(self.kept), "total_tokens": len(self.ids) + len(self.kept)}


def cut_at_stop(chat: ChatFormat, generated: list[int], stop: tuple[str, ...]) -> tuple[list[int], str, bool]:
    """The sample up to the first stop string: the ids through the one that completes it (what the model
    sampled before it stopped), the text before it (what OpenAI returns) and whether one was found."""
    text = chat.decode(generated)
    found = [(text.find(s), s) for s in stop if s in text]
    if not found:
        return generated, text, False
    at, s = min(found)
    for n in range(1, len(generated) + 1):
        if len(chat.decode(generated[:n])) >= at + len(s):
            return generated[:n], text[:at], True
    return generated, text[:at], True


def chat_chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished completion as `chat.completion.chunk`s: the role, the content, each tool call, the finish."""
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"], "model": response["model"]}
    choice = response["choices"][0]
    message = choice["message"]
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if message.get("content"):
        deltas.append({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or ()):
        deltas.append({"tool_calls": [{"index": i, **call}]})
    chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    last: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    if "logprobs" in choice:
        last["logprobs"] = choice["logprobs"]
    chunks.append({**base, "choices": [last], "usage": response["usage"]})
    return chunks


def text_chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished text completion as streamed `text_completion`s: the text, then the finish."""
    base = {k: response[k] for k in ("id", "object", "created", "model")}
    choice = response["choices"][0]
    return [
        {**base, "choices": [{"index": 0, "text": choice["text"], "finish_reason": None, "logprobs": choice["logprobs"]}]},
        {**base, "choices": [{"index": 0, "text": "", "finish_reason": choice["finish_reason"], "logprobs": None}], "usage": response["usage"]},
    ]
