"""fleet_scale: a segment that starts a chain stores its prompt as pieces of earlier calls' ids
(`segment.prompt_copies`), and leases are found by index at any fleet size (their expiry; a run's holders).

Rows stored before keep their meaning: no pieces is a prompt stored whole, as a chain's first call was.

Revision ID: d5f9b2c8e417
Revises: c4e8a1f7d263
Create Date: 2026-12-05 06:20:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from loopline.store import prompts

revision: str = "d5f9b2c8e417"
down_revision: Union[str, None] = "c4e8a1f7d263"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("segment", sa.Column("prompt_copies", postgresql.ARRAY(sa.Integer()), nullable=True))
    op.create_check_constraint(
        "ck_segment_prompt_copies", "segment", "prompt_copies IS NULL OR (starts_chain AND cardinality(prompt_copies) % 3 = 0)"
    )
    op.create_index("ix_slot_lease_expiry", "slot", ["lease_expires_at"], postgresql_where=sa.text("state = 'leased'"))
    op.create_index("ix_slot_lease_owner", "slot", ["run_id", "lease_owner"], postgresql_where=sa.text("state = 'leased'"))


def downgrade() -> None:
    # a prompt stored as pieces is written whole again (as the older schema stores a chain's first call)
    conn = op.get_bind()
    pieced = conn.exec_driver_sql("SELECT DISTINCT trajectory_id FROM segment WHERE prompt_copies IS NOT NULL").scalars().all()
    for trajectory_id in pieced:
        rows = conn.exec_driver_sql(
            "SELECT seq, prompt_ids, prompt_prefix_len, prompt_copies, generated_ids, starts_chain FROM segment "
            "WHERE trajectory_id = %(t)s ORDER BY seq", {"t": trajectory_id},
        ).all()
        decoded = prompts.decode(rows)
        for call, row in zip(decoded.calls, rows):
            if row.prompt_copies is not None:
                conn.exec_driver_sql(
                    "UPDATE segment SET prompt_ids = %(p)s, prompt_copies = NULL WHERE trajectory_id = %(t)s AND seq = %(s)s",
                    {"p": decoded.prompt(call).tolist(), "t": trajectory_id, "s": row.seq},
                )
    op.drop_index("ix_slot_lease_owner", table_name="slot")
    op.drop_index("ix_slot_lease_expiry", table_name="slot")
    op.drop_constraint("ck_segment_prompt_copies", "segment", type_="check")
    op.drop_column("segment", "prompt_copies")
