"""Verifiers: loopline scores the final state itself; what the agent says about its work is never trusted."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from loopline.envregistry.sandbox.base import InfraFailure, Sandbox, SandboxExhausted
from loopline.envregistry.spec import ANSWER_FILE, VERDICT_FILE, Verifier
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


def parse_verdict(text: str, reward_range: tuple[float, float]) -> Verdict:
    """A verdict file's JSON, range-checked: anything malformed or out of range is a verifier fault (infra)."""

    def fault(why: str) -> InfraFailure:
        return InfraFailure(f"verifier fault: {why}: {text[:200]!r}")

    def number(value: Any, integer: bool) -> bool:
        kinds = int if integer else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)

    try:
        report = json.loads(text, parse_constant=lambda name: float("nan"))
    except (ValueError, RecursionError):
        raise fault("verdict.json is not JSON") from None
    if not isinstance(report, dict):
        raise fault("verdict.json must be a JSON object")
    low, high = reward_range
    if "reward" in report:
        reward = report["reward"]
        if not number(reward, integer=False):
            raise fault("`reward` must be a finite number")
        details: dict[str, Any] = {"reward": reward}
    elif "passed" in report and "total" in report:
        passed, total = report["passed"], report["total"]
        if not (number(passed, integer=True) and number(total, integer=True)):
            raise fault("`passed` and `total` must be integers")
        if not 0 <= passed <= total or total < 1:
            raise fault("need 0 <= passed <= total and total >= 1")
        reward = passed / total
        details = {"passed": passed, "total": total}
    else:
        raise fault('verdict.json needs {"passed": P, "total": T} or {"reward": R}')
    if not low <= reward <= high:
        raise fault(f"reward {reward:g} is outside the env's reward_range [{low:g}, {high:g}]")
    return Verdict(float(reward), reward >= high, details)


async def verify_with_command(
    spec: Verifier, task: Task, final_text: str, sandbox: Sandbox, fresh_sandbox: Callable[[], Awaitable[Sandbox]]
) -> Verdict:
    """Copy the agent's outputs out of its sandbox, into a fresh one (`fresh_sandbox()`) where the command verifier
    runs on a channel the agent cannot write (see `spec.Verifier`), and check its verdict. The agent's sandbox is
    evidence and nothing more: what it left there besides its outputs never reaches the verifier.

    A verifier that writes no verdict (it crashed, timed out) is an infra failure, not a reward of 0.
    """
    files = dict(spec.support_files)
    files.update({path: str(task.data[task_field]) for path, task_field in spec.hidden_files.items()})
    files[ANSWER_FILE] = final_text
    try:
        outputs = await sandbox.collect_outputs(spec.outputs)
        verifier_box = await fresh_sandbox()
        try:
            await verifier_box.put_outputs(outputs)
            run = await verifier_box.run_verifier(files, spec.command, spec.timeout_s)
        finally:
            await verifier_box.close()
    except SandboxExhausted as exc:
        return Verdict(0.0, False, {"reason": f"the agent used its sandbox up: {exc}"})
    if run.exhausted:
        return Verdict(0.0, False, {"reason": "the agent's code used up the verifier's sandbox: the verifier was killed for memory"})
    if run.verdict is None:
        result = run.result
        raise InfraFailure(
            f"verifier wrote no {VERDICT_FILE} (exit {result.exit_code}, timed out: {result.timed_out}): "
            f"{(result.stderr or result.stdout)[-300:]}"
        )
    verdict = parse_verdict(run.verdict, spec.reward_range)
    if outputs.left_out:
        verdict.details["outputs_left_out"] = outputs.left_out
    return verdict


async def verify(
    spec: Verifier, task: Task, final_text: str, sandbox: Sandbox, fresh_sandbox: Callable[[], Awaitable[Sandbox]]
) -> Verdict:
    if spec.builtin == "arithmetic_answer":
        return verify_arithmetic(task, final_text)
    return await verify_with_command(spec, task, final_text, sandbox, fresh_sandbox)
