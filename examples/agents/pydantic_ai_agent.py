"""An arithmetic agent written as pydantic-ai's docs show (an Agent, a tool by decorator, run_sync), unchanged for
loopline: OPENAI_BASE_URL points the OpenAI provider at the policy being trained. It reads its task from stdin
and writes its answer to answer.txt, where the env's verifier looks."""

import json
import sys

from calc_tool import answer_of, calc
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

task = json.load(sys.stdin)
agent = Agent(OpenAIChatModel("policy", provider=OpenAIProvider()), system_prompt=task["system_prompt"])
agent.tool_plain(calc)
result = agent.run_sync(task["prompt"])
with open("answer.txt", "w") as out:
    out.write(f"<answer>{answer_of(result.output)}</answer>")
