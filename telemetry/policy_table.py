"""The policy table's rules: its JSON form, its caps and validation, and the one lookup of a row's k.

:class:`~telemetry.records.PolicyTable` is the data. Here:

- :func:`lookup`: a bucket's k: the exact key, then progressively broader ones (:func:`fallback_keys`), then
  ``default_k``;
- :class:`RowLookup`: the one map ``(request_type, batch_size, context_len) -> k`` an engine calls per row:
  it puts the row in its bucket (:class:`~telemetry.records.BucketConfig`) and asks a resolver (a table's
  :func:`lookup`, or a policy) once per bucket;
- :func:`table_to_json` / :func:`policy_table_from_json`: the table as it travels (Redis, the store, files),
  with the size caps a table must meet before anyone parses it (:func:`check_table_size` for the sidecar's side).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from telemetry.records import (
    DEFAULT_BUCKETS,
    POLICY_SCHEMA_VERSION,
    WILDCARD,
    Bucket,
    BucketConfig,
    PolicyTable,
    RecordError,
)
from telemetry.wire import (
    DraftLen,
    RuleBroken,
    Seconds,
    as_plain,
    parse_bucket_key,
    record_error,
    refuse_negative_zero,
    rule_broken,
    undecodable,
)

# Size caps of a policy table, checked by the sidecar before it stores and publishes one and by every client
# before it parses one. The sidecar's own tables stay far below (SidecarConfig.max_table_buckets, 4096 by
# default, plus a few pins); a table past them is a forgery or a runaway pin script. A client holds a table as a
# dict plus a lookup cache, about 7x its JSON (a 28.9 MB table cost a client about 190 MB), so 4 MiB bounds what
# any table can cost an engine to some 30 MB.
MAX_TABLE_ENTRIES = 16_384
MAX_TABLE_BYTES = 4 << 20
# Versions are stored as a 64-bit integer (policy_versions.version is BIGINT); larger ones cannot be stored.
MAX_POLICY_VERSION = (1 << 63) - 1
MAX_REASON_CHARS = 500  # an operator's note on a version; the store's column has this width


# ---------------------------------------------------------------------------------------------- lookup
def fallback_keys(b: Bucket) -> list[str]:
    """Exact key first, then broader: any context, any request type, any batch size, any versions."""
    w = WILDCARD
    t, d, r, bb, c = b.target_version, b.draft_version, b.request_type, str(b.batch_bucket), b.context_bucket
    return [
        "|".join(p)
        for p in (
            (t, d, r, bb, c), (t, d, r, bb, w), (t, d, w, bb, c), (t, d, w, bb, w),
            (t, d, r, w, w), (t, d, w, w, w), (w, w, r, bb, c), (w, w, w, bb, w), (w, w, w, w, w),
        )
    ]


def lookup(table: PolicyTable, bucket: Bucket) -> int:
    """The k ``table`` gives ``bucket``: the first entry along :func:`fallback_keys`, else ``default_k``."""
    entries = table.entries
    for key in fallback_keys(bucket):
        k = entries.get(key)
        if k is not None:
            return k
    return table.default_k


class RowLookup:
    """``(request_type, batch_size, context_len) -> k`` for one pair of model versions, cached per bucket.

    The engine calls this per row per round, so a repeat is one ``bisect`` per edge list and one dict read; the
    resolver runs once per bucket. Build a new one when the table or the versions change (the cache belongs to
    them).

    Args:
        resolve: the k for a bucket (``functools.partial(lookup, table)``, or a policy's decision).
        target_version: the bucket's target version.
        draft_version: the bucket's draft version.
        buckets: the bucket edges; engines and the sidecar must agree on them.
    """

    def __init__(self, resolve: Callable[[Bucket], int], target_version: str, draft_version: str,
                 buckets: BucketConfig = DEFAULT_BUCKETS) -> None:
        self._resolve = resolve
        self.versions = (target_version, draft_version)
        self._batch_edges = buckets.batch_edges
        self._context_edges = buckets.context_edges
        self._context_labels = buckets.context_labels()
        # (request type, batch-bucket index, context-bucket index) -> k
        self._cache: dict[tuple[str, int, int], int] = {}

    def __call__(self, request_type: str, batch_size: int, context_len: int) -> int:
        bi = bisect.bisect_left(self._batch_edges, batch_size)  # the smallest edge >= batch_size
        ci = bisect.bisect_left(self._context_edges, context_len)
        k = self._cache.get((request_type, bi, ci))
        if k is None:
            edges = self._batch_edges
            bucket = Bucket(self.versions[0], self.versions[1], request_type, edges[min(bi, len(edges) - 1)],
                            self._context_labels[ci])
            k = self._cache[(request_type, bi, ci)] = self._resolve(bucket)
        return k


# ------------------------------------------------------------------------------------------ JSON form
class _Table(Struct, frozen=True):
    version: Annotated[int, Meta(ge=0, le=MAX_POLICY_VERSION)]
    default_k: DraftLen
    k_max: DraftLen
    entries: dict[str, DraftLen]
    created_at: Seconds = 0.0
    reason: str = ""
    schema_version: int | None = None  # required; None (absent) is refused by name below

    def __post_init__(self) -> None:
        _check_schema_version(self.schema_version)
        _check_entry_count(len(self.entries), "policy table")
        k_max = self.k_max
        for key, k in self.entries.items():
            try:
                parse_bucket_key(key)
            except RecordError as e:
                rule_broken(e.reason, e.detail)
            if k > k_max:
                rule_broken("out_of_range", f"entries[{key!r}]={k} outside [0, k_max={k_max}]")
        if self.default_k > k_max:
            rule_broken("out_of_range", f"default_k={self.default_k} outside [0, k_max={k_max}]")
        refuse_negative_zero("created_at", self.created_at)


def _check_schema_version(sv: object) -> None:
    if type(sv) is not int or sv != POLICY_SCHEMA_VERSION:  # True and 1.0 equal 1 but are not a version
        rule_broken("unknown_schema_version", f"policy schema_version={sv!r}, expected {POLICY_SCHEMA_VERSION}")


def _check_entry_count(n: int, what: str) -> None:
    if n > MAX_TABLE_ENTRIES:
        rule_broken("table_too_large", f"{what} has {n} entries > cap {MAX_TABLE_ENTRIES}; "
                                   "remove pins or lower max_table_buckets")


def check_entry_count(table: PolicyTable) -> None:
    """The entry cap alone (a client's check of a table handed over in-process).

    Raises:
        RecordError: ``table_too_large``.
    """
    try:
        _check_entry_count(len(table.entries), f"table v{table.version}")
    except RuleBroken as e:
        raise RecordError(e.reason, e.detail) from None


def check_table_size(table: PolicyTable) -> None:
    """The sidecar's side of the size caps: refuse to store or publish a table a client would refuse.

    Raises:
        RecordError: ``table_too_large`` with the entry count or encoded size and the cap.
    """
    check_entry_count(table)
    n = len(table_to_json(table).encode())
    if n > MAX_TABLE_BYTES:
        raise RecordError("table_too_large", f"table v{table.version} encodes to {n} bytes > cap {MAX_TABLE_BYTES}; "
                                             "remove pins or lower max_table_buckets")


def table_to_json(table: PolicyTable) -> str:
    """The table as it travels: one JSON object, keys sorted."""
    return msgspec.json.encode(table, order="sorted").decode()


def policy_table_from_json(text: str | bytes | bytearray) -> PolicyTable:
    """Parse and validate a policy table. Raises :class:`RecordError` with a countable ``reason``.

    The byte cap is checked before anything is parsed, the entry cap before any key is.
    """
    if not isinstance(text, str | bytes | bytearray):
        raise RecordError("bad_type", f"policy table must be str or bytes, got {type(text).__name__}")
    if len(text) > MAX_TABLE_BYTES:  # chars <= bytes: a str over the cap is over it encoded too
        raise RecordError("table_too_large", f"policy table of {len(text)} bytes > cap {MAX_TABLE_BYTES}")
    try:
        t = msgspec.json.decode(text, type=_Table)
    except (msgspec.ValidationError, RuleBroken) as e:
        raise record_error(e, as_plain(text), _check_schema_version) from None
    except (msgspec.DecodeError, RecursionError, ValueError) as e:
        raise undecodable(e, text) from None
    return PolicyTable(version=t.version, default_k=t.default_k, k_max=t.k_max, entries=t.entries,
                       created_at=t.created_at, reason=t.reason[:MAX_REASON_CHARS])
