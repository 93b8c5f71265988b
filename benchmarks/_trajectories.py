"""Synthetic trajectories shaped as the harness records them, for the ledger benchmarks."""

from __future__ import annotations

import random


def multi_turn(rng: random.Random, turns: int, first: int, generated: int, observation: int):
    """Each segment's prompt is the whole context so far (the previous prompt, its generated tokens and the
    tool's output): what `TrajectoryRecord.validate` requires. The ledger stores each prompt's new part only."""
    from loopline.types import SegmentRecord, TrajectoryRecord

    context = [rng.randrange(150_000) for _ in range(first)]
    segments = []
    for _ in range(turns):
        out = [rng.randrange(150_000) for _ in range(generated)]
        segments.append(SegmentRecord(
            request_id=f"r{rng.getrandbits(48)}", policy_version=0, tokenizer_version="tok", prompt_ids=list(context),
            generated_ids=out, action_loss_mask=[1] * generated, rollout_logprobs=[-rng.random() * 4 for _ in range(generated)],
            logprob_semantics="log_softmax(logits/T)", sampling_config={"temperature": 1.0},
            tool_events=[{"tool": "bash", "args": "pytest -q", "output": "1 passed", "seconds": 0.5}],
        ))
        context += out + [rng.randrange(150_000) for _ in range(observation)]
    return TrajectoryRecord("bench", 1, "v1", "h1", 1.0, True, False, segments)


def stored_ids(turns: int, first: int, generated: int, observation: int) -> int:
    """Token ids the ledger stores for such a trajectory: each segment only what the previous one does not hold
    (the first prompt once, every generation, every tool output but the last turn's)."""
    return first + turns * generated + (turns - 1) * observation


HISTORIES = ("appending", "re-rendering", "trimming", "summarising")


def rewriting(rng: random.Random, turns: int, first: int, generated: int, observation: int, history: str, window: int = 8):
    """An agent whose history is not always its last call's prompt and generation (each such call starts a
    chain): `re-rendering` re-tokenises its last answer's final 4 ids each call (smolagents' CodeAgent renders
    its memory anew); `trimming` keeps the first prompt and the last `window` turns (LangChain's trim_messages
    before each call); `summarising` replaces all but the last 2 turns by a 256-id summary every 16 turns, then
    appends (LangMem's SummarizationNode). `appending` is multi_turn's agent."""
    from dataclasses import replace

    from loopline.types import TrajectoryRecord

    word = lambda n: [rng.randrange(150_000) for _ in range(n)]  # noqa: E731
    system = word(first)
    done: list[list[int]] = []  # each turn's generated ids and tool output
    segments, prompt = [], list(system)
    base = multi_turn(rng, turns, first, generated, observation).segments  # (request ids, logprobs, tool events)
    for n in range(turns):
        out = word(generated)
        segments.append(replace(base[n], prompt_ids=list(prompt), generated_ids=out, starts_chain=False))
        done.append(out + word(observation))
        if history == "appending":
            prompt += done[-1]
        elif history == "re-rendering":
            prompt += out[:-4] + word(4) + done[-1][generated:]
        elif history == "trimming":
            prompt = system + [x for turn in done[-window:] for x in turn]
        elif history == "summarising" and (n + 1) % 16 == 0:
            prompt = system + word(256) + [x for turn in done[-2:] for x in turn]
        else:
            prompt += done[-1]
    for k in range(1, turns):  # a call starts a chain where its prompt does not extend the previous call's ids
        held = [*segments[k - 1].prompt_ids, *segments[k - 1].generated_ids]
        if segments[k].prompt_ids[: len(held)] != held:
            segments[k] = replace(segments[k], starts_chain=True)
    return TrajectoryRecord("bench", 1, "v1", "h1", 1.0, True, False, segments)
