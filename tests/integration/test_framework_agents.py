"""Issue 48, section 6: agents written with real frameworks, as each framework's docs show, train unchanged
with their native tool calls: pydantic-ai (an Agent with a tool), LangGraph (create_react_agent over
ChatOpenAI), smolagents (ToolCallingAgent), the OpenAI Agents SDK (Agent, function_tool, Runner) and the raw
openai SDK (`tools=`, `role: tool`). Each is played against a scripted model through
loopline's endpoint, in the local sandbox with the system python3 (where CI installs the frameworks):
`envreg test` passes, the policy was shown the tool (Hermes's tool prompt: the starter's template drops tools),
the call it wrote reached the framework's tool, the tool's result came back as a tool turn appended to the same
token ids (one chain: every call is trained), and the verifier scores the answer. The tiny starter's
demonstrations for such an env are its program's own calls, id for id. The pydantic-ai agent then trains for
real (`loopline train`, `policy: tiny`): the policy's native tool calls are in the trained tokens, and
`loopline check` passes on its ledger.

smolagents' ToolCallingAgent forces every call (tool_choice "required"), ends with its `final_answer` tool and
re-renders its history each call (its calls as text, results as "Observation:" turns): each call a chain, all
kept. The OpenAI Agents SDK runs with its defaults: the Responses API (`/v1/responses`). Not yet here:
smolagents' CodeAgent."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loopline.envregistry.registry import prepare
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import SamplingParams
from loopline.rollout.harness.episode import EpisodeSetup, run_episode
from tests.integration.test_agent_program import Scripted
from tests.integration.test_train_flow import STARTER

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "examples" / "agents"
TOOLS_ENV = AGENTS / "arithmetic_tools_env.yaml"
FRAMEWORKS = {"pydantic-ai": ("pydantic_ai_agent.py", "pydantic_ai"), "pydantic-ai-few-shot": ("pydantic_ai_few_shot_agent.py", "pydantic_ai"), "langgraph": ("langgraph_agent.py", "langgraph"),
              "openai-sdk": ("openai_tools_agent.py", "openai"), "smolagents": ("smolagents_agent.py", "smolagents"),
              "openai-agents": ("openai_agents_sdk_agent.py", "agents")}


def _env(tmp_path: Path, framework: str) -> Path:
    program, module = FRAMEWORKS[framework]
    probe = subprocess.run(["/usr/bin/python3", "-c", f"import {module}"], capture_output=True)
    assert probe.returncode == 0, f"the framework agents need {module} in the system python3 (.ci/run installs it)"
    spec = yaml.safe_load((AGENTS / "arithmetic_tools_env.yaml").read_text())
    spec["agent"]["files"] = {"agent.py": str(AGENTS / program), "calc_tool.py": str(AGENTS / "calc_tool.py")}
    if framework == "smolagents":  # (its calls are forced: the scripted model writes what follows the forced prefix)
        spec["smoke_test"]["replies"] = ['calc", "arguments": {"expression": "{task.expression}"}}</tool_call>',
                                         'final_answer", "arguments": {"answer": "{task.answer}"}}</tool_call>']
    path = tmp_path / f"{framework}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_framework_agent_runs_unchanged_its_tool_call_reaches_the_framework_and_every_call_is_kept(framework, tmp_path):
    env_file = _env(tmp_path, framework)
    # (smolagents' system prompt and the worked examples are past the tiny starter's context of 1,024 tokens:
    # checked against a real model's)
    context = ["--max-context", "8192"] if framework in ("smolagents", "pydantic-ai-few-shot") else []
    tested = subprocess.run([sys.executable, "-m", "loopline.envreg", "test", str(env_file), "--tasks", "2", *context],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-3000:]

    prepared = prepare(env_file)
    chat = ChatFormat.for_policy(STARTER)
    task = next(t for t in prepared.tasks if t.split == "train")
    expression, answer = task.data["expression"], task.data["answer"]
    setup = EpisodeSetup(prepared.spec, 1, chat, SamplingParams(temperature=1.0, max_new_tokens=64))
    if framework == "smolagents":  # every call forced (tool_choice "required": the reply starts `<tool_call>\n{"name": "`),
        # the last one its `final_answer` tool
        replies = [f'calc", "arguments": {{"expression": "{expression}"}}}}</tool_call>', f'final_answer", "arguments": {{"answer": "{answer}"}}}}</tool_call>']
    else:
        replies = [f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{expression}"}}}}</tool_call>', f"<answer>{answer}</answer>"]
    played = asyncio.run(run_episode(Scripted(chat, replies), setup, task, "framework-0"))
    first, second = played.segments
    assert played.reward == 1.0, played.info
    shown = chat.tokenizer.decode(first.prompt_ids)
    assert "<tools>" in shown and '"name": "calc"' in shown  # the policy saw the tool (Hermes's tool prompt)
    if framework == "pydantic-ai-few-shot":  # ... and the worked examples' calls, as the blocks it is to write
        assert '<tool_call>\n{"name": "calc", "arguments": {"expression": "23 * 4"}}\n</tool_call><|im_end|>\n<|im_start|>tool\n92<|im_end|>' in shown
    assert [e["name"] for e in first.tool_events[0]["openai_tool_calls"]] == ["calc"]  # ... and its call reached the framework
    head = list(first.prompt_ids) + list(first.generated_ids)
    if framework == "smolagents":
        # it re-renders its history (its calls as text, results as "Observation:" user turns): a second chain, kept
        assert played.info["chains"] == 2 and second.starts_chain and {"forced": '<tool_call>\n{"name": "'} in first.tool_events
        assert f"Observation:\n{answer}<|im_end|>" in chat.tokenizer.decode(second.prompt_ids)
    else:
        assert played.info["chains"] == 1 and list(second.prompt_ids[: len(head)]) == head  # the next call extends those ids
        appended = chat.tokenizer.decode(second.prompt_ids[len(head) :])
        assert f"<|im_start|>tool\n{answer}<|im_end|>" in appended, appended  # the tool's result, as a tool turn


@pytest.mark.parametrize("framework", ["pydantic-ai", "openai-sdk", "langgraph", "openai-agents"])
def test_the_tiny_starters_demonstrations_are_the_ids_the_endpoint_gives_the_agent(framework, tmp_path):
    """`policy: tiny` on an env whose agent is a framework's program: the SFT demonstrations are filled from the
    program's own calls, and each must be, id for id and mask for mask, what the endpoint builds when the program
    plays that task (a demonstration that differs teaches the policy a conversation it never sees)."""
    from loopline.envregistry.smoke import fill
    from loopline.policies.starter import ProgramDemonstrations
    from loopline.rollout.harness.agent_program import ScriptedModel
    from loopline.trainer.tiny import train_tokenizer

    prepared = prepare(_env(tmp_path, framework))
    train = [t for t in prepared.tasks if t.split == "train"]
    demonstrations = ProgramDemonstrations.recorded(prepared.spec, train)
    chat = ChatFormat.from_tokenizer(train_tokenizer(demonstrations.corpus(train[:300]), vocab_size=512))
    task = train[7]
    setup = EpisodeSetup(prepared.spec, 0, chat, SamplingParams(temperature=1.0, max_new_tokens=64))
    replies = list(prepared.spec.smoke_test.replies)
    for said, direct in ((replies, False), (replies[-1:], True)):
        played = asyncio.run(run_episode(ScriptedModel(chat, [fill(r, task) for r in said], 1 << 30), setup, task, "demo-0"))
        assert played.reward == 1.0 and played.info["chains"] == 1, played.info
        (demonstration,) = demonstrations.sequences(chat, task, direct)
        last = played.segments[-1]
        assert list(demonstration.input_ids) == list(last.prompt_ids) + list(last.generated_ids)
        trained = [0] * len(demonstration.input_ids)
        for segment in played.segments:  # (each call's reply, where it sits in the chain's ids)
            trained[len(segment.prompt_ids) : len(segment.prompt_ids) + len(segment.generated_ids)] = [1] * len(segment.generated_ids)
        assert list(demonstration.action_mask) == trained


def test_a_program_whose_calls_differ_beyond_the_tasks_fields_is_refused_one_line(tmp_path):
    from loopline.errors import LooplineError
    from loopline.policies.starter import ProgramDemonstrations

    env_file = _env(tmp_path, "openai-sdk")
    program = tmp_path / "varying_agent.py"  # (a system prompt that changes with each run: a time, a random id)
    program.write_text((AGENTS / "openai_tools_agent.py").read_text().replace(
        '{"role": "system", "content": task["system_prompt"]}', '{"role": "system", "content": task["system_prompt"] + " " + __import__("uuid").uuid4().hex}'))
    assert "uuid4" in program.read_text()
    spec = yaml.safe_load(env_file.read_text())
    spec["agent"]["files"]["agent.py"] = str(program)
    env_file.write_text(yaml.safe_dump(spec))
    prepared = prepare(env_file)
    with pytest.raises(LooplineError, match="differ from task to task by more than the task's fields"):
        ProgramDemonstrations.recorded(prepared.spec, [t for t in prepared.tasks if t.split == "train"])


def test_a_smolagents_code_agent_runs_unchanged_every_call_is_kept_and_its_prompt_is_checked_against_the_context(tmp_path):
    """smolagents' default agent, the CodeAgent: the policy writes Python in <code> blocks (no native tool calls),
    smolagents runs it (the calculator, then `final_answer`) and shows the output as an observation. Both calls
    are kept, token for token. Its system prompt (the code-agent instructions, a few thousand tokens) does not fit
    the tiny starter's context of 1,024: `envreg test` says so, as the engine would refuse it."""
    probe = subprocess.run(["/usr/bin/python3", "-c", "import smolagents"], capture_output=True)
    assert probe.returncode == 0, "the framework agents need smolagents in the system python3 (.ci/run installs it)"
    spec = yaml.safe_load(TOOLS_ENV.read_text())
    spec["agent"]["files"] = {"agent.py": str(AGENTS / "smolagents_code_agent.py"), "calc_tool.py": str(AGENTS / "calc_tool.py")}
    spec["smoke_test"]["replies"] = ['Thought: compute it.\n<code>\nprint(calc("{task.expression}"))\n</code>',
                                     'Thought: done.\n<code>\nfinal_answer("{task.answer}")\n</code>']
    env_file = tmp_path / "code-agent.yaml"
    env_file.write_text(yaml.safe_dump(spec))
    prepared = prepare(env_file)
    task = next(t for t in prepared.tasks if t.split == "train")
    chat = ChatFormat.for_policy(STARTER)
    replies = [r.replace("{task.expression}", task.data["expression"]).replace("{task.answer}", str(task.data["answer"])) for r in spec["smoke_test"]["replies"]]
    played = asyncio.run(run_episode(Scripted(chat, replies), EpisodeSetup(prepared.spec, 1, chat, SamplingParams(temperature=1.0, max_new_tokens=64)), task, "code-0"))
    assert played.reward == 1.0 and len(played.segments) == 2, played.info
    first, second = played.segments
    assert "final_answer" in chat.tokenizer.decode(first.prompt_ids) and played.validate() is None
    assert f"{task.data['answer']}" in chat.tokenizer.decode(second.prompt_ids[len(first.prompt_ids) :])  # the code's output, observed
    assert len(first.prompt_ids) > 1024, len(first.prompt_ids)  # (what the tiny starter cannot hold)
    said = {}
    for context, code in ((), 1), (("--max-context", "8192"), 0):  # (the tiny starter's context, then a real model's)
        tested = subprocess.run([sys.executable, "-m", "loopline.envreg", "test", str(env_file), "--tasks", "1", *context],
                                capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "COLUMNS": "300"})
        assert tested.returncode == code, tested.stdout[-3000:] + tested.stderr[-2000:]
        said[code] = tested.stdout
    assert "context_length_exceeded" in said[1] and "exceeds the policy's context of 1024" in said[1], said[1][-3000:]
    assert "must fit a context of 8,192 tokens" in said[0], said[0]


