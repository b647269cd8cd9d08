"""SQLAlchemy 2 models of the spectune store. Alembic (``migrations/``) owns the schema; these models are what
``alembic check`` compares the migrations against.

Window aggregates are stored flat (one column per statistic) so that SQL can sum them; the acceptance
histogram is JSON (its length depends on k). Every window row names the ingested batch it came from;
``ingested_batches`` carries the unique ``(engine_id, seq)`` that makes ingestion idempotent.

The two window tables are the hot path (about 46 acceptance rows and a few cost rows per window batch, tens of
thousands per second), so a row holds only its statistics and two small references, and carries only the
indexes its readers need:

- the key a window is aggregated by (model pair, request type or batch bucket, context bucket, k) lives once in
  ``acceptance_buckets`` / ``cost_buckets``; a window row holds its ``bucket_id``. The sender and the window's
  end are the batch's, read through ``batch_id`` from ``ingested_batches``.
- the primary key is their only index (``id`` increases with ingestion; readers resume with ``id > since_id``
  and the sidecar asks for ``max(id)``); a model pair's or a request type's buckets are a join to the small
  bucket tables. Every further index is one more B-tree insert per ingested row, for a reader to pay for: none
  asks for one bucket's windows alone, all that a ``(bucket_id, id)`` index would serve (it doubles the server's
  COPY time into ``acceptance_windows``).
- ``batch_id`` and ``bucket_id`` are plain columns, not foreign keys: the store writes them in the same
  transaction that registers the batch and the buckets, so a per-row referential check would only re-prove that,
  at two trigger queries per row. Deleting a batch therefore does not cascade to its windows; prune windows by
  ``id`` range (ids follow ingestion order) when retention comes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from telemetry.records import MAX_NAME_LEN

VERSION_TABLE = "spectune_alembic_version"  # distinct from optuna's alembic_version in a shared database
BUCKET_KEY_LEN = 5 * MAX_NAME_LEN + 4  # five labels and four '|' separators
REASON_LEN = 500  # operators' notes; PolicyTable.reason is cut to this length too
SOURCE_LEN = 32  # an ingest source name (``vllm-prom``)
ALERT_KIND_LEN = 32  # alert kinds and count units are short fixed words (telemetry.alerts)

# Deterministic constraint names, so migrations can name what they create and drop (SQLite batch mode needs it).
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}


class EngineRow(Base):
    """An engine process that has sent telemetry."""

    __tablename__ = "engines"
    engine_id: Mapped[str] = mapped_column(String(MAX_NAME_LEN), primary_key=True)
    first_seen_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)


class ModelVersionRow(Base):
    """A (target, draft) pair of model versions; acceptance never carries over between pairs."""

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("target_version", "draft_version", name="uq_model_versions_pair"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    target_version: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    draft_version: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    first_seen_at: Mapped[float] = mapped_column(Float)
    # The alerts' model-version registry (revision 0003): null until the registry first observes the pair, so the
    # store may register a pair while ingesting and the registry still raises its ``model_update`` exactly once.
    last_seen_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    acceptance_windows: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cost_windows: Mapped[int] = mapped_column(BigInteger, server_default="0")


class IngestedBatchRow(Base):
    """One window batch as received; ``(engine_id, seq)`` is unique, so a redelivered batch is stored once."""

    __tablename__ = "ingested_batches"
    __table_args__ = (UniqueConstraint("engine_id", "seq", name="uq_ingested_batches_engine_seq"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    engine_id: Mapped[str] = mapped_column(ForeignKey("engines.engine_id"))
    seq: Mapped[int] = mapped_column(BigInteger)
    window_start: Mapped[float] = mapped_column(Float)
    window_end: Mapped[float] = mapped_column(Float)
    dropped_before: Mapped[int] = mapped_column(Integer)
    ingested_at: Mapped[float] = mapped_column(Float)


class AcceptanceBucketRow(Base):
    """A key the acceptance windows are aggregated by: model pair, request type, context bucket and k.

    Registered once (the store caches the ids), so a window row carries one small integer instead of the key.
    """

    __tablename__ = "acceptance_buckets"
    __table_args__ = (
        UniqueConstraint("model_version_id", "request_type", "context_bucket", "k", name="uq_acceptance_buckets_key"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id"))
    request_type: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    context_bucket: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    k: Mapped[int] = mapped_column(Integer)


class CostBucketRow(Base):
    """A key the cost windows are aggregated by: model pair, batch-size bucket, context bucket and largest k."""

    __tablename__ = "cost_buckets"
    __table_args__ = (
        UniqueConstraint("model_version_id", "batch_bucket", "context_bucket", "max_k", name="uq_cost_buckets_key"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id"))
    batch_bucket: Mapped[int] = mapped_column(Integer)
    context_bucket: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    max_k: Mapped[int] = mapped_column(Integer)


class AcceptanceWindowRow(Base):
    """One acceptance window aggregate (see :class:`~telemetry.records.AcceptanceWindow`); hot, see the module doc."""

    __tablename__ = "acceptance_windows"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    batch_id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"))  # ingested_batches.id
    bucket_id: Mapped[int] = mapped_column(Integer)  # acceptance_buckets.id
    rows: Mapped[int] = mapped_column(Integer)
    drafted: Mapped[int] = mapped_column(Integer)
    accepted: Mapped[int] = mapped_column(Integer)
    emitted: Mapped[int] = mapped_column(Integer)
    hist: Mapped[list[Any]] = mapped_column(JSON)  # hist[i] = rows that accepted exactly i drafts, len k + 1


class CostWindowRow(Base):
    """One cost window aggregate (see :class:`~telemetry.records.CostWindow`); hot, see the module doc."""

    __tablename__ = "cost_windows"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    batch_id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"))  # ingested_batches.id
    bucket_id: Mapped[int] = mapped_column(Integer)  # cost_buckets.id
    rounds: Mapped[int] = mapped_column(Integer)
    tokens_verified: Mapped[int] = mapped_column(BigInteger)
    emitted: Mapped[int] = mapped_column(BigInteger)
    batch_rows: Mapped[int] = mapped_column(BigInteger)
    draft_count: Mapped[int] = mapped_column(Integer)
    draft_total: Mapped[float] = mapped_column(Float)
    draft_sumsq: Mapped[float] = mapped_column(Float)
    draft_max: Mapped[float] = mapped_column(Float)
    verify_count: Mapped[int] = mapped_column(Integer)
    verify_total: Mapped[float] = mapped_column(Float)
    verify_sumsq: Mapped[float] = mapped_column(Float)
    verify_max: Mapped[float] = mapped_column(Float)
    other_count: Mapped[int] = mapped_column(Integer)
    other_total: Mapped[float] = mapped_column(Float)
    other_sumsq: Mapped[float] = mapped_column(Float)
    other_max: Mapped[float] = mapped_column(Float)
    latency_p50: Mapped[float] = mapped_column(Float)
    latency_p95: Mapped[float] = mapped_column(Float)
    latency_p99: Mapped[float] = mapped_column(Float)


class ScrapeBaselineRow(Base):
    """The last scrape of one engine series ``spectune ingest`` read from a cumulative-counter source.

    The next run's first scrape forms an interval with it, so one scrape per run (cron and curl) still yields
    windows. ``state`` is the series' counter values as the source's parser keeps them.
    """

    __tablename__ = "scrape_baselines"
    __table_args__ = (UniqueConstraint("source", "engine_id", "series", name="uq_scrape_baselines_key"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    source: Mapped[str] = mapped_column(String(SOURCE_LEN))
    engine_id: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    series: Mapped[str] = mapped_column(String(BUCKET_KEY_LEN))  # the source's series labels (model|engine)
    scraped_at: Mapped[float] = mapped_column(Float)
    own_time: Mapped[bool] = mapped_column(Boolean)  # scraped_at is the scrape's own time, not the ingest's
    state: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[float] = mapped_column(Float)


class SampledRoundRow(Base):
    """A raw round kept for offline replay (the engine samples a fraction of its rounds)."""

    __tablename__ = "sampled_rounds"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    batch_id: Mapped[int] = mapped_column(ForeignKey("ingested_batches.id", ondelete="CASCADE"), index=True)
    engine_id: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    round: Mapped[dict[str, Any]] = mapped_column(JSON)


class PolicyVersionRow(Base):
    """A published policy table; ``version`` is the table's own, unique and increasing.

    The sidecar's version counter comes from here (its own truth, never from Redis); 64-bit since revision 0002.
    """

    __tablename__ = "policy_versions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[int] = mapped_column(BigInteger, unique=True)
    table: Mapped[dict[str, Any]] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(String(REASON_LEN))
    created_at: Mapped[float] = mapped_column(Float)


class PinRow(Base):
    """An operator's override of k for a bucket key; active while ``removed_at`` is null."""

    __tablename__ = "pins"
    __table_args__ = (Index("ix_pins_active", "bucket_key", "removed_at"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    bucket_key: Mapped[str] = mapped_column(String(BUCKET_KEY_LEN))
    k: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    created_at: Mapped[float] = mapped_column(Float)
    removed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    removed_by: Mapped[str | None] = mapped_column(String(MAX_NAME_LEN), nullable=True)


class AlertRow(Base):
    """A raised alert (see :class:`telemetry.alerts.Alert`); acked by an operator, never deleted by spectune."""

    __tablename__ = "alerts"
    # "acked alerts of this kind and bucket" (is a new detection the same change?) and "newest first".
    __table_args__ = (Index("ix_alerts_kind_bucket", "kind", "bucket", "acked_at"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(ALERT_KIND_LEN))
    bucket: Mapped[str] = mapped_column(String(BUCKET_KEY_LEN))
    k: Mapped[int | None] = mapped_column(Integer, nullable=True)
    target_version: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    draft_version: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    previous_target_version: Mapped[str | None] = mapped_column(String(MAX_NAME_LEN), nullable=True)
    previous_draft_version: Mapped[str | None] = mapped_column(String(MAX_NAME_LEN), nullable=True)
    affected: Mapped[list[Any]] = mapped_column(JSON)
    statistic: Mapped[str] = mapped_column(String(MAX_NAME_LEN))
    stat_before: Mapped[float | None] = mapped_column(Float, nullable=True)
    before_count: Mapped[int] = mapped_column(BigInteger)
    stat_after: Mapped[float | None] = mapped_column(Float, nullable=True)
    after_count: Mapped[int] = mapped_column(BigInteger)
    count_unit: Mapped[str] = mapped_column(String(ALERT_KIND_LEN))
    detector: Mapped[str | None] = mapped_column(String(REASON_LEN), nullable=True)
    change_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    detected_at: Mapped[float] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text)
    extra: Mapped[dict[str, Any]] = mapped_column(JSON)
    acked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    acked_by: Mapped[str | None] = mapped_column(String(MAX_NAME_LEN), nullable=True)
