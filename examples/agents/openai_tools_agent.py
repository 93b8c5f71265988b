"""An arithmetic agent on the raw openai SDK with native tool calls (`tools=`, `tool_calls`, `role: tool`), as
OpenAI's function-calling guide shows. It reads its task from stdin and writes its answer to answer.txt."""

import json
import sys

from calc_tool import answer_of, calc
from openai import OpenAI

task = json.load(sys.stdin)
client = OpenAI()
tools = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression of numbers and + - * / ( ).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]
messages = [{"role": "system", "content": task["system_prompt"]}, {"role": "user", "content": task["prompt"]}]
reply = None
for _ in range(3):
    reply = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    if not reply.tool_calls:
        break
    for call in reply.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(**json.loads(call.function.arguments))})
with open("answer.txt", "w") as out:
    out.write(f"<answer>{answer_of(reply.content if reply else '')}</answer>")
