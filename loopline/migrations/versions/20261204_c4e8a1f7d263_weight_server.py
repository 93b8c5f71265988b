"""weight_server: where a run's trainer serves the weights it publishes (`trainer://` URIs), and the token a
host presents to fetch them. One row per run, replaced by each trainer process that drives it (a restarted
trainer listens on a new port with a new token; a fetching host reads the row again before each try).

Revision ID: c4e8a1f7d263
Revises: b3d7f0a2c915
Create Date: 2026-12-04 22:10:00
"""
from typing import Sequence, Union

from alembic import op

revision: str = "c4e8a1f7d263"
down_revision: Union[str, None] = "b3d7f0a2c915"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.execute(
        "CREATE TABLE weight_server ("
        " run_id uuid PRIMARY KEY REFERENCES run(id) ON DELETE CASCADE,"
        " url text NOT NULL,"
        " token text NOT NULL,"
        " holder text NOT NULL,"
        " started_at timestamptz NOT NULL DEFAULT now())"
    )


def downgrade() -> None:
    op.execute("DROP TABLE weight_server")
