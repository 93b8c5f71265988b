"""segment.prompt_prefix_len: a segment stores only the prompt ids after what the previous segment of its chain
already holds (its prompt and generated ids): `prompt_ids` is that suffix and `prompt_prefix_len` its length.
A trajectory's stored ids grew with the square of its turns (each prompt repeated every earlier one); they grow
linearly now. The first segment and a segment that starts a chain store their whole prompt (prefix 0).
Existing rows are converted where the rule holds (every committed trajectory: the ledger refused others);
the downgrade writes whole prompts back.

Revision ID: f3a9d6b2c480
Revises: e5b7c1d3f926
Create Date: 2026-12-03 20:10:00
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = "f3a9d6b2c480"
down_revision: Union[str, None] = "e5b7c1d3f926"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("segment", sa.Column("prompt_prefix_len", sa.Integer(), nullable=False, server_default="0"))
    # one statement: every row's previous segment is read as it was before the statement (whole prompts)
    op.execute(
        "UPDATE segment s SET prompt_prefix_len = cardinality(p.head), prompt_ids = s.prompt_ids[cardinality(p.head) + 1 :] "
        "FROM (SELECT trajectory_id, seq, prompt_ids || generated_ids AS head FROM segment) p "
        "WHERE p.trajectory_id = s.trajectory_id AND p.seq = s.seq - 1 AND NOT s.starts_chain "
        "AND s.prompt_ids[1 : cardinality(p.head)] = p.head"
    )
    op.create_check_constraint(
        "ck_segment_prompt_prefix", "segment", "prompt_prefix_len >= 0 AND (prompt_prefix_len = 0 OR (seq > 0 AND NOT starts_chain))"
    )


def downgrade() -> None:
    op.drop_constraint("ck_segment_prompt_prefix", "segment", type_="check")
    bind = op.get_bind()
    deepest = bind.exec_driver_sql("SELECT coalesce(max(seq), 0) FROM segment WHERE prompt_prefix_len > 0").scalar_one()
    for seq in range(1, deepest + 1):  # in turn order: each previous prompt is whole again before it is used
        bind.exec_driver_sql(
            "UPDATE segment s SET prompt_ids = (p.prompt_ids || p.generated_ids)[1 : s.prompt_prefix_len] || s.prompt_ids "
            "FROM segment p WHERE p.trajectory_id = s.trajectory_id AND p.seq = s.seq - 1 AND s.seq = %s AND s.prompt_prefix_len > 0",
            (seq,),
        )
    op.drop_column("segment", "prompt_prefix_len")
