"""Which sidecar decides: the leader lease, followed from the sidecar's loop.

Several sidecars (scale-out): ingestion scales out through the consumer group (each consumer stores its share);
deciding does not. With a :class:`~controller.service.lease.Lease`, exactly one sidecar at a time, the
**leader**, decides and publishes; the others (followers) ingest, never touch the engines' key, and answer
``publish_now`` with None (a pin they store is applied by the leader on its next tick). Followers are warm
standbys: when the leader dies its lease lapses and a follower takes it (the sidecar then catches up from the
store before its first decision, see :meth:`controller.service.sidecar.Sidecar.step`). A sidecar whose lease
Redis no longer confirms steps down instead of publishing. Without a lease (the embedded mode, ``--no-lease``)
the sidecar is always the leader.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from controller.service.faults import SIDECAR_LOGGER, Faults
from controller.service.lease import Lease
from controller.service.metrics import SidecarMetrics
from telemetry.errors import TransportError

LEASE_CHURN_WINDOW_S = 300.0  # health: the leader lease lost ...
LEASE_CHURN_LOSSES = 3  # ... this many times within the window is churn

log = logging.getLogger(SIDECAR_LOGGER)


class Leadership:
    """Whether this sidecar may decide and publish, and how often that changed.

    Args:
        lease: the leader lease shared with the other sidecars of this deployment (None: always the leader).
        metrics: the leadership series.
        faults: where a lease failure is counted.
        lock: the sidecar's lock (a step-down changes what the loop and the HTTP threads may do).
    """

    def __init__(self, lease: Lease | None, metrics: SidecarMetrics, faults: Faults,
                 lock: threading.RLock) -> None:
        self.lease = lease
        self.metrics = metrics
        self.faults = faults
        self._lock = lock
        self.leader = lease is None  # decides and publishes; with a lease only after acquiring it
        self.since: float | None = None  # wall-clock seconds this sidecar last became the leader
        self.since_mono: float | None = None
        self._losses: deque[float] = deque(maxlen=LEASE_CHURN_LOSSES)  # monotonic times of the last losses

    @property
    def key(self) -> str | None:
        return self.lease.key if self.lease is not None else None

    def leads(self) -> bool:
        """Whether this sidecar may decide and publish now (the lease's local deadline is checked too)."""
        if self.lease is None:
            return True
        if self.leader and not self.lease.held():
            with self._lock:
                self.step_down("the leader lease lapsed")
        return self.leader

    def confirmed(self) -> bool:
        """Whether Redis still holds this sidecar's lease (renewed now); True without a lease."""
        if self.lease is None:
            return True
        try:
            return self.lease.renew()
        except TransportError as e:
            self.faults.error(e)
            return False

    def tick(self) -> bool:
        """Renew or try to take the lease. Returns True when it was just taken: the caller catches up from the
        store, then calls :meth:`took_over`. A lease lost steps this sidecar down."""
        assert self.lease is not None
        leads = self.lease.tick()
        if leads and not self.leader:
            return True
        if not leads and self.leader:
            with self._lock:
                self.step_down("lost the leader lease")
        return False

    def took_over(self) -> None:
        """Become the leader, caught up (call with the lock held)."""
        self.leader = True
        self.since, self.since_mono = time.time(), time.monotonic()

    def step_down(self, why: str) -> None:
        """Stop deciding and publishing (call with the lock held)."""
        if not self.leader:
            return
        self.leader = False
        self._losses.append(time.monotonic())
        self.metrics.on_leadership(False, changed=True)
        log.warning("%s (%s): following; this sidecar no longer decides nor publishes", why, self.key)

    def release(self) -> None:
        """Give the lease up (a clean stop); a no-op without one. The next tick contends again."""
        if self.lease is None:
            return
        with self._lock:
            was, self.leader = self.leader, False
            self.lease.release()
        if was:
            self.metrics.on_leadership(False, changed=False)  # released, not lost
            log.info("leader lease %s released", self.key)

    def churning(self, now: float) -> bool:
        """The lease was lost ``LEASE_CHURN_LOSSES`` times within ``LEASE_CHURN_WINDOW_S`` (monotonic ``now``)."""
        return len(self._losses) >= LEASE_CHURN_LOSSES and now - self._losses[0] <= LEASE_CHURN_WINDOW_S

    def health(self, feed: dict[str, int]) -> dict[str, Any]:
        """The lease and the store feed (``feed``: its stats), for ``/health``: who may decide, how often it
        changed."""
        assert self.lease is not None
        ls = self.lease.stats()
        return {"key": self.lease.key, "lease_ms": self.lease.config.lease_ms,
                "leader_since": self.since if self.leader else None, "acquisitions": ls.acquisitions,
                "losses": ls.losses, "failures": ls.failures, "last_error": ls.last_error, "feed": feed}
