"""An OpenAI-compatible endpoint over the run's engine, so that an agent program written against the `openai`
SDK (or LangGraph, smolagents, curl) plays episodes unchanged, and every call it makes is recorded as a
token-exact segment.

The trap it avoids is re-tokenisation: the API speaks text, and tokenising the conversation again for
training gives other tokens than the model sampled. So an episode keeps the ids of its last call (prompt +
generated) and, when the next call's messages extend that conversation (the agent appended the reply it got
and what followed: tool results, a new user turn), the new prompt is exactly those ids followed by the
template's rendering of what was appended, as the built-in harness builds its turns (`ChatFormat`). The
sampled ids are never decoded and encoded again. A call whose messages do not extend the previous call's
(the agent rewrote or trimmed its history, re-sent its tool results as text, or made two calls at once) starts
a new chain of segments (`starts_chain`): the trajectory keeps every chain, and each is trained as a sequence of
its own with the episode's advantage.

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
import ctypes
import ctypes.util
import hashlib
import json
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from loopline.rollout.harness.chat import ChatFormat, hermes_tool_prompt
from loopline.rollout.engines.base import ContextOverflow, EngineClosed, EngineError, Sampler, SamplingParams
from loopline.rollout.endpoint.tool_formats import FORMATS, ToolCallFormat
from loopline.types import SegmentRecord

log = logging.getLogger(__name__)


class RequestError(Exception):
    """An error the agent is told (HTTP 400, OpenAI's error shape): its request, or a spent budget."""

    def __init__(self, message: str, code: str = "invalid_request_error", status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


MAX_REFUSALS_KEPT = 3
# A request's own work (JSON, checks, the chat template, tokenising, the chain check) runs here, never on the
# endpoint's event loop, and one piece of an episode's at a time: one request within every bound (12 MiB of
# message text) held the loop for 19 s and every other episode's call waited behind it.
_CPU = ThreadPoolExecutor(max_workers=4, thread_name_prefix="loopline-endpoint")
LARGE_REQUEST_BYTES = 1 << 20  # past it, the memory the request took is handed back to the system afterwards


def _libc_trim():
    """glibc's malloc_trim, or None elsewhere: what a large request freed goes back to the system (it stayed:
    597 -> 2,683 MB after one)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_trim = _libc_trim()


def hand_back_memory() -> None:
    if _trim is not None:
        _trim(0)


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


def _with_system(messages: list[dict], prompt: str) -> list[dict]:
    """`prompt` after the conversation's system message (Qwen2.5 puts its tool prompt there), or as one."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _calls_as_text(message: dict) -> dict:
    """An assistant turn's tool calls as the `<tool_call>` blocks it wrote (a template that drops `tool_calls`
    would show the policy its own turn without them when a conversation is rendered afresh)."""
    if not message.get("tool_calls"):
        return message
    blocks = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n</tool_call>"
              for c in message["tool_calls"]]
    text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning(message)


def forced_call_prefix(choice: Any, tools: list[dict], fmt: ToolCallFormat = FORMATS["hermes"]) -> str:
    """What `tool_choice` forces the reply to start with, in the policy's tool-call format (`fmt`): `required`
    opens a call and leaves the policy the function's name; a named function also writes the name. The policy
    samples the rest (its arguments); the forced text is prompt, never trained."""
    names = [t["function"]["name"] for t in tools]
    if choice in (None, "auto", "none"):
        return ""
    if choice == "required":
        if not tools:
            raise RequestError("tool_choice: 'required' needs tools")
        return fmt.required
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise RequestError("tool_choice: 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in names:
        raise RequestError(f"tool_choice: function {name!r} is not one of the request's tools ({', '.join(names) or 'none'})")
    return fmt.named(name)


def parse_tool_calls(text: str, tools: list[dict], fmt: ToolCallFormat = FORMATS["hermes"]) -> tuple[str, list[dict]]:
    """The calls of `tools` a reply makes in the policy's tool-call format (`tool_formats`), as OpenAI tool calls;
    the text before them is the content. A reply without a well-formed call of one of `tools` is all content:
    the agent sees what the model wrote."""
    content, calls = fmt.parse(text, tools)
    return content, [{"id": f"call_{secrets.token_hex(8)}", **call} for call in calls]


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
    chains: int = 0  # chains of segments so far (a call that does not extend the previous one's ids starts one)
    generated: int = 0
    calls: int = 0
    exhausted: str | None = None  # what ended the episode's calls ("turns", "tokens", "context", "engine", "requests")
    requests_open: int = 0  # HTTP requests of this episode being served (bounded: see openai_server)
    engine_error: str | None = None  # the engine failed a call: the episode is an infra failure, retried
    engine_closed: bool = False  # ... because this process closed it (stopping): not a failure (EngineClosed)
    refused: list[str] = field(default_factory=list)  # the first requests the endpoint refused (4xx), said in the episode's info
    refusals: int = 0
    model_seconds: float = 0.0  # time with a call of the agent's waiting for the model (not its own: see `waited`)
    _waiting: int = 0  # calls in flight now (an agent may make several at once)
    _waiting_since: float = 0.0
    _last: tuple[list[dict], list[dict], list[int], list[int]] | None = None  # messages (ours), tools, ids, generated
    _last_text: tuple[str | None, list[int], list[int]] | None = None  # /v1/completions: prompt, ids, generated
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _cpu: asyncio.Lock = field(default_factory=asyncio.Lock)  # one piece of this episode's request work at a time

    async def offload(self, fn, *args):
        """`fn(*args)` on the endpoint's CPU threads, this episode's one at a time: an episode's heavy request
        takes one thread of a few, never the event loop every episode's calls go through."""
        async with self._cpu:
            try:
                work = asyncio.get_running_loop().run_in_executor(_CPU, fn, *args)
            except RuntimeError:  # (the process is exiting: its threads are gone, and the request with them)
                raise EngineClosed("the endpoint is stopping") from None
            return await work

    def _render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        shown = [_for_template(m) for m in messages]
        extra: dict[str, Any] = {}
        if tools and self.chat.renders_tools():
            extra["tools"] = tools
        elif tools:  # the template drops them (SmolLM2's): the policy must still see them, in the format parsed back
            _say_once(
                "tools: the policy's chat template does not render them; loopline writes them into the system message "
                "as Hermes's tool prompt (tool calls are read back from <tool_call> blocks)"
            )
            shown = _with_system([_calls_as_text(m) for m in shown], hermes_tool_prompt(tools))
        try:
            return self.chat.tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=generation_prompt, **extra)
        except TemplateError as exc:  # (e.g. roles that do not alternate as the template requires)
            raise RequestError(f"messages: the model's chat template refused them: {exc}") from None

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

    def _starts_chain(self, ids: list[int]) -> bool:
        """Whether a call of these ids starts a chain: the episode's first call, or one whose ids do not extend
        the last call's (counted in `chains`)."""
        if self.segments:
            last = self.segments[-1]
            head = list(last.prompt_ids) + list(last.generated_ids)
            if ids[: len(head)] == head:
                return False
        self.chains += 1
        return True

    def refuse(self, error: "RequestError") -> None:
        """A request of the program's this endpoint refused: the program's doing (a parameter not served, a prompt
        past the context), never the infrastructure's; the first few are kept for the episode's info."""
        self.refusals += 1
        if len(self.refused) < MAX_REFUSALS_KEPT:
            self.refused.append(f"{error.status} {error.code}: {error}")

    def waited(self, now: float) -> float:
        """Seconds until `now` that the agent spent waiting for the model, the call in flight included: the
        wall-time budget excludes them (they grow with the engine's load, not by the agent's doing)."""
        return self.model_seconds + (now - self._waiting_since if self._waiting else 0.0)

    async def _timed(self, serve, body: dict[str, Any]) -> dict[str, Any]:
        if not self._waiting:
            self._waiting_since = time.monotonic()
        self._waiting += 1
        try:
            return await serve(body)
        finally:  # (read from the episode's thread: the time is added before the count drops, never after)
            if self._waiting == 1:
                self.model_seconds += time.monotonic() - self._waiting_since
            self._waiting -= 1

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """`/v1/chat/completions` (without streaming: `stream` is the server's framing of the same answer)."""
        return await self._timed(self._chat, body)

    async def complete_text(self, body: dict[str, Any]) -> dict[str, Any]:
        """`/v1/completions`: the agent's own prompt, chained to the previous call's ids where it extends them."""
        return await self._timed(self._text, body)

    def _chat_request(self, body: dict[str, Any]) -> tuple[list[dict], list[dict], str]:
        messages, tools = _checked_messages(body.get("messages")), _checked_tools(body.get("tools") or [])
        forced = forced_call_prefix(body.get("tool_choice"), tools, self.chat.tool_format())
        return messages, ([] if body.get("tool_choice") == "none" else tools), forced

    async def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        messages, tools, forced = await self.offload(self._chat_request, body)
        fmt = self.chat.tool_format()
        call = _Call.of(body)
        async with self._lock:
            # a forced prefix goes after the prompt, as prompt: the policy did not choose it, so it is never trained
            reply = await self._sample(call, lambda: self.prompt_ids(messages, tools) + self.chat.tokenizer.encode(forced, add_special_tokens=False))
            said = forced + reply.text
            said += fmt.close(said) if forced else ""  # (a forced call the policy left open)
            content, calls = parse_tool_calls(said, tools, fmt) if tools else (reply.text, [])
            calls = calls[:1] if call.one_call else calls
            events = ([{"openai_tool_calls": [c["function"] for c in calls]}] if calls else []) + ([{"forced": forced}] if forced else [])
            if events:
                self.segments[-1] = replace(self.segments[-1], tool_events=events)
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

    def _text_prompt(self, body: dict[str, Any]) -> str | list[int]:
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
        return prompt

    async def _text(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = await self.offload(self._text_prompt, body)
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
        ids = await self.offload(prompt_ids)
        starts_chain = await self.offload(self._starts_chain, ids) and bool(self.segments)  # (the first chain is the trajectory's own)
        asked = call.max_tokens or self.sampling.max_new_tokens
        sampling = replace(self.sampling, max_new_tokens=max(1, min(asked, self.sampling.max_new_tokens, remaining)), stop=call.stop)
        if call.seed is not None:  # the same draws for the same call of the same sample; the group's samples still differ
            # (an agent that always sends seed=42 would otherwise make every sample of a group the same: nothing to learn)
            digest = hashlib.sha256(f"{call.seed}/{self.request_id}/{self.calls}".encode()).digest()
            sampling = replace(sampling, seed=int.from_bytes(digest[:4], "little"))
        rid = f"{self.request_id}/c{self.calls}/"  # prefix-free (SGLang aborts by prefix)
        self.calls += 1
        started = _now()
        try:
            gen = await self.engine.generate(ids, sampling, rid)
        except ContextOverflow as exc:
            self.exhausted = "context"
            raise RequestError(f"the conversation is longer than the model's context: {exc}", "context_length_exceeded") from None
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
            version_spans=gen.recorded_spans(len(kept)), started_at=started, ended_at=_now(), starts_chain=starts_chain,
        ))
        return _Reply(ids, kept, text, logprobs, "length" if gen.finish_reason == "length" and not stopped else "stop")


