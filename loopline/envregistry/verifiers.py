"""Verifiers: loopline scores the final state itself; what the agent says about its work is never trusted."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from loopline.envregistry.sandbox.base import InfraFailure, Sandbox
from loopline.envregistry.spec import Verifier
from loopline.envregistry.tasks import Task

ANSWER_PATTERN = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


@dataclass(frozen=True)
class Verdict:
    reward: float
    passed: bool
    details: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- arithmetic


class _Parser:
    """A recursive-descent evaluator for + - * and parentheses over integers.

    Deliberately a second implementation, independent of the calculator tool
    the agent uses: a bug in the tool cannot make wrong answers score.
    """

    def __init__(self, text: str):
        self.tokens = re.findall(r"\d+|[-+*()]", text)
        if "".join(self.tokens) != re.sub(r"\s+", "", text):
            raise ValueError(f"unexpected characters in {text!r}")
        self.pos = 0

    def parse(self) -> int:
        value = self._sum()
        if self.pos != len(self.tokens):
            raise ValueError("trailing tokens")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ValueError("unexpected end")
        self.pos += 1
        return token

    def _sum(self) -> int:
        value = self._product()
        while self._peek() in ("+", "-"):
            value = value + self._product() if self._take() == "+" else value - self._product()
        return value

    def _product(self) -> int:
        value = self._atom()
        while self._peek() == "*":
            self._take()
            value *= self._atom()
        return value

    def _atom(self) -> int:
        token = self._take()
        if token == "(":
            value = self._sum()
            if self._take() != ")":
                raise ValueError("missing )")
            return value
        if token == "-":
            return -self._atom()
        return int(token)


def evaluate_expression(text: str) -> int:
    return _Parser(text).parse()


def verify_arithmetic(task: Task, final_text: str) -> Verdict:
    expected = evaluate_expression(task.data["expression"])
    if expected != task.data["answer"]:
        raise InfraFailure(
            f"verifier disagrees with task {task.id}: {task.data['expression']} = {expected}, "
            f"task says {task.data['answer']}"
        )
    answers = ANSWER_PATTERN.findall(final_text)
    if not answers:
        return Verdict(0.0, False, {"reason": "no <answer>N</answer> in the final message", "expected": expected})
    given = int(answers[-1])
    return Verdict(float(given == expected), given == expected, {"answer": given, "expected": expected})


# --------------------------------------------------------------------------- command verifiers


async def verify_with_command(spec: Verifier, task: Task, sandbox: Sandbox) -> Verdict:
    """Copy the hidden files in (only now), run the command, read its JSON verdict from the last stdout line.

    The command prints e.g. {"passed": 3, "total": 4}; reward = passed / total.
    A crash of the verifier itself (no verdict line) is an infra failure, not a reward of 0.
    """
    for path, text in spec.support_files.items():
        await sandbox.write_file(path, text)
    for path, task_field in spec.hidden_files.items():
        await sandbox.write_file(path, str(task.data[task_field]))
    result = await sandbox.exec(spec.command, timeout_s=spec.timeout_s)
    lines = result.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
        passed, total = int(report["passed"]), int(report["total"])
    except (IndexError, ValueError, KeyError, TypeError):
        raise InfraFailure(
            f"verifier command gave no verdict (exit {result.exit_code}, timed out: {result.timed_out}): "
            f"{(result.stderr or result.stdout)[-300:]}"
        ) from None
    reward = passed / total if total else 0.0
    return Verdict(reward, total > 0 and passed == total, {"passed": passed, "total": total})


async def verify(spec: Verifier, task: Task, final_text: str, sandbox: Sandbox) -> Verdict:
    if spec.builtin == "arithmetic_answer":
        return verify_arithmetic(task, final_text)
    return await verify_with_command(spec, task, sandbox)
