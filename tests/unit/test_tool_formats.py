"""Issue 48, section 1: a policy's tool calls are read in the convention its chat template teaches (Hermes/Qwen,
Llama 3.x JSON, Mistral, pythonic), chosen from the template, and `tool_choice` forces a call in that format.
Hand-written cases per format; then through the endpoint with the real openai SDK, on templates written for
these tests in each convention (the starter's tokenizer)."""

from __future__ import annotations

import json

import openai
import pytest

from loopline.rollout.endpoint.server import OpenAIServer
from loopline.rollout.endpoint.tool_formats import FORMATS, of_template
from tests.unit.test_openai_endpoint import _episode, tokenizer  # noqa: F401 (a fixture)
from tests.unit.test_tool_calls import HERMES_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "arithmetic", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
HERMES_ASK = 'To call one, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>'
TEMPLATES = {  # the Hermes test template, its instruction written in each convention
    "hermes": HERMES_TEMPLATE,
    "mistral": HERMES_TEMPLATE.replace(HERMES_ASK, 'To call one, write [TOOL_CALLS] [{"name": NAME, "arguments": {...}}]'),
    "llama3_json": HERMES_TEMPLATE.replace(HERMES_ASK, 'To call one, write only <|python_tag|>{"name": NAME, "parameters": {...}}'),
    "pythonic": HERMES_TEMPLATE.replace(HERMES_ASK, "To call one, write only [func_name1(params_name1=params_value1)]"),
}
# (what the policy writes, the content the agent gets, the calls as (name, arguments))
WRITTEN = {
    "hermes": ('Let me compute. <tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>', "Let me compute.", [("calc", {"expression": "1+2"})]),
    "mistral": ('Sure [TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "1+2"}}, {"name": "calc", "arguments": {"expression": "3"}}]', "Sure",
                [("calc", {"expression": "1+2"}), ("calc", {"expression": "3"})]),
    "llama3_json": ('<|python_tag|>{"name": "calc", "parameters": {"expression": "1+2"}}', "", [("calc", {"expression": "1+2"})]),
    "pythonic": ('[calc(expression="1+2"), calc(expression="4 * 5")]', "", [("calc", {"expression": "1+2"}), ("calc", {"expression": "4 * 5"})]),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_reads_its_calls_and_leaves_anything_else_as_content(name):
    fmt = FORMATS[name]
    assert of_template(TEMPLATES[name]) is fmt
    written, content, calls = WRITTEN[name]
    got_content, got = fmt.parse(written, TOOLS)
    assert got_content == content and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    for other in (written.replace("calc", "nope"), written[:-3], "just text", ""):  # an unknown tool, cut short, no call
        assert fmt.parse(other, TOOLS) == (other, [])


def test_a_template_that_names_no_convention_is_read_as_hermes():
    assert of_template(None) is of_template("{{ messages }}") is FORMATS["hermes"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_through_the_endpoint_a_call_in_the_templates_format_reaches_the_sdk_and_tool_choice_forces_that_format(tokenizer, name):  # noqa: F811
    fmt = FORMATS[name]
    written, _, calls = WRITTEN[name]
    forced_rest = {"hermes": 'calc", "arguments": {"expression": "7"}}</tool_call>', "mistral": 'calc", "arguments": {"expression": "7"}}]',
                   "llama3_json": 'calc", "parameters": {"expression": "7"}}', "pythonic": 'calc(expression="7")]'}[name]
    replies = [tokenizer.encode(written, add_special_tokens=False), tokenizer.encode(forced_rest, add_special_tokens=False)]
    episode, engine, chat = _episode(tokenizer, replies, template=TEMPLATES[name])
    assert chat.tool_format() is fmt
    with OpenAIServer() as server:
        client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="unused")
        user = [{"role": "user", "content": "What is 1 + 2?"}]
        free = client.chat.completions.create(model="policy", messages=user, tools=TOOLS).choices[0]
        forced = client.chat.completions.create(model="policy", messages=user, tools=TOOLS, tool_choice="required").choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in free.message.tool_calls] == calls and free.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in forced.message.tool_calls] == [("calc", {"expression": "7"})]
    prefix = tokenizer.encode(fmt.required, add_special_tokens=False)
    assert engine.prompts[1][-len(prefix) :] == prefix  # the forced start, in the template's convention, as prompt


def test_a_scripted_reply_after_a_forced_tool_call_start_is_not_said_twice():
    """`envreg test`'s scripted model: with `tool_choice: "required"` (smolagents' ToolCallingAgent sends it on every
    call) the endpoint puts the call's start after the prompt, and the scripted reply, the whole call, came after it:
    a second `<tool_call>`, a malformed call, and the program never finished where a server gave the right answer."""
    import asyncio

    from transformers import AutoTokenizer

    from loopline.rollout.engines.base import SamplingParams
    from loopline.rollout.harness.agent_program import ScriptedModel
    from loopline.rollout.harness.chat import ChatFormat
    from tests.unit.test_openai_endpoint import STARTER

    chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(STARTER))
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>'
    model = ScriptedModel(chat, [call, "3"], 10_000)
    forced = chat.initial_ids("", "1+2?") + chat.tokenizer.encode(FORMATS["hermes"].required, add_special_tokens=False)
    reply = asyncio.run(model.generate(forced, SamplingParams(max_new_tokens=64), "r/c1/"))
    assert chat.tokenizer.decode(forced[-40:] + list(reply.token_ids[:-1])).count("<tool_call>") == 1
    assert chat.tokenizer.decode(list(reply.token_ids[:-1])) == call.removeprefix(FORMATS["hermes"].required)
    unforced = asyncio.run(model.generate(chat.initial_ids("", "and then?"), SamplingParams(max_new_tokens=64), "r/c2/"))
    assert chat.tokenizer.decode(list(unforced.token_ids[:-1])) == "3" and model.said == [call, "3"]