@dataclass(frozen=True)
class _Call:
    """What a request asks of its one sample."""

    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool
    seed: int | None = None
    one_call: bool = False  # parallel_tool_calls: false (the first call of a reply is the reply's call)

    @classmethod
    def of(cls, body: dict[str, Any]) -> "_Call":
        n = body.get("n")
        if n is not None and (not _integer(n) or n != 1):
            raise RequestError("n: an episode samples one reply per call (n: 1); sample more episodes for more samples")
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, (str, list)):
            raise RequestError("stop: a non-empty string or a list of up to 4 of them")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop: a non-empty string or a list of up to 4 of them")
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None and (not _integer(asked) or asked < 1):
            raise RequestError("max_tokens: a positive integer")
        for name in ("stream", "echo"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise RequestError(f"{name}: true or false")
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], (bool, int)):  # (/v1/completions: a count)
            raise RequestError("logprobs: true or false (chat), a number of logprobs (completions)")
        # what would change the answer and cannot be served is refused, never silently ignored
        if body.get("top_logprobs"):
            raise RequestError("top_logprobs: not served (the engines return the logprob of the sampled token only: logprobs: true)")
        shape = body.get("response_format")
        if shape is not None and (not isinstance(shape, dict) or shape.get("type") != "text"):
            kind = shape.get("type") if isinstance(shape, dict) else shape
            raise RequestError(
                f"response_format: {kind!r} is not served: the policy's output is not constrained (ask for JSON in the prompt and parse it)"
            )
        seed = body.get("seed")
        if seed is not None and not _integer(seed):
            raise RequestError("seed: an integer")
        if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
            raise RequestError("parallel_tool_calls: true or false")
        return cls(asked, stop, bool(body.get("logprobs")), seed, body.get("parallel_tool_calls") is False)


MAX_MESSAGES = 4096  # messages in one request (each is rendered into the prompt)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked_messages(messages: Any) -> list[dict]:
    """The request's `messages` as OpenAI takes them, or a 400 naming the field (never a 500 from deeper in)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"messages: at most {MAX_MESSAGES} in one request, got {len(messages)}")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"{where}: an object with a `role` string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"{where}.content: a string, a list of content parts or null")
        if isinstance(content, list) and not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
            raise RequestError(f"{where}.content: content parts are objects whose `text` is a string")
        calls = message.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list)
            and all(isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str) for c in calls)
        ):
            raise RequestError(f"{where}.tool_calls: a list of {{id, type, function: {{name, arguments}}}} objects")
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise RequestError(f"{where}.{key}: a string")
    return messages


def _checked_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str) for t in tools
    ):
        raise RequestError("tools: a list of {type: function, function: {name, description, parameters}} objects")
    return tools


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
