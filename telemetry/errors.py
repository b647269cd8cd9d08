"""The project's exception tree.

Every error spectune raises at a boundary (network input, database, configuration) derives from
:class:`SpectuneError`, so a caller can catch the whole family, and each message says what to do next.
Record validation errors are :class:`telemetry.records.RecordError` (a :class:`CountableError`), defined beside
the records they validate; the offline parsers' :class:`controller.offline.sources.common.SourceError` is the other.
"""

from __future__ import annotations


class CountableError(ValueError):
    """Input refused with a short, countable ``reason`` label (rejects are counted by it) and a ``detail``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class SpectuneError(Exception):
    """Base class of every error spectune raises on purpose."""


class TransportError(SpectuneError):
    """The transport (Redis or the in-process queue) failed; the message names the URL and what to check."""


class StoreError(SpectuneError):
    """The SQL store failed in a way the caller should see (bad URL, unreachable database)."""


class StoreRejectedError(StoreError):
    """The database refused the data itself (a constraint, a value out of range): retrying it will not help."""


class SchemaOutOfDateError(StoreError):
    """The database schema is not at the head revision of ``migrations/``; the message names the upgrade command."""


class MigrationDriftError(StoreError):
    """The SQLAlchemy models and the Alembic migrations disagree (what ``alembic check`` reports)."""
