"""How a policy writes a tool call: the convention its chat template teaches it, read back into OpenAI tool
calls by the endpoint (`openai_api`) and forced at the start of a reply for `tool_choice`.

- `hermes` (Hermes, Qwen2.5/3, and loopline's own tool prompt where the template drops tools):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after the reply's text.
- `llama3_json` (Llama 3.1/3.2 JSON tool calling): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`; several calls separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` after the reply's text.
- `pythonic` (Llama 3.2 / 4 pythonic): the whole reply is a Python list of calls, `[calc(expression="1+2")]`.

A reply that does not hold a well-formed call of one of the request's tools is content, as the policy wrote it:
the agent sees what the model said. The format is chosen from the template's source (`of_template`).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

Call = tuple[str, Any]  # (function name, its arguments: an object, or a JSON string)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hermes(text: str, names: set[str]) -> tuple[str, list[Call]] | None:
    calls = []
    for found in _HERMES.finditer(text):
        call = _json(found.group(1))
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        calls.append((call["name"], call.get("arguments", {})))
    return (text[: text.find("<tool_call>")].strip(), calls) if calls else None


def _llama3_json(text: str, names: set[str]) -> tuple[str, list[Call]] | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls = []
    for part in body.split(";"):
        call = _json(part)
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        calls.append((call["name"], call.get("parameters", call.get("arguments", {}))))
    return "", calls


def _mistral(text: str, names: set[str]) -> tuple[str, list[Call]] | None:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return None
    listed = _json(text[at + len("[TOOL_CALLS]") :])
    if not isinstance(listed, list) or not listed or not all(isinstance(c, dict) and c.get("name") in names for c in listed):
        return None
    return text[:at].strip(), [(c["name"], c.get("arguments", {})) for c in listed]


def _pythonic(text: str, names: set[str]) -> tuple[str, list[Call]] | None:
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id not in names or node.args:
                return None
            calls.append((node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return "", calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    _parse: Callable[[str, set[str]], tuple[str, list[Call]] | None]
    required: str  # the start of a reply that must call a tool (the policy writes the function's name on)
    named: Callable[[str], str]  # the start of a reply that must call this function (the policy writes its arguments)
    close: Callable[[str], str]  # what closes a forced call the policy left open ("" when nothing needs closing)

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[dict]]:
        """The reply's content and its calls of `tools`, as OpenAI tool calls (ids are the caller's to give)."""
        names = {t.get("function", {}).get("name") for t in tools}
        found = self._parse(text, names)
        if found is None:
            return text, []
        content, calls = found
        return content, [{"type": "function", "function": {"name": name, "arguments": a if isinstance(a, str) else json.dumps(a)}}
                         for name, a in calls]


FORMATS = {
    "hermes": ToolCallFormat(
        "hermes", _hermes, '<tool_call>\n{"name": "', lambda n: f'<tool_call>\n{{"name": {json.dumps(n, ensure_ascii=False)}, "arguments": ',
        lambda said: "" if "</tool_call>" in said else "\n</tool_call>",
    ),
    "llama3_json": ToolCallFormat(
        "llama3_json", _llama3_json, '{"name": "', lambda n: f'{{"name": {json.dumps(n, ensure_ascii=False)}, "parameters": ', lambda said: "",
    ),
    "mistral": ToolCallFormat(
        "mistral", _mistral, '[TOOL_CALLS] [{"name": "', lambda n: f'[TOOL_CALLS] [{{"name": {json.dumps(n, ensure_ascii=False)}, "arguments": ',
        lambda said: "" if said.rstrip().endswith("]") else "]",
    ),
    "pythonic": ToolCallFormat("pythonic", _pythonic, "[", lambda n: f"[{n}(", lambda said: "" if said.rstrip().endswith("]") else "]"),
}


def of_template(template: str | None) -> ToolCallFormat:
    """The convention a chat template teaches (Hermes when it names none: loopline's own tool prompt)."""
    source = template or ""
    if "[TOOL_CALLS]" in source:
        return FORMATS["mistral"]
    if "<tool_call>" in source:
        return FORMATS["hermes"]
    if "<|python_tag|>" in source or '"parameters": dictionary of argument name and its value' in source:
        return FORMATS["llama3_json"]
    if "[func_name1(" in source:
        return FORMATS["pythonic"]
    return FORMATS["hermes"]
