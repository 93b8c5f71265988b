"""run lifecycle: why a run stopped, which process drives it and when it last said so, a cancel request.

Revision ID: b5c8e2f4a713
Revises: a1d4e7b90c12
Create Date: 2026-12-01 09:55:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = "b5c8e2f4a713"
down_revision: Union[str, None] = "a1d4e7b90c12"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

STATUSES = ("created", "running", "completed", "failed", "interrupted", "cancelled")


def upgrade() -> None:
    op.add_column("run", sa.Column("status_reason", sa.Text(), nullable=True))
    op.add_column("run", sa.Column("holder", sa.Text(), nullable=True))
    op.add_column("run", sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("run", sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True))
    op.drop_constraint("ck_run_status", "run", type_="check")
    op.create_check_constraint("ck_run_status", "run", "status IN (" + ", ".join(repr(s) for s in STATUSES) + ")")


def downgrade() -> None:
    op.execute("UPDATE run SET status = 'failed' WHERE status IN ('interrupted', 'cancelled')")
    op.drop_constraint("ck_run_status", "run", type_="check")
    op.create_check_constraint("ck_run_status", "run", "status IN ('created', 'running', 'completed', 'failed')")
    for column in ("cancel_requested_at", "heartbeat_at", "holder", "status_reason"):
        op.drop_column("run", column)
