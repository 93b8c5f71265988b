"""A fuzzer over everything an agent writes that loopline reads: its turns (parsed for tool calls), its tool
calls' arguments (run in a real local sandbox), its requests to the agent endpoint (over HTTP), and what the
ledger stores of them. Arbitrary text and bytes (NUL, lone surrogates, huge, deeply nested, missing and extra
fields, wrong types) must each end as an outcome: an observation told to the model, an HTTP status in OpenAI's
shape (never a 500), a storable record; never an exception out of the episode.

Fixed example budgets and a fixed seed (`derandomize`): the same inputs in every CI run, a failure reproduces."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from loopline.envregistry.episode import MAX_COMMAND_BYTES, MAX_OBSERVATION_CHARS, Episode, Observation, ToolCall
from loopline.envregistry.spec import LocalSettings, Tool, ToolArg
from loopline.envregistry.tasks import Task
from loopline.rollout.harness.actions import parse_action
from loopline.rollout.endpoint.server import OpenAIServer
from loopline.store.nul import restored, storable
from tests.integration.test_train_flow import STARTER
from tests.unit.test_envspec import ARITHMETIC
from tests.unit.test_openai_endpoint import _episode

def fuzz(examples: int = 100) -> settings:
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))

# Any code point, lone surrogates and NUL included (hypothesis leaves surrogates out of text by default).
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=300)
HUGE_TEXT = st.integers(130_000, 300_000).map(lambda n: "x" * n)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@fuzz()
@given(text=ANY_TEXT | HUGE_TEXT, style=st.sampled_from(["tags", "hermes"]))
def test_any_turn_parses_to_an_action(text, style):
    from loopline.envregistry.spec import load_spec

    tools = load_spec(ARITHMETIC).tools
    parse_action(text, tools, style)
    parse_action(f"<tool_call>{text}</tool_call>", tools, "hermes")
    parse_action(f"<calc>{text}</calc>", tools, "tags")


TOOLS = (
    Tool(name="echo", description="d", command="printf %s {text} {extra}", stdin="{text}", timeout_s=5,
         args={"text": ToolArg(), "extra": ToolArg(required=False), "n": ToolArg(type="integer", required=False)}),
)
ARG_NAMES = st.sampled_from(["text", "extra", "n"]) | ANY_TEXT
ARGS = st.dictionaries(ARG_NAMES, JSON | HUGE_TEXT, max_size=4)


WELL_FORMED = st.tuples(st.just("echo"), st.fixed_dictionaries({"text": ANY_TEXT | HUGE_TEXT}, optional={"extra": ANY_TEXT}))


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the local backend runs commands in bubblewrap")
@fuzz(60)
@given(calls=st.lists(WELL_FORMED | st.tuples(st.sampled_from(["echo", "calc", "nosuch"]) | ANY_TEXT, ARGS), min_size=1, max_size=3))
def test_any_tool_call_is_an_observation_in_a_real_sandbox(calls):
    from loopline.envregistry.spec import load_spec

    spec = load_spec(ARITHMETIC)
    spec = spec.model_copy(update={"tools": (*spec.tools, *TOOLS), "sandbox": LocalSettings(backend="local")})

    async def play():
        episode = await Episode.start(spec, Task("t", "train", "p", {"expression": "1 + 1", "answer": 2}))
        try:
            return [await episode.step(ToolCall(name, args)) for name, args in calls]
        finally:
            await episode.close()

    for (name, args), observation in zip(calls, asyncio.run(play())):
        assert isinstance(observation, Observation) and _encodable(observation.text)
        if name == "echo" and set(args) <= {"text", "extra"} and all(isinstance(v, str) for v in args.values()) and "text" in args:
            printed = args["text"] + args.get("extra", "")
            # what no sandbox can carry is told to the model; the rest runs exactly as written (the quoting held)
            if not _encodable(printed) or "\x00" in printed or len(printed.encode()) > MAX_COMMAND_BYTES:
                assert observation.error, (args, observation)
            elif len(printed) < MAX_OBSERVATION_CHARS:
                assert (observation.text, observation.error) == (printed, False), (args, observation)


@fuzz()
@given(value=JSON)
def test_whatever_the_agent_wrote_is_storable(value):
    stored = storable(value)
    text = json.dumps(stored, ensure_ascii=False)
    assert "\x00" not in text and "\\u0000" not in text and _encodable(text)
    # lossless but for what has no storable form by design: lone surrogates (U+FFFD) and NULs in keys (\\x00)
    if _encodable(json.dumps(value, ensure_ascii=False)) and not _nul_in_a_key(value):
        assert restored(stored) == value


def _nul_in_a_key(value) -> bool:
    if isinstance(value, dict):
        return any("\x00" in k or _nul_in_a_key(v) for k, v in value.items())
    return isinstance(value, list) and any(_nul_in_a_key(v) for v in value)


@pytest.fixture(scope="module")
def endpoint():
    tokenizer = AutoTokenizer.from_pretrained(STARTER)
    episode, _, _ = _episode(tokenizer, [[42]] * 10_000, max_calls=10_000, max_tokens=10**9)
    with OpenAIServer() as server, httpx.Client(timeout=30) as client:  # (one client: a connection per request cost most of the test)
        yield server.base_url(server.open(episode)), client


MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | JSON},
    optional={"content": JSON, "tool_calls": JSON, "tool_call_id": JSON, "name": JSON},
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=4) | JSON},
    optional={key: JSON for key in ("n", "stop", "tools", "tool_choice", "max_tokens", "logprobs", "stream", "temperature")},
)
TEXT = st.fixed_dictionaries({"prompt": JSON}, optional={key: JSON for key in ("n", "stop", "max_tokens", "logprobs", "echo", "stream")})
ITEM = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | JSON},
    optional={key: JSON for key in ("role", "content", "call_id", "name", "arguments", "output")},
)
RESPONSES = st.fixed_dictionaries(
    {"input": st.lists(ITEM, max_size=4) | JSON},
    optional={key: JSON for key in ("instructions", "tools", "tool_choice", "max_output_tokens", "text", "stream", "previous_response_id")},
)


@fuzz(200)
@given(path=st.sampled_from(["chat/completions", "completions", "responses"]), body=CHAT | TEXT | RESPONSES | JSON, raw=st.binary(max_size=64))
def test_any_request_gets_an_answer_in_openais_shape_never_a_500(endpoint, path, body, raw):
    base, client = endpoint
    for content in (json.dumps(body), raw):
        response = client.post(f"{base}/{path}", content=content, headers={"content-type": "application/json"})
        assert response.status_code in (200, 400), (response.status_code, response.text[:300])
        if response.status_code == 400:
            assert set(response.json()["error"]) == {"message", "type", "code"}
