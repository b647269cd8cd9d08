"""Deciding: k for every bucket seen, from the policy, within a time budget, with the operators' pins applied.

Every ``publish_every_windows`` windows or ``publish_every_s`` seconds the sidecar asks the policy for k in
every bucket seen (versions x request types x batch buckets x context buckets) whose cell had traffic lately
(a quiet bucket keeps its last k, so a decision costs what the traffic does, not what was ever seen; the labels
tracked are capped by :class:`~telemetry.cardinality.CardinalityLimits`), applies the operators' pins (a pin
overrides the policy), and when any k changed proposes a new table with the reason
(:class:`~controller.service.tables.TableKeeper` stores and publishes it).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from controller.service.config import SidecarConfig
from controller.service.faults import Faults
from controller.service.metrics import SidecarMetrics
from policies.base import Decision, Policy
from telemetry.alerts import Alert
from telemetry.errors import StoreError
from telemetry.records import (
    MAX_DRAFT_LEN,
    WILDCARD,
    AcceptanceWindow,
    Bucket,
    Cell,
    CostWindow,
    PolicyTable,
    RecordError,
)
from telemetry.store import Pin, Store
from telemetry.wire import parse_bucket_key

DECISION_TIMES_KEPT = 256  # recent decision durations kept for health's p99

BucketParts = tuple[str, str, str, int | None, str]  # parse_bucket_key's answer


@dataclass
class _Seen:
    types: set[str] = field(default_factory=set)
    batch: set[int] = field(default_factory=set)
    context: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Proposal:
    """A decision that changed the table: what to store and publish next."""

    entries: dict[str, int]  # bucket key -> k, pins applied
    default_k: int
    reason: str
    decisions: dict[str, Decision]  # exact bucket key -> the policy's decision (before pins)


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


class Decider:
    """The policy, the buckets it has seen, and when and how it decides them.

    Args:
        config: the decision interval, the time budget, the table and exploration caps.
        policy: the learning policy.
        store: where the operators' pins are read.
        metrics: the decision series.
        faults: where a refused window or a failed decision is counted.
    """

    def __init__(self, config: SidecarConfig, policy: Policy, store: Store, metrics: SidecarMetrics,
                 faults: Faults) -> None:
        self.config = config
        self.policy = policy
        self.store = store
        self.metrics = metrics
        self.faults = faults
        self._seen: dict[tuple[str, str], _Seen] = {}
        self.decisions = 0  # decisions taken (Sidecar.publish_if_changed calls)
        self._last_traffic: dict[Cell, int] = {}  # cell -> self.decisions when its last cost window came
        # bucket key -> the decision a quiet bucket keeps (taken without exploration): only active cells, new
        # buckets and cells that just went quiet are decided on a publish, so its cost follows the traffic
        self._kept: dict[Bucket, Decision] = {}
        self._deferred: list[Bucket] = []  # buckets the last decision's budget did not reach: first next time
        self._last_decision: dict[Bucket, Decision] = {}  # bucket -> its latest decision (kept when deferred)
        self._decision_times: deque[float] = deque(maxlen=DECISION_TIMES_KEPT)  # seconds per decision
        self.last_at: float | None = None  # wall-clock seconds of the last decision taken
        self.last_mono: float | None = None
        self.since_decide = 0  # windows learned since the last decision
        self.next_tick = 0.0  # monotonic time the next decision (a follower: the next store read) is due

    # ------------------------------------------------------------------------------------------ learning
    def learn(self, w: AcceptanceWindow | CostWindow) -> bool:
        """The policy observes ``w`` and its bucket counts as seen; False when the policy refused it (counted)."""
        try:
            self.policy.observe(w)
        except RecordError as e:
            self.faults.reject(e.reason)
            return False
        s = self._seen.setdefault((w.target_version, w.draft_version), _Seen())
        if isinstance(w, AcceptanceWindow):
            s.types.add(w.request_type)
            s.context.add(w.context_bucket)
        else:
            s.batch.add(w.batch_bucket)
            s.context.add(w.context_bucket)
            self._last_traffic[w.cell] = self.decisions
        self.since_decide += 1
        return True

    def forget(self, request_type: str | None = None, versions: tuple[str, str] | None = None) -> None:
        """An evicted label leaves the buckets and the policy: its entries drop out of the next table.
        Raises what the policy's ``forget`` raises, once the buckets are gone."""
        def gone(b: Bucket) -> bool:
            if versions is not None:
                return (b.target_version, b.draft_version) == versions
            return b.request_type == request_type

        if versions is not None:
            self._seen.pop(versions, None)
        else:
            for seen in self._seen.values():
                seen.types.discard(request_type or "")
        self._kept = {k: d for k, d in self._kept.items() if not gone(k)}
        self._last_decision = {k: d for k, d in self._last_decision.items() if not gone(k)}
        self._deferred = [k for k in self._deferred if not gone(k)]
        self.policy.forget(request_type=request_type, versions=versions)

    def reopen(self, a: Alert) -> None:
        """Widen exploration of the drifted acceptance bucket (``target|draft|type|*|context``). Raises what
        the policy raises, or RecordError on an odd bucket label."""
        _t, _d, rtype, _bb, ctx = parse_bucket_key(a.bucket)
        self.policy.reopen(a.target_version, a.draft_version, rtype, ctx)

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

    # ------------------------------------------------------------------------------------------ deciding
    def due(self, now: float) -> bool:
        """Whether a decision is due (monotonic ``now``): enough new windows, or the interval passed."""
        return self.since_decide >= self.config.publish_every_windows or now >= self.next_tick

    def postpone(self, now: float) -> None:
        """The next tick comes one interval after ``now``."""
        self.next_tick = now + self.config.publish_every_s

    def restart(self) -> None:
        """A new leader decides every bucket afresh, at once."""
        self._kept = {}
        self.next_tick = 0.0

    def begin(self) -> None:
        """A decision starts: it counts, and the next one is due an interval from now."""
        self.decisions += 1
        self.since_decide = 0
        self.postpone(time.monotonic())

    def propose(self, cur: PolicyTable | None, trigger: str) -> Proposal | None:
        """Decide every bucket and apply the pins; None when the table ``cur`` would not change, nothing was
        seen yet, or the policy or the store failed (counted)."""
        buckets = self.buckets()
        t0 = time.perf_counter()
        try:
            decisions = self._decide(buckets)
        except Exception as e:  # a policy bug must not take the sidecar down; the last table stays
            self.faults.reject("policy_error")
            self.faults.error(e)
            return None
        took = time.perf_counter() - t0
        self._decision_times.append(took)
        self.last_at, self.last_mono = time.time(), time.monotonic()
        self.metrics.on_decision(took, len(self._deferred))
        try:
            pins = self.store.active_pins()
        except StoreError as e:
            self.faults.error(e)
            return None
        learned = {key: d.k for key, d in decisions.items()}
        entries = apply_pins(learned, pins)
        if not entries:
            return None  # nothing seen yet: engines stay on their default
        default_k = _most_common(learned.values(), cur.default_k if cur else 0)
        if cur is not None and cur.entries == entries and cur.default_k == default_k:
            return None
        return Proposal(entries, default_k, _describe(cur, entries, default_k, pins, trigger), decisions)

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
        active = {b: self.active(b) for b in buckets}

        def need(b: Bucket) -> int:
            return 0 if b in deferred else 1 if active[b] else 2 if b not in self._last_decision else 3

        end = time.perf_counter() + self.config.decide_budget_s
        decided: dict[Bucket, Decision] = {}
        kept: dict[Bucket, Decision] = {}
        late: list[Bucket] = []
        for b in sorted(buckets, key=need):
            d = None if active[b] else self._kept.get(b)
            if d is None:
                if time.perf_counter() >= end:
                    late.append(b)
                    if (prev := self._last_decision.get(b)) is not None:
                        decided[b] = prev
                    continue
                d = self.policy.decide(b, explore=active[b])
            if not active[b]:
                kept[b] = d
            decided[b] = d
        decided = {b: decided[b] for b in buckets if b in decided}  # the buckets' order
        self._kept, self._deferred, self._last_decision = kept, late, decided
        return {b.key(): d for b, d in decided.items()}  # the table's keys (the wire's form)

    def active(self, b: Bucket) -> bool:
        """Whether ``b``'s cell had a cost window within the last ``explore_active_decisions`` decisions."""
        last = self._last_traffic.get(b.cell)
        return last is not None and self.decisions - last <= self.config.explore_active_decisions

    # -------------------------------------------------------------------------------------------- health
    def overdue(self, leader: bool, leader_since_mono: float | None) -> bool:
        """The leader has not taken a due decision within twice the decision interval plus a second."""
        if not leader:
            return False
        since = self.last_mono or leader_since_mono
        if since is None:
            return False
        return time.monotonic() - since > 2 * self.config.publish_every_s + 1.0

    def health(self, overdue: bool) -> dict[str, Any]:
        times = sorted(self._decision_times)
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else None
        return {"decisions": self.decisions, "last_at": self.last_at,
                "last_s": round(self._decision_times[-1], 6) if times else None,
                "p99_s": None if p99 is None else round(p99, 6), "budget_s": self.config.decide_budget_s,
                "deferred_buckets": len(self._deferred), "overdue": overdue}


def _most_common(ks: Iterable[int], fallback: int) -> int:
    tally = Tally(ks)
    if not tally:
        return min(max(fallback, 0), MAX_DRAFT_LEN)
    return max(tally, key=lambda k: (tally[k], -k))  # ties go to the smaller k (the cheaper mistake)


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
