"""The SQL store: window aggregates, sampled rounds, policy versions and pins, behind one small class.

SQLite is the default (a file, WAL mode, a busy timeout so a reader never fails a writer); PostgreSQL by URL
(``postgresql+psycopg://user@host:5432/db``). Alembic owns the schema (:mod:`telemetry.migrate`); :class:`Store`
refuses to start on a database that is not at the head revision and names the command that fixes it.

The ORM stays inside: callers get records (:class:`StoredWindow`, :class:`Pin`, tables) and only the project's
errors: a database failure is a :class:`~telemetry.errors.StoreError`, data the database refused (a constraint,
a value out of range) a :class:`~telemetry.errors.StoreRejectedError`, retrying which will not help.

Ingestion is idempotent: each :class:`~telemetry.records.WindowBatch` carries ``(engine_id, seq)``, unique in
``ingested_batches``; a redelivered batch is skipped (``INSERT ... ON CONFLICT DO NOTHING``), so at-least-once
delivery from Redis becomes exactly-once in the store.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from itertools import chain, repeat
from operator import attrgetter
from typing import Any, Generic, TypeVar

import msgspec
from sqlalchemy import JSON, BigInteger, Float, Integer, String, func, select, update
from sqlalchemy.orm import Session

from telemetry.db import Database
from telemetry.errors import StoreError, StoreRejectedError
from telemetry.migrate import check, upgrade
from telemetry.policy_table import policy_table_from_json
from telemetry.records import (
    MAX_NAME_LEN,
    AcceptanceWindow,
    CostWindow,
    PolicyTable,
    RecordError,
    Stat,
    WindowBatch,
)
from telemetry.schema import (
    REASON_LEN,
    AcceptanceBucketRow,
    AcceptanceWindowRow,
    CostBucketRow,
    CostWindowRow,
    IngestedBatchRow,
    ModelVersionRow,
    PinRow,
    PolicyVersionRow,
    SampledRoundRow,
    ScrapeBaselineRow,
)
from telemetry.urls import redact_url
from telemetry.wire import check_draft_len, parse_bucket_key

DEFAULT_DB_URL = "sqlite:///spectune.sqlite"
ROWS_PER_STATEMENT = 1000  # multi-VALUES chunk: well under SQLite's 32766 bound variables at <= 30 columns
# Column order of the bulk-loaded tables (the columns Store.ingest_new builds follow it).
ACCEPTANCE_COLUMNS = ("batch_id", "bucket_id", "rows", "drafted", "accepted", "emitted", "hist")
COST_COLUMNS = (
    "batch_id", "bucket_id", "rounds", "tokens_verified", "emitted", "batch_rows", "latency_p50", "latency_p95",
    "latency_p99",
    *(f"{name}_{part}" for name in ("draft", "verify", "other") for part in ("count", "total", "sumsq", "max")),
)
SAMPLED_COLUMNS = ("batch_id", "engine_id", "round")

__all__ = ["DEFAULT_DB_URL", "Pin", "ScrapeBaseline", "Store", "StoredWindow"]

W = TypeVar("W", AcceptanceWindow, CostWindow)
AccKey = tuple[str, str, str, str, int]  # target, draft, request type, context bucket, k
CostKey = tuple[str, str, int, str, int]  # target, draft, batch bucket, context bucket, max k


@dataclass(frozen=True)
class StoredWindow(Generic[W]):
    """A window aggregate as stored: its row id (increasing; resume with ``since_id``), sender and time."""

    id: int
    engine_id: str
    window_end: float
    window: W


@dataclass(frozen=True)
class Pin:
    """An operator's override of k for a bucket key (any part may be ``*``)."""

    bucket_key: str
    k: int
    reason: str
    created_by: str
    created_at: float


@dataclass(frozen=True)
class ScrapeBaseline:
    """The last scrape of one engine series read by ``spectune ingest`` (see ``ScrapeBaselineRow``)."""

    source: str  # the ingest source (``vllm-prom``)
    engine_id: str  # the store's engine id the series' windows go under
    series: str  # the series' labels as the source names them
    scraped_at: float  # unix seconds
    own_time: bool  # scraped_at is the scrape's own time (else the time it was ingested)
    state: dict[str, Any]  # the counter values, JSON-safe, as the source's parser keeps them


