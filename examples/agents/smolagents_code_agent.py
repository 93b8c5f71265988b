"""An arithmetic agent written as smolagents' docs show for its default agent: a CodeAgent over
OpenAIServerModel with a @tool. The model writes Python in <code> blocks that calls the tool and
`final_answer`; smolagents runs it and shows the output as an observation. Unchanged for loopline:
OPENAI_BASE_URL points the model at the policy being trained. It reads its task from stdin and writes its
answer to answer.txt, where the env's verifier looks."""

import json
import os
import sys

import calc_tool
from smolagents import CodeAgent, OpenAIServerModel, tool

task = json.load(sys.stdin)


@tool
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers and + - * / ( ), e.g. "12 + 3 * 4".
    """
    return calc_tool.calc(expression)


model = OpenAIServerModel(model_id="policy", api_base=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
agent = CodeAgent(tools=[calc], model=model, max_steps=3, instructions=task["system_prompt"])
answer = agent.run(task["prompt"])
with open("answer.txt", "w") as out:
    out.write(f"<answer>{calc_tool.answer_of(str(answer))}</answer>")
