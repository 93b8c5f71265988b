"""policy_version.sync_timings: how long publishing the version to the engines took, part by part (check, load, swap, confirm).

Revision ID: 4b8e1f2c6d57
Revises: 7c1d2e9a0b31
Create Date: 2026-11-30 07:30:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = "4b8e1f2c6d57"
down_revision: Union[str, None] = "7c1d2e9a0b31"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column(
        "policy_version",
        sa.Column("sync_timings", postgresql.JSONB(astext_type=sa.Text()), server_default="{}", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("policy_version", "sync_timings")
