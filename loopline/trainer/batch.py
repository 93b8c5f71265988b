"""From committed trajectories to training sequences, token-exact.

A trajectory's segments form prefix chains (each prompt is the previous
prompt + its generated ids + an observation), so a chain's training sequence
is its last segment's prompt + generated ids, and the action mask and behaviour
logprobs are placed at each segment's generated positions. A trajectory is
mostly one chain; an agent program that rewrote its history (or called twice
at once) made a new chain where a segment records `starts_chain`, and each
chain is a sequence of its own with the trajectory's advantage. A break
anywhere else is refused rather than silently re-aligned.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Sequence

import torch

from loopline.types import StoredTrajectory, chains, first_chain_break


@dataclass(frozen=True)
class TrainSequence:
    trajectory_id: uuid.UUID | None
    group_id: object
    reward: float
    input_ids: tuple[int, ...]
    action_mask: tuple[int, ...]  # 1 where input_ids[i] is a generated action token
    behaviour_logprobs: tuple[float, ...]  # μ at action positions, 0.0 elsewhere
    policy_version: int = 0  # the oldest version that generated any of its tokens
    policy_version_max: int | None = None  # the newest (None: the same)
    chain: int = 0  # which chain of its trajectory (0: the first; a trajectory's chains are consecutive sequences)

    def generated_by(self, version: int) -> bool:
        """Every action token came from `version` (the learner's own weights: their logprobs must match)."""
        return self.policy_version == version and (self.policy_version_max in (None, version))

    @property
    def action_tokens(self) -> int:
        return sum(self.action_mask)


def batch_metrics(sequences: list[TrainSequence], learner_s: float) -> dict[str, float]:
    """What a learner step's batch looked like, named as verl names them: generated tokens per trajectory (over its chains)
    (`response_length/mean`, `/max`) and every token through the learner per second (`perf/tokens_per_s`,
    verl's `perf/throughput` on one device)."""
    lengths = [0] * (max(trajectory_index(sequences), default=-1) + 1)
    for s, t in zip(sequences, trajectory_index(sequences)):  # (a trajectory's chains are its one response)
        lengths[t] += s.action_tokens
    return {
        "response_length/mean": sum(lengths) / max(len(lengths), 1),
        "response_length/max": float(max(lengths, default=0)),
        "perf/tokens_per_s": sum(len(s.input_ids) for s in sequences) / learner_s if learner_s > 0 else 0.0,
    }


def sequences_from_trajectory(trajectory: StoredTrajectory) -> list[TrainSequence]:
    """Each chain of the trajectory as one sequence: its last segment's context plus its generation; each
    segment's action tokens keep their mask and rollout logprobs at their place in it."""
    segments = trajectory.segments
    if not segments:
        raise ValueError(f"trajectory {trajectory.id} has no segments")
    broken = first_chain_break(segments)
    if broken is not None:
        raise ValueError(f"trajectory {trajectory.id}: segment {segments[broken].seq} does not extend the one before")
    out = []
    for k, chain in enumerate(chains(segments)):
        last = chain[-1]
        ids = list(last.prompt_ids) + list(last.generated_ids)
        mask, logprobs = [0] * len(ids), [0.0] * len(ids)
        for seg in chain:
            start = len(seg.prompt_ids)
            for i, (m, lp) in enumerate(zip(seg.action_loss_mask, seg.rollout_logprobs)):
                mask[start + i], logprobs[start + i] = int(m), float(lp)
        out.append(TrainSequence(
            trajectory.id, trajectory.group_id, trajectory.reward, tuple(ids), tuple(mask), tuple(logprobs),
            trajectory.policy_version_min, trajectory.policy_version_max, chain=k,
        ))
    return out


def trajectory_index(sequences: Sequence[TrainSequence]) -> list[int]:
    """For each sequence, the position of its trajectory among the batch's trajectories (a sequence of chain 0
    starts the next trajectory; its other chains follow it)."""
    index: list[int] = []
    for s in sequences:
        if s.chain == 0:
            index.append(index[-1] + 1 if index else 0)
        elif not index or sequences[len(index) - 1].trajectory_id != s.trajectory_id:
            raise ValueError(f"trajectory {s.trajectory_id}: chain {s.chain} does not follow its trajectory's other chains")
        else:
            index.append(index[-1])
    return index


def micro_batches(sequences: Sequence[TrainSequence], token_budget: int) -> list[list[int]]:
    """Indices grouped so that each padded micro-batch (count x longest) stays within `token_budget`."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].input_ids))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max([len(sequences[j].input_ids) for j in current] + [len(sequences[i].input_ids)])
        if current and longest * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class Padded:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    target_mask: torch.Tensor  # [B, L-1]: 1 where the token predicted at that position is an action
    behaviour_logprobs: torch.Tensor  # [B, L-1]
    rows: list[int]  # indices into the step's sequences


def pad(sequences: Sequence[TrainSequence], rows: list[int], pad_id: int = 0) -> Padded:
    longest = max(len(sequences[i].input_ids) for i in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    mu = torch.zeros((len(rows), longest), dtype=torch.float32)
    for b, i in enumerate(rows):
        s = sequences[i]
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(s.action_mask)
        mu[b, :n] = torch.tensor(s.behaviour_logprobs)
    # logits at position t predict token t+1: targets and their masks shift by one
    return Padded(ids, attn, mask[:, 1:], mu[:, 1:], list(rows))
