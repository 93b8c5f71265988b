"""The OpenAI-compatible endpoint, driven by the real `openai` SDK as an unmodified agent program would: every
call is recorded as a segment whose ids are exactly what the engine sampled (never decoded and encoded again),
chained across calls as long as the agent appends to its conversation."""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from loopline.rollout.harness.chat import ChatFormat, hermes_tool_prompt
from loopline.rollout.engines.base import Generation, SamplingParams, VersionSpan
from loopline.rollout.endpoint.api import AgentEpisode, Budget
from loopline.rollout.endpoint.server import OpenAIServer
from loopline.types import chains, first_chain_break
from tests.integration.test_train_flow import STARTER
from tests.unit.test_tool_calls import HERMES_TEMPLATE


class ScriptedIds:
    """An engine that 'samples' given id lists (a policy may sample a spelling the tokenizer would not write)."""

    def __init__(self, replies: list[list[int]], eos: int):
        self.replies, self.eos, self.prompts, self.returned, self.samplings = list(replies), eos, [], [], []

    def version(self) -> int:
        return 7

    async def generate(self, prompt_ids, sampling, request_id):
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        ids = (self.replies.pop(0) + [self.eos])[: sampling.max_new_tokens]
        self.returned.append(ids)
        return Generation(tuple(ids), tuple(-0.5 - i / 100 for i in range(len(ids))), "stop", (VersionSpan(7, 0, len(ids)),))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STARTER)


def _episode(tokenizer, replies, max_calls=4, max_tokens=200, template=None):
    if template:
        tokenizer = AutoTokenizer.from_pretrained(STARTER)
        tokenizer.chat_template = template
    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = ScriptedIds(replies, chat.eos_id)
    episode = AgentEpisode(engine, chat, SamplingParams(temperature=1.0, max_new_tokens=128), Budget(max_calls, max_tokens), "ep")
    return episode, engine, chat


def test_the_sampled_ids_are_trained_across_calls_even_where_the_tokenizer_would_spell_them_otherwise(tokenizer):
    spelled = tokenizer.convert_tokens_to_ids(["<", "c", "a", "l", "c", ">", "1", "+", "2", "</", "calc", ">"])  # "calc" is one token
    assert tokenizer.encode("<calc>1+2</calc>", add_special_tokens=False) != spelled  # re-tokenising would change them
    answer = tokenizer.encode("<answer>3</answer>", add_special_tokens=False)
    episode, engine, chat = _episode(tokenizer, [spelled, answer])
    with OpenAIServer() as server:
        client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="unused")
        messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 1 + 2?"}]
        first = client.chat.completions.create(model="policy", messages=messages, temperature=0.2)
        assert first.choices[0].message.content == "<calc>1+2</calc>" and first.choices[0].finish_reason == "stop"
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "<result>3</result>"}]
        second = client.chat.completions.create(model="policy", messages=messages)
    assert second.choices[0].message.content == "<answer>3</answer>"
    one, two = episode.segments
    assert [list(s.generated_ids) for s in episode.segments] == engine.returned  # exactly what was sampled
    assert first_chain_break(episode.segments) is None
    head = list(one.prompt_ids) + list(one.generated_ids)
    assert list(two.prompt_ids[: len(head)]) == head and engine.prompts[1] == list(two.prompt_ids)
    assert chat.tokenizer.decode(two.prompt_ids[len(head) :]) == "\n<|im_start|>user\n<result>3</result><|im_end|>\n<|im_start|>assistant\n"
    # what the template would give for the same conversation differs exactly where the policy spelled "calc" its way
    retokenised = chat.tokenizer.encode(chat.tokenizer.apply_chat_template(
        messages[:2] + [{"role": "assistant", "content": "<calc>1+2</calc>"}, messages[3]], tokenize=False, add_generation_prompt=True
    ), add_special_tokens=False)
    assert retokenised != list(two.prompt_ids) and chat.tokenizer.decode(retokenised) == chat.tokenizer.decode(two.prompt_ids)
    assert one.sampling_config["temperature"] == 1.0  # the run's sampling, not the request's 0.2
    assert one.policy_version == 7 and list(one.rollout_logprobs)[:2] == [-0.5, -0.51]


