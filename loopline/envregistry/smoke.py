"""`envreg test`: play an environment's scripted smoke test on a few tasks, phase by phase."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from loopline.envregistry.episode import Episode, ToolCall
from loopline.envregistry.sandbox.base import InfraFailure
from loopline.envregistry.spec import EnvSpec
from loopline.envregistry.tasks import Task

_PLACEHOLDER = re.compile(r"{task\.(\w+)}")


def fill(value: Any, task: Task) -> Any:
    """Replace {task.FIELD} in strings with the task's data (the smoke test knows the answers).

    Every field used is checked to exist on every task when the spec is validated.
    """
    if not isinstance(value, str):
        return value
    return _PLACEHOLDER.sub(lambda m: str(task.data[m.group(1)]), value)


@dataclass(frozen=True)
class SmokeStepResult:
    call: str
    output: str
    seconds: float


@dataclass
class SmokeResult:
    task_id: str
    timings: dict[str, float] = field(default_factory=dict)
    reward: float | None = None
    verdict: dict[str, Any] = field(default_factory=dict)
    steps: list[SmokeStepResult] = field(default_factory=list)
    answer: str | None = None
    infra_error: str | None = None

    def passed(self, expected: float) -> bool:
        return self.infra_error is None and self.reward is not None and abs(self.reward - expected) < 1e-9


# Plays an env with `agent:` (its program against scripted model replies): the rollout layer's
# (`loopline.rollout.harness.agent_program.play_scripted`), handed in by whoever sits above both (the `envreg` command).
AgentPlayer = Callable[[EnvSpec, Task], Awaitable[SmokeResult]]


async def run_smoke(spec: EnvSpec, task: Task, play_agent: AgentPlayer | None = None) -> SmokeResult:
    if spec.smoke_test is None:
        raise ValueError(f"{spec.name} declares no smoke_test")
    if spec.agent is not None:
        if play_agent is None:
            raise ValueError(f"{spec.name} runs an agent program: test it with the `envreg` command")
        return await play_agent(spec, task)
    result = SmokeResult(task.id)
    clock = time.monotonic()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.monotonic()
        result.timings[phase] = result.timings.get(phase, 0.0) + now - clock
        clock = now

    episode = None
    try:
        episode = await Episode.start(spec, task, labels={"loopline.purpose": "smoke"})
        lap("start")
        await episode.reset()
        lap("reset")
        for step in spec.smoke_test.steps:
            if step.tool is not None:
                args = {k: fill(v, task) for k, v in step.args.items()}
                seen = await episode.step(ToolCall(step.tool, args))
                shown = ", ".join(f"{k}={v!r}"[:80] for k, v in args.items())
                result.steps.append(SmokeStepResult(f"{step.tool}({shown})", seen.text, seen.seconds))
            if step.answer is not None:
                result.answer = fill(step.answer, task)
        lap("steps")
        verdict = await episode.verify(result.answer or "")
        result.reward, result.verdict = verdict.reward, verdict.details
        lap("verify")
    except InfraFailure as exc:
        result.infra_error = str(exc)
    finally:
        if episode is not None:
            await episode.close()
        lap("close")
    return result

