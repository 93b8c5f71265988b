"""An agent program of your own, unchanged by loopline: it talks to "the model" through the openai SDK
(loopline points OPENAI_BASE_URL at the policy being trained) and does its arithmetic with a Python function
as a tool. It reads its task from stdin and writes its final answer to answer.txt, where the env's verifier
looks. Run by `loopline train examples/arithmetic_agent_quickstart.yaml` through examples/arithmetic_agent_env.yaml."""

import json
import re
import sys

from openai import OpenAI

task = json.load(sys.stdin)
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment


def calc(expression: str) -> str:
    if not re.fullmatch(r"[\d\s+\-*/().]+", expression):
        return "error: only numbers and + - * / ( )"
    try:
        value = eval(expression, {"__builtins__": {}})  # digits and operators only (checked above)
    except (SyntaxError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if value == int(value) else f"{value:g}"


messages = [{"role": "system", "content": task["system_prompt"]}] if task["system_prompt"] else []
messages.append({"role": "user", "content": task["prompt"]})
answer = ""
for _ in range(4):
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    messages.append({"role": "assistant", "content": reply.content})
    text = reply.content or ""
    if found := re.search(r"<answer>(.*?)</answer>", text, re.DOTALL):
        answer = found.group(1).strip()
        break
    if found := re.search(r"<calc>(.*?)</calc>", text, re.DOTALL):
        messages.append({"role": "user", "content": f"<result>{calc(found.group(1))}</result>"})
    else:
        answer = text.strip()
        break
with open("answer.txt", "w") as out:
    out.write(f"<answer>{answer}</answer>")