def test_the_tools_example_has_its_starter_shipped():
    """`policy: tiny` on examples/agents/arithmetic_tools_env.yaml finds its starter in the package (a changed
    example is another env: its starter would be built on first use, ~15 min, and CI's training test with it)."""
    from loopline.envregistry.registry import content_hash
    from loopline.policies.sources import SHIPPED_STARTERS, tiny_policy_name

    assert (SHIPPED_STARTERS / tiny_policy_name(content_hash(TOOLS_ENV), 0) / "config.json").is_file(), (
        "rebuild it: loopline models build-tiny --env examples/agents/arithmetic_tools_env.yaml --ship"
    )


@pytest.mark.slow
def test_a_pydantic_ai_agent_trains_its_native_tool_calls_and_the_ledger_holds_them(database_url, db, tmp_path):
    """The example pydantic-ai agent trained with `policy: tiny` (the starter taught its own calls): the trained
    tokens hold the policy's <tool_call> blocks, which reached pydantic-ai's tool as OpenAI tool_calls."""
    from loopline.envregistry.registry import content_hash
    from loopline.policies.sources import SHIPPED_STARTERS, tiny_policy_name
    from tests.integration.test_chaos import _checked_run, _rows

    name = f"pydantic-ai-{tmp_path.name[-12:]}".replace("_", "-")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "env": str(TOOLS_ENV), "policy": "tiny", "steps": 2,
        "rollout": {"groups_per_step": 2, "group_size": 4, "concurrency": 8, "sampling": {"max_new_tokens": 64}}, "learner": {"lr": 3e-4, "backend": "torch"}, "eval": {"every": 2, "tasks": 4},
    }))
    env = {**os.environ, "LOOPLINE_DATABASE_URL": database_url, "LOOPLINE_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "train", str(config)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_id = _checked_run(db, name)
    assert _rows(db, "SELECT count(*) FROM consumption WHERE run_id = :r", r=run_id)[0][0] == 2 * 2 * 4
    from loopline.store import ledger

    trained = ledger.load_trajectories(db, [r[0] for r in _rows(db, "SELECT trajectory_id FROM consumption WHERE run_id = :r", r=run_id)])
    tokenizer = ChatFormat.for_policy(SHIPPED_STARTERS / tiny_policy_name(content_hash(TOOLS_ENV), 0)).tokenizer
    # every trained trajectory's first prompt shows the policy the tool it may call ...
    assert all("<tools>" in tokenizer.decode(t.segments[0].prompt_ids) and '"name": "calc"' in tokenizer.decode(t.segments[0].prompt_ids) for t in trained)
    # ... and the policy called it natively: its <tool_call> blocks are trained tokens, each returned as a tool call
    called = [s for t in trained for s in t.segments if '<tool_call>{"name": "calc"' in tokenizer.decode(s.generated_ids)]
    assert len(called) >= len(trained) // 2, [tokenizer.decode(s.generated_ids) for t in trained for s in t.segments][:8]
    assert all(sum(s.action_loss_mask) > 0 for s in called)
    returned = _rows(db, "SELECT count(*) FROM segment s JOIN consumption c ON c.trajectory_id = s.trajectory_id "
                         "WHERE c.run_id = :r AND s.tool_events::text LIKE :calls", r=run_id, calls='%"openai_tool_calls"%')[0][0]
    assert len(trained) // 2 <= returned <= len(called)  # returned to pydantic-ai as OpenAI tool_calls (a malformed one: as text)


def test_envreg_test_counts_a_programs_calls_in_the_tokens_of_the_policy_that_trains_on_the_env(tmp_path):
    """`envreg test` counted every env's calls in the first shipped starter's tokens (67 for a `<tool_call>` line this
    env's own starter spends 29 on: a call that training served was refused). It now uses the starter `policy: tiny`
    trains on the env, or the model directory `--policy` names."""
    def tested(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "loopline.envreg", "test", str(TOOLS_ENV), "--tasks", "1", *args], capture_output=True,
                              text=True, timeout=300, cwd=ROOT, env={**os.environ, "COLUMNS": "300", "LOOPLINE_HOME": str(tmp_path)})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        return done.stdout

    assert "counted in the tokens of this env's tiny starter (tiny-ec6a96fe6f47-s0)" in tested()
    assert f"counted in the tokens of {STARTER}" in tested("--policy", str(STARTER))
