"""When each verified cell was measured: ``matrix_entries.measured_at``.

The dashboard shows a cell's evidence with the time it was measured; before this revision the store did not keep it.
Epoch seconds (UTC) as a float, like ``jobs.created_at``; rows stored before this revision keep NULL ("not recorded").

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("matrix_entries", sa.Column("measured_at", sa.Float(), nullable=True))


def downgrade() -> None:
    # Batch mode: SQLite before 3.35 has no DROP COLUMN; Alembic copies the table there, and alters it elsewhere.
    with op.batch_alter_table("matrix_entries") as batch:
        batch.drop_column("measured_at")
