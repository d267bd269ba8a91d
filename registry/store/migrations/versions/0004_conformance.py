"""The conformance suite's table: ``conformance_results`` (``multicomposite conformance``).

One row per torch version, covered op, op_db entry, check and dtype: the cases checked, how many passed natively and
inside ``use()``, how many newly pass and newly fail there, how many were on degenerate samples, and the first
failing case.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

_COUNTS = ("cases", "native_passed", "use_passed", "newly_passing", "newly_failing", "degenerate_cases")


def upgrade() -> None:
    op.create_table(
        "conformance_results",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("torch_version", sa.String(100), nullable=False),
        sa.Column("op", sa.String(200), nullable=False),
        sa.Column("entry", sa.String(200), nullable=False),
        sa.Column("check", sa.String(50), nullable=False),
        sa.Column("dtype", sa.String(50), nullable=False),
        *(sa.Column(name, sa.Integer, nullable=False) for name in _COUNTS),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("timestamp", sa.String(40), nullable=False),
        sa.UniqueConstraint("torch_version", "op", "entry", "check", "dtype", name="uq_conformance_key"),
    )
    op.create_index("ix_conformance_results_op", "conformance_results", ["op"])


def downgrade() -> None:
    op.drop_index("ix_conformance_results_op", table_name="conformance_results")
    op.drop_table("conformance_results")
