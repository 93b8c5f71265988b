"""The agent harness: one multi-turn episode of a task, as token-exact segments.

Each model call is a segment holding the exact prompt ids the engine saw and
the ids it generated (loss mask 1 on every generated token; prompts, tool
output and template tokens are context, mask 0). Budgets end an episode as
`truncated`; an engine or sandbox fault raises (`EngineError`,
`InfraFailure`) so the slot is retried, never scored 0.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from datetime import datetime, timezone

from loopline.envregistry.episode import Episode
from loopline.envregistry.tasks import Task
from loopline.rollout.harness.actions import Answer, Calls, NoAction, Unparsable, parse_action
from loopline.rollout.harness.agent_program import run_agent_program
from loopline.rollout.engines.base import ContextOverflow, EngineError, Sampler
from loopline.rollout.harness.episode_setup import EpisodeSetup
from loopline.types import SegmentRecord, TrajectoryRecord


def _now() -> datetime:
    return datetime.now(timezone.utc)


async def run_episode(engine: Sampler, setup: EpisodeSetup, task: Task, request_id: str, labels: dict[str, str] | None = None) -> TrajectoryRecord:
    """Play one task to the end and return its trajectory (the caller commits it). An env with `agent:` is
    played by the user's program instead (`agent_program`)."""
    if setup.spec.agent is not None:
        return await run_agent_program(engine, setup, task, request_id, labels)
    started = time.monotonic()
    episode = await Episode.start(setup.spec, task, labels)
    start_seconds = time.monotonic() - started
    segments: list[SegmentRecord] = []
    state = {"final": "", "end": "turns", "generated": 0, "tool_s": 0.0}
    try:
        reset = await episode.reset()
        ids = setup.chat.initial_ids(reset.system_prompt, reset.prompt)
        await _turns(engine, setup, episode, ids, request_id, segments, state)
        verify_started = time.monotonic()
        verdict = await episode.verify(state["final"])
        verify_seconds = time.monotonic() - verify_started
    finally:
        await episode.close()
    if not segments:
        raise EngineError(f"episode {request_id} ended before the first model call ({state['end']})")
    terminated = state["end"] == "answer"
    truncated = not terminated
    return TrajectoryRecord(
        env_name=setup.spec.name,
        env_version=setup.env_version,
        verifier_version=setup.spec.versions.verifier,
        harness_version=setup.spec.versions.harness,
        reward=verdict.reward,
        terminated=terminated,
        truncated=truncated,
        failure_type="truncated" if truncated else (None if verdict.passed else "task_failed"),
        segments=segments,
        timings={"episode_s": time.monotonic() - started, "sandbox_start_s": start_seconds, "tools_s": state["tool_s"], "verify_s": verify_seconds},
        info={"verdict": verdict.details, "end": state["end"], "generated_tokens": state["generated"]},
    )


def derive_seed(seed: int, task_id: str, turn: int) -> int:
    """One seed for every request would draw the same random numbers for every task (one coin for all)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{task_id}/{turn}".encode()).digest()[:4], "little")


async def _turns(engine, setup: EpisodeSetup, episode: Episode, ids, request_id, segments, state) -> None:
    budgets = setup.spec.budgets
    for turn in range(budgets.max_turns):
        remaining = budgets.max_generated_tokens - state["generated"]
        if remaining <= 0:
            state["end"] = "tokens"
            return
        sampling = replace(setup.sampling, max_new_tokens=min(setup.sampling.max_new_tokens, remaining))
        if sampling.seed is not None:  # fixed-seed sampling: reproducible per task and turn, independent across them
            sampling = replace(sampling, seed=derive_seed(sampling.seed, episode.task.id, turn))
        # prefix-free request ids: SGLang aborts by prefix ("r-1" would also match "r-10")
        rid = f"{request_id}/t{turn}/"
        started = _now()
        try:
            gen = await engine.generate(ids, sampling, rid)
        except ContextOverflow:
            state["end"] = "context"
            return
        if gen.finish_reason == "abort":
            raise EngineError(f"request {rid} was aborted by the engine (weight update or shutdown)")
        generated = list(gen.token_ids)
        state["generated"] += len(generated)
        text = setup.chat.decode(generated)
        action = parse_action(text, setup.spec.tools, setup.spec.tool_calls)
        events: list[dict] = []
        segment = SegmentRecord(
            request_id=rid,
            policy_version=gen.policy_version,
            tokenizer_version=setup.chat.version,
            prompt_ids=list(ids),
            generated_ids=generated,
            action_loss_mask=[1] * len(generated),
            rollout_logprobs=list(gen.logprobs),
            logprob_semantics=gen.logprob_semantics,
            sampling_config=sampling.to_dict(),
            tool_events=events,
            version_spans=gen.recorded_spans(),
            started_at=started,
            ended_at=_now(),
        )
        segments.append(segment)
        if gen.finish_reason == "length":
            state["end"] = "tokens"
            state["final"] = text
            return
        if isinstance(action, Answer):
            state["end"], state["final"] = "answer", text
            return
        if isinstance(action, NoAction):
            state["end"], state["final"] = "answer", text  # the model ended its turn without a tool: that is its answer
            return
        calls = action.calls if isinstance(action, Calls) else (action,)
        outputs = []
        for call in calls:
            if isinstance(call, Unparsable):
                events.append({"tool": None, "args": None, "output": call.message, "error": True, "seconds": 0.0})
            elif state["tool_s"] >= budgets.wall_time_s:
                break  # a turn's later calls are not run once the wall time is spent
            else:
                # The wall-time budget is the environment's time on the agent's actions: a call gets what is left
                # of it. Time spent waiting for the engine is not the agent's doing (it grows with the load: an
                # async run's queue, a busy server) and must not become a reward; generation is bounded by tokens.
                result = await episode.step(call, max_seconds=budgets.wall_time_s - state["tool_s"])
                state["tool_s"] += result.seconds
                events.append({"tool": call.name, "args": call.args, "output": result.text, "error": result.error, "seconds": result.seconds})
            outputs.append(setup.spec.reset.observation.replace("{output}", events[-1]["output"]))
        state["final"] = text
        if state["tool_s"] >= budgets.wall_time_s:
            state["end"] = "wall_time"
            return
        ids = ids + generated + setup.chat.observations_ids(outputs, generated)
    state["end"] = "turns"
