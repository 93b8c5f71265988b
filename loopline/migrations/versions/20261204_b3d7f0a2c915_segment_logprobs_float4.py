"""segment.rollout_logprobs as float4 (real[]): the engines compute logprobs in float32 (the LocalEngine's
log_softmax, SGLang's), and the trainer holds them as float32 tensors, so float8 stored 4 bytes of nothing per
token. Measured by `benchmarks/ledger_rows` (16-turn coding trajectories, one run): 0.86-0.91x the bytes and
1.7-2.0x the writes per second (pglz no longer spends its time on random mantissas). A float8 value is
rounded to the nearest float4; the downgrade widens them back exactly.

Revision ID: b3d7f0a2c915
Revises: a8c2e6f1b904
Create Date: 2026-12-04 02:05:00
"""
from typing import Sequence, Union

from alembic import op

revision: str = "b3d7f0a2c915"
down_revision: Union[str, None] = "a8c2e6f1b904"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.execute("ALTER TABLE segment ALTER COLUMN rollout_logprobs TYPE real[] USING rollout_logprobs::real[]")


def downgrade() -> None:
    op.execute("ALTER TABLE segment ALTER COLUMN rollout_logprobs TYPE double precision[] USING rollout_logprobs::double precision[]")
