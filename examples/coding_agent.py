"""A coding agent of your own, unchanged by loopline: it asks "the model" for solution.py through the openai SDK
(loopline points OPENAI_BASE_URL at the policy being trained), tries to import what it got, and when that fails
shows the model the error and asks for the whole file again, up to three times. It reads its task from stdin and
leaves solution.py in its working directory, where the env's verifier runs the hidden tests. No loopline import.
Trained by `loopline train examples/coding_agent_quickstart.yaml` through examples/coding_agent_env.yaml."""

import json
import re
import subprocess
import sys

from openai import OpenAI

task = json.load(sys.stdin)
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment


def code_of(reply: str) -> str:
    """The reply's first fenced code block, else the reply itself."""
    found = re.search(r"```(?:python)?\n(.*?)```", reply, re.DOTALL)
    return found.group(1) if found else reply


def import_error() -> str | None:
    try:
        tried = subprocess.run([sys.executable, "-c", "import solution"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "importing solution.py did not finish within 10 seconds"
    return tried.stderr[-600:] if tried.returncode else None


messages = [{"role": "system", "content": task["system_prompt"]}] if task["system_prompt"] else []
messages.append({"role": "user", "content": task["prompt"]})
for _ in range(3):
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content or ""
    messages.append({"role": "assistant", "content": reply})
    with open("solution.py", "w") as out:
        out.write(code_of(reply))
    error = import_error()
    if error is None:
        break
    messages.append({"role": "user", "content": f"Importing solution.py failed:\n{error}\nReply with the whole corrected file."})
with open("answer.txt", "w") as out:
    out.write("Done.")