def test_a_streamed_call_is_the_same_answer_and_the_same_segment(tokenizer):
    reply = tokenizer.encode("<answer>3</answer>", add_special_tokens=False)
    episode, engine, _ = _episode(tokenizer, [reply])
    with OpenAIServer() as server:
        key = server.open(episode)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key)  # the key alone names the episode
        stream = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+2?"}], stream=True, logprobs=True)
        chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "<answer>3</answer>"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == len(reply) + 1
    logprobs = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert logprobs == list(episode.segments[0].rollout_logprobs) and list(episode.segments[0].generated_ids) == engine.returned[0]


@pytest.mark.parametrize("template", ["hermes", "without-tools"])
def test_tool_calls_come_back_as_openai_tool_calls_and_the_tool_result_extends_the_chain(tokenizer, template):
    """With a template that renders `tools` (Qwen's Hermes one) and with one that drops them (the starter's, as
    SmolLM2's): there loopline writes them into the system message as Hermes's tool prompt, so that the policy
    sees the tools it is asked to call (issue 48: no framework's tool call was ever trained)."""
    call = tokenizer.encode('<tool_call>{"name": "calc", "arguments": {"expression": "12 + 3"}}</tool_call>', add_special_tokens=False)
    answer = tokenizer.encode("<answer>15</answer>", add_special_tokens=False)
    episode, engine, chat = _episode(tokenizer, [call, answer], template=HERMES_TEMPLATE if template == "hermes" else None)
    assert chat.renders_tools() == (template == "hermes")
    tools = [{"type": "function", "function": {"name": "calc", "description": "arithmetic", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    with OpenAIServer() as server:
        client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="unused")
        messages = [{"role": "user", "content": "What is 12 + 3?"}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        (tool_call,) = message.tool_calls
        assert tool_call.function.name == "calc" and json.loads(tool_call.function.arguments) == {"expression": "12 + 3"}
        messages += [message, {"role": "tool", "tool_call_id": tool_call.id, "content": "15"}]  # the SDK's own message object
        second = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    assert second.choices[0].message.content == "<answer>15</answer>" and not second.choices[0].message.tool_calls
    assert first_chain_break(episode.segments) is None and len(episode.segments) == 2
    head = list(episode.segments[0].prompt_ids) + list(episode.segments[0].generated_ids)
    first_prompt = chat.tokenizer.decode(episode.segments[0].prompt_ids)
    if template == "hermes":
        assert chat.tokenizer.decode(episode.segments[1].prompt_ids[len(head) :]) == (
            "\n<|im_start|>user\n<tool_response>\n15\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        assert '"name": "calc"' in first_prompt  # the template showed the tools
    else:  # loopline's tool prompt as the system turn, the tool's output as the template shows a `tool` message
        assert first_prompt == chat.tokenizer.apply_chat_template(
            [{"role": "system", "content": hermes_tool_prompt(tools)}, {"role": "user", "content": "What is 12 + 3?"}],
            tokenize=False, add_generation_prompt=True,
        )
        assert first_prompt.startswith("<|im_start|>system\n# Tools\n") and '<tools>\n{"type": "function", "function": {"name": "calc"' in first_prompt
        assert chat.tokenizer.decode(episode.segments[1].prompt_ids[len(head) :]).endswith("<|im_start|>tool\n15<|im_end|>\n<|im_start|>assistant\n")
        # the same conversation rendered afresh (a new chain) shows the policy its own call, as it wrote it
        fresh, _, _ = _episode(tokenizer, [], template=None)
        called = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": tool_call.function.model_dump()}]}
        history = [{"role": "user", "content": "What is 12 + 3?"}, called, {"role": "tool", "tool_call_id": "c1", "content": "15"}]
        rendered = chat.tokenizer.decode(fresh.prompt_ids(history, tools))
        assert '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {"expression": "12 + 3"}}\n</tool_call><|im_end|>' in rendered, rendered


def test_a_rewritten_history_starts_a_new_chain_and_budgets_end_the_episode(tokenizer):
    replies = [tokenizer.encode(t, add_special_tokens=False) for t in ("first", "second", "third")]
    episode, _, _ = _episode(tokenizer, replies, max_calls=3)
    with OpenAIServer() as server:
        client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="unused")
        a = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "one"}])
        # the agent drops the first exchange and asks afresh: not an extension of the call before
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "two"}])
        assert episode.chains == 2 and len(episode.segments) == 2 and episode.segments[1].starts_chain  # kept, a chain of its own
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "two"}, {"role": "assistant", "content": "second"},
                                                                  {"role": "user", "content": "three"}])
        assert len(episode.segments) == 3 and not episode.segments[2].starts_chain and first_chain_break(episode.segments) is None
        assert [len(c) for c in chains(episode.segments)] == [1, 2]
        with pytest.raises(openai.BadRequestError, match="3 model calls are spent"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "four"}])
        assert episode.exhausted == "turns"
        with pytest.raises(openai.BadRequestError, match="one reply per call"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], n=2)
        with pytest.raises(openai.AuthenticationError, match="unknown or ended episode"):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="ep-nosuch").chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        assert [m.id for m in client.models.list()] == ["policy"]
    assert a.usage.completion_tokens == len(tokenizer.encode("first", add_special_tokens=False)) + 1  # (+ the eos it sampled)


