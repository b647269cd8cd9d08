"""The telemetry functions the offline commands use, wherever this checkout keeps them.

The policy-table helpers (lookup, JSON form) and the label rule are moving out of ``telemetry/records.py`` into
``telemetry/policy_table.py`` and ``telemetry/wire.py``; this is the one place that knows both homes, so the
offline package works before and after the move. Once the move has landed, import them directly and delete this.
"""

from __future__ import annotations

from typing import Any

from telemetry.records import Bucket, PolicyTable, RecordError

try:  # after the move
    from telemetry.policy_table import lookup as _lookup
    from telemetry.policy_table import policy_table_from_json as _from_json
    from telemetry.policy_table import table_to_json as _to_json
    from telemetry.wire import check_label as _check_label
except ImportError:  # before it
    from telemetry.records import parse_bucket_key as _parse_key  # type: ignore[attr-defined,no-redef,unused-ignore]
    from telemetry.records import policy_table_from_json as _from_json  # type: ignore[attr-defined,no-redef,unused-ignore]

    def _lookup(table: PolicyTable, bucket: Bucket) -> int:
        return int(table.lookup(bucket))  # type: ignore[attr-defined,unused-ignore]

    def _to_json(table: PolicyTable) -> str:
        return str(table.to_json())  # type: ignore[attr-defined,unused-ignore]

    def _check_label(v: Any, what: str) -> str:
        _parse_key(f"{v}|x|x|1|x", wildcard=False)
        return str(v)


def lookup(table: PolicyTable, bucket: Bucket) -> int:
    """The k ``table`` gives ``bucket`` (exact key, then broader ones, then ``default_k``)."""
    return _lookup(table, bucket)


def table_to_json(table: PolicyTable) -> str:
    return _to_json(table)


def policy_table_from_json(text: str | bytes) -> PolicyTable:
    """Parse and validate a table; raises :class:`~telemetry.records.RecordError`."""
    return _from_json(text)


def check_label(value: Any, what: str) -> str:
    """``value`` if it can be a bucket-key part (the project's one label rule).

    Raises:
        ValueError: naming ``what`` and the rule broken.
    """
    if not isinstance(value, str) or "|" in value:
        raise ValueError(f"{what} {str(value)[:80]!r} cannot be a bucket label: a string without '|' is needed")
    try:
        _check_label(value, what)
    except RecordError as e:
        raise ValueError(f"{what} {value[:80]!r} cannot be a bucket label: {e.detail}") from None
    return value
