"""The window tables lose their ``(bucket_id, id)`` indexes: no reader uses them, and ingestion paid for them.

Every window query reads by primary key (``id > since_id``, oldest first, the sidecar's ``max(id)``) and filters
buckets through a join to the small bucket tables; nothing asks for "the latest windows of one bucket", which is
what ``(bucket_id, id)`` served. Each ingested acceptance window still updated it: a second B-tree insert per row
beside the primary key's, about half the server's time of a binary COPY into ``acceptance_windows`` (measured on
PostgreSQL 15: 512 window batches, 23,552 acceptance rows, 62 ms with the index, 32 ms without). A reader that
comes to need it adds it back in a revision of its own.

Revision ID: 0004_drop_window_bucket_indexes
Revises: 0003_alerts_and_model_versions
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004_drop_window_bucket_indexes"
down_revision: str | None = "0003_alerts_and_model_versions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("acceptance_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_acceptance_windows_bucket")
    with op.batch_alter_table("cost_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_cost_windows_bucket")


def downgrade() -> None:
    with op.batch_alter_table("cost_windows", schema=None) as batch_op:
        batch_op.create_index("ix_cost_windows_bucket", ["bucket_id", "id"], unique=False)
    with op.batch_alter_table("acceptance_windows", schema=None) as batch_op:
        batch_op.create_index("ix_acceptance_windows_bucket", ["bucket_id", "id"], unique=False)
