"""engine_server: the SGLang servers each process of a run generates on, and the version each serves.

Revision ID: f2b8c4d61a07
Revises: e5a1c7d93b20
Create Date: 2026-11-30 21:30:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = "f2b8c4d61a07"
down_revision: Union[str, None] = "e5a1c7d93b20"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "engine_server",
        sa.Column("run_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("run.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("url", sa.Text(), primary_key=True),
        sa.Column("holder", sa.Text(), primary_key=True),
        sa.Column("served_version", sa.Integer(), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("engine_server")
