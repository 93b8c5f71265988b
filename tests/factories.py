"""Trajectories as a rollout worker would commit them."""

from __future__ import annotations

import random
import struct

from loopline.types import SegmentRecord, TrajectoryRecord


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def segment(
    n_prompt: int = 8, n_gen: int = 4, version: int = 0, seed: int = 0, after: SegmentRecord | None = None, **kw
) -> SegmentRecord:
    """A model call; `after` makes it the next turn of a conversation (its prompt extends that call's)."""
    rng = random.Random(seed)
    history = [*after.prompt_ids, *after.generated_ids] if after is not None else []
    return SegmentRecord(
        request_id=kw.pop("request_id", f"req-{seed}"),
        policy_version=version,
        tokenizer_version="tok-1",
        prompt_ids=history + [rng.randrange(50_000) for _ in range(n_prompt)],
        generated_ids=[rng.randrange(50_000) for _ in range(n_gen)],
        action_loss_mask=kw.pop("action_loss_mask", [1] * n_gen),
        rollout_logprobs=kw.pop("rollout_logprobs", [_float32(-rng.random() * 5) for _ in range(n_gen)]),  # as engines compute them
        logprob_semantics="log_softmax(logits/T)",
        sampling_config={"temperature": 1.0, "top_p": 1.0},
        tool_events=kw.pop("tool_events", [{"tool": "calc", "args": "1+1", "output": "2"}]),
        **kw,
    )


def conversation(n_segments: int, version: int = 0, seed: int = 0) -> list[SegmentRecord]:
    segments: list[SegmentRecord] = []
    for i in range(n_segments):
        segments.append(segment(version=version, seed=seed * 100 + i, after=segments[-1] if segments else None))
    return segments


def trajectory(reward: float = 1.0, n_segments: int = 2, version: int = 0, seed: int = 0, **kw) -> TrajectoryRecord:
    return TrajectoryRecord(
        env_name="arithmetic",
        env_version=1,
        verifier_version="v1",
        harness_version="h1",
        reward=reward,
        terminated=kw.pop("terminated", True),
        truncated=kw.pop("truncated", False),
        segments=kw.pop("segments", None) or conversation(n_segments, version, seed),
        **kw,
    )


def kept_for_backward(learner, batch) -> int:
    """Bytes autograd holds between a micro-batch's forward (`learner._logprobs`) and its backward: each
    storage once, the weights not counted (saved, but no extra memory)."""
    import torch

    kept: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in learner.model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        learner._logprobs(batch)
    return sum(kept.values())
