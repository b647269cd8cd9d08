"""The sidecar: consume window batches, store them, feed the policy, publish a new policy version on change.

One loop (:meth:`Sidecar.step`, run on a thread or as the ``spectune sidecar`` process), each part in its own
module:

1. :class:`~controller.service.feed.Feed`: the consumer reads, dead-letters and stores the engines' batches; the
   policy learns their windows (with a lease, every consumer's windows, from the store), the Prometheus series
   count them, and the alert manager watches them;
2. :class:`~controller.service.leadership.Leadership`: with a lease, whether this sidecar is the one that decides;
   a follower that takes the lease over first reads the store feed to its end and adopts the store's newest table
   and version before its first decision;
3. :class:`~controller.service.decider.Decider`: every ``publish_every_windows`` windows or ``publish_every_s``
   seconds, k for every bucket seen, within a time budget, with the operators' pins applied;
4. :class:`~controller.service.tables.TableKeeper`: when any k changed, the next version is stored in SQL with the
   reason, then published (Redis, or an in-process callback); each tick it checks that the engines' key holds the
   store's newest table.

:class:`Sidecar` composes them, holds the lock they share (the loop thread against the operator endpoint's
threads), runs the loop and reports health. Build one, with its transport, store, policy, publisher, lease and
alerts, through :func:`controller.service.build.build_sidecar`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from controller.service.config import SidecarConfig
from controller.service.decider import Decider, apply_pins
from controller.service.faults import SIDECAR_LOGGER, Faults
from controller.service.feed import PEER_ALERTS_EVERY_S, Feed
from controller.service.leadership import LEASE_CHURN_LOSSES, LEASE_CHURN_WINDOW_S, Leadership
from controller.service.lease import Lease
from controller.service.metrics import SidecarMetrics
from controller.service.publish import Publisher
from controller.service.tables import PublishedVersion, TableKeeper
from policies.base import Policy
from telemetry.alerts import Alert
from telemetry.errors import StoreError
from telemetry.records import Bucket, PolicyTable
from telemetry.store import Store
from telemetry.transport import Transport

if TYPE_CHECKING:
    from controller.service.alerts import AlertManager

__all__ = ["LEASE_CHURN_LOSSES", "LEASE_CHURN_WINDOW_S", "PEER_ALERTS_EVERY_S", "PublishedVersion", "Sidecar",
           "SidecarConfig", "apply_pins"]

ERROR_BACKOFF_S = 0.5  # pause after an unexpected error, so a persistent fault is not a busy loop
MAX_CATCH_UP_POLLS = 1000  # a new leader reads the feed to its end before deciding, at most this many pages
HEALTH_GAUGES_EVERY_S = 0.25  # how often the loop refreshes spectune_sidecar_degraded

log = logging.getLogger(SIDECAR_LOGGER)


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

    Its parts: ``feed`` (:class:`~controller.service.feed.Feed`), ``leadership``
    (:class:`~controller.service.leadership.Leadership`), ``decider`` (:class:`~controller.service.decider.Decider`),
    ``tables`` (:class:`~controller.service.tables.TableKeeper`) and ``faults``
    (:class:`~controller.service.faults.Faults`).
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
        self.lease = lease
        self._lock = threading.RLock()  # the policy and the version counter (loop thread vs HTTP threads)
        self.faults = Faults(self.metrics)
        self.decider = Decider(config, policy, store, self.metrics, self.faults)
        self.feed = Feed(config, transport, store, self.decider, self.metrics, self.faults, self._lock,
                         alerts=alerts, from_store=lease is not None)
        self.leadership = Leadership(lease, self.metrics, self.faults, self._lock)
        self.tables = TableKeeper(store, publisher, policy.k_max, self.metrics, self.faults, self.leadership,
                                  self._lock)
        self.started_at = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_health_gauges = 0.0
        self.metrics.on_leadership(self.leadership.leader, changed=False)
        self._resume()

    def _resume(self) -> None:
        """Continue the version counter from the store, re-deliver its latest table, warm the policy."""
        self.tables.resume()
        if self.config.warm_start_windows:
            self.feed.replay(self.config.warm_start_windows)

    # ------------------------------------------------------------------------------------------- loop
    def step(self) -> int:
        """One ingestion step, then a decision if one is due. Returns the number of new window batches."""
        n = self.feed.ingest()
        if self.lease is not None:
            if self.leadership.tick():
                self._take_over()
            self.feed.poll()
            self.feed.reopen_from_peers()
        now = time.monotonic()
        leader = self.leadership.leader
        if leader and self.decider.due(now):
            self.publish_if_changed("learned")
        elif not leader and now >= self.decider.next_tick:
            self.decider.postpone(now)
            self.tables.follow_store()
        if self.feed.trim(now):
            self.metrics.on_degraded(self.degraded_because())
        if now >= self._next_health_gauges:
            self._next_health_gauges = now + HEALTH_GAUGES_EVERY_S
            self.metrics.on_degraded(self.degraded_because())
        return n

    def _take_over(self) -> None:
        """Become the leader: read every window stored so far, then continue from the store's newest table.
        On a store failure this sidecar holds the lease without deciding and tries again next step."""
        assert self.lease is not None
        try:
            for _ in range(MAX_CATCH_UP_POLLS):
                if not self.feed.poll(raise_errors=True):
                    break
                if not self.lease.tick():  # a long catch-up keeps renewing; lost meanwhile: still a follower
                    return
            latest = self.store.latest_policy_version()
        except StoreError as e:
            self._error(e)
            return
        with self._lock:
            self.tables.adopt(latest)
            self.decider.restart()  # decided afresh by this policy, at once
            self.leadership.took_over()
        self.metrics.on_leadership(True, changed=True)
        log.info("leader lease %s acquired: caught up from the store, continuing from v%d", self.lease_key,
                 self.version)

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
            self.tables.start_reports()
        try:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                try:
                    self.step()
                except Exception as e:  # the loop must outlive any surprise; the error is visible in health()
                    self._error(e)
                    stop.wait(ERROR_BACKOFF_S)
                if on_publish is not None:
                    for pv in self.tables.take_reports():
                        on_publish(pv)
        finally:
            self.release_lease()  # a clean stop: a peer takes over at once, not after the lease's TTL
            if on_publish is not None:
                for pv in self.tables.take_reports():
                    on_publish(pv)
                self.tables.stop_reports()

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

    def release_lease(self) -> None:
        """Give the lease up (a clean stop); a no-op without one. The next :meth:`step` contends again."""
        self.leadership.release()

    # --------------------------------------------------------------------------------------- deciding
    def publish_if_changed(self, trigger: str) -> PolicyTable | None:
        """Decide every bucket, apply pins, and publish a new version if anything changed.

        Args:
            trigger: why this decision was taken (``learned``, ``pin ...``), kept in the version's reason.

        Returns:
            The new table, or None when nothing changed (or it could not be stored).
        """
        with self._lock:
            if not self.leadership.leads():
                return None  # a follower never publishes: the leader applies stored pins on its next tick
            self.decider.begin()
            self.tables.sync()
            p = self.decider.propose(self.tables.current, trigger)
            if p is None:
                return None
            return self.tables.store_and_publish(p.entries, p.default_k, p.reason, p.decisions)

    def publish_now(self, trigger: str) -> PolicyTable | None:
        """Decide and publish at once (after a pin change); returns the new table or None if unchanged."""
        return self.publish_if_changed(trigger)

    def buckets(self) -> list[Bucket]:
        """Every bucket seen: per version pair, request types x batch buckets x context buckets."""
        return self.decider.buckets()

    # ----------------------------------------------------------------------------------------- status
    @property
    def current(self) -> PolicyTable | None:
        return self.tables.current

    @property
    def version(self) -> int:
        return self.tables.version

    @property
    def published(self) -> bool:
        """Whether the engines' key holds this sidecar's newest table (as of the last attempt)."""
        return self.tables.published

    @property
    def version_ahead(self) -> dict[str, Any] | None:
        """The last table found at the engines' key ahead of the store (reported, never adopted)."""
        return self.tables.version_ahead

    @property
    def history(self) -> list[PublishedVersion]:
        """The newest versions this sidecar published, oldest first."""
        return self.tables.history

    @property
    def is_leader(self) -> bool:
        """Whether this sidecar decides and publishes now (always, without a lease)."""
        return self.leadership.leads()

    @property
    def lease_key(self) -> str | None:
        return self.leadership.key

    @property
    def recent_alerts(self) -> list[Alert]:
        """Alerts this sidecar raised, newest last (the demo's report)."""
        return self.feed.recent_alerts

    @recent_alerts.setter
    def recent_alerts(self, alerts: list[Alert]) -> None:
        self.feed.recent_alerts = alerts

    @property
    def alert_failures(self) -> int:
        """Batches the alert manager raised on, and re-opens the policy refused."""
        return self.feed.alert_failures

    @property
    def reopened(self) -> int:
        """Buckets re-opened after an acceptance drift."""
        return self.feed.reopened

    @property
    def windows_ingested(self) -> int:
        """New window batches this sidecar's consumer stored."""
        return self.feed.windows_ingested

    @property
    def windows_observed(self) -> int:
        """Windows the policy learned from."""
        return self.feed.windows_observed

    @property
    def rejected(self) -> dict[str, int]:
        """Records refused, per reason."""
        return self.faults.rejected

    @property
    def errors(self) -> int:
        return self.faults.errors

    @property
    def last_error(self) -> str | None:
        return self.faults.last_error

    @property
    def last_error_at(self) -> float | None:
        """Unix seconds of ``last_error``."""
        return self.faults.last_error_at

    def _error(self, e: BaseException) -> None:
        """Count an error (also the operator endpoint's, which reports here)."""
        self.faults.error(e)

    def _decision_overdue(self) -> bool:
        return self.decider.overdue(self.leadership.leader, self.leadership.since_mono)

    def degraded_because(self) -> list[str]:
        """Why ``/health`` says degraded (empty: ok). Each reason is also the ``reason`` label of
        ``spectune_sidecar_degraded``."""
        cs = self.feed.consumer.stats()
        now = time.monotonic()
        out = [name for name, ok in (("transport", cs.transport_ok), ("store", cs.store_ok),
                                     ("publisher", self.tables.publisher_ok)) if not ok]
        if self._decision_overdue():
            out.append("decision_overdue")
        if self.leadership.churning(now):
            out.append("lease_churn")
        if self.feed.caps_hit_recently(now):
            out.append("label_caps")
        if self.feed.streams.get("unread", 0) > self.config.stream_backlog_degraded:
            out.append("stream_backlog")
        return out

    def health(self) -> dict[str, Any]:
        """A JSON-safe summary for ``GET /health`` and the CLI."""
        cs = self.feed.consumer.stats()
        tables = self.tables
        # "degraded" while a dependency's latest attempt failed or a stuck state holds (degraded_because); the
        # failure counts below stay cumulative.
        healthy = cs.transport_ok and cs.store_ok and tables.publisher_ok
        because = self.degraded_because()
        # last_error is the failure in force (None once every dependency answers again); previous_error keeps
        # the latest one with its time, so that an operator sees what happened after the recovery too.
        latest = cs.last_error if not cs.transport_ok or not cs.store_ok else self.last_error or cs.last_error
        return {
            "status": "degraded" if because else "ok",
            "degraded_because": because,
            "policy": self.policy.name,
            "policy_version": tables.version,
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
            "unpublished_version": tables.unpublished.version if tables.unpublished else None,
            "publisher_ok": tables.publisher_ok,
            "policy_version_ahead": dict(tables.version_ahead) if tables.version_ahead else None,
            "leader": self.leadership.leads(),
            "lease": None if self.feed.store_feed is None else self.leadership.health(self.feed.store_feed.stats()),
            "tracked": self.feed.gate.stats(),
            "evicted": dict(self.feed.evicted),
            "deciding": self.decider.health(self._decision_overdue()),
            "streams": {**self.feed.streams, "trimmed": self.feed.trimmed},
            "alerts": self.feed.alerts_health(),
            "uptime_s": round(time.time() - self.started_at, 3),
        }
