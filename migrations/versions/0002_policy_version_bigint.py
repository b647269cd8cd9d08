"""policy_versions.version becomes a 64-bit integer.

A table version at or above 2**31 (a forged table in Redis once pushed the sidecar's counter there) overflowed the
PostgreSQL INTEGER column, and every later table failed to save. Versions come from this column, so it holds
any version a table can carry (``telemetry.records.MAX_POLICY_VERSION``). SQLite integers are 64-bit already;
batch mode rebuilds its table the same way.

Revision ID: 0002_policy_version_bigint
Revises: 0001_initial
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_policy_version_bigint"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.alter_column("version", existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=False)


def downgrade() -> None:
    # Fails (rather than truncating) if a stored version no longer fits 32 bits; delete those rows first.
    with op.batch_alter_table("policy_versions", schema=None) as batch_op:
        batch_op.alter_column("version", existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=False)