# ------------------------------------------------------------------------------------------------- store
class Store(Database):
    """The spectune database.

    Args:
        url: SQLAlchemy URL; SQLite file by default, ``postgresql+psycopg://...`` for PostgreSQL.
        auto_upgrade: migrate to head at start-up instead of refusing (the embedded demo's choice; production
            runs ``spectune db upgrade`` deliberately).

    Raises:
        SchemaOutOfDateError: the database is not at the head revision and ``auto_upgrade`` is False.
    """

    def __init__(self, url: str = DEFAULT_DB_URL, *, auto_upgrade: bool = False) -> None:
        if auto_upgrade:
            upgrade(url)
        check(url)
        super().__init__(url)
        # Bucket key -> id, as committed (filled after the transaction that registered them commits).
        self._acc_ids: dict[AccKey, int] = {}
        self._cost_ids: dict[CostKey, int] = {}

    # -------------------------------------------------------------------------------------- ingestion
    def _bulk_insert(self, s: Session, table: Any, cols: tuple[str, ...], columns: list[list[Any]]) -> None:
        """Append rows, given column-wise in ``cols`` order, to ``table`` (a mapped class) in the session's
        transaction. Text and JSON columns arrive as UTF-8 bytes (JSON already serialised).

        PostgreSQL: one binary ``COPY ... FROM STDIN`` stream built in C loops (:func:`_binary_copy`): no
        per-row statement, no per-row Python call, and the server parses no numbers from text. SQLite: the
        driver's ``executemany`` of one prepared INSERT over rows zipped from the columns. Both skip
        SQLAlchemy's per-row parameter processing.
        """
        name = table.__tablename__
        names = ", ".join(f'"{c}"' for c in cols)
        if self._dialect == "postgresql":
            import psycopg  # COPY is psycopg's own API (the postgresql+psycopg driver), outside SQLAlchemy's errors

            try:
                data = _binary_copy([_copy_type(table.__table__.columns[c].type) for c in cols], columns)
            except struct.error as e:  # what the server's range check would refuse, refused before sending
                raise StoreRejectedError(f"storing {name}: a value is out of range for its column: {e}") from e
            raw = s.connection().connection.driver_connection
            assert raw is not None
            try:
                with raw.cursor() as cur, cur.copy(f'COPY "{name}" ({names}) FROM STDIN (FORMAT BINARY)') as cp:
                    cp.write(data)
            except (psycopg.IntegrityError, psycopg.DataError) as e:
                raise StoreRejectedError(f"storing {name}: the database refused the data: {e}") from e
            except psycopg.Error as e:
                raise StoreError(f"storing {name} failed on {redact_url(self.url)}: {e}; check that the "
                                 "database is reachable (the operation can be retried)") from e
        else:
            marks = ", ".join("?" * len(cols))
            text = [isinstance(table.__table__.columns[c].type, (String, JSON)) for c in cols]
            # sqlite3 would store bytes as a BLOB: text columns go as str
            columns = [list(map(bytes.decode, col)) if t else col for col, t in zip(columns, text, strict=True)]
            rows = list(zip(*columns, strict=True))
            s.connection().exec_driver_sql(f'INSERT INTO "{name}" ({names}) VALUES ({marks})', rows)

    def ingest(self, batches: Sequence[WindowBatch]) -> int:
        """Store validated batches in one transaction; returns how many were new (redeliveries are skipped)."""
        return len(self.ingest_new(batches))

    def ingest_new(self, batches: Sequence[WindowBatch]) -> list[WindowBatch]:
        """Like :meth:`ingest`, returning the batches that were new (feed only these to the policies)."""
        unique: dict[tuple[str, int], WindowBatch] = {}
        for b in batches:
            unique.setdefault((b.engine_id, b.seq), b)
        if not unique:
            return []
        now = time.time()
        with self._session("storing window batches") as s:
            self._upsert_engines(s, {b.engine_id for b in unique.values()}, now)
            items = list(unique.values())
            new_ids = self._claim_batches(s, items, now)
            fresh = [b for b in items if (b.engine_id, b.seq) in new_ids]
            bids = [new_ids[(b.engine_id, b.seq)] for b in fresh]
            # Every window of every fresh batch, with its batch id beside it: C loops over all windows at once
            # (attrgetter, map, zip), no Python call per window; rows go to the database column-wise.
            accs = _flatten(fresh, _ACCEPTANCE)
            costs = _flatten(fresh, _COST)
            acc_keys = list(map(_ACC_KEY, accs))
            cost_keys = list(map(_COST_KEY, costs))
            acc_ids, cost_ids = self._bucket_ids(s, acc_keys, cost_keys)
            acc_cols = [_repeat_per(bids, fresh, _ACCEPTANCE), list(map(acc_ids.__getitem__, acc_keys)),
                        *(list(map(getter, accs)) for getter in _ACC_GETTERS), list(map(_JSON, map(_HIST, accs)))]
            cost_cols = [_repeat_per(bids, fresh, _COST), list(map(cost_ids.__getitem__, cost_keys)),
                         *(list(map(getter, costs)) for getter in _COST_GETTERS)]
            sampled = _flatten(fresh, _SAMPLED)
            sampled_cols = [_repeat_per(bids, fresh, _SAMPLED),
                            list(map(str.encode, _repeat_per([b.engine_id for b in fresh], fresh, _SAMPLED))),
                            list(map(_JSON, sampled))]
            for table, cols, columns in (
                (AcceptanceWindowRow, ACCEPTANCE_COLUMNS, acc_cols),
                (CostWindowRow, COST_COLUMNS, cost_cols),
                (SampledRoundRow, SAMPLED_COLUMNS, sampled_cols),
            ):
                if columns[0]:
                    self._bulk_insert(s, table, cols, columns)
        self._acc_ids, self._cost_ids = acc_ids, cost_ids  # committed: later transactions may rely on them
        return fresh

    def _claim_batches(self, s: Session, items: list[WindowBatch], now: float) -> dict[tuple[str, int], int]:
        """Insert one ``ingested_batches`` row per batch, skipping ``(engine_id, seq)`` pairs already stored.

        Returns:
            ``(engine_id, seq) -> id`` of the batches that were new.

        Written as driver SQL: compiling a SQLAlchemy multi-row INSERT costs about as much as the rest of a
        batch's ingestion. PostgreSQL gets one statement of fixed text over arrays (``unnest``), which psycopg
        prepares once; SQLite gets multi-row VALUES in chunks under its bound-variable limit.
        """
        conn = s.connection()
        tail = " ON CONFLICT (engine_id, seq) DO NOTHING RETURNING id, engine_id, seq"
        head = "INSERT INTO ingested_batches (engine_id, seq, window_start, window_end, dropped_before, ingested_at) "
        results = []
        if self._dialect == "postgresql":
            params = {
                "e": [b.engine_id for b in items], "q": [b.seq for b in items],
                "ws": [b.window_start for b in items], "we": [b.window_end for b in items],
                "d": [b.dropped_before for b in items], "now": now,
            }
            results.append(conn.exec_driver_sql(
                head + "SELECT e, q, ws, we, d, %(now)s FROM unnest(%(e)s::varchar[], %(q)s::bigint[], "
                "%(ws)s::float8[], %(we)s::float8[], %(d)s::int[]) AS t(e, q, ws, we, d)" + tail,
                params,
            ))
        elif self._dialect == "sqlite":
            for i in range(0, len(items), ROWS_PER_STATEMENT):
                chunk = items[i : i + ROWS_PER_STATEMENT]
                flat: list[Any] = []
                for b in chunk:
                    flat += (b.engine_id, b.seq, b.window_start, b.window_end, b.dropped_before, now)
                values = ", ".join(["(?, ?, ?, ?, ?, ?)"] * len(chunk))
                results.append(conn.exec_driver_sql(head + "VALUES " + values + tail, tuple(flat)))
        else:
            raise StoreError(f"dialect {self._dialect} is not supported; use SQLite or PostgreSQL")
        return {(eid, int(seq)): int(bid) for res in results for bid, eid, seq in res}

    def _upsert_engines(self, s: Session, engine_ids: set[str], now: float) -> None:
        """Register the senders and mark them seen now, in sorted order (concurrent sidecars lock rows alike).

        Driver SQL for the reason given in :meth:`_claim_batches` (compiling SQLAlchemy's upsert of a read's few
        dozen engines cost ~7 us per ingested window): an array for PostgreSQL, multi-row VALUES for SQLite.
        """
        conn = s.connection()
        ids = sorted(engine_ids)
        head = "INSERT INTO engines (engine_id, first_seen_at, last_seen_at) "
        tail = " ON CONFLICT (engine_id) DO UPDATE SET last_seen_at = excluded.last_seen_at"
        if self._dialect == "postgresql":
            conn.exec_driver_sql(head + "SELECT e, %(now)s, %(now)s FROM unnest(%(e)s::varchar[]) AS t(e)" + tail,
                                 {"e": ids, "now": now})
        elif self._dialect == "sqlite":
            for i in range(0, len(ids), ROWS_PER_STATEMENT):
                chunk = ids[i : i + ROWS_PER_STATEMENT]
                flat = [v for e in chunk for v in (e, now, now)]
                conn.exec_driver_sql(head + "VALUES " + ", ".join(["(?, ?, ?)"] * len(chunk)) + tail, tuple(flat))
        else:
            raise StoreError(f"dialect {self._dialect} is not supported; use SQLite or PostgreSQL")

    def _bucket_ids(
        self, s: Session, acc_keys: list[AccKey], cost_keys: list[CostKey]
    ) -> tuple[dict[AccKey, int], dict[CostKey, int]]:
        """Bucket key -> id maps covering ``acc_keys`` and ``cost_keys``, registering keys seen for the first time.

        Window rows hold a bucket id instead of their key, and no foreign key, so ids come only from here: the
        cached maps are replaced only after the registering transaction committed (see :meth:`ingest_new`).
        """
        acc_ids, cost_ids = self._acc_ids, self._cost_ids
        new_acc = set(acc_keys).difference(acc_ids)
        new_cost = set(cost_keys).difference(cost_ids)
        if not new_acc and not new_cost:
            return acc_ids, cost_ids
        now = time.time()
        pairs = sorted({k[:2] for k in new_acc} | {k[:2] for k in new_cost})
        s.execute(
            self._insert(ModelVersionRow)
            .values([{"target_version": t, "draft_version": d, "first_seen_at": now} for t, d in pairs])
            .on_conflict_do_nothing(index_elements=["target_version", "draft_version"])
        )
        m = ModelVersionRow
        mv = {(t, d): int(i) for i, t, d in s.execute(select(m.id, m.target_version, m.draft_version))}
        if new_acc:
            s.execute(
                self._insert(AcceptanceBucketRow)
                .values([{"model_version_id": mv[(t, d)], "request_type": r, "context_bucket": c, "k": k}
                         for t, d, r, c, k in sorted(new_acc)])
                .on_conflict_do_nothing(index_elements=["model_version_id", "request_type", "context_bucket", "k"])
            )
        if new_cost:
            s.execute(
                self._insert(CostBucketRow)
                .values([{"model_version_id": mv[(t, d)], "batch_bucket": bb, "context_bucket": c, "max_k": k}
                         for t, d, bb, c, k in sorted(new_cost)])
                .on_conflict_do_nothing(index_elements=["model_version_id", "batch_bucket", "context_bucket", "max_k"])
            )
        ab, cb = AcceptanceBucketRow, CostBucketRow
        acc_q = select(ab.id, m.target_version, m.draft_version, ab.request_type, ab.context_bucket, ab.k).join(
            m, ab.model_version_id == m.id)
        cost_q = select(cb.id, m.target_version, m.draft_version, cb.batch_bucket, cb.context_bucket, cb.max_k).join(
            m, cb.model_version_id == m.id)
        return (
            {(t, d, r, c, int(k)): int(i) for i, t, d, r, c, k in s.execute(acc_q)},
            {(t, d, int(bb), c, int(k)): int(i) for i, t, d, bb, c, k in s.execute(cost_q)},
        )

    # ------------------------------------------------------------------------------------------ queries
    def acceptance_windows(
        self,
        since_id: int | None = None,
        *,
        target_version: str | None = None,
        draft_version: str | None = None,
        request_type: str | None = None,
        limit: int | None = None,
    ) -> list[StoredWindow[AcceptanceWindow]]:
        """Acceptance windows with id > ``since_id``, oldest first, optionally for one model pair / type."""
        a, ab, m, ib = AcceptanceWindowRow, AcceptanceBucketRow, ModelVersionRow, IngestedBatchRow
        q = (
            select(a, ab.request_type, ab.context_bucket, ab.k, m.target_version, m.draft_version, ib.engine_id,
                   ib.window_end)
            .join(ab, a.bucket_id == ab.id).join(m, ab.model_version_id == m.id).join(ib, a.batch_id == ib.id)
            .order_by(a.id)
        )
        q = _window_filters(q, a.id, since_id, target_version, draft_version, limit)
        if request_type is not None:
            q = q.where(ab.request_type == request_type)
        with self._session("reading acceptance windows") as s:
            return [
                StoredWindow(r.id, eng, end, AcceptanceWindow(
                    target_version=t, draft_version=d, request_type=rt, context_bucket=cb, k=k, rows=r.rows,
                    drafted=r.drafted, accepted=r.accepted, emitted=r.emitted, hist=tuple(int(h) for h in r.hist),
                ))
                for r, rt, cb, k, t, d, eng, end in s.execute(q)
            ]

    def cost_windows(
        self,
        since_id: int | None = None,
        *,
        target_version: str | None = None,
        draft_version: str | None = None,
        limit: int | None = None,
    ) -> list[StoredWindow[CostWindow]]:
        """Cost windows with id > ``since_id``, oldest first, optionally for one model pair."""
        c, cb, m, ib = CostWindowRow, CostBucketRow, ModelVersionRow, IngestedBatchRow
        q = (
            select(c, cb, m.target_version, m.draft_version, ib.engine_id, ib.window_end)
            .join(cb, c.bucket_id == cb.id).join(m, cb.model_version_id == m.id).join(ib, c.batch_id == ib.id)
            .order_by(c.id)
        )
        q = _window_filters(q, c.id, since_id, target_version, draft_version, limit)
        with self._session("reading cost windows") as s:
            return [
                StoredWindow(r.id, eng, end, _cost_window(r, key, t, d))
                for r, key, t, d, eng, end in s.execute(q)
            ]

    def recent_windows(
        self, n: int
    ) -> tuple[list[StoredWindow[AcceptanceWindow]], list[StoredWindow[CostWindow]]]:
        """The newest ``n`` acceptance and the newest ``n`` cost windows by id, each list oldest first (what a
        restarted sidecar replays into its policy)."""
        with self._session("reading the newest window ids") as s:
            top_a = s.scalar(select(func.max(AcceptanceWindowRow.id))) or 0
            top_c = s.scalar(select(func.max(CostWindowRow.id))) or 0
        return (self.acceptance_windows(since_id=max(0, top_a - n)),
                self.cost_windows(since_id=max(0, top_c - n)))

    def batch_count(self) -> int:
        """Batches ingested so far (each (engine_id, seq) once)."""
        with self._session("counting batches") as s:
            return int(s.scalar(select(func.count()).select_from(IngestedBatchRow)) or 0)

    def sampled_rounds(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Sampled raw rounds (as dicts, the shape of :class:`~telemetry.records.RoundRecord`), oldest first."""
        with self._session("reading sampled rounds") as s:
            return [dict(r) for r in s.scalars(select(SampledRoundRow.round).order_by(SampledRoundRow.id).limit(limit))]

    # ------------------------------------------------------------------------------------- scrape baselines
    def scrape_baselines(self, source: str) -> list[ScrapeBaseline]:
        """Every series' last scrape stored for ``source``."""
        b = ScrapeBaselineRow
        with self._session("reading scrape baselines") as s:
            return [ScrapeBaseline(r.source, r.engine_id, r.series, r.scraped_at, bool(r.own_time), dict(r.state))
                    for r in s.scalars(select(b).where(b.source == source).order_by(b.id))]

    def save_scrape_baselines(self, baselines: Sequence[ScrapeBaseline]) -> None:
        """Store each series' last scrape, replacing the one stored before (one transaction)."""
        if not baselines:
            return
        now = time.time()
        with self._session("storing scrape baselines") as s:
            for bl in baselines:
                ins = self._insert(ScrapeBaselineRow).values(
                    source=bl.source, engine_id=bl.engine_id, series=bl.series, scraped_at=bl.scraped_at,
                    own_time=bl.own_time, state=bl.state, updated_at=now)
                s.execute(ins.on_conflict_do_update(
                    index_elements=["source", "engine_id", "series"],
                    set_={"scraped_at": ins.excluded.scraped_at, "own_time": ins.excluded.own_time,
                          "state": ins.excluded.state, "updated_at": ins.excluded.updated_at}))

    # ------------------------------------------------------------------------------------------ policies
    def save_policy_version(self, table: PolicyTable) -> None:
        """Store a published table. Raises :class:`StoreError` when its version already exists."""
        try:
            with self._session("storing a policy version") as s:
                s.add(PolicyVersionRow(
                    version=table.version, table=asdict(table), reason=table.reason[:REASON_LEN],
                    created_at=table.created_at or time.time(),
                ))
        except StoreRejectedError as e:
            raise StoreRejectedError(
                f"policy version {table.version} already exists; publish a new table with a higher version"
            ) from e.__cause__

    def latest_policy_version(self) -> PolicyTable | None:
        """The table with the highest version, or None before the first one."""
        tables = self.policy_versions(limit=1)
        return tables[0] if tables else None

    def policy_versions(self, limit: int = 20) -> list[PolicyTable]:
        """The newest ``limit`` tables, newest first."""
        with self._session("reading policy versions") as s:
            rows = s.scalars(select(PolicyVersionRow.table).order_by(PolicyVersionRow.version.desc()).limit(limit))
            return [policy_table_from_json(json.dumps(t)) for t in rows]

    # ---------------------------------------------------------------------------------------------- pins
    def pin(self, bucket_key: str, k: int, reason: str, who: str = "operator") -> Pin:
        """Pin ``k`` for a bucket key (replacing an active pin on the same key).

        Raises:
            RecordError: the key does not have five ``|``-separated parts or k is out of range.
        """
        _check_pin(bucket_key, k, who)
        now = time.time()
        with self._session("pinning") as s:
            s.execute(
                update(PinRow).where(PinRow.bucket_key == bucket_key, PinRow.removed_at.is_(None))
                .values(removed_at=now, removed_by=who)
            )
            s.add(PinRow(bucket_key=bucket_key, k=k, reason=reason, created_by=who, created_at=now))
        return Pin(bucket_key, k, reason, who, now)

    def unpin(self, bucket_key: str, who: str = "operator") -> bool:
        """Remove the active pin on a key (kept in history); returns whether there was one."""
        with self._session("unpinning") as s:
            res = s.execute(
                update(PinRow).where(PinRow.bucket_key == bucket_key, PinRow.removed_at.is_(None))
                .values(removed_at=time.time(), removed_by=who[:MAX_NAME_LEN])
            )
            return bool(getattr(res, "rowcount", 0))

    def active_pins(self) -> list[Pin]:
        """Pins in force, oldest first."""
        with self._session("reading pins") as s:
            rows = s.scalars(select(PinRow).where(PinRow.removed_at.is_(None)).order_by(PinRow.id))
            return [Pin(r.bucket_key, r.k, r.reason, r.created_by, r.created_at) for r in rows]


def _check_pin(bucket_key: str, k: int, who: str) -> None:
    parse_bucket_key(bucket_key)  # the one bucket-key parser: the same rules as tables on the wire
    check_draft_len(k, "pinned k")
    if not who or len(who) > MAX_NAME_LEN:
        raise RecordError("bad_name", f"who must be 1..{MAX_NAME_LEN} chars")


def _copy_type(t: Any) -> str:
    """The PostgreSQL type a binary COPY sends a column's values as (JSON and strings go as text)."""
    if isinstance(t, BigInteger):
        return "int8"
    if isinstance(t, Integer):
        return "int4"
    if isinstance(t, Float):
        return "float8"
    if isinstance(t, (String, JSON)):
        return "text"
    raise StoreError(f"no binary COPY type for column type {t!r}")


_ACCEPTANCE, _COST, _SAMPLED = attrgetter("acceptance"), attrgetter("cost"), attrgetter("sampled_rounds")
_ACC_KEY = attrgetter("target_version", "draft_version", "request_type", "context_bucket", "k")  # an AccKey
_COST_KEY = attrgetter("target_version", "draft_version", "batch_bucket", "context_bucket", "max_k")  # a CostKey
# ACCEPTANCE_COLUMNS between bucket_id and hist, and COST_COLUMNS after bucket_id, read off a window (the cost
# window's three timing Stats spread out into four columns each)
_ACC_GETTERS = tuple(map(attrgetter, ("rows", "drafted", "accepted", "emitted")))
_HIST = attrgetter("hist")
_JSON = msgspec.json.Encoder().encode  # validated records: ints, finite floats, strings (bytes out)
_COST_GETTERS = (
    *map(attrgetter, ("rounds", "tokens_verified", "emitted", "batch_rows", "latency_p50", "latency_p95",
                      "latency_p99")),
    *(attrgetter(f"{name}_s.{part}") for name in ("draft", "verify", "other")
      for part in ("count", "total", "sumsq", "max")),
)


def _flatten(batches: list[WindowBatch], part: attrgetter[Any]) -> list[Any]:
    """One part of every batch (its acceptance windows, cost windows or sampled rounds), in batch order."""
    return list(chain.from_iterable(map(part, batches)))


def _repeat_per(values: list[Any], batches: list[WindowBatch], part: attrgetter[Any]) -> list[Any]:
    """``values[i]`` once per item of ``part`` of ``batches[i]``: the column beside :func:`_flatten`'s items."""
    return list(chain.from_iterable(map(repeat, values, map(len, map(part, batches)))))


_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)  # signature, flags, header extension length
_COPY_TRAILER = struct.pack(">h", -1)  # a field count of -1 ends the stream
_COPY_FIXED = {"int8": ("q", 8), "int4": ("i", 4), "float8": ("d", 8)}  # struct code and byte size


