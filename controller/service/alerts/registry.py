"""The model-version registry: every (target, draft) pair seen, when, and how many windows it carried.

A pair seen for the first time while another is already known is a model update: one ``model_update`` alert
names the old pair (the one seen most recently), the new one and the buckets of the new pair in the batch that
revealed it. The first pair a fresh deployment sees is its starting point, not an update, and raises nothing.

With a store, "first time" is decided by :meth:`telemetry.alerts_store.AlertStore.claim_version` (one atomic
update), so a restarted sidecar, or a second one, never raises the same update again. Window counts and
``last_seen_at`` are written at most every ``flush_s`` seconds of window time (and at once for a new pair): the
registry costs one small transaction per few seconds, not one per batch.
"""

from __future__ import annotations

from telemetry.alerts import MODEL_UPDATE, Alert
from telemetry.alerts_store import AlertStore, Pair
from telemetry.records import WindowBatch

__all__ = ["ModelRegistry"]


class ModelRegistry:
    """Pairs seen, from the store at start-up and from the batches observed since.

    Args:
        store: where the registry lives; None keeps it in memory (tests, a store-less embedded run).
        flush_s: window-time seconds between writes of the counts.
    """

    def __init__(self, store: AlertStore | None = None, flush_s: float = 5.0) -> None:
        self._store = store
        self._flush_s = flush_s
        self._last_seen: dict[Pair, float] = {}
        if store is not None:
            for mv in store.model_versions():
                if mv.last_seen_at is not None:
                    self._last_seen[(mv.target_version, mv.draft_version)] = mv.last_seen_at
        self._pending: dict[Pair, tuple[int, int]] = {}
        self._flushed_at: float | None = None

    @property
    def known(self) -> dict[Pair, float]:
        """Observed pairs and when each was last seen."""
        return dict(self._last_seen)

    def observe(self, batch: WindowBatch) -> list[Alert]:
        """Count ``batch``'s windows per pair; a ``model_update`` (not yet stored) for each new pair."""
        at = batch.window_end
        counts: dict[Pair, tuple[int, int]] = {}
        buckets: dict[Pair, set[str]] = {}
        for a in batch.acceptance:
            p = (a.target_version, a.draft_version)
            n_acc, n_cost = counts.get(p, (0, 0))
            counts[p] = (n_acc + 1, n_cost)
            buckets.setdefault(p, set()).add(f"{p[0]}|{p[1]}|{a.request_type}|*|{a.context_bucket}")
        for c in batch.cost:
            p = (c.target_version, c.draft_version)
            n_acc, n_cost = counts.get(p, (0, 0))
            counts[p] = (n_acc, n_cost + 1)
            buckets.setdefault(p, set()).add(f"{p[0]}|{p[1]}|*|{c.batch_bucket}|{c.context_bucket}")
        alerts: list[Alert] = []
        new = False
        for pair in sorted(counts):
            if pair not in self._last_seen:
                new = True
                previous = self._previous(pair)
                first = self._store.claim_version(pair, at) if self._store is not None else True
                if first and previous is not None:
                    alerts.append(_model_update(previous, pair, sorted(buckets[pair]), at))
            self._last_seen[pair] = max(at, self._last_seen.get(pair, at))
            n_acc, n_cost = self._pending.get(pair, (0, 0))
            self._pending[pair] = (n_acc + counts[pair][0], n_cost + counts[pair][1])
        if new or self._flushed_at is None or at - self._flushed_at >= self._flush_s:
            self.flush(at)
        return alerts

    def _previous(self, pair: Pair) -> Pair | None:
        others = [(t, p) for p, t in self._last_seen.items() if p != pair]
        return max(others)[1] if others else None

    def flush(self, at: float | None = None) -> None:
        """Write the pending counts (and last-seen times) to the store."""
        if self._store is not None and self._pending:
            when = at if at is not None else max(self._last_seen.values())
            self._store.touch_versions(self._pending, when)
        self._pending = {}
        self._flushed_at = at if at is not None else self._flushed_at


def _model_update(old: Pair, new: Pair, affected: list[str], at: float) -> Alert:
    return Alert(
        kind=MODEL_UPDATE, bucket=f"{new[0]}|{new[1]}|*|*|*", target_version=new[0], draft_version=new[1],
        previous_target_version=old[0], previous_draft_version=old[1], affected=tuple(affected), detected_at=at,
        change_at=at,
        message=(f"model update: {old[0]} / {old[1]} -> {new[0]} / {new[1]}; {len(affected)} bucket(s) of the new "
                 "pair start learning"),
    )
