"""An arithmetic agent written as the OpenAI Agents SDK's docs show (an Agent with a @function_tool, run by
Runner.run_sync), with the SDK's defaults (the Responses API), unchanged for loopline: OPENAI_BASE_URL points
the SDK's client at the policy being trained. It reads its task from stdin and writes its answer to answer.txt."""

import json
import sys

import calc_tool
from agents import Agent, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)  # (the SDK would upload traces to OpenAI: the sandbox reaches only the model)
task = json.load(sys.stdin)


@function_tool
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers and + - * / ( ), e.g. "12 + 3 * 4".
    """
    return calc_tool.calc(expression)


agent = Agent(name="arithmetic", instructions=task["system_prompt"], tools=[calc], model="policy")
result = Runner.run_sync(agent, task["prompt"], max_turns=4)
with open("answer.txt", "w") as out:
    out.write(f"<answer>{calc_tool.answer_of(str(result.final_output))}</answer>")
