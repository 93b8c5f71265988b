"""learner_logprob: π_old per action token of each consumed trajectory, as the learner recomputed it.

Revision ID: b7e2a4c9d1f3
Revises: 9d3a6c1e5f20
Create Date: 2026-11-30 12:00:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = "b7e2a4c9d1f3"
down_revision: Union[str, None] = "9d3a6c1e5f20"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "learner_logprob",
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("trajectory_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("logprobs", postgresql.ARRAY(sa.REAL()), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id", "trajectory_id"], ["consumption.run_id", "consumption.trajectory_id"],
            name="fk_learner_logprob_consumption", ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "trajectory_id"),
    )


def downgrade() -> None:
    op.drop_table("learner_logprob")