def _binary_copy(types: list[str], columns: list[list[Any]]) -> bytes:
    """Rows given column-wise, as one PostgreSQL binary COPY stream (header, rows, trailer).

    A row is an int16 field count, then per field an int32 byte length and the value, big-endian (a ``text``
    value: its UTF-8 bytes, given as bytes). Each run of fixed-width fields up to and including the next text
    field's length is packed by one ``struct`` format, and every loop over the rows runs in C (``map``,
    ``zip``, ``join``). A value outside its column's range (an INTEGER past 2**31 - 1) raises ``struct.error``
    while packing, before anything is sent.

    Args:
        types: per column, ``int8``, ``int4``, ``float8`` or ``text`` (see :func:`_copy_type`); no NULLs.
        columns: per column, its values for every row (the same length).
    """
    parts: list[Iterable[bytes]] = []
    args: list[Iterable[Any]]
    fmt, args = ">h", [repeat(len(types))]  # each row starts with its field count
    for t, col in zip(types, columns, strict=True):
        if t == "text":
            parts.append(map(struct.Struct(fmt + "i").pack, *args, map(len, col)))
            parts.append(col)
            fmt, args = ">", []
        else:
            code, size = _COPY_FIXED[t]
            fmt += "i" + code
            args += (repeat(size), col)
    if args:
        parts.append(map(struct.Struct(fmt).pack, *args))
    return b"".join((_COPY_HEADER, *chain.from_iterable(zip(*parts, strict=True)), _COPY_TRAILER))


