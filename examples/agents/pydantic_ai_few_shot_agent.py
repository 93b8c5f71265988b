"""The pydantic-ai agent of pydantic_ai_agent.py with two worked examples, given the way pydantic-ai's docs show
(`message_history`: earlier requests and responses, tool calls and their returns included). A small pretrained
policy (SmolLM2-135M-Instruct) does not call a tool it is only told about; shown two calls, it does, and RL has
something to reinforce. Unchanged for loopline: OPENAI_BASE_URL points the OpenAI provider at the policy."""

import json
import sys

from calc_tool import answer_of, calc
from pydantic_ai import Agent
from pydantic_ai.messages import ModelRequest, ModelResponse, SystemPromptPart, TextPart, ToolCallPart, ToolReturnPart, UserPromptPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider


def worked_example(question: str, expression: str, value: str, call_id: str, before: tuple = ()) -> list:
    return [
        ModelRequest(parts=[*before, UserPromptPart(question)]),
        ModelResponse(parts=[ToolCallPart("calc", {"expression": expression}, tool_call_id=call_id)]),
        ModelRequest(parts=[ToolReturnPart("calc", value, tool_call_id=call_id)]),
        ModelResponse(parts=[TextPart(f"<answer>{value}</answer>")]),
    ]


task = json.load(sys.stdin)
# With a message history pydantic-ai leaves the system prompt to it: the first request carries it.
history = worked_example("What is 23 * 4?", "23 * 4", "92", "example-1", before=(SystemPromptPart(task["system_prompt"]),))
history += worked_example("What is 56 - 18 + 7?", "56 - 18 + 7", "45", "example-2")

agent = Agent(OpenAIChatModel("policy", provider=OpenAIProvider()), system_prompt=task["system_prompt"])
agent.tool_plain(calc)
result = agent.run_sync(task["prompt"], message_history=history)
with open("answer.txt", "w") as out:
    out.write(f"<answer>{answer_of(result.output)}</answer>")
