"""run.plan: the memory estimate (`loopline plan`) for the hardware the run started on, beside what it measured.

Revision ID: c3f9d2e8a4b6
Revises: b7e2a4c9d1f3
Create Date: 2026-11-30 13:00:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = "c3f9d2e8a4b6"
down_revision: Union[str, None] = "b7e2a4c9d1f3"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("run", sa.Column("plan", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("run", "plan")
