"""policy_version.weights_uri may be NULL: a version the learner committed without exporting it.

Between full checkpoints an in-process engine takes the learner's weights from memory, so most versions
are never written to disk; the sha256 of the weights (computed in memory) is recorded either way, and a
resume exports the newest version first if nobody did (`flows/train.py`).

Revision ID: e5a1c7d93b20
Revises: c3f9d2e8a4b6
Create Date: 2026-11-30 14:00:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = "e5a1c7d93b20"
down_revision: Union[str, None] = "c3f9d2e8a4b6"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.alter_column("policy_version", "weights_uri", existing_type=sa.Text(), nullable=True)


def downgrade() -> None:
    op.execute("UPDATE policy_version SET weights_uri = '' WHERE weights_uri IS NULL")
    op.alter_column("policy_version", "weights_uri", existing_type=sa.Text(), nullable=False)
