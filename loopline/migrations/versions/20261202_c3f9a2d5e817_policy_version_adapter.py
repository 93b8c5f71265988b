"""policy_version.adapter_uri: a LoRA version's adapter alone (peft format), what SGLang servers load per version.

Revision ID: c3f9a2d5e817
Revises: b5c8e2f4a713
Create Date: 2026-12-02 06:20:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = "c3f9a2d5e817"
down_revision: Union[str, None] = "b5c8e2f4a713"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("policy_version", sa.Column("adapter_uri", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("policy_version", "adapter_uri")
