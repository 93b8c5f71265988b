"""What crosses the ledger's API besides the RL records of `loopline.types`: plain frozen dataclasses, no ORM
state attached."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from loopline.types import Split

@dataclass(frozen=True)
class Lease:
    """A claimed slot: the worker owns it until `expires_at` unless it renews."""

    attempt_id: uuid.UUID
    slot_id: uuid.UUID
    group_id: uuid.UUID
    run_id: uuid.UUID
    split: Split
    step: int
    task_id: str
    sample_index: int
    expires_at: datetime


@dataclass(frozen=True)
class CommitOutcome:
    attempt_id: uuid.UUID
    trajectory_id: uuid.UUID | None
    reason: str | None = None  # why it was refused, when trajectory_id is None

    @property
    def committed(self) -> bool:
        return self.trajectory_id is not None


@dataclass(frozen=True)
class LearnerBatch:
    """The groups one learner step trains on; a retry of the same step gets the same batch."""

    run_id: uuid.UUID
    learner_step: int
    policy_version: int  # the version being trained (the one the update starts from)
    group_ids: tuple[uuid.UUID, ...]
    trajectory_ids: tuple[uuid.UUID, ...]
    already_committed: bool = False
    stale_dropped: int = 0  # complete groups this claim dropped as older than max_staleness

    @property
    def empty(self) -> bool:
        return not self.group_ids


@dataclass(frozen=True)
class LearnerCommit:
    learner_step: int
    policy_version: int  # the new version
    consumed: int
    already_committed: bool = False


@dataclass(frozen=True)
class CheckpointInfo:
    learner_step: int
    policy_version: int
    uri: str


@dataclass(frozen=True)
class ResumeState:
    """Everything a restarted process needs to continue a run exactly once."""

    run_id: uuid.UUID
    last_checkpoint: CheckpointInfo | None
    policy_version: int
    weights_uri: str | None  # None: the version was committed without an export (flows/train.py exports it)
    next_learner_step: int
    consumed_trajectories: int
    pending_learner_groups: tuple[uuid.UUID, ...]  # claimed for next_learner_step, not yet committed
    group_states: dict[str, int]
    adapter_uri: str | None = None  # LoRA on SGLang: the newest version's adapter, what the servers load
