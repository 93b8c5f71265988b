"""`envreg test`: play an environment's scripted smoke test on a few tasks, phase by phase."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

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


async def run_smoke(spec: EnvSpec, task: Task) -> SmokeResult:
    if spec.smoke_test is None:
        raise ValueError(f"{spec.name} declares no smoke_test")
    if spec.agent is not None:
        return await _run_agent_smoke(spec, task)
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


async def _run_agent_smoke(spec: EnvSpec, task: Task) -> SmokeResult:
    """The env's own program, against a scripted model answering its calls with `smoke_test.replies` (the
    shipped starter's tokenizer and chat template stand in for the policy's)."""
    from loopline.rollout.agent_program import run_agent_program
    from loopline.rollout.chat import ChatFormat
    from loopline.rollout.engine import EngineError, Generation, SamplingParams, VersionSpan
    from loopline.rollout.harness import EpisodeSetup
    from loopline.flows.starter import SHIPPED_STARTERS

    chat = ChatFormat.for_policy(next(p for p in sorted(SHIPPED_STARTERS.iterdir()) if (p / "config.json").is_file()))
    replies = [fill(reply, task) for reply in spec.smoke_test.replies]
    result = SmokeResult(task.id)

    class Scripted:
        def version(self) -> int:
            return 0

        async def generate(self, prompt_ids, sampling, request_id):
            said = replies.pop(0) if replies else ""
            ids = chat.tokenizer.encode(said, add_special_tokens=False) + [chat.eos_id]
            result.steps.append(SmokeStepResult(f"model call {len(result.steps) + 1}", said, 0.0))
            return Generation(tuple(ids), tuple([0.0] * len(ids)), "stop", (VersionSpan(0, 0, len(ids)),))

    started = time.monotonic()
    setup = EpisodeSetup(spec, 0, chat, SamplingParams(temperature=1.0, max_new_tokens=spec.budgets.max_generated_tokens))
    try:
        trajectory = await run_agent_program(Scripted(), setup, task, f"smoke-{task.id}", labels={"loopline.purpose": "smoke"})
    except (InfraFailure, EngineError) as exc:
        result.infra_error = str(exc)
    else:
        result.reward, result.verdict = trajectory.reward, trajectory.info["verdict"]
        result.answer = f"(the program's answer.txt; it exited {trajectory.info['exit_code']}, {trajectory.info['end']})"
        t = trajectory.timings
        result.timings = {"start": t["sandbox_start_s"], "steps": t["episode_s"] - t["sandbox_start_s"] - t["verify_s"], "verify": t["verify_s"]}
    result.timings.setdefault("steps", time.monotonic() - started)
    return result