def _cost_window(r: CostWindowRow, key: CostBucketRow, target: str, draft: str) -> CostWindow:
    return CostWindow(
        target_version=target, draft_version=draft, batch_bucket=key.batch_bucket, context_bucket=key.context_bucket,
        max_k=key.max_k, rounds=r.rounds, tokens_verified=r.tokens_verified, emitted=r.emitted,
        batch_rows=r.batch_rows,
        draft_s=Stat(r.draft_count, r.draft_total, r.draft_sumsq, r.draft_max),
        verify_s=Stat(r.verify_count, r.verify_total, r.verify_sumsq, r.verify_max),
        other_s=Stat(r.other_count, r.other_total, r.other_sumsq, r.other_max),
        latency_p50=r.latency_p50, latency_p95=r.latency_p95, latency_p99=r.latency_p99,
    )


def _window_filters(
    q: Any, id_col: Any, since_id: int | None, target_version: str | None, draft_version: str | None,
    limit: int | None,
) -> Any:
    """The filters both window queries share (their select joins ``ModelVersionRow``)."""
    m = ModelVersionRow
    if since_id is not None:
        q = q.where(id_col > since_id)
    if target_version is not None:
        q = q.where(m.target_version == target_version)
    if draft_version is not None:
        q = q.where(m.draft_version == draft_version)
    return q.limit(limit) if limit is not None else q
