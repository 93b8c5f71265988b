"""segment.starts_chain: a model call that does not extend the previous one's ids starts a chain of its own
(an agent that rewrote its history, a parallel call); every chain of a trajectory is trained, each as a
sequence. Existing segments each extend the one before (only one chain was ever stored): false.

Revision ID: e5b7c1d3f926
Revises: d7e1b3c9a4f2
Create Date: 2026-12-03 19:20:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = "e5b7c1d3f926"
down_revision: Union[str, None] = "d7e1b3c9a4f2"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("segment", sa.Column("starts_chain", sa.Boolean(), nullable=False, server_default="false"))
    # the first segment of a trajectory starts no chain of its own (its chain is the trajectory's first)
    op.create_check_constraint("ck_segment_first_starts_no_chain", "segment", "seq > 0 OR NOT starts_chain")


def downgrade() -> None:
    # a trajectory with several chains cannot be stored by the older schema's rule (one chain): refused
    bind = op.get_bind()
    if bind.exec_driver_sql("SELECT 1 FROM segment WHERE starts_chain LIMIT 1").first():
        raise RuntimeError("the ledger holds trajectories of several chains, which the older schema cannot hold; not downgraded")
    op.drop_constraint("ck_segment_first_starts_no_chain", "segment", type_="check")
    op.drop_column("segment", "starts_chain")
