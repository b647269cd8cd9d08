"""How many labels the sidecar tracks: request types, buckets and model-version pairs, each with a cap, and who
gets a place under a full cap.

Every window that travels is well-formed, yet its labels are free text: an engine (or anyone who can write to
the windows stream) that invents a new request type, batch bucket, context bucket or version pair per window
would make the sidecar's policy, its bucket list and its decision time grow without end (without caps, 1,000
forged request types made one decision take about a minute and the sidecar's memory grow past 500 MB). The gate
admits a window whose labels are tracked, and new labels while they fit under :class:`CardinalityLimits`; a
window that would cross a cap is excess, and the consumer dead-letters it with one of the reasons below (the
other windows of its batch are stored as usual).

A full cap is not first come, first served: forged labels that filled it would lock out a real new request type
or a real model update for good. Every request type and version pair carries its **evidence**, the windows it
brought, halved every ``evidence_half_life`` windows the gate sees. A label outside a full cap is a *candidate*;
once its evidence reaches ``promote_windows`` and exceeds the weakest tracked label's by ``promote_ratio``, the
weakest is evicted and the candidate takes its place. Forged labels that come once stay at one window of
evidence and fade, so real traffic displaces them within ``promote_windows`` windows; a label that keeps
bringing windows keeps its place. Evictions are handed to the sidecar (:meth:`CardinalityGate.take_evictions`),
which drops the label from its buckets and its policy. Candidates are bounded too (``max_candidates``, the
weakest dropped first).

At start-up the gate is seeded from the windows the sidecar replays (the newest stored ones), so versions and
types that went out of use are forgotten by a restart, and evidence ranks what is replayed as it ranks live
traffic.

A bucket is counted as the sidecar lists them: per version pair, request types x batch buckets x context
buckets (each factor at least 1, so a flood of cost-only or acceptance-only labels counts too).

Pure logic, no I/O.
"""

from __future__ import annotations

import math
from collections import Counter as Tally
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, cast

from telemetry.records import AcceptanceWindow, CostWindow, WindowBatch

# Dead-letter reasons (the RecordError vocabulary: short, countable labels).
TOO_MANY_REQUEST_TYPES = "too_many_request_types"
TOO_MANY_BUCKETS = "too_many_buckets"
TOO_MANY_VERSIONS = "too_many_versions"

Window = AcceptanceWindow | CostWindow
VersionPair = tuple[str, str]  # (target version, draft version)


@dataclass(frozen=True)
class CardinalityLimits:
    """Caps on what one sidecar tracks, and the rule that gives a place under a full cap to the label with more
    evidence; a window that crosses a cap is dead-lettered, not learned from."""

    # Distinct request types over all version pairs. Real deployments have a handful (code, prose, ...); the
    # goodput policy chooses k jointly for the types of a cell, so each decision costs O(types).
    max_request_types: int = 64
    # Buckets (versions x type x batch bucket x context bucket), as listed in a table: 16 version pairs of 3
    # types x 9 batch edges x 4 context buckets is 1,728. Matches SidecarConfig.max_table_buckets' default.
    max_buckets: int = 4096
    # (target, draft) version pairs: each model update adds one; 16 is many updates between sidecar restarts.
    max_version_pairs: int = 16
    # A candidate label needs this much evidence (windows, decayed) before it may evict a tracked one ...
    promote_windows: int = 16
    # ... and this many times the weakest tracked label's evidence (hysteresis: two labels of equal traffic do
    # not take turns).
    promote_ratio: float = 2.0
    # Evidence halves every this many windows the gate sees: a label that stopped coming fades.
    evidence_half_life: int = 5000
    # Labels waiting outside a full cap whose evidence is kept; beyond it the weakest candidate is forgotten.
    max_candidates: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_request_types", "max_buckets", "max_version_pairs", "promote_windows",
                     "evidence_half_life", "max_candidates"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"CardinalityLimits.{name} must be an integer >= 1, got {v!r}")
        r = self.promote_ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not 1.0 <= r < float("inf"):
            raise ValueError(f"CardinalityLimits.promote_ratio must be a number >= 1, got {r!r}")


@dataclass(frozen=True)
class Eviction:
    """A tracked label that lost its place to a candidate with more evidence."""

    kind: str  # "request_type" or "version_pair"
    request_type: str | None = None  # the evicted type (kind "request_type")
    versions: VersionPair | None = None  # the evicted (target, draft) pair (kind "version_pair")


