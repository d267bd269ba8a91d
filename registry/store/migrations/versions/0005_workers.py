"""The workers table: one row per running ``multicomposite worker`` process (``registry/store/workers.py``).

Until this revision the service and each worker created it with ``create_all`` when they started, outside the
revisions. A store where they did keeps its table (and its rows) as it is: the table is created only where it is
missing, with the columns ``create_all`` made.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    if sa.inspect(op.get_bind()).has_table("workers"):
        return  # made by create_all before this revision: the same columns, kept with its rows
    op.create_table(
        "workers",
        sa.Column("id", sa.String(300), primary_key=True),
        sa.Column("host", sa.String(300), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("kinds", sa.Text, nullable=False),
        sa.Column("current_job", sa.Text, nullable=True),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("workers")
