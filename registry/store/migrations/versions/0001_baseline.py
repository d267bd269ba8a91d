"""Baseline: the schema as it was before migrations (stacks spelled vmap(grad), "schema_version" 2).

Creates the tables a store lacks, so it also adopts a store made before migrations existed (by ``create_all``, which
made whichever tables its version knew): what is there is kept, what is missing is added, and rows written with the
old stack spelling (vmap,grad, "schema_version" 1) are rewritten in the one spelling.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from registry.core.stacks import format_stack, split_stack

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

# The tables exactly as create_all made them then: frozen here, whatever the models say today.
TABLES: dict[str, tuple[list[sa.Column], list[sa.Constraint], list[str]]] = {
    "matrix_entries": ([
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("op", sa.String(200), nullable=False),
        sa.Column("composite", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(100), nullable=False),
        sa.Column("stack", sa.String(400), nullable=False),
        sa.Column("pattern", sa.String(100), nullable=False),
        sa.Column("dtype", sa.String(50), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("max_abs_error", sa.Float, nullable=True),
        sa.Column("max_rel_error", sa.Float, nullable=True),
        sa.Column("source_hash", sa.String(200), nullable=False),
        sa.Column("torch_version", sa.String(100), nullable=False),
        sa.Column("device", sa.String(50), nullable=False),
    ], [sa.UniqueConstraint("op", "composite", "stack", "pattern", "dtype", "device", "torch_version",
                            name="uq_matrix_key")], ["op"]),
    "profiles": ([
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("op", sa.String(200), nullable=False),
        sa.Column("composite", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(100), nullable=False),
        sa.Column("stack", sa.String(400), nullable=False),
        sa.Column("workload", sa.String(100), nullable=False),
        sa.Column("dtype", sa.String(50), nullable=False),
        sa.Column("device", sa.String(50), nullable=False),
        sa.Column("device_name", sa.String(200), nullable=False),
        sa.Column("numel_bucket", sa.Integer, nullable=False),
        sa.Column("batch_size", sa.Integer, nullable=False),
        sa.Column("valid", sa.Integer, nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("median_us", sa.Float, nullable=True),
        sa.Column("iqr_us", sa.Float, nullable=True),
        sa.Column("runs", sa.Integer, nullable=False),
        sa.Column("peak_memory", sa.Integer, nullable=True),
        sa.Column("source_hash", sa.String(200), nullable=False),
        sa.Column("torch_version", sa.String(100), nullable=False),
    ], [sa.UniqueConstraint("op", "composite", "workload", "dtype", "device", "device_name", "numel_bucket",
                            "batch_size", "torch_version", name="uq_profile_key")], ["op"]),
    "store_meta": ([
        sa.Column("key", sa.String(100), primary_key=True),
        sa.Column("value", sa.Integer, nullable=False),
    ], [], []),
    "jobs": ([
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(50), nullable=False),
        sa.Column("params", sa.Text, nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("done", sa.Integer, nullable=False),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("owner", sa.String(300), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("updated_at", sa.Float, nullable=False),
    ], [], ["state"]),
    "bench_runs": ([
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("kind", sa.String(50), nullable=False),
        sa.Column("host", sa.String(300), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
    ], [], []),
    "survey_results": ([
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("torch_version", sa.String(100), nullable=False),
        sa.Column("op", sa.String(200), nullable=False),
        sa.Column("opinfo_name", sa.String(200), nullable=False),
        sa.Column("variant_test_name", sa.String(200), nullable=False),
        sa.Column("stack", sa.String(100), nullable=False),
        sa.Column("batching", sa.String(20), nullable=False),
        sa.Column("dtype", sa.String(50), nullable=False),
        sa.Column("native_status", sa.String(20), nullable=False),
        sa.Column("native_detail", sa.Text, nullable=False),
        sa.Column("use_status", sa.String(20), nullable=False),
        sa.Column("use_detail", sa.Text, nullable=False),
        sa.Column("max_abs_error", sa.Float, nullable=True),
        sa.Column("max_rel_error", sa.Float, nullable=True),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("timestamp", sa.String(40), nullable=False),
    ], [sa.UniqueConstraint("torch_version", "op", "stack", "batching", "dtype", name="uq_survey_key")], ["op"]),
}


def upgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    for name, (columns, constraints, indexed) in TABLES.items():
        if name in existing:
            continue
        op.create_table(name, *columns, *constraints)
        for column in indexed:
            op.create_index(f"ix_{name}_{column}", name, [column])
    meta = sa.table("store_meta", sa.column("key", sa.String), sa.column("value", sa.Integer))
    bind = op.get_bind()
    stored = {row.key: row.value for row in bind.execute(sa.select(meta.c.key, meta.c.value))}
    if "generation" not in stored:
        bind.execute(meta.insert().values(key="generation", value=0))
    if stored.get("schema_version", 1) < 2:
        for table in ("matrix_entries", "profiles"):
            stacks = sa.table(table, sa.column("stack", sa.String))
            for (value,) in bind.execute(sa.select(stacks.c.stack).distinct()).all():
                spelled = format_stack(split_stack(value))
                if spelled != value:
                    bind.execute(stacks.update().where(stacks.c.stack == value).values(stack=spelled))
    if "schema_version" in stored:
        bind.execute(meta.update().where(meta.c.key == "schema_version").values(value=2))
    else:
        bind.execute(meta.insert().values(key="schema_version", value=2))


def downgrade() -> None:
    for name in reversed(TABLES):
        op.drop_table(name)
