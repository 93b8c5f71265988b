"""weight_rebuild: a version's weights rebuilt on resume that differ from the sha256 its commit recorded.

Revision ID: a1d4e7b90c12
Revises: f2b8c4d61a07
Create Date: 2026-12-01 09:10:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = "a1d4e7b90c12"
down_revision: Union[str, None] = "f2b8c4d61a07"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "weight_rebuild",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("run.id", ondelete="CASCADE"), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.Text(), nullable=False),
        sa.Column("recorded_sha256", sa.Text(), nullable=False),
        sa.Column("device", sa.Text(), nullable=False),
        sa.Column("learner_threads", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
    )
    op.create_index("ix_weight_rebuild_run_version", "weight_rebuild", ["run_id", "version"])


def downgrade() -> None:
    op.drop_table("weight_rebuild")
