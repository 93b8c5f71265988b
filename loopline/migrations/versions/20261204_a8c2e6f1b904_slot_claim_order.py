"""slot.group_index and a partial index on pending slots in claim order: a claim reads the next n slots of the
index instead of sorting every pending slot of the run (with a join to rollout_group for the group's order).
It cost ~370 ms for a run with 80,000 pending slots (issue 49: the claim had become the larger part of a
rollout worker's ledger time at 16 workers); now it is independent of how many are pending.

Revision ID: a8c2e6f1b904
Revises: f3a9d6b2c480
Create Date: 2026-12-04 02:00:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = "a8c2e6f1b904"
down_revision: Union[str, None] = "f3a9d6b2c480"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("slot", sa.Column("group_index", sa.Integer(), nullable=True))
    op.execute("UPDATE slot s SET group_index = g.group_index FROM rollout_group g WHERE g.id = s.group_id")
    op.alter_column("slot", "group_index", nullable=False)
    op.create_index(
        "ix_slot_pending", "slot", ["run_id", "split", "step", "group_index", "sample_index"],
        postgresql_where=sa.text("state = 'pending'"),
    )


def downgrade() -> None:
    op.drop_index("ix_slot_pending", table_name="slot")
    op.drop_column("slot", "group_index")
