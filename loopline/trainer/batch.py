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

import numpy as np
import torch

from loopline.types import ChainedTrajectory, StoredTrajectory


@dataclass(frozen=True, eq=False)
class TrainSequence:
    """One chain as the learner trains it. Its arrays are numpy's, in the ledger's own widths (a 128-turn
    trajectory is ~66,000 positions: as Python tuples it would take ~9x the bytes the ledger stores)."""

    trajectory_id: uuid.UUID | None
    group_id: object
    reward: float
    input_ids: np.ndarray  # int32
    action_mask: np.ndarray  # int8: 1 where input_ids[i] is a generated action token
    behaviour_logprobs: np.ndarray  # float32: μ at action positions, 0.0 elsewhere
    policy_version: int = 0  # the oldest version that generated any of its tokens
    policy_version_max: int | None = None  # the newest (None: the same)
    chain: int = 0  # which chain of its trajectory (0: the first; a trajectory's chains are consecutive sequences)

    def __post_init__(self) -> None:  # (any sequence in; the arrays the learner pads from out)
        for name, dtype in (("input_ids", np.int32), ("action_mask", np.int8), ("behaviour_logprobs", np.float32)):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=dtype))

    def generated_by(self, version: int) -> bool:
        """Every action token came from `version` (the learner's own weights: their logprobs must match)."""
        return self.policy_version == version and (self.policy_version_max in (None, version))

    @property
    def action_tokens(self) -> int:
        return int(self.action_mask.sum())


def prompt_length(sequence: TrainSequence) -> int:
    """Its tokens before the first action (what trainer/prefix.py shares between rows): all of them without one."""
    actions = np.flatnonzero(sequence.action_mask)
    return int(actions[0]) if len(actions) else len(sequence.input_ids)


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


def sequences_from_trajectory(trajectory: ChainedTrajectory | StoredTrajectory) -> list[TrainSequence]:
    """Each chain of the trajectory as one sequence: its last call's prompt and generation; each call's action
    tokens keep their mask and rollout logprobs at their place in it."""
    if isinstance(trajectory, StoredTrajectory):
        trajectory = trajectory.chained()
    if not trajectory.chains:
        raise ValueError(f"trajectory {trajectory.id} has no segments")
    out = []
    for k, chain in enumerate(trajectory.chains):
        mask: np.ndarray = np.zeros(len(chain.ids), dtype=np.int8)
        logprobs: np.ndarray = np.zeros(len(chain.ids), dtype=np.float32)
        for call in chain.calls:
            mask[call.prompt_len : call.prompt_len + len(call.action_loss_mask)] = call.action_loss_mask
            logprobs[call.prompt_len : call.prompt_len + len(call.rollout_logprobs)] = call.rollout_logprobs
        out.append(TrainSequence(
            trajectory.id, trajectory.group_id, trajectory.reward, chain.ids, mask, logprobs,
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


def micro_batches(sequences: Sequence[TrainSequence], token_budget: int, share_prefix: bool = False) -> list[list[int]]:
    """Indices grouped so that the tokens each micro-batch runs through the model stay within `token_budget`, the rows
    that share a prompt side by side (shortest prompt group first, each group's rows by length). The learner runs a
    prompt once per micro-batch that holds it (trainer/prefix.py): sorted by length alone, a group's rows spread over
    every micro-batch, and the race's step ran its 8 prompts 30 times (19,540 tokens through the model, 15,607 kept
    together). What a micro-batch runs: with `share_prefix`, where two of its rows share a prompt, each prompt once and
    every row's suffix (trainer/prefix.py pads the suffixes little); otherwise every row padded to the longest. Counted
    as padded rows, the race's micro-batches ran 3,800 tokens of their 8,320 and its prompts ran 1.5 times each."""
    prompts: dict[bytes, list[int]] = {}
    for i, sequence in enumerate(sequences):
        prompts.setdefault(sequence.input_ids[: prompt_length(sequence)].tobytes(), []).append(i)
    key = {i: k for k, rows in prompts.items() for i in rows}
    share_prefix = share_prefix and all(prompt_length(s) > 1 for s in sequences)  # (else trainer/prefix.py shares nothing)
    length = lambda i: len(sequences[i].input_ids)  # noqa: E731
    order = [i for rows in sorted(prompts.values(), key=lambda rows: max(map(length, rows))) for i in sorted(rows, key=length)]
    batches: list[list[int]] = []
    current: list[int] = []
    seen: set[bytes] = set()
    prefix_tokens = suffix_tokens = longest = 0
    for i in order:
        # (trainer/prefix.py's split: the prefix ends one token before the first action, which its last position predicts)
        prefix = max(prompt_length(sequences[i]) - 1, 0)
        shared = share_prefix and (key[i] in seen or len(seen) < len(current))
        runs = (prefix_tokens + (0 if key[i] in seen else prefix) + suffix_tokens + length(i) - prefix if shared
                else max(longest, length(i)) * (len(current) + 1))
        if current and runs > token_budget:
            batches.append(current)
            current, seen, prefix_tokens, suffix_tokens, longest = [], set(), 0, 0, 0
        current.append(i)
        prefix_tokens += 0 if key[i] in seen else prefix
        seen.add(key[i])
        suffix_tokens += length(i) - prefix
        longest = max(longest, length(i))
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
        ids[b, :n] = torch.from_numpy(s.input_ids)
        attn[b, :n] = 1
        mask[b, :n] = torch.from_numpy(s.action_mask)
        mu[b, :n] = torch.from_numpy(s.behaviour_logprobs)
    # logits at position t predict token t+1: targets and their masks shift by one
    return Padded(ids, attn, mask[:, 1:], mu[:, 1:], list(rows))
