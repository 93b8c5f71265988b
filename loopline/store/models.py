"""The ledger's tables: one row per thing that happened.

Rows are never rewritten except their status columns (slot.state,
attempt.status, rollout_group.state, ...). Every guarantee the pipeline
relies on (one trajectory per slot, one consumption per trajectory, no eval
trajectory trained, monotonic policy versions) is a database constraint, so
it holds for any writer, not only for the functions in `ledger.py`.

Schema changes go through Alembic (`loopline/migrations`); never
`create_all`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    REAL,
    SmallInteger,
    Text,
    UniqueConstraint,
    text,
    func,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlmodel import Field, SQLModel

SPLITS = ("train", "eval")
SLOT_STATES = ("pending", "leased", "done", "abandoned")
GROUP_STATES = ("open", "complete", "claimed", "consumed", "dropped")
ATTEMPT_STATUSES = ("running", "ok", "task_failed", "infra_failed", "cancelled")
RUN_STATUSES = ("created", "running", "completed", "failed", "interrupted", "cancelled")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _created_at() -> Any:
    return Field(
        default=None,
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=func.now()),
    )


def _timestamp() -> Any:
    return Field(default=None, sa_column=Column(DateTime(timezone=True), nullable=True))


def _jsonb(nullable: bool = False) -> Any:
    return Field(
        default=None,
        sa_column=Column(JSONB, nullable=nullable, server_default=None if nullable else "{}"),
    )


def _uuid_pk() -> Any:
    return Field(default_factory=uuid.uuid4, sa_column=Column(UUID(as_uuid=True), primary_key=True))


def _uuid_fk(target: str, nullable: bool = False, ondelete: str | None = None) -> Any:
    return Field(
        default=None,
        sa_column=Column(
            UUID(as_uuid=True), ForeignKey(target, ondelete=ondelete), nullable=nullable
        ),
    )


class Environment(SQLModel, table=True):
    """A registered environment version; re-adding an unchanged spec is a no-op (unique hash)."""

    __tablename__ = "environment"
    __table_args__ = (
        UniqueConstraint("name", "version", name="uq_environment_name_version"),
        UniqueConstraint("name", "spec_hash", name="uq_environment_name_spec_hash"),
        CheckConstraint("version >= 1", name="ck_environment_version_positive"),
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(sa_column=Column(Text, nullable=False))
    version: int
    spec_hash: str = Field(sa_column=Column(Text, nullable=False))
    spec: dict[str, Any] = _jsonb()
    env_version: str = Field(sa_column=Column(Text, nullable=False))
    verifier_version: str = Field(sa_column=Column(Text, nullable=False))
    harness_version: str = Field(sa_column=Column(Text, nullable=False))
    created_at: datetime | None = _created_at()
    deprecated: bool = Field(default=False, sa_column=Column(Boolean, nullable=False, server_default="false"))


class Run(SQLModel, table=True):
    __tablename__ = "run"
    __table_args__ = (
        UniqueConstraint("name", name="uq_run_name"),
        CheckConstraint(_in("status", RUN_STATUSES), name="ck_run_status"),
    )

    id: uuid.UUID = _uuid_pk()
    name: str = Field(sa_column=Column(Text, nullable=False))
    config: dict[str, Any] = _jsonb()
    config_hash: str = Field(sa_column=Column(Text, nullable=False))
    status: str = Field(default="created", sa_column=Column(Text, nullable=False, server_default="created"))
    plan: dict[str, Any] | None = _jsonb(nullable=True)  # `loopline plan`'s estimate on the hardware it started on
    created_at: datetime | None = _created_at()
    status_reason: str | None = Field(default=None, sa_column=Column(Text, nullable=True))  # why it stopped, in one line
    holder: str | None = Field(default=None, sa_column=Column(Text, nullable=True))  # host:pid:start of the process driving it
    heartbeat_at: datetime | None = _timestamp()  # that process's last sign of life (a run with none recent is stale)
    cancel_requested_at: datetime | None = _timestamp()  # `loopline cancel`: the driving process stops at its next beat


class PolicyVersion(SQLModel, table=True):
    """Version 0 is the initial model; version v is what learner step v produced."""

    __tablename__ = "policy_version"
    __table_args__ = (
        UniqueConstraint("run_id", "learner_step", name="uq_policy_version_run_step"),
        CheckConstraint("version >= 0", name="ck_policy_version_nonnegative"),
    )

    run_id: uuid.UUID = Field(
        sa_column=Column(UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    )
    version: int = Field(sa_column=Column(Integer, primary_key=True))
    learner_step: int
    weights_uri: str | None = Field(default=None, sa_column=Column(Text, nullable=True))  # None: never exported
    # LoRA runs on SGLang: the version's adapter alone (peft format), what the servers load (None: not written)
    adapter_uri: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    sha256: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: datetime | None = _created_at()
    published_at: datetime | None = _timestamp()
    sync_timings: dict[str, Any] = _jsonb()  # seconds per part of the first publication (check, load, confirm)


class EngineServer(SQLModel, table=True):
    """An inference server (SGLang) that a process of the run generates on, and the version it last loaded there.

    Each process that builds the run's engine (the trainer, a rollout worker on a GPU node) registers the
    servers it serves and records every version it syncs them to; it releases them when it stops. The
    ledger then says which replica serves what, on every machine, and the learner sees one left behind.
    """

    __tablename__ = "engine_server"

    run_id: uuid.UUID = Field(
        sa_column=Column(UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    )
    url: str = Field(sa_column=Column(Text, primary_key=True))
    holder: str = Field(sa_column=Column(Text, primary_key=True))  # host:pid:start of the process syncing it
    served_version: int
    registered_at: datetime | None = _created_at()
    seen_at: datetime | None = _created_at()
    released_at: datetime | None = _timestamp()


class WeightServer(SQLModel, table=True):
    """Where the run's trainer serves the weights it publishes as `trainer://` URIs, and the token a host presents
    to fetch them (rollout/weights/server.py). Replaced by each trainer process that drives the run."""

    __tablename__ = "weight_server"

    run_id: uuid.UUID = Field(
        sa_column=Column(UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    )
    url: str = Field(sa_column=Column(Text, nullable=False))
    token: str = Field(sa_column=Column(Text, nullable=False))
    holder: str = Field(sa_column=Column(Text, nullable=False))  # host:pid:start of the trainer serving
    started_at: datetime | None = _created_at()


class WeightRebuild(SQLModel, table=True):
    """A version's weights rebuilt (last checkpoint + the recorded batches replayed) that did not match the
    sha256 its commit recorded. The run continues from the rebuilt weights: later versions descend from
    them, and a replay that gives this sha256 reproduced the run as it went on. On CPU with a learner
    computing exactly this does not happen; on a GPU, or with another thread count, it can."""

    __tablename__ = "weight_rebuild"
    __table_args__ = (Index("ix_weight_rebuild_run_version", "run_id", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: uuid.UUID = Field(sa_column=Column(UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), nullable=False))
    version: int
    sha256: str = Field(sa_column=Column(Text, nullable=False))  # of the rebuilt weights
    recorded_sha256: str = Field(sa_column=Column(Text, nullable=False))  # what the version's commit recorded
    device: str = Field(sa_column=Column(Text, nullable=False))
    learner_threads: int | None = None
    created_at: datetime | None = _created_at()


class RolloutGroup(SQLModel, table=True):
    """The samples of one task that are normalised together; trained only when every sample is done.

    State: open -> complete -> claimed (by learner_step) -> consumed, or dropped
    (`drop_reason`): a slot ran out of infra retries, or the group became too stale to train.
    """

    __tablename__ = "rollout_group"
    __table_args__ = (
        UniqueConstraint("run_id", "split", "step", "group_index", name="uq_group_coordinates"),
        CheckConstraint(_in("split", SPLITS), name="ck_group_split"),
        CheckConstraint(_in("state", GROUP_STATES), name="ck_group_state"),
        CheckConstraint("size >= 1 AND max_attempts >= 1", name="ck_group_sizes"),
        CheckConstraint(
            "(state IN ('claimed', 'consumed')) = (learner_step IS NOT NULL)",
            name="ck_group_learner_step",
        ),
        CheckConstraint("split = 'train' OR learner_step IS NULL", name="ck_group_eval_never_trained"),
        CheckConstraint("(state = 'dropped') = (drop_reason IS NOT NULL)", name="ck_group_drop_reason"),
        Index("ix_group_run_state", "run_id", "state"),
    )

    id: uuid.UUID = Field(sa_column=Column(UUID(as_uuid=True), primary_key=True))
    run_id: uuid.UUID = _uuid_fk("run.id", ondelete="CASCADE")
    split: str = Field(sa_column=Column(Text, nullable=False))
    step: int
    group_index: int
    task_id: str = Field(sa_column=Column(Text, nullable=False))
    size: int
    max_attempts: int
    state: str = Field(default="open", sa_column=Column(Text, nullable=False, server_default="open"))
    learner_step: int | None = None
    drop_reason: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: datetime | None = _created_at()
    completed_at: datetime | None = _timestamp()


class Slot(SQLModel, table=True):
    """One planned trajectory; its id is derived from its coordinates so planning is idempotent."""

    __tablename__ = "slot"
    __table_args__ = (
        UniqueConstraint("group_id", "sample_index", name="uq_slot_group_sample"),
        CheckConstraint(_in("split", SPLITS), name="ck_slot_split"),
        CheckConstraint(_in("state", SLOT_STATES), name="ck_slot_state"),
        CheckConstraint(
            "(state = 'leased') = (lease_attempt_id IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name="ck_slot_lease",
        ),
        Index("ix_slot_claim", "run_id", "split", "state", "step"),
        # a claim reads the next pending slots in plan order from here, never sorting the run's pending slots
        Index("ix_slot_pending", "run_id", "split", "step", "group_index", "sample_index", postgresql_where=text("state = 'pending'")),
        # expiry reads only the leases that ran out, and a run's holders are found one index probe each, however
        # many leases a fleet holds (renewals go by primary key)
        Index("ix_slot_lease_expiry", "lease_expires_at", postgresql_where=text("state = 'leased'")),
        Index("ix_slot_lease_owner", "run_id", "lease_owner", postgresql_where=text("state = 'leased'")),
    )

    id: uuid.UUID = Field(sa_column=Column(UUID(as_uuid=True), primary_key=True))
    run_id: uuid.UUID = _uuid_fk("run.id", ondelete="CASCADE")
    group_id: uuid.UUID = _uuid_fk("rollout_group.id", ondelete="CASCADE")
    split: str = Field(sa_column=Column(Text, nullable=False))
    step: int
    task_id: str = Field(sa_column=Column(Text, nullable=False))
    group_index: int  # its group's (rollout_group.group_index): the plan order a claim follows
    sample_index: int
    state: str = Field(default="pending", sa_column=Column(Text, nullable=False, server_default="pending"))
    lease_owner: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    lease_attempt_id: uuid.UUID | None = Field(default=None, sa_column=Column(UUID(as_uuid=True), nullable=True))
    lease_expires_at: datetime | None = _timestamp()
    infra_failures: int = Field(default=0, sa_column=Column(Integer, nullable=False, server_default="0"))
    created_at: datetime | None = _created_at()


class Attempt(SQLModel, table=True):
    __tablename__ = "attempt"
    __table_args__ = (
        CheckConstraint(_in("status", ATTEMPT_STATUSES), name="ck_attempt_status"),
        Index("ix_attempt_slot", "slot_id"),
    )

    id: uuid.UUID = _uuid_pk()
    slot_id: uuid.UUID = _uuid_fk("slot.id", ondelete="CASCADE")
    run_id: uuid.UUID = _uuid_fk("run.id", ondelete="CASCADE")
    worker: str = Field(sa_column=Column(Text, nullable=False))
    status: str = Field(default="running", sa_column=Column(Text, nullable=False, server_default="running"))
    error_class: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    error_text: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    started_at: datetime | None = _created_at()
    ended_at: datetime | None = _timestamp()


class Trajectory(SQLModel, table=True):
    """At most one per slot (unique slot_id): racing attempts cannot both commit."""

    __tablename__ = "trajectory"
    __table_args__ = (
        UniqueConstraint("slot_id", name="uq_trajectory_slot"),
        UniqueConstraint("attempt_id", name="uq_trajectory_attempt"),
        # Target of consumption's composite foreign key: lets the database refuse eval trajectories.
        UniqueConstraint("run_id", "id", "split", name="uq_trajectory_run_id_split"),
        CheckConstraint(_in("split", SPLITS), name="ck_trajectory_split"),
        CheckConstraint(
            "failure_type IS NULL OR failure_type IN ('task_failed', 'truncated')",
            name="ck_trajectory_failure_type",
        ),
        CheckConstraint("NOT (terminated AND truncated)", name="ck_trajectory_end"),
        CheckConstraint("policy_version_min <= policy_version_max", name="ck_trajectory_versions"),
        Index("ix_trajectory_group", "group_id"),
    )

    id: uuid.UUID = _uuid_pk()
    run_id: uuid.UUID = _uuid_fk("run.id", ondelete="CASCADE")
    slot_id: uuid.UUID = _uuid_fk("slot.id", ondelete="CASCADE")
    attempt_id: uuid.UUID = _uuid_fk("attempt.id", ondelete="CASCADE")
    group_id: uuid.UUID = _uuid_fk("rollout_group.id", ondelete="CASCADE")
    task_id: str = Field(sa_column=Column(Text, nullable=False))
    split: str = Field(sa_column=Column(Text, nullable=False))
    env_name: str = Field(sa_column=Column(Text, nullable=False))
    env_version: int
    verifier_version: str = Field(sa_column=Column(Text, nullable=False))
    harness_version: str = Field(sa_column=Column(Text, nullable=False))
    reward: float = Field(sa_column=Column(Double, nullable=False))
    terminated: bool
    truncated: bool
    failure_type: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    policy_version_min: int
    policy_version_max: int
    timings: dict[str, Any] = _jsonb()
    info: dict[str, Any] = _jsonb()
    created_at: datetime | None = _created_at()


class Segment(SQLModel, table=True):
    """One model call exactly as the model saw it (token ids, not text)."""

    __tablename__ = "segment"
    __table_args__ = (
        CheckConstraint(
            "cardinality(generated_ids) = cardinality(action_loss_mask) "
            "AND cardinality(generated_ids) = cardinality(rollout_logprobs)",
            name="ck_segment_lengths",
        ),
        CheckConstraint("seq > 0 OR NOT starts_chain", name="ck_segment_first_starts_no_chain"),
        CheckConstraint(
            "prompt_prefix_len >= 0 AND (prompt_prefix_len = 0 OR (seq > 0 AND NOT starts_chain))", name="ck_segment_prompt_prefix"
        ),
        CheckConstraint(
            "prompt_copies IS NULL OR (starts_chain AND cardinality(prompt_copies) % 3 = 0)", name="ck_segment_prompt_copies"
        ),
    )

    trajectory_id: uuid.UUID = Field(
        sa_column=Column(
            UUID(as_uuid=True), ForeignKey("trajectory.id", ondelete="CASCADE"), primary_key=True
        )
    )
    seq: int = Field(sa_column=Column(Integer, primary_key=True))
    request_id: str = Field(sa_column=Column(Text, nullable=False))
    policy_version: int
    version_spans: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSONB, nullable=True))
    tokenizer_version: str = Field(sa_column=Column(Text, nullable=False))
    # the prompt ids after the `prompt_prefix_len` ids the previous segment of its chain holds (its prompt and
    # generated ids): stored ids grow linearly with a trajectory's turns (`prompts.decode` reads them back)
    prompt_ids: list[int] = Field(sa_column=Column(ARRAY(Integer), nullable=False))
    prompt_prefix_len: int = Field(default=0, sa_column=Column(Integer, nullable=False, server_default="0"))
    # a segment that starts a chain: its prompt as pieces, (source seq, start, length) each, copied from an
    # earlier segment's ids or (source -1) taken from its stored prompt_ids; what they leave follows
    # (`store/prompts.py`: a trimming or re-rendering agent stores each token about once)
    prompt_copies: list[int] | None = Field(default=None, sa_column=Column(ARRAY(Integer), nullable=True))
    generated_ids: list[int] = Field(sa_column=Column(ARRAY(Integer), nullable=False))
    action_loss_mask: list[int] = Field(sa_column=Column(ARRAY(SmallInteger), nullable=False))
    # float32, as the engines compute them and the trainer holds them (a float64 value is rounded to nearest)
    rollout_logprobs: list[float] = Field(sa_column=Column(ARRAY(REAL), nullable=False))
    logprob_semantics: str = Field(sa_column=Column(Text, nullable=False))
    sampling_config: dict[str, Any] = _jsonb()
    tool_events: list[dict[str, Any]] = Field(
        default_factory=list, sa_column=Column(JSONB, nullable=False, server_default="[]")
    )
    started_at: datetime | None = _timestamp()
    ended_at: datetime | None = _timestamp()
    starts_chain: bool = Field(default=False, sa_column=Column(Boolean, nullable=False, server_default="false"))


class Consumption(SQLModel, table=True):
    """A trajectory trained on; the primary key makes training it twice impossible."""

    __tablename__ = "consumption"
    __table_args__ = (
        ForeignKeyConstraint(
            ["run_id", "trajectory_id", "split"],
            ["trajectory.run_id", "trajectory.id", "trajectory.split"],
            name="fk_consumption_trajectory",
            ondelete="CASCADE",
        ),
        CheckConstraint("split = 'train'", name="ck_consumption_train_only"),
        Index("ix_consumption_step", "run_id", "learner_step"),
    )

    run_id: uuid.UUID = Field(
        sa_column=Column(UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    )
    trajectory_id: uuid.UUID = Field(sa_column=Column(UUID(as_uuid=True), primary_key=True))
    split: str = Field(default="train", sa_column=Column(Text, nullable=False, server_default="train"))
    learner_step: int
    policy_version: int
    version_lag: int
    advantage: float | None = Field(default=None, sa_column=Column(Double, nullable=True))  # what the learner used
    training: dict[str, Any] = _jsonb()  # TrainedSample's other facts: group mean/std, degenerate, correction
    created_at: datetime | None = _created_at()


class LearnerLogprob(SQLModel, table=True):
    """π_old as the learner recomputed it for a consumed trajectory, one value per action token (in the
    trajectory's order): beside the rollout's μ, it shows where inference and training disagree."""

    __tablename__ = "learner_logprob"
    __table_args__ = (
        ForeignKeyConstraint(
            ["run_id", "trajectory_id"],
            ["consumption.run_id", "consumption.trajectory_id"],
            name="fk_learner_logprob_consumption",
            ondelete="CASCADE",
        ),
    )

    run_id: uuid.UUID = Field(sa_column=Column(UUID(as_uuid=True), primary_key=True))
    trajectory_id: uuid.UUID = Field(sa_column=Column(UUID(as_uuid=True), primary_key=True))
    logprobs: list[float] = Field(sa_column=Column(ARRAY(REAL), nullable=False))  # float4: 4 bytes a token


class Checkpoint(SQLModel, table=True):
    __tablename__ = "checkpoint"
    __table_args__ = (
        ForeignKeyConstraint(
            ["run_id", "policy_version"],
            ["policy_version.run_id", "policy_version.version"],
            name="fk_checkpoint_policy_version",
            ondelete="CASCADE",
        ),
    )

    run_id: uuid.UUID = Field(
        sa_column=Column(UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    )
    learner_step: int = Field(sa_column=Column(Integer, primary_key=True))
    policy_version: int
    uri: str = Field(sa_column=Column(Text, nullable=False))
    complete: bool = Field(default=False, sa_column=Column(Boolean, nullable=False, server_default="false"))
    created_at: datetime | None = _created_at()


class Metric(SQLModel, table=True):
    __tablename__ = "metric"
    __table_args__ = (UniqueConstraint("run_id", "name", "step", name="uq_metric_run_name_step"),)

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True, autoincrement=True))
    run_id: uuid.UUID = _uuid_fk("run.id", ondelete="CASCADE")
    step: int
    name: str = Field(sa_column=Column(Text, nullable=False))
    value: float = Field(sa_column=Column(Double, nullable=False))
    policy_version: int | None = None
    created_at: datetime | None = _created_at()


class EvalResult(SQLModel, table=True):
    __tablename__ = "eval_result"
    __table_args__ = (
        UniqueConstraint(
            "run_id", "policy_version", "env_name", "env_version", name="uq_eval_result_version_env"
        ),
        CheckConstraint("n_success >= 0 AND n_success <= n_tasks", name="ck_eval_result_counts"),
    )

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True, autoincrement=True))
    run_id: uuid.UUID = _uuid_fk("run.id", ondelete="CASCADE")
    policy_version: int
    env_name: str = Field(sa_column=Column(Text, nullable=False))
    env_version: int
    n_tasks: int
    n_success: int
    success_rate: float = Field(sa_column=Column(Double, nullable=False))
    details: dict[str, Any] = _jsonb()
    created_at: datetime | None = _created_at()
