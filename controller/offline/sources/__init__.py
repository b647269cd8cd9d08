"""Parsers of the telemetry serving engines emit today, one module per format (pure: text in, windows out).

Each line parser returns None for a line that is not a record (blank, other log output), a
:class:`~controller.offline.sources.common.Parsed` (or a list of them) for a record, and raises
:class:`~controller.offline.sources.common.SourceError` with a countable reason for a malformed one.
"""

from controller.offline.sources.common import UNKNOWN, Parsed, SourceError, SourceLabels

__all__ = ["UNKNOWN", "Parsed", "SourceError", "SourceLabels"]
