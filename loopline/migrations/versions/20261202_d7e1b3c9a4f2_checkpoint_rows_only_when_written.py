"""checkpoint: a row per full checkpoint written, not per learner step. The step a run has committed is its
newest policy version's `learner_step`; the per-step rows that only repeated the newest checkpoint's uri
(or '' before the first) are removed.

Revision ID: d7e1b3c9a4f2
Revises: c3f9a2d5e817
Create Date: 2026-12-02 12:30:00
"""
from typing import Sequence, Union

from alembic import op

revision: str = "d7e1b3c9a4f2"
down_revision: Union[str, None] = "c3f9a2d5e817"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.execute(
        "DELETE FROM checkpoint c WHERE c.uri = '' OR EXISTS (SELECT 1 FROM checkpoint e "
        "WHERE e.run_id = c.run_id AND e.uri = c.uri AND e.learner_step < c.learner_step)"
    )


def downgrade() -> None:
    # every committed step gets its row again, naming the newest checkpoint written by then ('' before any)
    op.execute(
        "INSERT INTO checkpoint (run_id, learner_step, policy_version, uri, complete) "
        "SELECT p.run_id, p.learner_step, p.version, coalesce((SELECT e.uri FROM checkpoint e WHERE e.run_id = p.run_id "
        "AND e.learner_step < p.learner_step ORDER BY e.learner_step DESC LIMIT 1), ''), true "
        "FROM policy_version p WHERE p.version > 0 "
        "AND NOT EXISTS (SELECT 1 FROM checkpoint c WHERE c.run_id = p.run_id AND c.learner_step = p.learner_step)"
    )
