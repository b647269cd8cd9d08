"""Drift alerts: the ``alerts`` table, and the model-version registry's columns on ``model_versions``.

``model_versions`` already lists every (target, draft) pair the store has ingested; the registry adds when it last
saw each pair and how many acceptance / cost windows it carried. ``last_seen_at`` stays null until the registry
first observes a pair, which is how it raises one ``model_update`` per new pair even though the store registers
the pair first (see ``telemetry.alerts_store``). Existing pairs keep a null ``last_seen_at`` and zero counts; the
registry treats them as already known only once it has seen them, so an upgrade raises no alert by itself.

Revision ID: 0003_alerts_and_model_versions
Revises: 0002_policy_version_bigint
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_alerts_and_model_versions"
down_revision: str | None = "0002_policy_version_bigint"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("last_seen_at", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("acceptance_windows", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("cost_windows", sa.BigInteger(), server_default="0", nullable=False))

    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("bucket", sa.String(length=324), nullable=False),
        sa.Column("k", sa.Integer(), nullable=True),
        sa.Column("target_version", sa.String(length=64), nullable=False),
        sa.Column("draft_version", sa.String(length=64), nullable=False),
        sa.Column("previous_target_version", sa.String(length=64), nullable=True),
        sa.Column("previous_draft_version", sa.String(length=64), nullable=True),
        sa.Column("affected", sa.JSON(), nullable=False),
        sa.Column("statistic", sa.String(length=64), nullable=False),
        sa.Column("stat_before", sa.Float(), nullable=True),
        sa.Column("before_count", sa.BigInteger(), nullable=False),
        sa.Column("stat_after", sa.Float(), nullable=True),
        sa.Column("after_count", sa.BigInteger(), nullable=False),
        sa.Column("count_unit", sa.String(length=32), nullable=False),
        sa.Column("detector", sa.String(length=500), nullable=True),
        sa.Column("change_at", sa.Float(), nullable=True),
        sa.Column("detected_at", sa.Float(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.Column("acked_at", sa.Float(), nullable=True),
        sa.Column("acked_by", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
    )
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.create_index("ix_alerts_kind_bucket", ["kind", "bucket", "acked_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.drop_index("ix_alerts_kind_bucket")

    op.drop_table("alerts")
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.drop_column("cost_windows")
        batch_op.drop_column("acceptance_windows")
        batch_op.drop_column("last_seen_at")
