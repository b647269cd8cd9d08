"""The alert manager: windows in, alerts out (stored, then told to every sink).

What the sidecar calls, per new batch (after the store took it)::

    alerts = manager.observe_batch(batch)   # registry + every acceptance and cost window of the batch

or piecewise: :meth:`AlertManager.observe_versions`, :meth:`AlertManager.observe_acceptance`,
:meth:`AlertManager.observe_cost`. Each returns what it raised, already stored and dispatched.

Rules (stated once, here):

- **Buckets.** Acceptance is watched two ways in each (versions, request type, context bucket):
  - per k (the key the store aggregates by), each row's accepted / k (:data:`ACCEPTANCE_STATISTIC`): the most
    sensitive statistic while k holds still;
  - across every k, each row's first draft accepted or not (:data:`FIRST_DRAFT_STATISTIC`). Whether the first
    draft is accepted does not depend on how many drafts follow it, so this monitor keeps its level while a
    learning policy moves k. Without it a drift that coincides with a change of k is invisible: the new k's
    monitor starts with no level "before", and the old k's gets no rows "after".
  Cost is watched per (versions, batch bucket, context bucket, largest k). A new model pair gets new buckets,
  so its detectors start fresh; the update itself is the registry's ``model_update``.
- **Cool-down.** After an alert for an acceptance bucket (any k, either statistic) or a (cost bucket, largest
  k), further detections there are counted (``suppressed_cooldown``) but not raised for ``cooldown_s``
  seconds of window time (default 10 minutes): one change, or a flapping signal, raises one alert, not one per
  k or hundreds. Detection goes on meanwhile, so the level "before" of the next alert is the latest one, not
  the one an operator already saw.
- **Acked changes.** Before raising, the store is asked for an acked alert reporting the same change (same kind,
  bucket, k and direction, level after within ``same_change_rel_tol``; a model update: the same pairs); if there
  is one the detection is counted (``suppressed_acked``) and not raised again, across restarts too.
- **Young buckets and small shifts.** A detection with fewer than ``min_before`` samples of the old level
  (a bucket still filling) or a shift under ``min_relative_shift`` (significant but too small to act on, as
  ADWIN finds eventually in millions of rows) is counted, not raised.
- **Never in the way.** A failing sink or store is counted and logged; the caller's loop goes on.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controller.service.alerts.detectors import BOUNDED_DETECTORS, BucketMonitor, Change, DetectorSpec
from controller.service.alerts.registry import ModelRegistry
from controller.service.alerts.sinks import AlertSink
from telemetry.alerts import (
    ACCEPTANCE_DRIFT,
    ACCEPTANCE_STATISTIC,
    COST_DRIFT,
    COST_STATISTIC,
    FIRST_DRAFT_STATISTIC,
    Alert,
)
from telemetry.alerts_store import AlertStore
from telemetry.errors import StoreError
from telemetry.records import AcceptanceWindow, CostWindow, WindowBatch

__all__ = ["ACCEPTANCE_MONITOR", "COST_MONITOR", "FIRST_DRAFT_MONITOR", "AlertConfig", "AlertManager", "MonitorConfig"]

log = logging.getLogger(__name__)

MonitorKey = tuple[str, str, str, str, int]  # target, draft, request type or batch bucket, context bucket, k
ANY_K = -1  # the k part of a first-draft monitor's key: it pools every k
# Rows are fed one by one; a window claiming more (the wire allows any int64 count) is forged, not a measurement.
# A real window holds batch x rounds rows: 512 x 2,000 at most at a 1 s window.
MAX_ROWS_PER_WINDOW = 1 << 20


# statistic -> (what it is, where it was watched ({k}: the alert's k), the unit of its sample counts)
STATISTIC_WORDS: dict[str, tuple[str, str, str]] = {
    ACCEPTANCE_STATISTIC: ("acceptance rate", "at k={k}", "rows"),
    FIRST_DRAFT_STATISTIC: ("first-draft acceptance", "across every k", "rows"),
    COST_STATISTIC: ("seconds per verified token", "at largest k={k}", "windows"),
}


@dataclass(frozen=True)
class MonitorConfig:
    """How one kind of statistic is watched (see :mod:`controller.service.alerts.detectors` for the choice)."""

    detector: DetectorSpec  # the river detector and its parameters
    history: int  # samples kept per bucket to locate the change point; far above the detection delay
    min_before: int  # samples of the old level needed before a change is alerted (a young bucket is learning)
    min_relative_shift: float  # |after - before| / before below this is counted, not alerted
    # A detection is held this many windows, then tested window by window (see BucketMonitor); 0: raised at once.
    confirm_windows: int = 0
    confirm_z: float = 4.0  # the test's threshold (see controller.service.alerts.detectors.stretch_z)

    def __post_init__(self) -> None:
        if self.history < 2 or self.min_before < 1:
            raise ValueError("MonitorConfig.history must be >= 2 and min_before >= 1")
        if self.confirm_windows < 0 or not self.confirm_z > 0:
            raise ValueError("MonitorConfig.confirm_windows must be >= 0 and confirm_z > 0")
        if not 0.0 <= self.min_relative_shift < 1.0:
            raise ValueError("MonitorConfig.min_relative_shift must lie in [0, 1)")


# One sample per row (accepted / k). delta 1e-3, clock 16: see the detectors module for the measured figures.
# Detections are confirmed across 12 windows (3 s at the emitter's 0.25 s) at 3.5 (as a normal deviate) of the
# level's own swings over stretches that long (see BucketMonitor). Replayed on rows recorded from the xl engine at
# a steady load of 4 then 16 (6 minutes, static k=3, nothing changing), without a cool-down: rows alone raised
# 36-43 alerts per seed, confirmed 0 over three seeds; the demo's silent drift is still raised 4-6 s after it.
CONFIRM_WINDOWS, CONFIRM_Z = 12, 3.5
ACCEPTANCE_MONITOR = MonitorConfig(
    detector=DetectorSpec("adwin", {"delta": 1e-3, "clock": 16}), history=4096, min_before=500,
    min_relative_shift=0.05, confirm_windows=CONFIRM_WINDOWS, confirm_z=CONFIRM_Z,
)
# One sample per row (1: its first draft accepted, else 0), pooled over k. delta 1e-4, ten times stricter than
# the per-k monitor's: its samples are as many (one per row), and the per-k monitors already catch drifts while
# k holds still, so this one is tuned to add almost no false alarms; a drift that moves k is large (the demo's
# schema switch: 0.95 -> 0.78) and is caught within a few hundred rows anyway. See ``spectune bench drift``.
FIRST_DRAFT_MONITOR = MonitorConfig(
    detector=DetectorSpec("adwin", {"delta": 1e-4, "clock": 16}), history=4096, min_before=500,
    min_relative_shift=0.05, confirm_windows=CONFIRM_WINDOWS, confirm_z=CONFIRM_Z,
)
# One sample per window (log seconds per verified token); clock 1 since windows are few.
COST_MONITOR = MonitorConfig(
    detector=DetectorSpec("adwin", {"delta": 1e-3, "clock": 1}), history=1024, min_before=30,
    min_relative_shift=0.10,
)


@dataclass(frozen=True)
class AlertConfig:
    """The alert manager's settings."""

    acceptance: MonitorConfig = ACCEPTANCE_MONITOR
    first_draft: MonitorConfig | None = FIRST_DRAFT_MONITOR  # None: no monitor across k
    cost: MonitorConfig = COST_MONITOR
    cooldown_s: float = 600.0  # per (kind, bucket, k): at most one alert per 10 minutes of window time
    same_change_rel_tol: float = 0.10  # an acked alert covers later detections whose level after is this close
    registry_flush_s: float = 5.0  # window-time seconds between writes of the registry's counts
    seed: int = 0  # the order rows of one window are fed in (a histogram has no order; sorted would be a ramp)

    def __post_init__(self) -> None:
        if self.cost.detector.name in BOUNDED_DETECTORS:
            raise ValueError(f"detector {self.cost.detector.name!r} needs samples in [0, 1]; cost samples are log "
                             "seconds, so choose adwin or page_hinkley for cost")
        if self.cooldown_s < 0 or self.registry_flush_s < 0:
            raise ValueError("AlertConfig.cooldown_s and registry_flush_s must be >= 0")
        if not 0.0 <= self.same_change_rel_tol < 1.0:
            raise ValueError("AlertConfig.same_change_rel_tol must lie in [0, 1)")


