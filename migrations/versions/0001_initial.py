"""Initial schema: engines, model versions, ingested batches, acceptance and cost buckets and windows, sampled
rounds, policy versions and pins.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "engines",
        sa.Column("engine_id", sa.String(length=64), nullable=False),
        sa.Column("first_seen_at", sa.Float(), nullable=False),
        sa.Column("last_seen_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("engine_id", name=op.f("pk_engines")),
    )
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("target_version", sa.String(length=64), nullable=False),
        sa.Column("draft_version", sa.String(length=64), nullable=False),
        sa.Column("first_seen_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_versions")),
        sa.UniqueConstraint("target_version", "draft_version", name="uq_model_versions_pair"),
    )
    op.create_table(
        "pins",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("bucket_key", sa.String(length=324), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("removed_at", sa.Float(), nullable=True),
        sa.Column("removed_by", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pins")),
    )
    with op.batch_alter_table("pins", schema=None) as batch_op:
        batch_op.create_index("ix_pins_active", ["bucket_key", "removed_at"], unique=False)

    op.create_table(
        "policy_versions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("table", sa.JSON(), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_policy_versions")),
        sa.UniqueConstraint("version", name=op.f("uq_policy_versions_version")),
    )
    op.create_table(
        "ingested_batches",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("engine_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("window_start", sa.Float(), nullable=False),
        sa.Column("window_end", sa.Float(), nullable=False),
        sa.Column("dropped_before", sa.Integer(), nullable=False),
        sa.Column("ingested_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["engine_id"], ["engines.engine_id"], name=op.f("fk_ingested_batches_engine_id_engines")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ingested_batches")),
        sa.UniqueConstraint("engine_id", "seq", name="uq_ingested_batches_engine_seq"),
    )
    op.create_table(
        "acceptance_buckets",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("request_type", sa.String(length=64), nullable=False),
        sa.Column("context_bucket", sa.String(length=64), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_version_id"],
            ["model_versions.id"],
            name=op.f("fk_acceptance_buckets_model_version_id_model_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_acceptance_buckets")),
        sa.UniqueConstraint(
            "model_version_id", "request_type", "context_bucket", "k", name="uq_acceptance_buckets_key"
        ),
    )
    op.create_table(
        "cost_buckets",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("batch_bucket", sa.Integer(), nullable=False),
        sa.Column("context_bucket", sa.String(length=64), nullable=False),
        sa.Column("max_k", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_version_id"],
            ["model_versions.id"],
            name=op.f("fk_cost_buckets_model_version_id_model_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cost_buckets")),
        sa.UniqueConstraint("model_version_id", "batch_bucket", "context_bucket", "max_k", name="uq_cost_buckets_key"),
    )
    # The hot window tables: no foreign keys, one index besides the primary key (see telemetry/schema.py).
    op.create_table(
        "acceptance_windows",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("batch_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("bucket_id", sa.Integer(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("drafted", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("emitted", sa.Integer(), nullable=False),
        sa.Column("hist", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_acceptance_windows")),
    )
    with op.batch_alter_table("acceptance_windows", schema=None) as batch_op:
        batch_op.create_index("ix_acceptance_windows_bucket", ["bucket_id", "id"], unique=False)

    op.create_table(
        "cost_windows",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("batch_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("bucket_id", sa.Integer(), nullable=False),
        sa.Column("rounds", sa.Integer(), nullable=False),
        sa.Column("tokens_verified", sa.BigInteger(), nullable=False),
        sa.Column("emitted", sa.BigInteger(), nullable=False),
        sa.Column("batch_rows", sa.BigInteger(), nullable=False),
        sa.Column("draft_count", sa.Integer(), nullable=False),
        sa.Column("draft_total", sa.Float(), nullable=False),
        sa.Column("draft_sumsq", sa.Float(), nullable=False),
        sa.Column("draft_max", sa.Float(), nullable=False),
        sa.Column("verify_count", sa.Integer(), nullable=False),
        sa.Column("verify_total", sa.Float(), nullable=False),
        sa.Column("verify_sumsq", sa.Float(), nullable=False),
        sa.Column("verify_max", sa.Float(), nullable=False),
        sa.Column("other_count", sa.Integer(), nullable=False),
        sa.Column("other_total", sa.Float(), nullable=False),
        sa.Column("other_sumsq", sa.Float(), nullable=False),
        sa.Column("other_max", sa.Float(), nullable=False),
        sa.Column("latency_p50", sa.Float(), nullable=False),
        sa.Column("latency_p95", sa.Float(), nullable=False),
        sa.Column("latency_p99", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cost_windows")),
    )
    with op.batch_alter_table("cost_windows", schema=None) as batch_op:
        batch_op.create_index("ix_cost_windows_bucket", ["bucket_id", "id"], unique=False)

    op.create_table(
        "sampled_rounds",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("batch_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("engine_id", sa.String(length=64), nullable=False),
        sa.Column("round", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["ingested_batches.id"],
            name=op.f("fk_sampled_rounds_batch_id_ingested_batches"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sampled_rounds")),
    )
    with op.batch_alter_table("sampled_rounds", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_sampled_rounds_batch_id"), ["batch_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("sampled_rounds", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_sampled_rounds_batch_id"))

    op.drop_table("sampled_rounds")
    with op.batch_alter_table("cost_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_cost_windows_bucket")

    op.drop_table("cost_windows")
    with op.batch_alter_table("acceptance_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_acceptance_windows_bucket")

    op.drop_table("acceptance_windows")
    op.drop_table("cost_buckets")
    op.drop_table("acceptance_buckets")
    op.drop_table("ingested_batches")
    op.drop_table("policy_versions")
    with op.batch_alter_table("pins", schema=None) as batch_op:
        batch_op.drop_index("ix_pins_active")

    op.drop_table("pins")
    op.drop_table("model_versions")
    op.drop_table("engines")
