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
