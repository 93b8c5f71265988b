"""An arithmetic agent written as LangGraph's docs show (create_react_agent over ChatOpenAI with a tool),
unchanged for loopline: OPENAI_BASE_URL points ChatOpenAI at the policy being trained. It reads its task from
stdin and writes its answer to answer.txt, where the env's verifier looks."""

import json
import sys

from calc_tool import answer_of, calc
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

task = json.load(sys.stdin)
agent = create_react_agent(ChatOpenAI(model="policy"), tools=[tool(calc)], prompt=task["system_prompt"])
state = agent.invoke({"messages": [("user", task["prompt"])]}, {"recursion_limit": 8})
with open("answer.txt", "w") as out:
    out.write(f"<answer>{answer_of(state['messages'][-1].content)}</answer>")
