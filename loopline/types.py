"""loopline's RL vocabulary: what a rollout records, what the learner reads back, what it says each trajectory
contributed. Plain frozen dataclasses shared by the rollout, the trainer and the ledger (which stores them),
so that neither the rollout nor the trainer depends on the database layer for its types."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any, Literal, Sequence

import numpy as np

from loopline.errors import LooplineError

Split = Literal["train", "eval"]


# How long a worker's claim on a slot lasts without renewal (it renews every third of it while the episode
# runs): a dead worker's slots are retried after this long. One default for the run config, the rollout
# worker and the ledger.
LEASE_SECONDS = 60.0
# Attempts of an episode that fails for an infrastructure reason before its group is given up (one default for
# the run config, the ledger's plans and evaluations).
MAX_ATTEMPTS = 3

@dataclass(frozen=True)
class SegmentRecord:
    """One model call as the model saw it; arrays are aligned with `generated_ids`."""

    request_id: str
    policy_version: int
    tokenizer_version: str
    prompt_ids: Sequence[int]
    generated_ids: Sequence[int]
    action_loss_mask: Sequence[int]
    rollout_logprobs: Sequence[float]
    logprob_semantics: str
    sampling_config: dict[str, Any] = field(default_factory=dict)
    tool_events: Sequence[dict[str, Any]] = ()
    # Per-token version spans when weights changed mid-request: [{"version": v, "start": i, "end": j}, ...]
    version_spans: Sequence[dict[str, Any]] | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    # The call did not extend the previous one's ids (an agent that rewrote its history, a parallel call): it
    # starts a chain of its own, trained as a sequence of its own (see `chains`)
    starts_chain: bool = False

    def versions(self) -> list[int]:
        spans = [int(s["version"]) for s in self.version_spans or ()]
        return [self.policy_version, *spans]

    def validate(self, where: str) -> None:
        n = len(self.generated_ids)
        if len(self.action_loss_mask) != n or len(self.rollout_logprobs) != n:
            raise LooplineError(
                f"{where}: generated_ids ({n}), action_loss_mask ({len(self.action_loss_mask)}) and "
                f"rollout_logprobs ({len(self.rollout_logprobs)}) must have the same length"
            )
        if any(m not in (0, 1) for m in self.action_loss_mask):
            raise LooplineError(f"{where}: action_loss_mask holds values other than 0 and 1")


@dataclass(frozen=True)
class TrajectoryRecord:
    env_name: str
    env_version: int
    verifier_version: str
    harness_version: str
    reward: float
    terminated: bool
    truncated: bool
    segments: Sequence[SegmentRecord]
    failure_type: Literal["task_failed", "truncated"] | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if not self.segments:
            raise LooplineError("a trajectory needs at least one segment")
        for i, seg in enumerate(self.segments):
            seg.validate(f"segment {i}")
        broken = first_chain_break(self.segments)
        if broken is not None:
            raise LooplineError(f"segment {broken} does not extend segment {broken - 1} (the history was re-tokenised)")

    def version_range(self) -> tuple[int, int]:
        versions = [v for seg in self.segments for v in seg.versions()]
        return min(versions), max(versions)


def first_chain_break(segments: Sequence[Any]) -> int | None:
    """The trajectory rule every reader checks: each model call's prompt starts with exactly the previous
    call's prompt and generated tokens (the history is never re-tokenised), except a call recorded as starting
    a chain of its own (`starts_chain`). Returns the index of the first segment that breaks it, or None.
    Segments are anything with `prompt_ids` and `generated_ids` (and optionally `starts_chain`)."""
    for i in range(1, len(segments)):
        if getattr(segments[i], "starts_chain", False):
            continue
        prompt, generated = segments[i - 1].prompt_ids, segments[i - 1].generated_ids
        extends = segments[i].prompt_ids
        # (each prompt compared in place, without copying the growing history: a 128-turn trajectory's prompts
        # hold ~4M ids, and the copies were most of a rollout worker's commit)
        if not _equal(extends[: len(prompt)], prompt) or not _equal(extends[len(prompt) : len(prompt) + len(generated)], generated):
            return i
    return None


def _equal(a: Sequence[int], b: Sequence[int]) -> bool:
    return a == b if type(a) is type(b) else list(a) == list(b)  # (a list never equals a tuple)


def chains(segments: Sequence[Any]) -> list[list[Any]]:
    """A trajectory's segments cut where a segment starts a chain: each chain is one prefix chain, trained as one
    sequence (its last call's prompt and generation hold every earlier call of the chain)."""
    out: list[list[Any]] = []
    for i, segment in enumerate(segments):
        if i == 0 or getattr(segment, "starts_chain", False):
            out.append([])
        out[-1].append(segment)
    return out


@dataclass(frozen=True)
class StoredSegment:
    """A committed segment's tokens, as the learner reads them back."""

    seq: int
    prompt_ids: Sequence[int]
    generated_ids: Sequence[int]
    action_loss_mask: Sequence[int]
    rollout_logprobs: Sequence[float]
    starts_chain: bool = False


@dataclass(frozen=True)
class StoredTrajectory:
    """A committed trajectory with each call's whole prompt (for readers that show every call; the learner
    reads `ChainedTrajectory`, which holds each token once)."""

    id: uuid.UUID
    group_id: uuid.UUID
    reward: float
    policy_version_min: int
    policy_version_max: int
    segments: tuple[StoredSegment, ...]

    def chained(self) -> "ChainedTrajectory":
        """The learner's view; a segment that breaks its chain (the trajectory rule) is refused."""
        broken = first_chain_break(self.segments)
        if broken is not None:
            raise ValueError(f"trajectory {self.id}: segment {self.segments[broken].seq} does not extend the one before")
        return ChainedTrajectory(
            self.id, self.group_id, self.reward, self.policy_version_min, self.policy_version_max,
            tuple(
                StoredChain(
                    np.asarray([*chain[-1].prompt_ids, *chain[-1].generated_ids], dtype=np.int32),
                    tuple(StoredCall(len(s.prompt_ids), s.action_loss_mask, s.rollout_logprobs) for s in chain),
                )
                for chain in chains(self.segments)
            ),
        )


@dataclass(frozen=True)
class StoredCall:
    """Where one call's generated ids sit in its chain's ids, with their loss mask and behaviour logprobs."""

    prompt_len: int
    action_loss_mask: Sequence[int]
    rollout_logprobs: Sequence[float]


@dataclass(frozen=True)
class StoredChain:
    """One prefix chain as the learner trains it: its last call's prompt and generated ids (every earlier
    call's are a prefix of them), and each call's place in them."""

    ids: np.ndarray  # int32
    calls: tuple[StoredCall, ...]


@dataclass(frozen=True)
class ChainedTrajectory:
    """A committed trajectory as the learner reads it back: memory linear in its tokens, whatever its turns."""

    id: uuid.UUID
    group_id: uuid.UUID
    reward: float
    policy_version_min: int
    policy_version_max: int
    chains: tuple[StoredChain, ...]


@dataclass(frozen=True)
class TrainedSample:
    """What one consumed trajectory contributed to its learner step, stored with its consumption row so that
    the inspector shows the numbers the learner used, not a recomputation."""

    advantage: float
    group_mean: float
    group_std: float  # the divisor GRPO used (0 for mean-only estimators and degenerate groups)
    degenerate: bool  # all rewards of its group were equal
    trained: bool  # False: its group was dropped as degenerate, or it had no action tokens
    action_tokens: int = 0
    rejected_tokens: int = 0  # left out by the off-policy correction (MIS / rejection)
    correction_weight_mean: float | None = None  # mean π_old/μ weight over its kept tokens
    learner_logprobs: tuple[float, ...] | None = None  # π_old at its action tokens, in order (None: another rank's)
    logprob_abs_diff_mean: float | None = None  # mean and max |π_old - μ| over its action tokens
    logprob_abs_diff_max: float | None = None

    def details(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("advantage", "learner_logprobs")}

    def then(self, chain: "TrainedSample") -> "TrainedSample":
        """This trajectory's sample with its next chain's (trained as a sequence of its own, with the same
        advantage): token counts added, means weighted by tokens, π_old in chain order (None when a chain
        with action tokens has none here: another rank's)."""

        def mean(a: float | None, wa: int, b: float | None, wb: int) -> float | None:
            parts = [(x, w) for x, w in ((a, wa), (b, wb)) if x is not None and w > 0]
            return sum(x * w for x, w in parts) / sum(w for _, w in parts) if parts else None

        kept, kept_next = self.action_tokens - self.rejected_tokens, chain.action_tokens - chain.rejected_tokens
        unknown = any(s.learner_logprobs is None and s.action_tokens for s in (self, chain))
        gaps = [x for x in (self.logprob_abs_diff_max, chain.logprob_abs_diff_max) if x is not None]
        return replace(
            self, trained=self.trained or chain.trained, action_tokens=self.action_tokens + chain.action_tokens,
            rejected_tokens=self.rejected_tokens + chain.rejected_tokens,
            correction_weight_mean=mean(self.correction_weight_mean, kept, chain.correction_weight_mean, kept_next),
            learner_logprobs=None if unknown else (self.learner_logprobs or ()) + (chain.learner_logprobs or ()),
            logprob_abs_diff_mean=mean(self.logprob_abs_diff_mean, self.action_tokens, chain.logprob_abs_diff_mean, chain.action_tokens),
            logprob_abs_diff_max=max(gaps) if gaps else None,
        )