def test_a_react_loop_on_v1_completions_chains_through_its_stop_strings_and_trains_what_was_sampled_up_to_them(tokenizer):
    """A text-completion agent builds its own prompt and stops the model at "Observation:", as ReAct loops do."""
    act = tokenizer.encode("Action: calc[12+3]\nObservation: I guess 16\n", add_special_tokens=False)  # runs past its stop
    answer = tokenizer.encode("Final Answer: 15", add_special_tokens=False)
    episode, engine, chat = _episode(tokenizer, [act, answer])
    prompt = "Question: what is 12+3?\n"
    with OpenAIServer() as server:
        client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="unused")
        first = client.completions.create(model="policy", prompt=prompt, stop=["Observation:"], max_tokens=64, logprobs=1)
        assert first.choices[0].text == "Action: calc[12+3]\n" and first.choices[0].finish_reason == "stop"
        prompt += first.choices[0].text + "Observation: 15\n"  # the agent's tool result, after the stop string
        chunks = list(client.completions.create(model="policy", prompt=prompt, stop=["Observation:"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Final Answer: 15" and chunks[-1].choices[0].finish_reason == "stop"
    one, two = episode.segments
    # the first call keeps what the model sampled through the stop string's last token, never what came after it
    assert chat.tokenizer.decode(one.generated_ids) == "Action: calc[12+3]\nObservation:"
    assert list(one.generated_ids) == engine.returned[0][: len(one.generated_ids)] and len(one.generated_ids) < len(engine.returned[0])
    assert list(one.rollout_logprobs) == [-0.5 - i / 100 for i in range(len(one.generated_ids))]
    assert first.choices[0].logprobs.token_logprobs == list(one.rollout_logprobs)
    # the second prompt continues those ids: only the agent's " 15\n" after them was tokenised
    assert first_chain_break(episode.segments) is None and engine.prompts[1] == list(two.prompt_ids)
    head = list(one.prompt_ids) + list(one.generated_ids)
    assert chat.tokenizer.decode(two.prompt_ids[len(head) :]) == " 15\n"
    assert list(two.generated_ids) == engine.returned[1] and first.usage.completion_tokens == len(one.generated_ids)


def test_completion_prompts_given_as_ids_are_taken_as_they_are_and_an_unrelated_prompt_starts_a_new_chain(tokenizer):
    replies = [tokenizer.encode(t, add_special_tokens=False) for t in (" four", " five", " six")]
    episode, engine, chat = _episode(tokenizer, replies)
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    with OpenAIServer() as server:
        client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="unused")
        client.completions.create(model="policy", prompt=ids)
        client.completions.create(model="policy", prompt=ids + engine.returned[0] + ids)  # extends the ids: one chain
        assert episode.chains == 1 and len(episode.segments) == 2 and first_chain_break(episode.segments) is None
        client.completions.create(model="policy", prompt="something else")
        assert episode.chains == 2 and [s.starts_chain for s in episode.segments] == [False, False, True]
        for bad, said in ((["a", "b"], "a batch of prompts"), ([10**9], "below the vocabulary size"), ("", "non-empty")):
            with pytest.raises(openai.BadRequestError, match=said):
                client.completions.create(model="policy", prompt=bad)
        with pytest.raises(openai.BadRequestError, match="stop: a non-empty string"):
            client.completions.create(model="policy", prompt="x", stop=["a", "b", "c", "d", "e"])
    assert engine.prompts[0] == ids


def test_a_segment_records_version_spans_only_over_the_tokens_it_keeps():
    """A weight sync mid-generation: v3 made tokens 0-1, v4 tokens 2-4. Cut after 2 tokens (a stop string) the
    segment is all v3 (no spans: its policy_version says it); cut after 3 it names both, the second span cut."""
    gen = Generation((5, 6, 7, 8, 9), (-0.1,) * 5, "stop", (VersionSpan(3, 0, 2), VersionSpan(4, 2, 5)))
    assert gen.recorded_spans() == [{"version": 3, "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 5}]
    assert gen.recorded_spans(3) == [{"version": 3, "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 3}]
    assert gen.recorded_spans(2) is None
    assert Generation((5,), (-0.1,), "stop", (VersionSpan(3, 0, 1),)).recorded_spans() is None


@pytest.mark.parametrize("template", ["hermes", "without-tools"])
def test_tool_choice_required_or_named_forces_a_call_whose_forced_part_is_prompt_never_trained(tokenizer, template):
    """smolagents' ToolCallingAgent sends tool_choice "required" on every call (it was a 400); a named function
    is the OpenAI SDK's way to insist on one. The reply opens with the call (and the name); the policy samples
    the rest, and only what it sampled is its action."""
    tools = [{"type": "function", "function": {"name": "calc", "description": "arithmetic", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    user = [{"role": "user", "content": "What is 12 + 3?"}]
    rest_of_name = tokenizer.encode('calc", "arguments": {"expression": "12 + 3"}}\n</tool_call>', add_special_tokens=False)
    arguments = tokenizer.encode('{"expression": "1 + 1"}}', add_special_tokens=False)  # (it left the call open)
    episode, engine, chat = _episode(tokenizer, [rest_of_name, arguments], template=HERMES_TEMPLATE if template == "hermes" else None)
    with OpenAIServer() as server:
        client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="unused")
        first = client.chat.completions.create(model="policy", messages=user, tools=tools, tool_choice="required")
        named = client.chat.completions.create(
            model="policy", messages=user, tools=tools, tool_choice={"type": "function", "function": {"name": "calc"}},
        )
        with pytest.raises(openai.BadRequestError, match="'add' is not one of the request's tools"):
            client.chat.completions.create(model="policy", messages=user, tools=tools, tool_choice={"type": "function", "function": {"name": "add"}})
        with pytest.raises(openai.BadRequestError, match="'required' needs tools"):
            client.chat.completions.create(model="policy", messages=user, tool_choice="required")
    (one,), (two,) = first.choices[0].message.tool_calls, named.choices[0].message.tool_calls
    assert (one.function.name, json.loads(one.function.arguments)) == ("calc", {"expression": "12 + 3"})
    assert (two.function.name, json.loads(two.function.arguments)) == ("calc", {"expression": "1 + 1"})
    for prompt, forced in zip(engine.prompts, ['<tool_call>\n{"name": "', '<tool_call>\n{"name": "calc", "arguments": ']):
        ids = tokenizer.encode(forced, add_special_tokens=False)
        assert prompt[-len(ids) :] == ids  # what the engine continued from
    kept, segment = episode.segments  # (the second call started over: a new chain, kept)
    assert segment.starts_chain and list(kept.prompt_ids) == engine.prompts[0] and {"forced": '<tool_call>\n{"name": "'} in kept.tool_events
    assert list(segment.prompt_ids) == engine.prompts[1] and list(segment.generated_ids) == arguments + [chat.eos_id]
    assert {"forced": '<tool_call>\n{"name": "calc", "arguments": '} in segment.tool_events


def test_an_agents_seed_repeats_its_sample_yet_the_groups_samples_differ_and_parallel_tool_calls_false_keeps_one(tokenizer):
    """`seed` and `parallel_tool_calls` were silently ignored. An agent that always sends seed=42 must not make
    every sample of a group the same (nothing would be learned): the seed is mixed with the sample's id."""
    call = tokenizer.encode('<tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call>', add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]
    seeds = {}
    for sample in ("a", "a", "b"):
        episode, engine, _ = _episode(tokenizer, [call + call], template=HERMES_TEMPLATE)
        episode.request_id = f"run/step1/{sample}"
        with OpenAIServer() as server:
            client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="unused")
            reply = client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], tools=tools, seed=42, parallel_tool_calls=False,
            )
        assert len(reply.choices[0].message.tool_calls) == 1  # (the model wrote two)
        seeds.setdefault(sample, []).append(engine.samplings[0].seed)
    assert seeds["a"][0] == seeds["a"][1] is not None and seeds["a"][0] != seeds["b"][0]


def test_the_responses_api_serves_function_calls_streamed_or_not_and_the_whole_input_resent_extends_the_same_ids(tokenizer):
    """Issue 48, section 4: the OpenAI Agents SDK calls /v1/responses by default (it was a 404). Its calls: the
    instructions and input items, function tools; it sends the whole conversation back each call, its earlier
    function_call and their function_call_output items, which must extend the ids the policy sampled."""
    call = tokenizer.encode('<tool_call>{"name": "calc", "arguments": {"expression": "12 + 3"}}</tool_call>', add_special_tokens=False)
    answer = tokenizer.encode("<answer>15</answer>", add_special_tokens=False)
    episode, engine, chat = _episode(tokenizer, [call, answer])
    tools = [{"type": "function", "name": "calc", "description": "arithmetic", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}]
    with OpenAIServer() as server:
        client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="unused")
        first = client.responses.create(model="policy", instructions="Use the calculator.", input="What is 12 + 3?", tools=tools)
        (called,) = first.output
        assert (called.type, called.name, json.loads(called.arguments), first.status) == ("function_call", "calc", {"expression": "12 + 3"}, "completed")
        conversation = [{"role": "user", "content": "What is 12 + 3?"}, called.model_dump(exclude_none=True),
                        {"type": "function_call_output", "call_id": called.call_id, "output": "15"}]
        with client.responses.stream(model="policy", instructions="Use the calculator.", input=conversation, tools=tools) as stream:
            kinds = [event.type for event in stream]
            done = stream.get_final_response()
        assert done.output_text == "<answer>15</answer>" and done.usage.output_tokens == len(answer) + 1
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
        for refused, said in (({"previous_response_id": first.id}, "keeps no responses"), ({"tools": [{"type": "web_search"}]}, "'web_search' tools are not served"),
                              ({"text": {"format": {"type": "json_object"}}}, "text.format: 'json_object' is not served")):
            with pytest.raises(openai.BadRequestError, match=said):
                client.responses.create(model="policy", input="hi", **refused)
    one, two = episode.segments
    assert first_chain_break(episode.segments) is None and not two.starts_chain  # one chain: the second call extends the first's ids
    head = list(one.prompt_ids) + list(one.generated_ids)
    assert chat.tokenizer.decode(two.prompt_ids[len(head) :]).endswith("<|im_start|>tool\n15<|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>" in chat.tokenizer.decode(one.prompt_ids)  # the tool, shown to the policy
    assert episode.refusals == 3
