"""The alert record: something moved (a model update, acceptance or cost drift), told once to every sink.

Data and its JSON form, nothing else: the detectors and sinks live in :mod:`controller.service.alerts`, the SQL
rows in :mod:`telemetry.alerts_store`. Defined here, beside the other records, because the store (telemetry) and
the sidecar (controller) both read it and nothing may import ``controller``.

Conventions (defined here, once):

- ``kind`` is one of :data:`ALERT_KINDS`.
- ``bucket`` is a :meth:`telemetry.records.Bucket.key`-shaped label with ``*`` where a part does not apply:
  acceptance drift ``target|draft|type|*|context`` (the window's k in ``k``, or None when the statistic pools
  every k), cost drift
  ``target|draft|*|batch bucket|context`` (the largest k in ``k``), model update ``target|draft|*|*|*`` of the
  new pair, the buckets it affects listed in ``affected``.
- ``before`` / ``after`` are the statistic's means on either side of the estimated change point, over
  ``before_count`` / ``after_count`` samples of ``count_unit`` (acceptance: ``rows``, each row's accepted / k,
  or whether its first draft was accepted; cost: ``windows``, each window's seconds per verified token). A model
  update carries no statistic.
- Times are wall-clock seconds (``time.time()``): ``change_at`` estimates when the change happened (the window
  in which it began), ``detected_at`` when the detector fired (the window that tipped it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

MODEL_UPDATE = "model_update"
ACCEPTANCE_DRIFT = "acceptance_drift"
COST_DRIFT = "cost_drift"
ALERT_KINDS = (MODEL_UPDATE, ACCEPTANCE_DRIFT, COST_DRIFT)
ACCEPTANCE_STATISTIC = "acceptance_rate"  # accepted / k per row (a row's share of its drafts the target kept)
FIRST_DRAFT_STATISTIC = "first_draft_acceptance"  # 1 if a row's first draft was kept, else 0; the same at any k
COST_STATISTIC = "seconds_per_verified_token"  # (draft + verify seconds) / tokens verified, per window


@dataclass(frozen=True)
class Alert:
    """One alert, as raised and as stored (``id`` is the store's, None until stored)."""

    kind: str
    bucket: str
    target_version: str
    draft_version: str
    detected_at: float
    message: str  # one human sentence: what moved, where, by how much
    k: int | None = None  # acceptance: the bucket's k (None: every k); cost: its largest k
    previous_target_version: str | None = None  # model update: the pair seen last before the new one
    previous_draft_version: str | None = None
    affected: tuple[str, ...] = ()  # model update: bucket labels of the new pair seen in its first batch
    statistic: str = ""
    before: float | None = None
    before_count: int = 0
    after: float | None = None
    after_count: int = 0
    count_unit: str = ""
    detector: str | None = None  # the detector and its parameters, e.g. ``adwin(clock=16, delta=0.001)``
    change_at: float | None = None
    id: int | None = None
    acked_at: float | None = None
    acked_by: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # anything a sink may show; never read by logic

    def __post_init__(self) -> None:
        if self.kind not in ALERT_KINDS:
            raise ValueError(f"Alert.kind must be one of {ALERT_KINDS}, got {self.kind!r}")
        for name in ("before", "after", "change_at", "detected_at"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"Alert.{name} must be finite, got {v}")

    @property
    def direction(self) -> str:
        """``up``, ``down`` or ``""`` (no statistic)."""
        if self.before is None or self.after is None:
            return ""
        return "up" if self.after > self.before else "down"

    def with_id(self, id: int) -> Alert:
        return replace(self, id=id)


def alert_to_json(a: Alert) -> dict[str, Any]:
    """A JSON-safe dict (the Redis stream, the webhook, the log line and ``GET /alerts`` all send this)."""
    d = asdict(a)
    d["affected"] = list(a.affected)
    d["direction"] = a.direction
    return d


def alert_from_json(d: dict[str, Any]) -> Alert:
    """Inverse of :func:`alert_to_json` (unknown keys are ignored, so older readers accept newer alerts)."""
    names = set(Alert.__dataclass_fields__)
    kw = {k: v for k, v in d.items() if k in names}
    kw["affected"] = tuple(kw.get("affected", ()))
    return Alert(**kw)