class AlertManager:
    """Watches the windows the sidecar ingests and raises alerts: ``model_update``, ``acceptance_drift``,
    ``cost_drift`` (the vocabulary is :mod:`telemetry.alerts`).

    Args:
        config: detectors, cool-down, tolerances.
        store: the ``alerts`` table and the model-version registry; None keeps both in memory (alerts then
            have no id and cannot be acked).
        sinks: told of every raised alert, in order, after the store.
    """

    def __init__(
        self, config: AlertConfig | None = None, *, store: AlertStore | None = None, sinks: Sequence[AlertSink] = (),
    ) -> None:
        self.config = config or AlertConfig()
        self._store = store
        self._sinks = list(sinks)
        self._registry = ModelRegistry(store, self.config.registry_flush_s)
        self._rng = random.Random(self.config.seed)
        self._first_rng = random.Random(self.config.seed + 1)  # its own, so the per-k samples keep their order
        self._acceptance: dict[MonitorKey, BucketMonitor] = {}
        self._first_draft: dict[MonitorKey, BucketMonitor] = {}
        self._cost: dict[MonitorKey, BucketMonitor] = {}
        self._last_alert: dict[tuple[str, str, int | None], float] = {}  # cool-down key -> last alert's time
        self._levels: dict[int, tuple[float, ...]] = {}  # k -> (0/k, 1/k, ..., k/k), shared float objects
        self.stats: Counter[str] = Counter()  # raised_<kind>, suppressed_*, skipped_<reason>, failures

    @property
    def store(self) -> AlertStore | None:
        """The ``alerts`` table this manager writes (None: alerts kept in memory only); ``GET /alerts`` reads it."""
        return self._store

    # ----------------------------------------------------------------------------------------- entry points
    def observe_batch(self, batch: WindowBatch) -> list[Alert]:
        """Everything in one new batch: its model versions, then each acceptance and cost window."""
        out = self.observe_versions(batch)
        for a in batch.acceptance:
            if (alert := self.observe_acceptance(a, batch.window_end)) is not None:
                out.append(alert)
        for c in batch.cost:
            if (alert := self.observe_cost(c, batch.window_end)) is not None:
                out.append(alert)
        return out

    def observe_versions(self, batch: WindowBatch) -> list[Alert]:
        """Count the batch's windows per model pair; a ``model_update`` for each pair new to the registry."""
        try:
            found = self._registry.observe(batch)
        except StoreError as e:
            self.stats["failures"] += 1
            log.error("model-version registry failed: %s", e)
            return []
        return [a for a in (self._raise(x) for x in found) if a is not None]

    def observe_acceptance(self, window: AcceptanceWindow, at: float) -> Alert | None:
        """Feed one acceptance window (its rows) to its bucket's per-k monitor and to its monitor across k.

        Args:
            window: the window; k = 0 windows carry no acceptance and are skipped.
            at: the window's time (its batch's ``window_end``).

        Returns:
            The alert raised, if any (the per-k monitor's first: it is the more precise; the cool-down keeps a
            second one for the same bucket from being raised).
        """
        k = window.k
        if k < 1 or window.rows < 1:
            self.stats["skipped_no_drafts"] += 1
            return None
        if len(window.hist) != k + 1 or any(h < 0 for h in window.hist) or sum(window.hist) != window.rows:
            self.stats["skipped_bad_hist"] += 1
            return None
        if window.rows > MAX_ROWS_PER_WINDOW:
            self.stats["skipped_implausible"] += 1
            return None
        levels = self._levels.get(k) or self._levels.setdefault(k, tuple(i / k for i in range(k + 1)))
        samples = [levels[i] for i, n in enumerate(window.hist) for _ in range(n)]
        self._rng.shuffle(samples)
        key = (window.target_version, window.draft_version, window.request_type, window.context_bucket, k)
        bucket = f"{key[0]}|{key[1]}|{key[2]}|*|{key[3]}"
        monitor = self._monitor(self._acceptance, key, self.config.acceptance, None)
        change = monitor.add(samples, at)
        raised = None
        if change is not None:
            raised = self._on_change(ACCEPTANCE_DRIFT, bucket, window.target_version, window.draft_version, k,
                                     change, monitor, self.config.acceptance, ACCEPTANCE_STATISTIC)
        if (cfg := self.config.first_draft) is not None:
            first = [0.0] * window.hist[0] + [1.0] * (window.rows - window.hist[0])
            self._first_rng.shuffle(first)
            monitor = self._monitor(self._first_draft, (*key[:4], ANY_K), cfg, None)
            change = monitor.add(first, at)
            if change is not None:
                alert = self._on_change(ACCEPTANCE_DRIFT, bucket, window.target_version, window.draft_version,
                                        None, change, monitor, cfg, FIRST_DRAFT_STATISTIC)
                raised = raised or alert
        return raised

    def observe_cost(self, window: CostWindow, at: float) -> Alert | None:
        """Feed one cost window (its seconds per verified token) to its bucket's detector."""
        work = window.draft_s.total + window.verify_s.total
        if window.tokens_verified < 1 or not math.isfinite(work) or work <= 0:
            self.stats["skipped_no_cost"] += 1
            return None
        key = (window.target_version, window.draft_version, str(window.batch_bucket), window.context_bucket,
               window.max_k)
        monitor = self._monitor(self._cost, key, self.config.cost, math.log)
        change = monitor.add([work / window.tokens_verified], at)
        if change is None:
            return None
        bucket = f"{key[0]}|{key[1]}|*|{key[2]}|{key[3]}"
        return self._on_change(COST_DRIFT, bucket, window.target_version, window.draft_version, window.max_k,
                               change, monitor, self.config.cost, COST_STATISTIC)

    def flush(self) -> None:
        """Write the registry's pending counts."""
        try:
            self._registry.flush()
        except StoreError as e:
            self.stats["failures"] += 1
            log.error("model-version registry flush failed: %s", e)

    def close(self) -> None:
        """Flush and close the sinks (the store is the caller's to close)."""
        self.flush()
        for s in self._sinks:
            s.close()

    # ------------------------------------------------------------------------------------------- internals
    def _monitor(
        self, monitors: dict[MonitorKey, BucketMonitor], key: MonitorKey, cfg: MonitorConfig,
        transform: Callable[[float], float] | None,
    ) -> BucketMonitor:
        m = monitors.get(key)
        if m is None:
            m = monitors[key] = BucketMonitor(cfg.detector, cfg.history, transform, cfg.confirm_windows, cfg.confirm_z)
        return m

    def _on_change(
        self, kind: str, bucket: str, target: str, draft: str, k: int | None, change: Change,
        monitor: BucketMonitor, cfg: MonitorConfig, statistic: str,
    ) -> Alert | None:
        self.stats[f"detections_{kind}"] += 1
        if not change.confirmed:
            self.stats["suppressed_unconfirmed"] += 1
            return None
        if change.before_count < cfg.min_before:
            self.stats["suppressed_young_bucket"] += 1
            return None
        shift = (change.after - change.before) / change.before if change.before else math.inf
        if abs(shift) < cfg.min_relative_shift:
            self.stats["suppressed_small_shift"] += 1
            return None
        verb = "rose" if shift > 0 else "fell"
        what, where, unit = STATISTIC_WORDS[statistic]
        where = where.format(k=k)
        alert = Alert(
            kind=kind, bucket=bucket, k=k, target_version=target, draft_version=draft,
            detected_at=change.detected_at, change_at=change.change_at, statistic=statistic,
            before=change.before, before_count=change.before_count, after=change.after,
            after_count=change.after_count, count_unit=unit, detector=monitor.detector,
            message=(f"{what} of {bucket} {where} {verb} {abs(shift):.0%}: {change.before:.4g} over "
                     f"{change.before_count} {unit} -> {change.after:.4g} over {change.after_count} {unit}"),
        )
        return self._raise(alert)

    def _raise(self, alert: Alert) -> Alert | None:
        """Cool-down, acked-change check, store, sinks: the one path every alert takes."""
        ck = (alert.kind, alert.bucket, None if alert.kind == ACCEPTANCE_DRIFT else alert.k)
        last = self._last_alert.get(ck)
        if last is not None and alert.detected_at - last < self.config.cooldown_s:
            self.stats["suppressed_cooldown"] += 1
            return None
        if self._store is not None:
            try:
                if self._store.acked_same_change(alert, self.config.same_change_rel_tol) is not None:
                    self.stats["suppressed_acked"] += 1
                    self._last_alert[ck] = alert.detected_at
                    return None
                alert = self._store.add(alert)
            except StoreError as e:  # still tell the sinks: an alert without an id beats no alert
                self.stats["failures"] += 1
                log.error("storing alert (%s, %s) failed: %s", alert.kind, alert.bucket, e)
        self._last_alert[ck] = alert.detected_at
        self.stats[f"raised_{alert.kind}"] += 1
        for s in self._sinks:
            s.emit(alert)
        return alert
