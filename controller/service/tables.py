"""The policy table versions a sidecar makes: numbered from the store, stored, then delivered to the engines.

Versions come from the SQL store, the sidecar's own truth, never from what sits in Redis: at start-up the counter
continues from the latest stored version, and that table is delivered again. The store fences a stale leader: a
version a peer already stored is refused, and a sidecar whose lease Redis no longer confirms steps down instead
of retrying with the next number.

On every decision tick the sidecar checks that the engines' key holds the store's newest table and re-publishes
it when it is missing or older (Redis restarted empty, flushed, or was down when the table was made). A table
there whose version is ahead of the store was not made by any sidecar of this store (forged, or another
deployment's): it is reported (log line, ``spectune_policy_version_ahead_total``, ``policy_version_ahead`` in
``/health``), never adopted, and replaced by the store's newest table.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from controller.service.faults import SIDECAR_LOGGER, Faults
from controller.service.leadership import Leadership
from controller.service.metrics import SidecarMetrics
from controller.service.publish import FencedError, Publisher
from policies.base import Decision
from telemetry.errors import StoreError, TransportError
from telemetry.policy_table import MAX_REASON_CHARS, check_table_size
from telemetry.records import PolicyTable, RecordError
from telemetry.store import Store

HISTORY_KEEP = 1000  # decisions kept in memory for the demo and the HTTP endpoint
STORE_ATTEMPTS = 3  # another sidecar may have taken the next version number meanwhile

log = logging.getLogger(SIDECAR_LOGGER)


@dataclass(frozen=True)
class PublishedVersion:
    """One published table and the decisions behind it (what the demo and operators look at)."""

    table: PolicyTable
    decisions: dict[str, Decision]  # exact bucket key -> the policy's decision (before pins)
    at: float  # wall-clock seconds


class TableKeeper:
    """The version counter, the newest table, and whether the engines' key holds it.

    Args:
        store: where versions are stored (and numbered).
        publisher: the engines' key (Redis, or a callback).
        k_max: the policy's largest k, written into every table.
        metrics: the published-version series.
        faults: where failures and refused tables are counted.
        leadership: only the leader stores and publishes; a fenced publish steps it down.
        lock: the sidecar's lock, held while the counter moves.
    """

    def __init__(self, store: Store, publisher: Publisher, k_max: int, metrics: SidecarMetrics, faults: Faults,
                 leadership: Leadership, lock: threading.RLock) -> None:
        self.store = store
        self.publisher = publisher
        self.k_max = k_max
        self.metrics = metrics
        self.faults = faults
        self.leadership = leadership
        self._lock = lock
        self.version = 0
        self.current: PolicyTable | None = None
        self.unpublished: PolicyTable | None = None  # stored but not yet delivered (publisher was down)
        self.publisher_ok = True  # the last attempt to reach the publisher succeeded (health)
        self.version_ahead: dict[str, Any] | None = None  # the last table found ahead of the store (reported)
        self.history: list[PublishedVersion] = []
        # versions not yet handed to Sidecar.run()'s on_publish (None: no one listens); a queue, not the trimmed
        # history, so a burst of publishes from other threads (pins) between two loop steps is reported whole
        self._to_report: deque[PublishedVersion] | None = None

    @property
    def published(self) -> bool:
        """Whether the engines' key holds this sidecar's newest table (as of the last attempt)."""
        return self.unpublished is None and self.publisher_ok

    # ------------------------------------------------------------------------------- following the store
    def resume(self) -> None:
        """Continue the counter from the store and re-deliver its latest table (raises StoreError)."""
        latest = self.store.latest_policy_version()
        if latest is not None:
            self.version, self.current = latest.version, latest
            self.unpublished = latest  # e.g. Redis was flushed: engines get the last table back
        self.sync()  # a leader's only (followers never touch the engines' key)

    def adopt(self, latest: PolicyTable | None) -> None:
        """A new leader continues from the store's newest table (call with the lock held)."""
        if latest is not None and latest.version >= self.version:
            self.version, self.current = latest.version, latest
            self.unpublished = latest  # checked against the engines' key by the next sync

    def follow_store(self) -> None:
        """A follower's version is the store's newest (what the leader published), so /health tells the truth."""
        try:
            latest = self.store.latest_policy_version()
        except StoreError as e:
            self.faults.error(e)
            return
        with self._lock:
            if latest is not None and latest.version > self.version and not self.leadership.leader:
                self.version, self.current = latest.version, latest

    # ---------------------------------------------------------------------------------------- publishing
    def store_and_publish(self, entries: dict[str, int], default_k: int, reason: str,
                          decisions: dict[str, Decision]) -> PolicyTable | None:
        """Store the next version and deliver it (call with the lock held). Returns it, or None when this
        sidecar no longer leads, the table is too large for the engines, or the store failed."""
        table: PolicyTable | None = None
        for _attempt in range(STORE_ATTEMPTS):
            # Fencing: right before a version number is taken, Redis must still hold this sidecar's lease (one
            # round trip per publish); a stale leader, e.g. one paused past its lease, steps down here.
            if not self.leadership.leads():
                return None
            if not self.leadership.confirmed():
                self.leadership.step_down("Redis no longer holds this sidecar's lease")
                return None
            table = PolicyTable(version=self.version + 1, default_k=default_k, k_max=self.k_max,
                                entries=entries, created_at=time.time(), reason=reason[:MAX_REASON_CHARS])
            try:
                check_table_size(table)  # engines would refuse it: keep the last table, say why
            except RecordError as e:
                self.faults.reject(e.reason)
                self.faults.error(e)
                return None
            try:
                self.store.save_policy_version(table)
                break
            except StoreError as e:  # a peer may have taken the version; else the store failed (kept, retried)
                latest = _safe_latest(self.store)
                if latest is None or latest.version <= self.version:
                    self.faults.error(e)
                    return None
                # with a lease, the next attempt confirms it first: a stale peer took the number, or we are stale
                self.version = latest.version
        else:
            return None
        assert table is not None
        self.version, self.current = table.version, table
        self.metrics.on_published(table.version, table.entries)
        pv = PublishedVersion(table, decisions, time.time())
        self.history.append(pv)
        del self.history[:-HISTORY_KEEP]
        if self._to_report is not None:
            self._to_report.append(pv)
        self.unpublished = table
        self.sync()
        return table

    def sync(self) -> None:
        """Make the engines' key hold the newest stored table this sidecar knows.

        Cheap when all is well (one version read). Re-publishes when the key is missing, unreadable or older
        (a Redis restart or flush, a publish that failed); adopts a newer version only from the store (a peer
        sidecar of the same store made it); reports a version ahead of the store and replaces that table.
        """
        want = self.unpublished or self.current
        if want is None or not self.leadership.leads():
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
            self.faults.error(e)
            self.leadership.step_down("a publish was fenced off")
        except TransportError as e:
            self.publisher_ok = False
            self.faults.error(e)

    def _delivered(self) -> None:
        self.unpublished = None
        self.publisher_ok = True

    def _newer_than_mine(self, there: int | None) -> None:
        """The key holds a version above ours, or junk: a peer's table (in the store) is followed, anything
        else is reported and overwritten with the store's newest table. Raises TransportError."""
        try:
            latest = self.store.latest_policy_version()
        except StoreError as e:  # cannot tell a peer from a forger now; retry next tick
            self.faults.error(e)
            return
        self.publisher_ok = True
        if latest is not None and latest.version > self.version:
            self.version, self.current = latest.version, latest  # a peer sidecar of this store got further
        if there is not None and latest is not None and there <= latest.version:
            self.unpublished = latest if there < latest.version else None
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
            self.unpublished = None

    # ------------------------------------------------------------------------------------------ reports
    def start_reports(self) -> None:
        """Queue every version published from now on for :meth:`take_reports`."""
        with self._lock:
            self._to_report = deque()

    def take_reports(self) -> list[PublishedVersion]:
        """The versions published since the last call, oldest first."""
        with self._lock:
            if not self._to_report:
                return []
            out = list(self._to_report)
            self._to_report.clear()
        return out

    def stop_reports(self) -> None:
        with self._lock:
            self._to_report = None


def _safe_latest(store: Store) -> PolicyTable | None:
    try:
        return store.latest_policy_version()
    except StoreError:
        return None
