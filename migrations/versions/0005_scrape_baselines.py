"""``scrape_baselines``: the last scrape of each engine series ``spectune ingest`` read from cumulative counters.

vLLM's ``/metrics`` counters count since the engine started, so a window is the difference of two scrapes. An
operator who ingests one scrape per run (a cron job with curl) never has two in one run: the store keeps each
series' last scrape, and the next run's first scrape forms an interval with it.

Revision ID: 0005_scrape_baselines
Revises: 0004_drop_window_bucket_indexes
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_scrape_baselines"
down_revision: str | None = "0004_drop_window_bucket_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "scrape_baselines",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("engine_id", sa.String(length=64), nullable=False),
        sa.Column("series", sa.String(length=324), nullable=False),
        sa.Column("scraped_at", sa.Float(), nullable=False),
        sa.Column("own_time", sa.Boolean(), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scrape_baselines")),
        sa.UniqueConstraint("source", "engine_id", "series", name="uq_scrape_baselines_key"),
    )


def downgrade() -> None:
    op.drop_table("scrape_baselines")
