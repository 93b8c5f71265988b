"""consumption.advantage and consumption.training: what each trained trajectory contributed, as the learner used it.

Revision ID: 9d3a6c1e5f20
Revises: 4b8e1f2c6d57
Create Date: 2026-11-30 08:00:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = "9d3a6c1e5f20"
down_revision: Union[str, None] = "4b8e1f2c6d57"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("consumption", sa.Column("advantage", sa.Double(), nullable=True))
    op.add_column(
        "consumption", sa.Column("training", postgresql.JSONB(astext_type=sa.Text()), server_default="{}", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("consumption", "training")
    op.drop_column("consumption", "advantage")
