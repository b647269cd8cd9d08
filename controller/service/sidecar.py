"""The sidecar: consume window batches, store them, feed the policy, publish a new policy version on change.

One loop (:meth:`Sidecar.step`, run on a thread or as the ``spectune sidecar`` process):

1. :meth:`telemetry.ingest.Consumer.step` reads a batch of entries from the transport, dead-letters invalid ones
   with their reason, stores the valid ones idempotently and returns only the new ones;
2. each acceptance and cost window of those goes to ``policy.observe`` (a window the policy refuses is counted
   by reason, never fatal) and to the Prometheus series, then, when the sidecar has an
   :class:`~controller.service.alerts.AlertManager`, the batch goes to it: the alerts it raises are stored and told
   to its sinks, and an ``acceptance_drift`` re-opens that bucket's exploration (:meth:`policies.base.Policy.reopen`).
   An alert failure is counted, never raised into the loop;
3. every ``publish_every_windows`` windows or ``publish_every_s`` seconds the sidecar asks the policy for k in
   every bucket seen (versions x request types x batch buckets x context buckets) whose cell had traffic lately
   (a quiet bucket keeps its last k, so a decision costs what the traffic does, not what was ever seen; the
   labels tracked are capped by :class:`~telemetry.cardinality.CardinalityLimits`), applies the operators' pins
   (a pin overrides the policy), and when any k changed stores a new :class:`~telemetry.records.PolicyTable`
   version in SQL with the reason, then publishes it (Redis, or an in-process callback).

Restart: the consumer group redelivers what was not acknowledged (stores ingest each ``(engine_id, seq)`` once);
the version counter continues from the latest stored version; the policy is warmed by replaying the newest
stored windows, so a restarted sidecar does not fall back to its priors.

Several sidecars (scale-out): ingestion scales out through the consumer group (each consumer stores its share);
deciding does not. With a :class:`~controller.service.lease.Lease`, exactly one sidecar at a time, the
**leader**, decides and publishes; the others (followers) ingest, never touch the engines' key, and answer
``publish_now`` with None (a pin they store is applied by the leader on its next tick). In this mode every
sidecar's policy learns from the *store*, not from its own consumer: a :class:`~telemetry.window_feed.WindowFeed`
hands it each window any consumer committed, once, in commit order (the own consumer's windows go to the
Prometheus series and the alerts only, so nothing is observed twice). Followers are thus warm standbys: when the
leader dies its lease lapses, a follower takes it, reads the feed to its end and adopts the store's newest table
and version before its first decision. The store fences a stale leader: a version a peer already stored is
refused, and a sidecar whose lease Redis no longer confirms steps down instead of retrying with the next number.
Without a lease (the embedded mode, ``--no-lease``) the sidecar is always the leader and learns from its
consumer's batches directly.

Versions come from the SQL store, the sidecar's own truth, never from what sits in Redis. On every decision tick
the sidecar checks that the engines' key holds the store's newest table and re-publishes it when it is missing
or older (Redis restarted empty, flushed, or was down when the table was made). A table there whose version is
ahead of the store was not made by any sidecar of this store (forged, or another deployment's): it is reported
(log line, ``spectune_policy_version_ahead_total``, ``policy_version_ahead`` in :meth:`Sidecar.health`), never
adopted, and replaced by the store's newest table.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controller.service.lease import Lease
from controller.service.metrics import SidecarMetrics
from controller.service.publish import FencedError, Publisher
from policies.base import Decision, Policy, cell_key
from telemetry.alerts import ACCEPTANCE_DRIFT, Alert
from telemetry.cardinality import CardinalityGate, CardinalityLimits
from telemetry.errors import SpectuneError, StoreError, TransportError
from telemetry.ingest import Consumer, ConsumerConfig
from telemetry.policy_table import MAX_REASON_CHARS, check_table_size
from telemetry.records import (
    MAX_DRAFT_LEN,
    WILDCARD,
    AcceptanceWindow,
    Bucket,
    CostWindow,
    PolicyTable,
    RecordError,
    WindowBatch,
)
from telemetry.store import Pin, Store
from telemetry.transport import Transport
from telemetry.window_feed import WindowFeed, WindowFeedConfig
from telemetry.wire import parse_bucket_key

if TYPE_CHECKING:
    from controller.service.alerts import AlertManager

PEER_ALERTS_EVERY_S = 1.0  # with a lease: how often the alerts other sidecars stored are read (re-opening)
PEER_ALERTS_READ = 200  # newest acceptance_drift alerts read each time
HISTORY_KEEP = 1000  # decisions kept in memory for the demo and the HTTP endpoint
ERROR_BACKOFF_S = 0.5  # pause after an unexpected error, so a persistent fault is not a busy loop
MAX_CATCH_UP_POLLS = 1000  # a new leader reads the feed to its end before deciding, at most this many pages
DECISION_TIMES_KEPT = 256  # recent decision durations kept for health's p99
LEASE_CHURN_WINDOW_S = 300.0  # health: the leader lease lost ...
LEASE_CHURN_LOSSES = 3  # ... this many times within the window is churn
CAPS_RECENT_S = 60.0  # health: a label cap refused windows this recently

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SidecarConfig:
    """How often the sidecar decides, and what it replays at start-up."""

    publish_every_windows: int = 16  # decide after this many new windows ...
    publish_every_s: float = 1.0  # ... or this many seconds (also how soon a pin made in SQL takes effect)
    warm_start_windows: int = 20_000  # newest stored windows replayed into the policy at start-up (0 = cold)
    max_table_buckets: int = 4096  # cap on exact entries in a table (versions x types x batch x context)
    # A bucket explores only while its cell (versions, batch bucket, context bucket) has traffic: a cost window
    # within the last this-many decisions. Other buckets get the policy's current best without exploration (no
    # rows there to measure a probe, and probing them only churns the table: after a model update the old
    # version's cells would be probed at k=0 and the default k would follow them).
    explore_active_decisions: int = 3
    consumer: ConsumerConfig = field(default_factory=ConsumerConfig)
    # Caps on the request types, buckets and version pairs tracked: windows beyond them are dead-lettered with a
    # reason (telemetry.cardinality), so forged labels cannot grow the policy or the decision time without end.
    limits: CardinalityLimits = field(default_factory=CardinalityLimits)
    # With a lease, how the policy tails the store for the windows every consumer committed.
    feed: WindowFeedConfig = field(default_factory=WindowFeedConfig)
    # A decision stops deciding buckets after this many seconds; the buckets it did not reach keep their last k
    # and go first at the next decision. It must stay well inside the leader lease (renewed between steps), so
    # that no flood of labels can make a decision outlast the lease and stop publishing.
    decide_budget_s: float = 0.5
    # How often the windows stream is trimmed below what every consumer group acknowledged, and the streams'
    # lengths read for health.
    trim_every_s: float = 5.0
    # /health says degraded while more windows than this wait in the stream undelivered (a backlog nobody reads).
    stream_backlog_degraded: int = 100_000

    def __post_init__(self) -> None:
        if self.publish_every_windows < 1:
            raise ValueError(f"SidecarConfig.publish_every_windows must be >= 1, got {self.publish_every_windows}")
        if self.publish_every_s <= 0:
            raise ValueError(f"SidecarConfig.publish_every_s must be > 0, got {self.publish_every_s}")
        if not 0 < self.decide_budget_s <= 60 or not self.trim_every_s > 0 or self.stream_backlog_degraded < 1:
            raise ValueError("SidecarConfig needs 0 < decide_budget_s <= 60, trim_every_s > 0 and "
                             "stream_backlog_degraded >= 1")
        if self.warm_start_windows < 0 or self.max_table_buckets < 1 or self.explore_active_decisions < 1:
            raise ValueError("SidecarConfig needs warm_start_windows >= 0, max_table_buckets >= 1 and "
                             "explore_active_decisions >= 1")


@dataclass(frozen=True)
class PublishedVersion:
    """One published table and the decisions behind it (what the demo and operators look at)."""

    table: PolicyTable
    decisions: dict[str, Decision]  # exact bucket key -> the policy's decision (before pins)
    at: float  # wall-clock seconds


@dataclass
class _Seen:
    types: set[str] = field(default_factory=set)
    batch: set[int] = field(default_factory=set)
    context: set[str] = field(default_factory=set)


BucketParts = tuple[str, str, str, int | None, str]  # parse_bucket_key's answer


def _parts_match(pin: BucketParts, bucket: BucketParts) -> bool:
    """True when every part of the pin equals the bucket's or is ``*``."""
    return all(p in (WILDCARD, None, b) for p, b in zip(pin, bucket, strict=True))