class _Evidence:
    """Windows per label, halved every ``half_life`` windows of the gate's clock (lazily, on access)."""

    def __init__(self, half_life: int) -> None:
        self._rate = math.log(2.0) / half_life
        self._value: dict[object, tuple[float, int]] = {}  # label -> (evidence, clock when last updated)

    def add(self, label: object, now: int) -> float:
        v = self.get(label, now) + 1.0
        self._value[label] = (v, now)
        return v

    def get(self, label: object, now: int) -> float:
        v, at = self._value.get(label, (0.0, now))
        return v * math.exp(-self._rate * (now - at))

    def labels(self) -> list[object]:
        return list(self._value)

    def forget(self, labels: set[object]) -> None:
        for label in labels:
            self._value.pop(label, None)

    def __len__(self) -> int:
        return len(self._value)

    def weakest(self, labels: Iterable[object], now: int) -> tuple[object | None, float]:
        best: tuple[object | None, float] = (None, float("inf"))
        for label in labels:
            v = self.get(label, now)
            if v < best[1]:
                best = (label, v)
        return best


@dataclass
class _Pair:
    types: set[str] = field(default_factory=set)
    batch: set[int] = field(default_factory=set)
    context: set[str] = field(default_factory=set)

    def buckets(self, extra_types: int = 0, extra_batch: int = 0, extra_context: int = 0) -> int:
        return (max(1, len(self.types) + extra_types) * max(1, len(self.batch) + extra_batch)
                * max(1, len(self.context) + extra_context))


@dataclass(frozen=True)
class Split:
    """A batch divided by the gate: what is stored and learned from, and the excess with its reason.

    The excess travels as one dead letter (a dead letter acknowledges its entry, so two would lose the second's
    windows if the transport failed in between); its reason is the one most of its windows crossed.
    """

    admitted: WindowBatch | None  # None when every window of the batch is excess
    excess: WindowBatch | None = None  # the excess windows (same engine_id and seq), None when all were admitted
    reason: str | None = None  # the dead-letter reason of the excess

    @property
    def excess_windows(self) -> int:
        return 0 if self.excess is None else len(self.excess.acceptance) + len(self.excess.cost)


