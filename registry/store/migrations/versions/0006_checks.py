"""The checks table: ``checks``, one row per ``registry.check`` report a check job stored (``POST /checks``).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "checks",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("example", sa.String(100), nullable=False),
        sa.Column("function", sa.String(400), nullable=False),
        sa.Column("transform", sa.String(120), nullable=False),
        sa.Column("policy", sa.String(20), nullable=False),
        sa.Column("native_verdict", sa.String(20), nullable=False),
        sa.Column("use_verdict", sa.String(20), nullable=False),
        sa.Column("summary", sa.Text, nullable=False),
        sa.Column("native_s", sa.Float, nullable=True),
        sa.Column("use_s", sa.Float, nullable=True),
        sa.Column("reference_s", sa.Float, nullable=True),
        sa.Column("report", sa.Text, nullable=False),
        sa.Column("torch_version", sa.String(100), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_checks_example", "checks", ["example"])


def downgrade() -> None:
    op.drop_index("ix_checks_example", table_name="checks")
    op.drop_table("checks")
