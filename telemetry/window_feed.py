"""Tailing the store: every acceptance and cost window committed by any sidecar's consumer, once, in id order.

With several sidecars in the consumer group, each one's consumer stores only its share of the engines' windows;
the one that decides (the lease's leader, see :mod:`controller.service.lease`) must learn from all of them. The
store is where they meet, so the sidecars read them back from there: :class:`WindowFeed` polls the store's
public window queries (:meth:`telemetry.store.Store.acceptance_windows` / ``cost_windows`` with ``since_id``)
and hands out each row once.

Row ids are not commit order. Two consumers' transactions take ids from one sequence while they run; the one
with the higher ids may commit first, and a reader that moved past them would never see the lower ids commit.
So each id sequence keeps its **gaps** (ids below the highest one seen that have not been seen) for
``gap_grace_s`` and reads from the lowest open gap until it is filled or given up on (an id a rolled-back
transaction took is never filled). ``gap_grace_s`` must exceed the longest ingest transaction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from telemetry.records import AcceptanceWindow, CostWindow
from telemetry.store import Store, StoredWindow

MAX_GAPS = 100_000  # open gaps tracked per sequence; a larger hole (a huge rollback) is skipped at once


@dataclass(frozen=True)
class WindowFeedConfig:
    """How the feed pages through the store."""

    page: int = 5000  # new rows read per sequence per poll: bounds one poll's time and memory
    # An id missing below the newest one seen is waited for this long (a transaction still open), then skipped.
    gap_grace_s: float = 10.0
    # Open gaps are looked at again this often (re-reading the rows above them); new rows are read every poll.
    gap_recheck_s: float = 0.5

    def __post_init__(self) -> None:
        if self.page < 1:
            raise ValueError(f"WindowFeedConfig.page must be >= 1, got {self.page}")
        if self.gap_grace_s < 0 or self.gap_recheck_s < 0:
            raise ValueError("WindowFeedConfig.gap_grace_s and gap_recheck_s must be >= 0")


class _IdTail:
    """The read position in one id sequence: the highest id seen and the open gaps below it."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.high = 0  # every id above this is unseen
        self.gaps: dict[int, float] = {}  # unseen id below high -> monotonic time it was first missed
        self.skipped = 0  # gaps given up on (never committed, or committed later than the grace)
        self.next_gap_check = 0.0  # monotonic time the open gaps are read again

    def start_after(self, ids: Iterable[int]) -> None:
        """Mark ``ids`` seen (the start-up replay); ids missing between them are gaps from now on."""
        seen = sorted(set(ids))
        if seen:
            self.high = max(self.high, seen[0])
            self.accept([_Id(i) for i in seen[1:]], time.monotonic())

    def since(self) -> int:
        """The ``since_id`` that covers the open gaps: just below the lowest, else the highest id seen."""
        return min(self.gaps) - 1 if self.gaps else self.high

    def accept(self, rows: list[Any], now: float) -> list[Any]:
        """The rows (sorted by ``id``) not handed out before; opens gaps for ids skipped over, expires old ones."""
        out = []
        for r in rows:
            if r.id > self.high:
                if r.id - self.high - 1 + len(self.gaps) <= MAX_GAPS:
                    for g in range(self.high + 1, r.id):
                        self.gaps[g] = now
                else:
                    self.skipped += r.id - self.high - 1
                self.high = r.id
                out.append(r)
            elif self.gaps.pop(r.id, None) is not None:
                out.append(r)
        expired = [g for g, at in self.gaps.items() if now - at > self.grace_s]
        for g in expired:
            del self.gaps[g]
        self.skipped += len(expired)
        return out


@dataclass(frozen=True)
class _Id:
    id: int


Window = AcceptanceWindow | CostWindow


class WindowFeed:
    """Hands out each window row of a store once, acceptance and cost each in id order.

    Args:
        store: the store to read (read only; its public queries).
        config: page size and gap grace.
    """

    def __init__(self, store: Store, config: WindowFeedConfig | None = None) -> None:
        self.store = store
        self.config = config or WindowFeedConfig()
        self._acc = _IdTail(self.config.gap_grace_s)
        self._cost = _IdTail(self.config.gap_grace_s)
        self.delivered = 0  # rows handed out so far

    def start_after(self, acceptance_ids: Iterable[int], cost_ids: Iterable[int]) -> None:
        """Begin after rows already learned from elsewhere (the sidecar's start-up replay)."""
        self._acc.start_after(acceptance_ids)
        self._cost.start_after(cost_ids)

    def start_at_top(self) -> None:
        """Begin after the newest rows stored now (nothing before them is handed out)."""
        acc, cost = self.store.recent_windows(1)
        self.start_after([w.id for w in acc], [w.id for w in cost])

    def poll(self) -> tuple[list[StoredWindow[AcceptanceWindow]], list[StoredWindow[CostWindow]]]:
        """Rows committed since the last poll (or filling a gap), each list oldest first.

        Raises:
            StoreError: the store could not be read (nothing is marked seen; the next poll reads it again).
        """
        now = time.monotonic()
        acc = self._read(self._acc, self.store.acceptance_windows, now)
        cost = self._read(self._cost, self.store.cost_windows, now)
        self.delivered += len(acc) + len(cost)
        return acc, cost

    def _read(self, tail: _IdTail, query: Callable[..., list[Any]], now: float) -> list[Any]:
        since = tail.high
        if tail.gaps and now >= tail.next_gap_check:
            # the rows between the lowest open gap and the highest id seen are read again (and skipped)
            since, tail.next_gap_check = tail.since(), now + self.config.gap_recheck_s
        rows = query(since_id=since, limit=self.config.page + (tail.high - since))
        return tail.accept(rows, now)

    def windows(self) -> list[Window]:
        """One :meth:`poll`, both kinds merged by window end (the order a policy would have seen them live)."""
        acc, cost = self.poll()
        both: list[tuple[float, Window]] = [(w.window_end, w.window) for w in acc]
        both += [(w.window_end, w.window) for w in cost]
        both.sort(key=lambda x: x[0])
        return [w for _, w in both]

    def stats(self) -> dict[str, int]:
        """Rows delivered, gaps open now and gaps given up on (JSON-safe, for ``/health``)."""
        return {"delivered": self.delivered, "gaps_open": len(self._acc.gaps) + len(self._cost.gaps),
                "gaps_skipped": self._acc.skipped + self._cost.skipped}
