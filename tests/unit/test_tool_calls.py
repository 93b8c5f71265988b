"""`tool_calls: hermes`: the chat template's own tool calling, token-exact as the tag format.

The template below is written for this test in the Hermes convention (tools as JSON inside <tools></tools>
in the system turn, calls as <tool_call>{"name", "arguments"}</tool_call>, outputs as <tool_response> in a
user turn; the outputs of several calls of one turn together in one), which Qwen2.5/3 and Hermes models are
trained on; the starter's tokenizer renders it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loopline.envregistry.episode import ToolCall
from loopline.envregistry.spec import load_spec
from loopline.envregistry.tasks import Task
from loopline.rollout.harness.actions import Calls, NoAction, Unparsable, parse_action, tool_schemas
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import SamplingParams
from loopline.rollout.harness.episode import EpisodeSetup, run_episode
from tests.integration.test_train_flow import STARTER
from tests.ledger.test_harness import ScriptedEngine

ARITHMETIC = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_env.yaml"
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call these functions, each described as JSON within <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "12 + 3 * 4"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(STARTER)
    tok.chat_template = HERMES_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def spec():
    spec = load_spec(ARITHMETIC)
    return spec.model_copy(update={"tool_calls": "hermes", "reset": spec.reset.model_copy(update={"observation": "{output}"})})


def test_a_hermes_call_is_parsed_and_what_is_not_one_is_told_back(spec):
    tools = spec.tools
    assert parse_action(f"let me compute {CALL}", tools, "hermes") == Calls((ToolCall("calc", {"expression": "12 + 3 * 4"}),))
    as_string = '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1 + 1\\"}"}</tool_call>'
    assert parse_action(as_string, tools, "hermes") == Calls((ToolCall("calc", {"expression": "1 + 1"}),))
    assert parse_action("<answer>24</answer>", tools, "hermes") == NoAction()  # no call: the turn is the answer
    assert parse_action("<calc>1 + 1</calc>", tools, "hermes") == NoAction()  # the tag format is not a call here
    for text, said in (
        ('<tool_call>{"name": "shell", "arguments": {}}</tool_call>', "no tool named 'shell'; the tools are: calc"),
        ("<tool_call>{name: calc}</tool_call>", "must be a JSON object"),
        ('<tool_call>["calc"]</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "arguments of calc must be a JSON object"),
        ('<tool_call>{"name": "calc", "arguments": {}}', "never closed"),
    ):
        (call,) = parse_action(text, tools, "hermes").calls
        assert isinstance(call, Unparsable) and said in call.message, (text, call)


def test_the_template_describes_the_tools_and_a_tools_output_comes_back_as_its_tool_message(tokenizer, spec):
    chat = ChatFormat.from_tokenizer(tokenizer).with_tools(tool_schemas(spec.tools))
    first = tokenizer.decode(chat.initial_ids("You add numbers.", "What is 1 + 1?"))
    assert first.startswith("<|im_start|>system\nYou add numbers.\n\n# Tools\n") and '"name": "calc"' in first
    assert '"required": ["expression"]' in first and first.endswith("<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n")
    generated = tokenizer.encode(CALL, add_special_tokens=False) + [chat.eos_id]
    assert tokenizer.decode(chat.observation_ids("24", generated)) == "\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_template_without_tool_calling_is_refused_in_one_line(spec):
    plain = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(STARTER))  # the starter's own template
    with pytest.raises(ValueError, match="does not render tools.*tool_calls: tags"):
        plain.with_tools(tool_schemas(spec.tools))


def test_a_hermes_episode_is_token_exact_and_equals_the_templates_own_rendering(tokenizer, spec):
    chat = ChatFormat.from_tokenizer(tokenizer).with_tools(tool_schemas(spec.tools))
    task = Task("t1", "train", "What is 12 + 3 * 4?", {"expression": "12 + 3 * 4", "answer": 24})
    engine = ScriptedEngine(chat, [CALL, "<answer>24</answer>"])
    setup = EpisodeSetup(spec, 1, chat, SamplingParams(temperature=1.0, max_new_tokens=120, seed=0))
    traj = asyncio.run(run_episode(engine, setup, task, "ep"))
    assert (traj.reward, traj.terminated, traj.failure_type) == (1.0, True, None)
    first, second = traj.segments
    assert first.tool_events[0]["tool"] == "calc" and first.tool_events[0]["output"] == "24" and not first.tool_events[0]["error"]
    head = list(first.prompt_ids) + list(first.generated_ids)
    assert list(second.prompt_ids[: len(head)]) == head  # never re-tokenised
    # and the ids the model saw are exactly the template's own rendering of the conversation
    messages = [
        {"role": "system", "content": spec.reset.system_prompt}, {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": CALL}, {"role": "tool", "content": "24"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=list(tool_schemas(spec.tools)), tokenize=False, add_generation_prompt=True)
    assert list(second.prompt_ids) == tokenizer.encode(rendered, add_special_tokens=False)


def test_an_env_that_asks_for_hermes_with_a_policy_without_it_is_refused_before_the_run(tmp_path):
    import yaml

    from loopline.errors import LooplineError
    from loopline.pipeline.assembly import build_setup
    from loopline.config import RunConfig

    data = yaml.safe_load(ARITHMETIC.read_text()) | {"tool_calls": "hermes"}
    (tmp_path / "env.yaml").write_text(yaml.safe_dump(data))
    env = load_spec(tmp_path / "env.yaml")
    with pytest.raises(LooplineError, match="tool_calls: hermes.*does not render tools"):
        build_setup(RunConfig(name="r", env=str(tmp_path / "env.yaml"), policy=str(STARTER)), env, 1, STARTER)


def test_several_calls_in_one_turn_run_in_order_and_come_back_as_the_templates_own_tool_messages(tokenizer, spec):
    """Qwen-style parallel calls: every call of the turn runs (a bad one is told back in its place), and the
    next prompt is the template's rendering of one tool message per call, token-exact."""
    chat = ChatFormat.from_tokenizer(tokenizer).with_tools(tool_schemas(spec.tools))
    task = Task("t1", "train", "What is (2 + 3) * (4 + 5)?", {"expression": "(2 + 3) * (4 + 5)", "answer": 45})
    two = (
        '<tool_call>{"name": "calc", "arguments": {"expression": "2 + 3"}}</tool_call>\n'
        '<tool_call>{"name": "shell", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "calc", "arguments": {"expression": "4 + 5"}}</tool_call>'
    )
    engine = ScriptedEngine(chat, [two, "<answer>45</answer>"])
    setup = EpisodeSetup(spec, 1, chat, SamplingParams(temperature=1.0, max_new_tokens=200, seed=0))
    traj = asyncio.run(run_episode(engine, setup, task, "ep"))
    assert traj.reward == 1.0
    first, second = traj.segments
    events = first.tool_events
    assert [(e["tool"], e["output"], bool(e["error"])) for e in events] == [
        ("calc", "5", False), (None, "error: no tool named 'shell'; the tools are: calc", True), ("calc", "9", False),
    ]
    messages = [
        {"role": "system", "content": spec.reset.system_prompt}, {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": two}, *({"role": "tool", "content": e["output"]} for e in events),
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=list(tool_schemas(spec.tools)), tokenize=False, add_generation_prompt=True)
    assert rendered.count("<|im_start|>user") == 2  # the three outputs share one turn
    assert list(second.prompt_ids) == tokenizer.encode(rendered, add_special_tokens=False)