def _specificity(pin: BucketParts) -> int:
    """Parts of a pin that are not ``*``: a more specific pin wins."""
    return sum(p not in (WILDCARD, None) for p in pin)


def apply_pins(entries: dict[str, int], pins: Iterable[Pin]) -> dict[str, int]:
    """Pins override the policy: each entry takes the k of the most specific matching pin (newest on a tie);
    each pin's own key is added so buckets the table does not list fall back to it."""
    pins = list(pins)
    pin_parts = [parse_bucket_key(p.bucket_key) for p in pins]
    out = dict(entries)
    for key in entries:
        parts = parse_bucket_key(key)
        best: tuple[int, int] | None = None
        for i, (p, pp) in enumerate(zip(pins, pin_parts, strict=True)):
            if _parts_match(pp, parts):
                rank = (_specificity(pp), i)
                if best is None or rank > best:
                    best = rank
                    out[key] = p.k
    for p in pins:
        out[p.bucket_key] = p.k
    return out


class Sidecar:
    """Learns k per bucket from the engines' windows and publishes versioned policy tables.

    Args:
        config: timing and start-up settings.
        transport: the sidecar side of the windows transport (Redis Streams or in-process).
        store: the SQL store (windows, policy versions, pins).
        policy: the learning policy (``goodput`` in production).
        publisher: where tables go (Redis or a callback).
        metrics: the Prometheus series (a fresh private registry by default).
        alerts: watches every new batch and raises drift alerts (None: no alerts); the caller closes it.
        lease: the leader lease shared with the other sidecars of this deployment (None: a single sidecar,
            always the leader). The sidecar releases it when :meth:`run` ends; the caller closes it.
    """

    def __init__(self, config: SidecarConfig, transport: Transport, store: Store, policy: Policy,
                 publisher: Publisher, metrics: SidecarMetrics | None = None, *,
                 alerts: AlertManager | None = None, lease: Lease | None = None) -> None:
        self.config = config
        self.transport = transport
        self.store = store
        self.policy = policy
        self.publisher = publisher
        self.metrics = metrics or SidecarMetrics()
        self.alerts = alerts
        self.recent_alerts: list[Alert] = []  # raised by this sidecar, newest last (the demo's report)
        self._peer_alerts_after: int | None = None  # the newest stored alert id already considered (with a lease)
        self._next_peer_alerts = 0.0
        self.alert_failures = 0  # batches the alert manager raised on, and re-opens the policy refused
        self.reopened = 0  # buckets re-opened after an acceptance drift
        self._gate = CardinalityGate(config.limits)  # fed by the consumer, seeded by the start-up replay
        self._consumer = Consumer(transport, store, config.consumer, gate=self._gate)
        self._lock = threading.RLock()  # the policy and the version counter (loop thread vs HTTP threads)
        self._seen: dict[tuple[str, str], _Seen] = {}
        self._decisions = 0  # decisions taken (publish_if_changed calls)
        self._last_traffic: dict[str, int] = {}  # cell key -> self._decisions when its last cost window came
        # bucket key -> the decision a quiet bucket keeps (taken without exploration): only active cells, new
        # buckets and cells that just went quiet are decided on a publish, so its cost follows the traffic
        self._kept: dict[str, Decision] = {}
        self._version = 0
        self._current: PolicyTable | None = None
        self._unpublished: PolicyTable | None = None  # stored but not yet delivered (publisher was down)
        self._publisher_ok = True  # the last attempt to reach the publisher succeeded (health)
        self.version_ahead: dict[str, Any] | None = None  # the last table found ahead of the store (reported)
        self._since_decide = 0
        self._next_tick = 0.0
        self._consumer_rejected: dict[str, int] = {}
        self.history: list[PublishedVersion] = []
        # versions not yet handed to run()'s on_publish (None: no one listens); a queue, not the trimmed history,
        # so a burst of publishes from other threads (pins) between two loop steps is reported whole
        self._to_report: deque[PublishedVersion] | None = None
        self.windows_ingested = 0
        self.windows_observed = 0
        self.rejected: dict[str, int] = {}
        self.errors = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None  # unix seconds of last_error
        self.started_at = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease = lease
        self._leader = lease is None  # decides and publishes; with a lease only after acquiring it
        # with a lease the policy learns every consumer's windows from the store (see the module docstring)
        self._feed = WindowFeed(store, config.feed) if lease is not None else None
        self._feed_ready = False  # the feed's start position is set (by the replay, or at the store's top)
        self._leader_since: float | None = None  # wall-clock seconds this sidecar last became the leader
        self._leader_since_mono: float | None = None
        self._deferred: list[str] = []  # bucket keys the last decision's budget did not reach: first next time
        self._last_decision: dict[str, Decision] = {}  # bucket key -> its latest decision (kept when deferred)
        self._decision_times: deque[float] = deque(maxlen=DECISION_TIMES_KEPT)  # seconds per decision
        self._last_decision_at: float | None = None  # wall-clock seconds of the last decision taken
        self._last_decision_mono: float | None = None
        self._lease_losses: deque[float] = deque(maxlen=LEASE_CHURN_LOSSES)  # monotonic times of the last losses
        self._cap_hits_seen = 0  # windows the gate refused, as of the last step
        self._caps_hit_at: float | None = None  # monotonic time a cap last refused a window
        self._next_trim = 0.0
        self._next_health_gauges = 0.0
        self.streams: dict[str, int] = {}  # entries per stream, as of the last trim
        self.trimmed = 0  # stream entries trimmed after every consumer group acknowledged them
        self.evicted: dict[str, int] = {}  # labels evicted from the caps by ones with more evidence, per kind
        self.metrics.on_leadership(self._leader, changed=False)
        self._resume()

    # --------------------------------------------------------------------------------------- start-up
    def _resume(self) -> None:
        """Continue the version counter from the store, re-deliver its latest table, warm the policy."""
        latest = self.store.latest_policy_version()
        if latest is not None:
            self._version, self._current = latest.version, latest
            self._unpublished = latest  # e.g. Redis was flushed: engines get the last table back
        self._sync_published()  # a leader's only (followers never touch the engines' key)
        if self.config.warm_start_windows:
            self._replay(self.config.warm_start_windows)

    def _replay(self, n: int) -> None:
        try:
            acc, cost = self.store.recent_windows(n)
        except StoreError as e:
            self._error(e)
            return
        if self._feed is not None:  # the feed goes on after what was replayed
            self._feed.start_after([w.id for w in acc], [w.id for w in cost])
            self._feed_ready = True
        windows: list[tuple[float, AcceptanceWindow | CostWindow]] = [(w.window_end, w.window) for w in acc]
        windows += [(w.window_end, w.window) for w in cost]
        windows.sort(key=lambda x: x[0])
        with self._lock:
            for _, w in windows:
                if self._gate.admit(w) is None:  # stored before the caps were lowered: kept, not learned from
                    self._observe_window(w, count_metrics=False)
            self._apply_evictions()

    # ------------------------------------------------------------------------------------------- loop
    def step(self) -> int:
        """One ingestion step, then a decision if one is due. Returns the number of new window batches."""
        batches = self._consumer.step()
        self._sync_consumer_rejections()
        with self._lock:
            self._apply_evictions()  # before the batches: their windows may be of a label just admitted
            for b in batches:
                self._observe_batch(b, learn=self._feed is None)  # with a feed the policy learns from the store
        self.windows_ingested += len(batches)
        if batches:
            self.metrics.windows_ingested.inc(len(batches))
        if self.lease is not None:
            self._follow_lease()
            self._poll_feed()
            self._reopen_from_peers()
        now = time.monotonic()
        if self._leader and (self._since_decide >= self.config.publish_every_windows or now >= self._next_tick):
            self.publish_if_changed("learned")
        elif not self._leader and now >= self._next_tick:
            self._next_tick = now + self.config.publish_every_s
            self._follow_store_version()
        if now >= self._next_trim:
            self._next_trim = now + self.config.trim_every_s
            self._trim_streams()
        if now >= self._next_health_gauges:
            self._next_health_gauges = now + 0.25
            self.metrics.on_degraded(self.degraded_because())
        return len(batches)

    def _follow_store_version(self) -> None:
        """A follower's version is the store's newest (what the leader published), so /health tells the truth."""
        try:
            latest = self.store.latest_policy_version()
        except StoreError as e:
            self._error(e)
            return
        with self._lock:
            if latest is not None and latest.version > self._version and not self._leader:
                self._version, self._current = latest.version, latest

    def _trim_streams(self) -> None:
        """Trim the windows stream below what every consumer group acknowledged (stored), and read the streams'
        lengths: without this Redis would hold every window ever sent, up to the stream's MAXLEN."""
        try:
            n = self.transport.trim_acknowledged()
            self.streams = self.transport.stream_lengths()
        except TransportError as e:
            self._error(e)
            return
        self.trimmed += n
        self.metrics.on_streams(n, self.streams)
        self.metrics.on_degraded(self.degraded_because())

    def run(self, stop: threading.Event | None = None, *, duration_s: float | None = None,
            on_publish: Callable[[PublishedVersion], None] | None = None) -> None:
        """Step until ``stop`` (or :meth:`stop`) is set. Never raises: errors are counted and kept.

        Args:
            stop: ends the loop when set (default: the event :meth:`stop` sets).
            duration_s: also end after this many seconds (None: run until stopped).
            on_publish: called on the loop's thread with each version this sidecar published, oldest first
                (``spectune sidecar`` prints them).
        """
        stop = stop or self._stop
        deadline = None if duration_s is None else time.monotonic() + duration_s
        if on_publish is not None:
            with self._lock:
                self._to_report = deque()
        try:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                try:
                    self.step()
                except Exception as e:  # the loop must outlive any surprise; the error is visible in health()
                    self._error(e)
                    stop.wait(ERROR_BACKOFF_S)
                if on_publish is not None:
                    for pv in self._take_reports():
                        on_publish(pv)
        finally:
            self.release_lease()  # a clean stop: a peer takes over at once, not after the lease's TTL
            if on_publish is not None:
                for pv in self._take_reports():
                    on_publish(pv)
                with self._lock:
                    self._to_report = None

    def _take_reports(self) -> list[PublishedVersion]:
        """The versions published since the last call, oldest first (run()'s ``on_publish`` queue)."""
        with self._lock:
            if not self._to_report:
                return []
            out = list(self._to_report)
            self._to_report.clear()
        return out

    def start(self) -> threading.Thread:
        """Run the loop on a daemon thread (the embedded mode)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="spectune-sidecar", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def drain(self, idle_steps: int = 2, max_steps: int = 1000) -> int:
        """Step until ``idle_steps`` consecutive steps bring nothing new; returns the batches ingested."""
        total, idle = 0, 0
        for _ in range(max_steps):
            n = self.step()
            total += n
            idle = idle + 1 if n == 0 else 0
            if idle >= idle_steps:
                break
        return total

    # ------------------------------------------------------------------------------------------ lease
    def _follow_lease(self) -> None:
        """Renew or try to take the lease; a new leader catches up from the store before deciding."""
        assert self.lease is not None
        leads = self.lease.tick()
        if leads and not self._leader:
            self._take_over()
        elif not leads and self._leader:
            with self._lock:
                self._step_down("lost the leader lease")

    def _take_over(self) -> None:
        """Become the leader: read every window stored so far, then continue from the store's newest table.
        On a store failure this sidecar holds the lease without deciding and tries again next step."""
        assert self.lease is not None
        try:
            for _ in range(MAX_CATCH_UP_POLLS):
                if not self._poll_feed(raise_errors=True):
                    break
                if not self.lease.tick():  # a long catch-up keeps renewing; lost meanwhile: still a follower
                    return
            latest = self.store.latest_policy_version()
        except StoreError as e:
            self._error(e)
            return
        with self._lock:
            if latest is not None and latest.version >= self._version:
                self._version, self._current = latest.version, latest
                self._unpublished = latest  # checked against the engines' key by the next _sync_published
            self._kept = {}  # decided afresh by this policy
            self._next_tick = 0.0  # decide at once
            self._leader = True
            self._leader_since, self._leader_since_mono = time.time(), time.monotonic()
        self.metrics.on_leadership(True, changed=True)
        log.info("leader lease %s acquired: caught up from the store, continuing from v%d", self.lease_key,
                 self._version)

    def _step_down(self, why: str) -> None:
        """Stop deciding and publishing (call with the lock held)."""
        if not self._leader:
            return
        self._leader = False
        self._lease_losses.append(time.monotonic())
        self.metrics.on_leadership(False, changed=True)
        log.warning("%s (%s): following; this sidecar no longer decides nor publishes", why, self.lease_key)

    def _leads(self) -> bool:
        """Whether this sidecar may decide and publish now (the lease's local deadline is checked too)."""
        if self.lease is None:
            return True
        if self._leader and not self.lease.held():
            with self._lock:
                self._step_down("the leader lease lapsed")
        return self._leader

    def release_lease(self) -> None:
        """Give the lease up (a clean stop); a no-op without one. The next :meth:`step` contends again."""
        if self.lease is None:
            return
        with self._lock:
            was, self._leader = self._leader, False
            self.lease.release()
        if was:
            self.metrics.on_leadership(False, changed=False)  # released, not lost
            log.info("leader lease %s released", self.lease_key)

    @property
    def lease_key(self) -> str | None:
        return self.lease.key if self.lease is not None else None

    def _poll_feed(self, raise_errors: bool = False) -> int:
        """Feed the policy the windows committed to the store since the last poll (every consumer's); returns
        how many. A store failure is counted (raised with ``raise_errors``); the next poll reads them again."""
        if self._feed is None:
            return 0
        try:
            if not self._feed_ready:
                self._feed.start_at_top()
                self._feed_ready = True
            windows = self._feed.windows()
        except StoreError as e:
            if raise_errors:
                raise
            self._error(e)
            return 0
        with self._lock:
            for w in windows:
                if self._gate.admit(w) is None:  # as the replay: labels past the caps are stored, not learned
                    self._observe_window(w, count_metrics=False)
            self._apply_evictions()
        return len(windows)

    def _apply_evictions(self) -> None:
        """Labels the gate evicted for ones with more evidence leave the buckets, the policy and the series
        (call with the lock held): their entries drop out of the next table."""
        hits = sum(self._gate.cap_hits.values())
        if hits > self._cap_hits_seen:
            self._cap_hits_seen, self._caps_hit_at = hits, time.monotonic()
        for e in self._gate.take_evictions():
            gone: Callable[[str], bool]
            if e.versions is not None:
                self._seen.pop(e.versions, None)
                prefix = f"{e.versions[0]}|{e.versions[1]}|"
                gone = prefix_of(prefix)
                label = f"versions {e.versions[0]}/{e.versions[1]}"
            else:
                rtype = e.request_type or ""
                for seen in self._seen.values():
                    seen.types.discard(rtype)
                gone = type_of(rtype)
                label = f"request type {rtype!r}"
            self._kept = {k: d for k, d in self._kept.items() if not gone(k)}
            self._last_decision = {k: d for k, d in self._last_decision.items() if not gone(k)}
            self._deferred = [k for k in self._deferred if not gone(k)]
            try:
                self.policy.forget(request_type=e.request_type, versions=e.versions)
            except Exception as exc:  # a policy bug must not stop ingestion
                self._error(exc)
            if e.request_type is not None:
                self.metrics.forget_request_type(e.request_type)
            self.evicted[e.kind] = self.evicted.get(e.kind, 0) + 1
            self.metrics.on_label_evicted(e.kind)
            log.warning("%s evicted from the label caps by a label with more evidence; no longer learned", label)

    # ---------------------------------------------------------------------------------------- learning
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
            self._count_rejected("engine_dropped_windows", b.dropped_before)
        if self.alerts is not None:
            self._watch(self.alerts, b)

    def _watch(self, alerts: AlertManager, b: WindowBatch) -> None:
        """Alerts for a new batch (stored and sent by the manager); an acceptance drift re-opens its bucket."""
        try:
            raised = alerts.observe_batch(b)
        except Exception as e:  # the manager counts its store's and sinks' faults; anything else is counted here
            self.alert_failures += 1
            self._error(e)
            return
        for a in raised:
            if a.kind == ACCEPTANCE_DRIFT:
                self._reopen(a)
        self.recent_alerts += raised
        del self.recent_alerts[:-HISTORY_KEEP]

    def _reopen_from_peers(self) -> None:
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
            self._error(e)
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
        """Widen exploration of the drifted acceptance bucket (``target|draft|type|*|context``)."""
        try:
            _t, _d, rtype, _bb, ctx = parse_bucket_key(a.bucket)
            self.policy.reopen(a.target_version, a.draft_version, rtype, ctx)
        except Exception as e:  # a policy bug or an odd label must not stop ingestion
            self.alert_failures += 1
            self._error(e)
            return
        self.reopened += 1

    def _observe_window(self, w: AcceptanceWindow | CostWindow, count_metrics: bool = True) -> None:
        try:
            self.policy.observe(w)
        except RecordError as e:
            self._count_rejected(e.reason)
            return
        s = self._seen.setdefault((w.target_version, w.draft_version), _Seen())
        if isinstance(w, AcceptanceWindow):
            s.types.add(w.request_type)
            s.context.add(w.context_bucket)
            if count_metrics:
                self.metrics.on_acceptance(w)
        else:
            s.batch.add(w.batch_bucket)
            s.context.add(w.context_bucket)
            self._last_traffic[cell_key(w.target_version, w.draft_version, w.batch_bucket, w.context_bucket)] = (
                self._decisions)
            if count_metrics:
                self.metrics.on_cost()
        self._since_decide += 1
        self.windows_observed += 1

    def _count_rejected(self, reason: str, n: int = 1) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + n
        self.metrics.on_rejected(reason, n)

    def _sync_consumer_rejections(self) -> None:
        now = self._consumer.stats().rejected
        for reason, n in now.items():
            delta = n - self._consumer_rejected.get(reason, 0)
            if delta > 0:
                self._count_rejected(reason, delta)
        self._consumer_rejected = now

    def buckets(self) -> list[Bucket]:
        """Every bucket seen: per version pair, request types x batch buckets x context buckets."""
        all_batch = {bb for s in self._seen.values() for bb in s.batch}
        out: list[Bucket] = []
        for (t, d), s in sorted(self._seen.items()):
            for rt in sorted(s.types):
                for bb in sorted(s.batch or all_batch):
                    for cb in sorted(s.context):
                        out.append(Bucket(t, d, rt, bb, cb))
        return out[: self.config.max_table_buckets]

    # --------------------------------------------------------------------------------------- deciding
    def publish_if_changed(self, trigger: str) -> PolicyTable | None:
        """Decide every bucket, apply pins, and publish a new version if anything changed.

        Args:
            trigger: why this decision was taken (``learned``, ``pin ...``), kept in the version's reason.

        Returns:
            The new table, or None when nothing changed (or it could not be stored).
        """
        with self._lock:
            if not self._leads():
                return None  # a follower never publishes: the leader applies stored pins on its next tick
            self._decisions += 1
            self._since_decide = 0
            self._next_tick = time.monotonic() + self.config.publish_every_s
            self._sync_published()
            buckets = self.buckets()
            t0 = time.perf_counter()
            try:
                decisions = self._decide(buckets)
            except Exception as e:  # a policy bug must not take the sidecar down; the last table stays
                self._count_rejected("policy_error")
                self._error(e)
                return None
            took = time.perf_counter() - t0
            self._decision_times.append(took)
            self._last_decision_at, self._last_decision_mono = time.time(), time.monotonic()
            self.metrics.on_decision(took, len(self._deferred))
            try:
                pins = self.store.active_pins()
            except StoreError as e:
                self._error(e)
                return None
            learned = {key: d.k for key, d in decisions.items()}
            entries = apply_pins(learned, pins)
            if not entries:
                return None  # nothing seen yet: engines stay on their default
            default_k = _most_common(learned.values(), self._current.default_k if self._current else 0)
            cur = self._current
            if cur is not None and cur.entries == entries and cur.default_k == default_k:
                return None
            reason = _describe(cur, entries, default_k, pins, trigger)
            return self._store_and_publish(entries, default_k, reason, decisions)

    def _decide(self, buckets: list[Bucket]) -> dict[str, Decision]:
        """The policy's decision per bucket, within ``decide_budget_s``.

        A bucket whose cell is quiet keeps the decision it got without exploration (the policy would return the
        same incumbent: nothing of that cell moved); active cells, new buckets and buckets that were exploring when
        their cell went quiet are decided. They are decided in order of need: the buckets the last decision's
        budget did not reach, then buckets whose cells have traffic, then new ones, then the rest. Once the budget
        is spent, a bucket still to decide keeps its latest decision (a new one stays out of the table: engines
        give it the default k) and goes first next time, so a flood of labels slows how fast the table follows,
        never whether it is published.
        """
        deferred = set(self._deferred)
        active = {b.key(): self._active(b) for b in buckets}

        def need(b: Bucket) -> int:
            key = b.key()
            return 0 if key in deferred else 1 if active[key] else 2 if key not in self._last_decision else 3

        end = time.perf_counter() + self.config.decide_budget_s
        decisions: dict[str, Decision] = {}
        kept: dict[str, Decision] = {}
        late: list[str] = []
        for b in sorted(buckets, key=need):
            key = b.key()
            d = None if active[key] else self._kept.get(key)
            if d is None:
                if time.perf_counter() >= end:
                    late.append(key)
                    if (prev := self._last_decision.get(key)) is not None:
                        decisions[key] = prev
                    continue
                d = self.policy.decide(b, explore=active[key])
            if not active[key]:
                kept[key] = d
            decisions[key] = d
        decisions = {b.key(): decisions[b.key()] for b in buckets if b.key() in decisions}  # the buckets' order
        self._kept, self._deferred, self._last_decision = kept, late, decisions
        return decisions

    def _active(self, b: Bucket) -> bool:
        """Whether ``b``'s cell had a cost window within the last ``explore_active_decisions`` decisions."""
        last = self._last_traffic.get(cell_key(b.target_version, b.draft_version, b.batch_bucket, b.context_bucket))
        return last is not None and self._decisions - last <= self.config.explore_active_decisions

    def _store_and_publish(self, entries: dict[str, int], default_k: int, reason: str,
                           decisions: dict[str, Decision]) -> PolicyTable | None:
        table: PolicyTable | None = None
        for _attempt in range(3):  # another sidecar may have taken the next version number meanwhile
            # Fencing: right before a version number is taken, Redis must still hold this sidecar's lease (one
            # round trip per publish); a stale leader, e.g. one paused past its lease, steps down here.
            if not self._leads():
                return None
            if not self._lease_confirmed():
                self._step_down("Redis no longer holds this sidecar's lease")
                return None
            table = PolicyTable(version=self._version + 1, default_k=default_k, k_max=self.policy.k_max,
                                entries=entries, created_at=time.time(), reason=reason[:MAX_REASON_CHARS])
            try:
                check_table_size(table)  # engines would refuse it: keep the last table, say why
            except RecordError as e:
                self._count_rejected(e.reason)
                self._error(e)
                return None
            try:
                self.store.save_policy_version(table)
                break
            except StoreError as e:  # a peer may have taken the version; else the store failed (kept, retried)
                latest = _safe_latest(self.store)
                if latest is None or latest.version <= self._version:
                    self._error(e)
                    return None
                # with a lease, the next attempt confirms it first: a stale peer took the number, or we are stale
                self._version = latest.version
        else:
            return None
        assert table is not None
        self._version, self._current = table.version, table
        self.metrics.on_published(table.version, table.entries)
        pv = PublishedVersion(table, decisions, time.time())
        self.history.append(pv)
        del self.history[:-HISTORY_KEEP]
        if self._to_report is not None:
            self._to_report.append(pv)
        self._unpublished = table
        self._sync_published()
        return table

    def _sync_published(self) -> None:
        """Make the engines' key hold the newest stored table this sidecar knows.

        Cheap when all is well (one version read). Re-publishes when the key is missing, unreadable or older
        (a Redis restart or flush, a publish that failed); adopts a newer version only from the store (a peer
        sidecar of the same store made it); reports a version ahead of the store and replaces that table.
        """
        want = self._unpublished or self._current
        if want is None or not self._leads():
            return
        try:
            there = self.publisher.current_version()
            if there is None or there < want.version:
                if self.publisher.publish(want):
                    self._delivered()
                    return
                there = self.publisher.current_version()  # a peer or a forger wrote meanwhile
            if there is not None and there == want.version:
                self._delivered()
                return
            self._newer_than_mine(there)
        except FencedError as e:  # Redis says another sidecar holds the lease: this one follows from now on
            self._error(e)
            self._step_down("a publish was fenced off")
        except TransportError as e:
            self._publisher_ok = False
            self._error(e)

    def _lease_confirmed(self) -> bool:
        """Whether Redis still holds this sidecar's lease (renewed now); True without a lease."""
        if self.lease is None:
            return True
        try:
            return self.lease.renew()
        except TransportError as e:
            self._error(e)
            return False

    def _delivered(self) -> None:
        self._unpublished = None
        self._publisher_ok = True

    def _newer_than_mine(self, there: int | None) -> None:
        """The key holds a version above ours, or junk: a peer's table (in the store) is followed, anything
        else is reported and overwritten with the store's newest table. Raises TransportError."""
        try:
            latest = self.store.latest_policy_version()
        except StoreError as e:  # cannot tell a peer from a forger now; retry next tick
            self._error(e)
            return
        self._publisher_ok = True
        if latest is not None and latest.version > self._version:
            self._version, self._current = latest.version, latest  # a peer sidecar of this store got further
        if there is not None and latest is not None and there <= latest.version:
            self._unpublished = latest if there < latest.version else None
            return
        if there is not None:
            store_v = latest.version if latest is not None else 0
            self.version_ahead = {"version": there, "store_version": store_v, "at": time.time()}
            self.metrics.on_version_ahead()
            log.warning("policy table v%d at the engines' key is ahead of the store (v%d): not made by a sidecar "
                        "of this store (forged, or another deployment's); not adopted, replaced by v%d", there,
                        store_v, store_v)
        if latest is not None:
            self.publisher.publish(latest, force=True)
            self._unpublished = None

    def publish_now(self, trigger: str) -> PolicyTable | None:
        """Decide and publish at once (after a pin change); returns the new table or None if unchanged."""
        return self.publish_if_changed(trigger)

    # ----------------------------------------------------------------------------------------- status
    @property
    def current(self) -> PolicyTable | None:
        return self._current

    @property
    def version(self) -> int:
        return self._version

    @property
    def published(self) -> bool:
        """Whether the engines' key holds this sidecar's newest table (as of the last attempt)."""
        return self._unpublished is None and self._publisher_ok

    def _error(self, e: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(e).__name__}: {e}" if not isinstance(e, SpectuneError) else str(e)
        self.last_error_at = time.time()

    def _lease_health(self) -> dict[str, Any]:
        """The lease and the store feed, for :meth:`health`: who may decide, how often it changed."""
        assert self.lease is not None and self._feed is not None
        ls = self.lease.stats()
        return {"key": self.lease.key, "lease_ms": self.lease.config.lease_ms,
                "leader_since": self._leader_since if self._leader else None, "acquisitions": ls.acquisitions,
                "losses": ls.losses, "failures": ls.failures, "last_error": ls.last_error,
                "feed": self._feed.stats()}

    @property
    def is_leader(self) -> bool:
        """Whether this sidecar decides and publishes now (always, without a lease)."""
        return self._leads()

    def _decision_overdue(self) -> bool:
        """The leader has not taken a due decision within twice the decision interval plus a second."""
        if not self._leader:
            return False
        since = self._last_decision_mono or self._leader_since_mono
        if since is None:
            return False
        return time.monotonic() - since > 2 * self.config.publish_every_s + 1.0

    def degraded_because(self) -> list[str]:
        """Why ``/health`` says degraded (empty: ok). Each reason is also the ``reason`` label of
        ``spectune_sidecar_degraded``."""
        cs = self._consumer.stats()
        now = time.monotonic()
        out = [name for name, ok in (("transport", cs.transport_ok), ("store", cs.store_ok),
                                     ("publisher", self._publisher_ok)) if not ok]
        if self._decision_overdue():
            out.append("decision_overdue")
        if len(self._lease_losses) >= LEASE_CHURN_LOSSES and now - self._lease_losses[0] <= LEASE_CHURN_WINDOW_S:
            out.append("lease_churn")
        if self._caps_hit_at is not None and now - self._caps_hit_at <= CAPS_RECENT_S:
            out.append("label_caps")
        if self.streams.get("unread", 0) > self.config.stream_backlog_degraded:
            out.append("stream_backlog")
        return out

    def _deciding_health(self) -> dict[str, Any]:
        times = sorted(self._decision_times)
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else None
        return {"decisions": self._decisions, "last_at": self._last_decision_at,
                "last_s": round(self._decision_times[-1], 6) if times else None,
                "p99_s": None if p99 is None else round(p99, 6), "budget_s": self.config.decide_budget_s,
                "deferred_buckets": len(self._deferred), "overdue": self._decision_overdue()}

    def health(self) -> dict[str, Any]:
        """A JSON-safe summary for ``GET /health`` and the CLI."""
        cs = self._consumer.stats()
        # "degraded" while a dependency's latest attempt failed or a stuck state holds (degraded_because); the
        # failure counts below stay cumulative.
        healthy = cs.transport_ok and cs.store_ok and self._publisher_ok
        because = self.degraded_because()
        # last_error is the failure in force (None once every dependency answers again); previous_error keeps
        # the latest one with its time, so that an operator sees what happened after the recovery too.
        latest = cs.last_error if not cs.transport_ok or not cs.store_ok else self.last_error or cs.last_error
        return {
            "status": "degraded" if because else "ok",
            "degraded_because": because,
            "policy": self.policy.name,
            "policy_version": self._version,
            "windows_ingested": self.windows_ingested,
            "windows_observed": self.windows_observed,
            "duplicates_skipped": cs.duplicates,
            "claimed_from_dead_consumers": cs.claimed,
            "reclaimed_own": cs.reclaimed,
            "store_refused": cs.refused,
            "rejected": dict(self.rejected),
            "dead_lettered_entries": cs.dead_lettered_entries,
            "transport_failures": cs.transport_failures,
            "store_failures": cs.store_failures,
            "errors": self.errors,
            "last_error": None if healthy else latest,
            "previous_error": None if latest is None else {
                "error": latest, "at": self.last_error_at if latest == self.last_error else None},
            "unpublished_version": self._unpublished.version if self._unpublished else None,
            "publisher_ok": self._publisher_ok,
            "policy_version_ahead": dict(self.version_ahead) if self.version_ahead else None,
            "leader": self._leads(),
            "lease": None if self.lease is None else self._lease_health(),
            "tracked": self._gate.stats(),
            "evicted": dict(self.evicted),
            "deciding": self._deciding_health(),
            "streams": {**self.streams, "trimmed": self.trimmed},
            "alerts": None if self.alerts is None else {
                "raised": dict(sorted((k[len("raised_"):], n) for k, n in self.alerts.stats.items()
                                      if k.startswith("raised_"))),
                "failures": self.alert_failures + self.alerts.stats["failures"], "reopened": self.reopened},
            "uptime_s": round(time.time() - self.started_at, 3),
        }


def prefix_of(prefix: str) -> Callable[[str], bool]:
    """Whether a bucket key is of the version pair ``prefix`` (``"target|draft|"``)."""
    return lambda key: key.startswith(prefix)


def type_of(rtype: str) -> Callable[[str], bool]:
    """Whether a bucket key is of request type ``rtype``."""
    return lambda key: parse_bucket_key(key)[2] == rtype


def _most_common(ks: Iterable[int], fallback: int) -> int:
    tally = Tally(ks)
    if not tally:
        return min(max(fallback, 0), MAX_DRAFT_LEN)
    return max(tally, key=lambda k: (tally[k], -k))  # ties go to the smaller k (the cheaper mistake)


def _safe_latest(store: Store) -> PolicyTable | None:
    try:
        return store.latest_policy_version()
    except StoreError:
        return None


def _describe(cur: PolicyTable | None, entries: dict[str, int], default_k: int, pins: list[Pin],
              trigger: str) -> str:
    """What changed, in a line an operator can read (``k 2->0 in 3 buckets``...)."""
    if cur is None:
        return f"{trigger}: first table, {len(entries)} buckets, default k={default_k}"
    moves: Tally[tuple[int, int]] = Tally()
    for key, k in entries.items():
        old = cur.entries.get(key)
        if old != k:
            moves[(-1 if old is None else old, k)] += 1
    removed = sum(1 for key in cur.entries if key not in entries)
    parts = [f"k {'new' if a < 0 else a}->{b} in {n} bucket{'s' if n > 1 else ''}"
             for (a, b), n in moves.most_common(6)]
    if removed:
        parts.append(f"{removed} buckets removed")
    if default_k != cur.default_k:
        parts.append(f"default k {cur.default_k}->{default_k}")
    if pins:
        parts.append(f"{len(pins)} pin{'s' if len(pins) > 1 else ''} in force")
    return f"{trigger}: " + ("; ".join(parts) or "no change")
