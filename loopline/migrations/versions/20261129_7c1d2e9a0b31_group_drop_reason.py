"""rollout_group.drop_reason: why a group was dropped (infra retries exhausted, or too stale to train).

Revision ID: 7c1d2e9a0b31
Revises: 53ef7a0f4282
Create Date: 2026-11-29 11:00:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = "7c1d2e9a0b31"
down_revision: Union[str, None] = "53ef7a0f4282"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("rollout_group", sa.Column("drop_reason", sa.Text(), nullable=True))
    op.execute("UPDATE rollout_group SET drop_reason = 'infra_retries_exhausted' WHERE state = 'dropped'")
    op.create_check_constraint(
        "ck_group_drop_reason", "rollout_group", "(state = 'dropped') = (drop_reason IS NOT NULL)"
    )


def downgrade() -> None:
    op.drop_constraint("ck_group_drop_reason", "rollout_group", type_="check")
    op.drop_column("rollout_group", "drop_reason")
