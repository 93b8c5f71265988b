"""Reading the model's turn: a tool call, a final answer, or neither.

A tool is called as `<NAME>ARGUMENT</NAME>` when it takes one string
argument (`<calc>12 * 7</calc>`), or `<NAME>{"json": "object"}</NAME>`
otherwise. `<answer>...</answer>` ends the episode. What does not parse is
told back to the model as an observation; it never crashes the episode.
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
class Call:
    call: ToolCall


@dataclass(frozen=True)
class Unparsable:
    message: str


@dataclass(frozen=True)
class NoAction:
    pass


Action = Answer | Call | Unparsable | NoAction


def parse_action(text: str, tools: tuple[Tool, ...]) -> Action:
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
        return Call(ToolCall(name, {}))
    single = [arg for arg, spec in tool.args.items() if spec.type == "string"]
    if len(tool.args) == 1 and single:
        return Call(ToolCall(name, {single[0]: inner.strip()}))
    try:
        args = json.loads(inner)
    except json.JSONDecodeError as exc:
        return Unparsable(f"error: arguments of <{name}> must be a JSON object ({exc.msg}); expected keys: {', '.join(tool.args)}")
    if not isinstance(args, dict):
        return Unparsable(f"error: arguments of <{name}> must be a JSON object, got {type(args).__name__}")
    return Call(ToolCall(name, args))
