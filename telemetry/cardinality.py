"""How many labels the sidecar tracks: request types, buckets and model-version pairs, each with a cap.

Every window that travels is well-formed, yet its labels are free text: an engine (or anyone who can write to
the windows stream) that invents a new request type, batch bucket, context bucket or version pair per window
makes the sidecar's policy, its bucket list and its decision time grow without end (the issue-14 probe: 1,000
forged request types, one decision took 55.6 s and the sidecar grew to 541 MB). The gate here admits a window
whose labels are already tracked, and new labels while they fit under :class:`CardinalityLimits`; a window that
would cross a cap is excess, and the consumer dead-letters it with one of the reasons below (the other windows
of its batch are stored as usual).

Tracked labels only grow while a sidecar runs (a label once admitted stays admitted, so a redelivered entry is
split the same way again). At start-up the gate is seeded from the windows the sidecar replays (the newest
stored ones), so versions and types that went out of use are forgotten by a restart.

A bucket is counted as the sidecar lists them: per version pair, request types x batch buckets x context
buckets (each factor at least 1, so a flood of cost-only or acceptance-only labels counts too).

Pure logic, no I/O.
"""

from __future__ import annotations

from collections import Counter as Tally
from dataclasses import dataclass, field, replace

from telemetry.records import AcceptanceWindow, CostWindow, WindowBatch

# Dead-letter reasons (the RecordError vocabulary: short, countable labels).
TOO_MANY_REQUEST_TYPES = "too_many_request_types"
TOO_MANY_BUCKETS = "too_many_buckets"
TOO_MANY_VERSIONS = "too_many_versions"

Window = AcceptanceWindow | CostWindow
VersionPair = tuple[str, str]  # (target version, draft version)


@dataclass(frozen=True)
class CardinalityLimits:
    """Caps on what one sidecar tracks; a window that would cross one is dead-lettered, not learned from."""

    # Distinct request types over all version pairs. Real deployments have a handful (code, prose, ...); the
    # goodput policy chooses k jointly for the types of a cell, so each decision costs O(types).
    max_request_types: int = 64
    # Buckets (versions x type x batch bucket x context bucket), as listed in a table: 16 version pairs of 3
    # types x 9 batch edges x 4 context buckets is 1,728. Matches SidecarConfig.max_table_buckets' default.
    max_buckets: int = 4096
    # (target, draft) version pairs: each model update adds one; 16 is many updates between sidecar restarts.
    max_version_pairs: int = 16

    def __post_init__(self) -> None:
        for name in ("max_request_types", "max_buckets", "max_version_pairs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"CardinalityLimits.{name} must be an integer >= 1, got {v!r}")


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
    """Admits windows while the labels they add fit under the limits.

    Args:
        limits: the caps.
    """

    def __init__(self, limits: CardinalityLimits | None = None) -> None:
        self.limits = limits or CardinalityLimits()
        self._pairs: dict[VersionPair, _Pair] = {}
        self._types: set[str] = set()
        self._buckets = 0  # sum of _Pair.buckets() over the pairs

    def admit(self, w: Window) -> str | None:
        """Track ``w``'s labels if they fit. Returns None when admitted, else the dead-letter reason."""
        lim = self.limits
        vp = (w.target_version, w.draft_version)
        pair = self._pairs.get(vp)
        if pair is None:
            if len(self._pairs) >= lim.max_version_pairs:
                return TOO_MANY_VERSIONS
            pair = _Pair()
        new_ctx = int(w.context_bucket not in pair.context)
        if isinstance(w, AcceptanceWindow):
            new_type = w.request_type not in pair.types
            if w.request_type not in self._types and len(self._types) >= lim.max_request_types:
                return TOO_MANY_REQUEST_TYPES
            grown = pair.buckets(extra_types=int(new_type), extra_context=new_ctx)
        else:
            grown = pair.buckets(extra_batch=int(w.batch_bucket not in pair.batch), extra_context=new_ctx)
        old = pair.buckets() if vp in self._pairs else 0
        if self._buckets - old + grown > lim.max_buckets:
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
        return {"request_types": len(self._types), "buckets": self._buckets, "version_pairs": len(self._pairs)}