class CardinalityGate:
    """Admits windows while the labels they add fit under the limits; under a full cap, by evidence.

    Args:
        limits: the caps and the promotion rule.
    """

    def __init__(self, limits: CardinalityLimits | None = None) -> None:
        self.limits = limits or CardinalityLimits()
        self._pairs: dict[VersionPair, _Pair] = {}
        self._types: set[str] = set()
        self._buckets = 0  # sum of _Pair.buckets() over the pairs
        self._clock = 0  # windows seen: the evidence's time axis
        self._evidence = _Evidence(self.limits.evidence_half_life)  # ("t", type) / ("v", pair) -> windows
        self._evictions: list[Eviction] = []  # not yet taken by the sidecar
        self.evicted = 0  # labels evicted so far
        self.cap_hits: Tally[str] = Tally()  # windows refused, per reason

    def admit(self, w: Window) -> str | None:
        """Track ``w``'s labels if they fit (evicting a weaker label when ``w``'s has earned a place). Returns None
        when admitted, else the dead-letter reason."""
        reason = self._admit(w)
        if reason is not None:
            self.cap_hits[reason] += 1
            self._trim_candidates()
        return reason

    def _admit(self, w: Window) -> str | None:
        lim = self.limits
        self._clock += 1
        vp = (w.target_version, w.draft_version)
        pair_evidence = self._evidence.add(("v", vp), self._clock)
        pair = self._pairs.get(vp)
        if pair is None:
            if len(self._pairs) >= lim.max_version_pairs and not self._promote(("v", vp), pair_evidence):
                return TOO_MANY_VERSIONS
            pair = _Pair()
        new_ctx = int(w.context_bucket not in pair.context)
        if isinstance(w, AcceptanceWindow):
            type_evidence = self._evidence.add(("t", w.request_type), self._clock)
            if (w.request_type not in self._types and len(self._types) >= lim.max_request_types
                    and not self._promote(("t", w.request_type), type_evidence)):
                return TOO_MANY_REQUEST_TYPES
            grown = pair.buckets(extra_types=int(w.request_type not in pair.types), extra_context=new_ctx)
        else:
            grown = pair.buckets(extra_batch=int(w.batch_bucket not in pair.batch), extra_context=new_ctx)
        old = pair.buckets() if vp in self._pairs else 0
        while self._buckets - old + grown > lim.max_buckets:
            # Buckets are mostly version pairs (types x batch x context each): the weakest other pair gives way
            # to a label that earned a place, as under the other caps.
            if not self._promote_over_buckets(vp, type_evidence if isinstance(w, AcceptanceWindow) and
                                              w.request_type not in pair.types else pair_evidence):
                return TOO_MANY_BUCKETS
        self._pairs[vp] = pair
        self._buckets += grown - old
        pair.context.add(w.context_bucket)
        if isinstance(w, AcceptanceWindow):
            pair.types.add(w.request_type)
            self._types.add(w.request_type)
        else:
            pair.batch.add(w.batch_bucket)
        return None

    def _tracked(self, kind: str) -> list[object]:
        if kind == "v":
            return [("v", vp) for vp in self._pairs]
        return [("t", t) for t in self._types]

    def _promote(self, label: tuple[str, object], evidence: float) -> bool:
        """Evict the weakest tracked label of ``label``'s kind when ``label`` has earned its place."""
        return self._evict_weakest(self._tracked(label[0]), evidence)

    def _promote_over_buckets(self, keep: VersionPair, evidence: float) -> bool:
        """Evict the weakest version pair other than ``keep`` when a label with ``evidence`` has earned the buckets
        it needs."""
        return self._evict_weakest([("v", vp) for vp in self._pairs if vp != keep], evidence)

    def _evict_weakest(self, tracked: list[object], evidence: float) -> bool:
        """Evict the label of ``tracked`` with the least evidence, if ``evidence`` reaches ``promote_windows`` and
        ``promote_ratio`` times that label's. Returns whether one was evicted."""
        lim = self.limits
        if evidence < lim.promote_windows:
            return False
        weakest, weakest_evidence = self._evidence.weakest(tracked, self._clock)
        if weakest is None or evidence < lim.promote_ratio * weakest_evidence:
            return False
        kind, value = cast(tuple[str, Any], weakest)
        if kind == "v":
            del self._pairs[value]
            self._evictions.append(Eviction("version_pair", versions=value))
        else:
            self._types.discard(value)
            for p in self._pairs.values():
                p.types.discard(value)
            self._evictions.append(Eviction("request_type", request_type=value))
        self._buckets = sum(p.buckets() for p in self._pairs.values())
        self.evicted += 1
        return True

    def _trim_candidates(self) -> None:
        """Forget the weakest candidates once there are twice ``max_candidates`` of them (amortised O(1))."""
        lim = self.limits
        tracked = len(self._pairs) + len(self._types)
        if len(self._evidence) <= tracked + 2 * lim.max_candidates:
            return
        keep = {*self._tracked("v"), *self._tracked("t")}
        candidates = sorted((label for label in self._evidence.labels() if label not in keep),
                            key=lambda label: self._evidence.get(label, self._clock))
        self._evidence.forget(set(candidates[: len(candidates) - lim.max_candidates]))

    def take_evictions(self) -> list[Eviction]:
        """The labels evicted since the last call, oldest first (the sidecar drops them from its policy)."""
        out, self._evictions = self._evictions, []
        return out

    def split(self, batch: WindowBatch) -> Split:
        """Admit each window of ``batch`` in order; the rest is the excess."""
        acc: list[AcceptanceWindow] = []
        cost: list[CostWindow] = []
        out_acc: list[AcceptanceWindow] = []
        out_cost: list[CostWindow] = []
        reasons: Tally[str] = Tally()
        for a in batch.acceptance:
            reason = self.admit(a)
            (acc if reason is None else out_acc).append(a)
            reasons.update([reason] if reason else [])
        for c in batch.cost:
            reason = self.admit(c)
            (cost if reason is None else out_cost).append(c)
            reasons.update([reason] if reason else [])
        if not reasons:
            return Split(batch)
        excess = replace(batch, acceptance=tuple(out_acc), cost=tuple(out_cost), sampled_rounds=(), dropped_before=0)
        admitted = None if not acc and not cost else replace(batch, acceptance=tuple(acc), cost=tuple(cost))
        return Split(admitted, excess, max(sorted(reasons), key=lambda r: reasons[r]))

    # ------------------------------------------------------------------------------------------ status
    @property
    def request_types(self) -> int:
        return len(self._types)

    @property
    def version_pairs(self) -> int:
        return len(self._pairs)

    @property
    def buckets(self) -> int:
        return self._buckets

    def stats(self) -> dict[str, int]:
        """What is tracked now, JSON-safe (for health)."""
        tracked = len(self._pairs) + len(self._types)
        return {"request_types": len(self._types), "buckets": self._buckets, "version_pairs": len(self._pairs),
                "candidates": max(0, len(self._evidence) - tracked), "evicted": self.evicted,
                **{f"refused_{r}": n for r, n in sorted(self.cap_hits.items())}}
