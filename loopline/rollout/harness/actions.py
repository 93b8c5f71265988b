"""Reading the model's turn: a tool call, a final answer, or neither.

`tool_calls: tags` (the default): a tool is called as `<NAME>ARGUMENT</NAME>`
when it takes one string argument (`<calc>12 * 7</calc>`), or
`<NAME>{"json": "object"}</NAME>` otherwise; `<answer>...</answer>` ends the
episode. `tool_calls: hermes`: the convention instruction-tuned models are
trained on (Hermes, Qwen2.5/3): `<tool_call>{"name": N, "arguments": {...}}</tool_call>`,
the tools described to the model by its own chat template (`tool_schemas`);
a turn may make several calls (Qwen's parallel calls), run in order, each
output its own tool message; a turn without a call is the answer. Either way
what does not parse is told back to the model as an observation (in its
place among a turn's calls); it never crashes the episode.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from loopline.envregistry.episode import ToolCall
from loopline.envregistry.spec import Tool


@dataclass(frozen=True)
class Answer:
    text: str


@dataclass(frozen=True)
class Unparsable:
    message: str


@dataclass(frozen=True)
class Calls:
    """A turn's tool calls in the order written; one that does not parse is told back in its place."""

    calls: tuple[ToolCall | Unparsable, ...]


@dataclass(frozen=True)
class NoAction:
    pass


Action = Answer | Calls | Unparsable | NoAction


def parse_action(text: str, tools: tuple[Tool, ...], tool_calls: str = "tags") -> Action:
    if tool_calls == "hermes":
        return _parse_hermes(text, tools)
    names = [t.name for t in tools] + ["answer"]
    opening = re.search(r"<(" + "|".join(map(re.escape, names)) + r")>", text)
    if opening is None:
        return NoAction()
    name = opening.group(1)
    close = text.find(f"</{name}>", opening.end())
    if name == "answer":
        return Answer(text)
    if close < 0:
        return Unparsable(f"error: <{name}> was opened but never closed with </{name}>")
    inner = text[opening.end() : close]
    tool = next(t for t in tools if t.name == name)
    if not tool.args:
        return Calls((ToolCall(name, {}),))
    single = [arg for arg, spec in tool.args.items() if spec.type == "string"]
    if len(tool.args) == 1 and single:
        return Calls((ToolCall(name, {single[0]: inner.strip()}),))
    try:
        args = json.loads(inner)
    except json.JSONDecodeError as exc:
        return Unparsable(f"error: arguments of <{name}> must be a JSON object ({exc.msg}); expected keys: {', '.join(tool.args)}")
    if not isinstance(args, dict):
        return Unparsable(f"error: arguments of <{name}> must be a JSON object, got {type(args).__name__}")
    return Calls((ToolCall(name, args),))


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _parse_hermes(text: str, tools: tuple[Tool, ...]) -> Action:
    """Every `<tool_call>` block of the turn, in order."""
    found = list(_HERMES_CALL.finditer(text))
    if not found:
        return NoAction()
    return Calls(tuple(_hermes_call(f.group(1), bool(f.group(2)), tools) for f in found))


def _hermes_call(body: str, closed: bool, tools: tuple[Tool, ...]) -> ToolCall | Unparsable:
    if not closed:
        return Unparsable("error: <tool_call> was opened but never closed with </tool_call>")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return Unparsable(f'error: a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}} ({exc.msg})')
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return Unparsable('error: a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    tool = next((t for t in tools if t.name == call["name"]), None)
    if tool is None:
        return Unparsable(f"error: no tool named {call['name'][:80]!r}; the tools are: {', '.join(t.name for t in tools) or 'none'}")
    args = call.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI's API returns them
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return Unparsable(f"error: the arguments of {tool.name} must be a JSON object; expected keys: {', '.join(tool.args) or 'none'}")
    return ToolCall(tool.name, args)


def tool_schemas(tools: tuple[Tool, ...]) -> tuple[dict, ...]:
    """The tools as chat templates take them (`apply_chat_template(tools=...)`: OpenAI's function format)."""
    return tuple(
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": {
                    "type": "object",
                    "properties": {name: {"type": a.type, "description": a.description} for name, a in t.args.items()},  # (JSON Schema's names)
                    "required": [name for name, a in t.args.items() if a.required],
                },
            },
        }
        for t in tools
    )
