"""One episode of an environment: reset a task into a fresh sandbox, dispatch tool calls, verify, close.

The agent harness (rollout) drives this; it is plain async code with no
Prefect and no engine, so `envreg test` and the tests drive it directly.
Failures are classified here: a bad tool call is an observation for the
model; a sandbox problem raises `InfraFailure`.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable

from loopline.envregistry import verifiers
from loopline.envregistry.calculator import CalculatorError, calculate, format_number
from loopline.envregistry.sandbox.backends import open_sandbox
from loopline.envregistry.sandbox.base import ROLE_LABEL, VERIFIER_ROLE, InfraFailure, ModelEndpoint, Sandbox
from loopline.envregistry.spec import EnvSpec, Tool
from loopline.envregistry.tasks import Task
from loopline.store.nul import unicode

_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool}
MAX_OBSERVATION_CHARS = 4000
# Linux's limit on one argument of a command (MAX_ARG_STRLEN): a command is passed as one (`sh -c COMMAND`).
MAX_COMMAND_BYTES = 128 * 1024 - 1


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    text: str
    error: bool  # the call was refused or failed: the model's fault, told to the model
    seconds: float


@dataclass(frozen=True)
class ResetResult:
    system_prompt: str
    prompt: str


def _check_args(tool: Tool, args: dict[str, Any]) -> str | None:
    unknown = sorted(set(args) - set(tool.args))
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)}; {tool.name} takes: {', '.join(tool.args) or 'nothing'}"
    for name, arg in tool.args.items():
        if name not in args:
            if arg.required:
                return f"missing argument {name!r} ({arg.type})"
            continue
        value = args[name]
        if not isinstance(value, _TYPES[arg.type]) or (arg.type != "boolean" and isinstance(value, bool)):
            return f"argument {name!r} must be a {arg.type}, got {type(value).__name__}"
    return None


def _not_text(args: dict[str, Any]) -> str | None:
    """Why these arguments are not text any sandbox could carry (the model's doing, told back to it), or None."""
    for name, value in args.items():
        if unicode(name) != name or (isinstance(value, str) and unicode(value) != value):
            return f"argument {unicode(name)!r} is not valid Unicode text (it holds a lone surrogate such as \\ud800)"
    return None


def _uncarried(command: str) -> str | None:
    """Why no sandbox could run this command line, or None."""
    if "\x00" in command:
        return "a command line cannot carry a NUL character; pass such data on stdin or in a file"
    if len(command.encode()) > MAX_COMMAND_BYTES:
        return f"the command would be {len(command.encode()):,} bytes, over the {MAX_COMMAND_BYTES + 1:,} one command may hold"
    return None


class Episode:
    def __init__(self, spec: EnvSpec, task: Task, sandbox: Sandbox, labels: dict[str, str] | None = None):
        self.spec, self.task, self.sandbox, self.labels = spec, task, sandbox, labels or {}
        self.tools = {t.name: t for t in spec.tools}

    @classmethod
    async def start(cls, spec: EnvSpec, task: Task, labels: dict[str, str] | None = None, model: ModelEndpoint | None = None) -> "Episode":
        return cls(spec, task, await open_sandbox(spec.sandbox, labels, model), labels)

    async def reset(self) -> ResetResult:
        for path, task_field in self.spec.reset.files.items():
            await self.sandbox.write_file(path, str(self.task.data[task_field]))
        prompt = self.spec.reset.prompt.replace("{prompt}", self.task.prompt)
        return ResetResult(self.spec.reset.system_prompt, prompt)

    async def step(self, call: ToolCall, max_seconds: float | None = None) -> Observation:
        """Run one tool call, stopped after its tool's timeout_s or `max_seconds` (what the episode's budget has left)."""
        start = time.monotonic()
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return Observation(f"error: no tool named {call.name!r} (tools: {known})", True, time.monotonic() - start)
        problem = _not_text(call.args) or _check_args(tool, call.args)
        if problem:
            return Observation(f"error: {problem}", True, time.monotonic() - start)
        if tool.builtin == "calculator":
            try:
                text, error = format_number(calculate(str(call.args["expression"]))), False
            except CalculatorError as exc:
                text, error = f"error: {exc}", True
            return Observation(text, error, time.monotonic() - start)
        # (an optional argument left out is the empty string in the templates)
        fill = {name: "" for name in tool.args} | {name: str(value) for name, value in call.args.items()}
        command = tool.command.format(**{name: shlex.quote(value) for name, value in fill.items()})
        problem = _uncarried(command)
        if problem:
            return Observation(f"error: {problem}", True, time.monotonic() - start)
        stdin = tool.stdin.format(**fill) if tool.stdin else None
        timeout_s = tool.timeout_s if max_seconds is None else max(0.1, min(tool.timeout_s, max_seconds))  # `timeout 0`: none
        result = await self.sandbox.exec(command, timeout_s=timeout_s, stdin=stdin)
        text = (result.stdout + result.stderr)[-MAX_OBSERVATION_CHARS:]
        if result.timed_out:
            text += f"\n[timed out after {timeout_s:g} s]"
        elif result.oom_killed:
            text += "\n[killed: out of memory]"
        elif result.exit_code:
            text += f"\n[exit code {result.exit_code}]"
        return Observation(text, not result.ok, result.seconds)

    async def verify(self, final_text: str) -> verifiers.Verdict:
        try:
            return await verifiers.verify(self.spec.verifier, self.task, final_text, self.sandbox, self._verifier_sandbox)
        except InfraFailure:
            raise
        except Exception as exc:  # a crash of the verifier is never the agent's fault
            raise InfraFailure(f"verifier crashed: {type(exc).__name__}: {exc}") from exc

    def _verifier_sandbox(self) -> Awaitable[Sandbox]:
        """A sandbox the agent never touched, for the verifier (labelled so that a backend can size it for one)."""
        return open_sandbox(self.spec.sandbox, {**self.labels, ROLE_LABEL: VERIFIER_ROLE})

    async def close(self) -> None:
        await self.sandbox.close()
