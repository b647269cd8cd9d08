"""What went wrong in the sidecar, kept for ``/health``: errors, and records refused per reason.

Every part of the sidecar reports here instead of raising into the loop, and logs under one logger name
(:data:`SIDECAR_LOGGER`), whichever part writes the line, so that operators filter the sidecar's lines as one.
"""

from __future__ import annotations

import time

from controller.service.metrics import SidecarMetrics
from telemetry.errors import SpectuneError

SIDECAR_LOGGER = "controller.service.sidecar"  # the logger every part of the sidecar writes to


class Faults:
    """The sidecar's error count with the latest error and its time, and the records refused per reason.

    Args:
        metrics: where refusals are counted too (``spectune_records_rejected_total{reason}``).
    """

    def __init__(self, metrics: SidecarMetrics) -> None:
        self.metrics = metrics
        self.errors = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None  # unix seconds of last_error
        self.rejected: dict[str, int] = {}

    def error(self, e: BaseException) -> None:
        """Count an error and keep it as the latest (a spectune error's message says what to do; others say
        their type too)."""
        self.errors += 1
        self.last_error = f"{type(e).__name__}: {e}" if not isinstance(e, SpectuneError) else str(e)
        self.last_error_at = time.time()

    def reject(self, reason: str, n: int = 1) -> None:
        """Count ``n`` records refused for ``reason``."""
        self.rejected[reason] = self.rejected.get(reason, 0) + n
        self.metrics.on_rejected(reason, n)
