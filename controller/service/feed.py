"""What the sidecar learns from: its consumer's batches (or, with a lease, the store's windows), and the alerts.

1. :meth:`telemetry.ingest.Consumer.step` reads a batch of entries from the transport, dead-letters invalid ones
   with their reason, stores the valid ones idempotently and returns only the new ones;
2. each acceptance and cost window of those goes to ``policy.observe`` (a window the policy refuses is counted
   by reason, never fatal) and to the Prometheus series, then, when the sidecar has an
   :class:`~controller.service.alerts.AlertManager`, the batch goes to it: the alerts it raises are stored and told
   to its sinks, and an ``acceptance_drift`` re-opens that bucket's exploration (:meth:`policies.base.Policy.reopen`).
   An alert failure is counted, never raised into the loop.

With a lease every sidecar's policy learns from the *store*, not from its own consumer: a
:class:`~telemetry.window_feed.WindowFeed` hands it each window any consumer committed, once, in commit order (the
own consumer's windows go to the Prometheus series and the alerts only, so nothing is observed twice), so that a
follower is a warm standby. Without a lease the policy learns from the consumer's batches directly.

Restart: the consumer group redelivers what was not acknowledged (stores ingest each ``(engine_id, seq)`` once);
the policy is warmed by replaying the newest stored windows, so a restarted sidecar does not fall back to its
priors.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from controller.service.config import SidecarConfig
from controller.service.decider import Decider
from controller.service.faults import SIDECAR_LOGGER, Faults
from controller.service.metrics import SidecarMetrics
from telemetry.alerts import ACCEPTANCE_DRIFT, Alert
from telemetry.cardinality import CardinalityGate
from telemetry.errors import StoreError, TransportError
from telemetry.ingest import Consumer
from telemetry.records import AcceptanceWindow, CostWindow, WindowBatch
from telemetry.store import Store
from telemetry.transport import Transport
from telemetry.window_feed import WindowFeed

if TYPE_CHECKING:
    from controller.service.alerts import AlertManager

PEER_ALERTS_EVERY_S = 1.0  # with a lease: how often the alerts other sidecars stored are read (re-opening)
PEER_ALERTS_READ = 200  # newest acceptance_drift alerts read each time
ALERTS_KEEP = 1000  # alerts this sidecar raised kept in memory for the demo and the HTTP endpoint
CAPS_RECENT_S = 60.0  # health: a label cap refused windows this recently

log = logging.getLogger(SIDECAR_LOGGER)


class Feed:
    """The consumer, the label caps, the store feed, the alerts, and the windows stream's upkeep.

    Args:
        config: the consumer, the caps, the store feed and the trim interval.
        transport: the windows transport.
        store: where the consumer stores windows (and, with ``from_store``, where the policy reads them).
        decider: what learns from the windows.
        metrics: the ingestion, label and stream series.
        faults: where failures and refused windows are counted.
        lock: the sidecar's lock, held while the policy learns.
        alerts: watches every new batch (None: no alerts).
        from_store: the policy learns every consumer's windows from the store (with a lease).
    """

    def __init__(self, config: SidecarConfig, transport: Transport, store: Store, decider: Decider,
                 metrics: SidecarMetrics, faults: Faults, lock: threading.RLock, *,
                 alerts: AlertManager | None = None, from_store: bool = False) -> None:
        self.config = config
        self.transport = transport
        self.store = store
        self.decider = decider
        self.metrics = metrics
        self.faults = faults
        self._lock = lock
        self.alerts = alerts
        self.gate = CardinalityGate(config.limits)  # fed by the consumer, seeded by the start-up replay
        self.consumer = Consumer(transport, store, config.consumer, gate=self.gate)
        self.store_feed = WindowFeed(store, config.feed) if from_store else None
        self._feed_ready = False  # the feed's start position is set (by the replay, or at the store's top)
        self.recent_alerts: list[Alert] = []  # raised by this sidecar, newest last (the demo's report)
        self._peer_alerts_after: int | None = None  # the newest stored alert id already considered (with a lease)
        self._next_peer_alerts = 0.0
        self.alert_failures = 0  # batches the alert manager raised on, and re-opens the policy refused
        self.reopened = 0  # buckets re-opened after an acceptance drift
        self.windows_ingested = 0
        self.windows_observed = 0
        self._consumer_rejected: dict[str, int] = {}
        self._cap_hits_seen = 0  # windows the gate refused, as of the last step
        self.caps_hit_at: float | None = None  # monotonic time a cap last refused a window
        self._next_trim = 0.0
        self.streams: dict[str, int] = {}  # entries per stream, as of the last trim
        self.trimmed = 0  # stream entries trimmed after every consumer group acknowledged them
        self.evicted: dict[str, int] = {}  # labels evicted from the caps by ones with more evidence, per kind

    # ------------------------------------------------------------------------------------------ start-up
    def replay(self, n: int) -> None:
        """Warm the policy with the newest ``n`` stored windows; the store feed goes on after them."""
        try:
            acc, cost = self.store.recent_windows(n)
        except StoreError as e:
            self.faults.error(e)
            return
        if self.store_feed is not None:  # the feed goes on after what was replayed
            self.store_feed.start_after([w.id for w in acc], [w.id for w in cost])
            self._feed_ready = True
        windows: list[tuple[float, AcceptanceWindow | CostWindow]] = [(w.window_end, w.window) for w in acc]
        windows += [(w.window_end, w.window) for w in cost]
        windows.sort(key=lambda x: x[0])
        with self._lock:
            for _, w in windows:
                if self.gate.admit(w) is None:  # stored before the caps were lowered: kept, not learned from
                    self._observe_window(w, count_metrics=False)
            self._apply_evictions()

    # ------------------------------------------------------------------------------------------ ingesting
    def ingest(self) -> int:
        """One consumer step: store what arrived, learn from it (without a store feed), count it, watch it for
        alerts. Returns the number of new window batches."""
        batches = self.consumer.step()
        self._sync_consumer_rejections()
        with self._lock:
            self._apply_evictions()  # before the batches: their windows may be of a label just admitted
            for b in batches:
                self._observe_batch(b, learn=self.store_feed is None)  # with a feed the policy learns from the store
        self.windows_ingested += len(batches)
        if batches:
            self.metrics.windows_ingested.inc(len(batches))
        return len(batches)

    def poll(self, raise_errors: bool = False) -> int:
        """Feed the policy the windows committed to the store since the last poll (every consumer's); returns
        how many. A store failure is counted (raised with ``raise_errors``); the next poll reads them again."""
        if self.store_feed is None:
            return 0
        try:
            if not self._feed_ready:
                self.store_feed.start_at_top()
                self._feed_ready = True
            windows = self.store_feed.windows()
        except StoreError as e:
            if raise_errors:
                raise
            self.faults.error(e)
            return 0
        with self._lock:
            for w in windows:
                if self.gate.admit(w) is None:  # as the replay: labels past the caps are stored, not learned
                    self._observe_window(w, count_metrics=False)
            self._apply_evictions()
        return len(windows)

    def _apply_evictions(self) -> None:
        """Labels the gate evicted for ones with more evidence leave the buckets, the policy and the series
        (call with the lock held): their entries drop out of the next table."""
        hits = sum(self.gate.cap_hits.values())
        if hits > self._cap_hits_seen:
            self._cap_hits_seen, self.caps_hit_at = hits, time.monotonic()
        for e in self.gate.take_evictions():
            rtype = e.request_type or ""
            label = f"versions {e.versions[0]}/{e.versions[1]}" if e.versions is not None else f"request type {rtype!r}"
            try:
                self.decider.forget(request_type=e.request_type, versions=e.versions)
            except Exception as exc:  # a policy bug must not stop ingestion
                self.faults.error(exc)
            if e.request_type is not None:
                self.metrics.forget_request_type(e.request_type)
            self.evicted[e.kind] = self.evicted.get(e.kind, 0) + 1
            self.metrics.on_label_evicted(e.kind)
            log.warning("%s evicted from the label caps by a label with more evidence; no longer learned", label)

    def _observe_batch(self, b: WindowBatch, learn: bool = True) -> None:
        """A batch this sidecar's consumer stored: to the policy (``learn``; else the feed brings it) and to
        the Prometheus series, the engine's own drop count and the alerts."""
        for a in b.acceptance:
            if learn:
                self._observe_window(a)
            else:
                self.metrics.on_acceptance(a)
        for c in b.cost:
            if learn:
                self._observe_window(c)
            else:
                self.metrics.on_cost()
        if b.dropped_before:
            self.faults.reject("engine_dropped_windows", b.dropped_before)
        if self.alerts is not None:
            self._watch(self.alerts, b)

    def _observe_window(self, w: AcceptanceWindow | CostWindow, count_metrics: bool = True) -> None:
        if not self.decider.learn(w):
            return
        if count_metrics:
            if isinstance(w, AcceptanceWindow):
                self.metrics.on_acceptance(w)
            else:
                self.metrics.on_cost()
        self.windows_observed += 1

    def _sync_consumer_rejections(self) -> None:
        now = self.consumer.stats().rejected
        for reason, n in now.items():
            delta = n - self._consumer_rejected.get(reason, 0)
            if delta > 0:
                self.faults.reject(reason, delta)
        self._consumer_rejected = now

    # --------------------------------------------------------------------------------------------- alerts
    def _watch(self, alerts: AlertManager, b: WindowBatch) -> None:
        """Alerts for a new batch (stored and sent by the manager); an acceptance drift re-opens its bucket."""
        try:
            raised = alerts.observe_batch(b)
        except Exception as e:  # the manager counts its store's and sinks' faults; anything else is counted here
            self.alert_failures += 1
            self.faults.error(e)
            return
        for a in raised:
            if a.kind == ACCEPTANCE_DRIFT:
                self._reopen(a)
        self.recent_alerts += raised
        del self.recent_alerts[:-ALERTS_KEEP]

    def reopen_from_peers(self) -> None:
        """With several sidecars each detector sees only its own consumer's share of the windows, so a drift may
        be raised by any of them: every sidecar re-opens the buckets of ``acceptance_drift`` alerts its peers
        stored (its own were re-opened when raised), at most every ``PEER_ALERTS_EVERY_S``."""
        store = self.alerts.store if self.alerts is not None else None
        now = time.monotonic()
        if store is None or now < self._next_peer_alerts:
            return
        self._next_peer_alerts = now + PEER_ALERTS_EVERY_S
        try:
            newest = store.list_alerts(limit=PEER_ALERTS_READ, kind=ACCEPTANCE_DRIFT)
        except StoreError as e:
            self.faults.error(e)
            return
        if self._peer_alerts_after is None:  # start from what is stored now: older drifts are the past
            self._peer_alerts_after = max((a.id or 0 for a in newest), default=0)
            return
        mine = {a.id for a in self.recent_alerts}
        fresh = [a for a in reversed(newest) if (a.id or 0) > self._peer_alerts_after and a.id not in mine]
        self._peer_alerts_after = max([self._peer_alerts_after, *(a.id or 0 for a in newest)])
        with self._lock:
            for a in fresh:
                self._reopen(a)

    def _reopen(self, a: Alert) -> None:
        try:
            self.decider.reopen(a)
        except Exception as e:  # a policy bug or an odd label must not stop ingestion
            self.alert_failures += 1
            self.faults.error(e)
            return
        self.reopened += 1

    def alerts_health(self) -> dict[str, Any] | None:
        """The alerts raised per kind, the failures and the re-opened buckets (None: no alerts)."""
        if self.alerts is None:
            return None
        return {"raised": dict(sorted((k[len("raised_"):], n) for k, n in self.alerts.stats.items()
                                      if k.startswith("raised_"))),
                "failures": self.alert_failures + self.alerts.stats["failures"], "reopened": self.reopened}

    # ---------------------------------------------------------------------------------------------- upkeep
    def trim(self, now: float) -> bool:
        """Every ``trim_every_s`` (monotonic ``now``), trim the windows stream below what every consumer group
        acknowledged (stored), and read the streams' lengths: without this Redis would hold every window ever
        sent, up to the stream's MAXLEN. Returns whether it trimmed."""
        if now < self._next_trim:
            return False
        self._next_trim = now + self.config.trim_every_s
        try:
            n = self.transport.trim_acknowledged()
            self.streams = self.transport.stream_lengths()
        except TransportError as e:
            self.faults.error(e)
            return False
        self.trimmed += n
        self.metrics.on_streams(n, self.streams)
        return True

    def caps_hit_recently(self, now: float) -> bool:
        """A label cap refused a window within ``CAPS_RECENT_S`` (monotonic ``now``)."""
        return self.caps_hit_at is not None and now - self.caps_hit_at <= CAPS_RECENT_S
