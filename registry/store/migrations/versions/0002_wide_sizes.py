"""64-bit sizes, and the schema version kept by Alembic alone.

``profiles.numel_bucket`` and ``profiles.peak_memory`` pass 2**31 on a large CUDA tensor (4 GiB of peak memory), and
``store_meta.value`` (the generation counter) must never wrap: BIGINT on PostgreSQL, whose INTEGER is 32 bits.
SQLite stores any INTEGER in up to 64 bits already, so its tables are left as they are (no table rebuild).

``store_meta``'s "schema_version" row, the hand-made version before Alembic, is dropped: ``alembic_version`` says it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

WIDENED = (("profiles", "numel_bucket", False), ("profiles", "peak_memory", True), ("store_meta", "value", False))
_meta = sa.table("store_meta", sa.column("key", sa.String), sa.column("value", sa.Integer))


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        for table, column, nullable in WIDENED:
            op.alter_column(table, column, type_=sa.BigInteger(), existing_type=sa.Integer(),
                            existing_nullable=nullable)
    op.execute(_meta.delete().where(_meta.c.key == "schema_version"))


def downgrade() -> None:
    op.execute(_meta.insert().values(key="schema_version", value=2))
    if op.get_bind().dialect.name != "sqlite":
        for table, column, nullable in WIDENED:
            op.alter_column(table, column, type_=sa.Integer(), existing_type=sa.BigInteger(),
                            existing_nullable=nullable)
