"""Pure aggregation of engine round records into the window aggregates that travel.

Acceptance is a property of a **row**, keyed by (target version, draft version, request type, context bucket, k);
rows with ``k == 0`` (speculation off) are counted too, with a one-bin histogram, so the cost of plain decoding
is known beside the cost of speculating. Cost is a property of a **round**, keyed by (versions, batch-size bucket,
context bucket of the round's longest context, largest k).

Per-token latency: a row that emitted ``e`` tokens in a round of ``wall_s`` seconds waited ``wall_s / e`` seconds
per token; the window's p50 / p95 / p99 are taken over all rows of the key's rounds (rows that emitted nothing
have no per-token latency and are skipped).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from telemetry.records import (
    DEFAULT_BUCKETS,
    AcceptanceWindow,
    BucketConfig,
    CostWindow,
    RoundRecord,
    Stat,
)
from telemetry.wire import check_rounds

LATENCY_PERCENTILES = (50.0, 95.0, 99.0)  # what operators read off latency dashboards

AcceptanceKey = tuple[str, str, str, str, int]  # target, draft, request type, context bucket, k
CostKey = tuple[str, str, int, str, int]  # target, draft, batch bucket, context bucket, max k


@dataclass
class _AcceptanceAcc:
    k: int
    rows: int = 0
    accepted: int = 0
    emitted: int = 0
    hist: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hist = [0] * (self.k + 1)


@dataclass
class _CostAcc:
    rounds: int = 0
    batch_rows: int = 0
    tokens_verified: int = 0
    emitted: int = 0
    draft: list[float] = field(default_factory=list)
    verify: list[float] = field(default_factory=list)
    other: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Aggregate:
    """The result of aggregating one window's rounds.

    Attributes:
        acceptance: one :class:`AcceptanceWindow` per acceptance key, sorted by key.
        cost: one :class:`CostWindow` per cost key, sorted by key.
        rounds: rounds that went into the aggregates.
        rejected: rounds left out because they failed validation, counted by reason.
    """

    acceptance: tuple[AcceptanceWindow, ...]
    cost: tuple[CostWindow, ...]
    rounds: int
    rejected: dict[str, int]


def percentiles(values: Sequence[float], qs: Sequence[float] = LATENCY_PERCENTILES) -> list[float]:
    """Linear-interpolated percentiles, as ``numpy.percentile``'s default; zeros for an empty sample.

    Pure Python on purpose: windows hold tens of values per key, where numpy's call overhead dominates.
    """
    if not values:
        return [0.0] * len(qs)
    xs = sorted(values)
    last = len(xs) - 1
    out = []
    for q in qs:
        pos = q / 100.0 * last  # numpy "linear": position (n - 1) * q between order statistics
        lo = int(pos)
        hi = min(lo + 1, last)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
    return out


def _stat(xs: list[float]) -> Stat:
    return Stat(count=len(xs), total=math.fsum(xs), sumsq=math.fsum(x * x for x in xs), max=max(xs, default=0.0))


def aggregate(rounds: Iterable[RoundRecord], buckets: BucketConfig = DEFAULT_BUCKETS) -> Aggregate:
    """Aggregate a window's rounds into acceptance and cost windows.

    Args:
        rounds: the rounds of one window (any order).
        buckets: bucket edges; the engine and the sidecar must agree on them.

    Returns:
        The :class:`Aggregate`; invalid rounds are left out and counted in ``rejected``.
    """
    acc: dict[AcceptanceKey, _AcceptanceAcc] = {}
    cost: dict[CostKey, _CostAcc] = {}
    rejected: dict[str, int] = {}
    ctx_edges = buckets.context_edges
    ctx_labels = buckets.context_labels()  # label i for bisect index i: the smallest edge >= context_len
    # (target, draft, request type, context bucket index, k, accepted, emitted) -> rows
    row_counts: dict[tuple[str, str, str, int, int, int, int], int] = {}
    get_count = row_counts.get
    n = 0
    rounds = list(rounds)
    for r, err in zip(rounds, check_rounds(rounds), strict=True):
        if err is not None:  # the wire's rules for a round: what the sidecar would refuse is left out here
            rejected[err.reason] = rejected.get(err.reason, 0) + 1
            continue
        n += 1
        tv, dv = r.target_version, r.draft_version
        max_ctx = 0
        emitted = 0
        wall = r.draft_s + r.verify_s + r.other_s + r.prefill_s  # what a row waited for this round's tokens
        lat: list[float] = []
        for row in r.rows:  # the hot loop: one tuple and one dict update per row, folded per key below
            ctx, e = row.context_len, row.emitted
            rkey = (tv, dv, row.request_type, bisect_left(ctx_edges, ctx), row.k, row.accepted, e)
            row_counts[rkey] = get_count(rkey, 0) + 1
            emitted += e
            if ctx > max_ctx:
                max_ctx = ctx
            if e:
                lat.append(wall / e)
        if not r.costed:  # its rows count above; its seconds are not a measurement of its k (RoundRecord.costed)
            continue
        cb = ctx_labels[bisect_left(ctx_edges, max_ctx)]
        ckey = (tv, dv, buckets.batch_bucket(r.batch_size), cb, r.max_k)
        c = cost.get(ckey)
        if c is None:
            c = cost[ckey] = _CostAcc()
        c.rounds += 1
        c.batch_rows += r.batch_size
        c.tokens_verified += r.tokens_verified
        c.emitted += emitted
        c.draft.append(r.draft_s)
        c.verify.append(r.verify_s)
        c.other.append(r.other_s)
        c.latencies.extend(lat)
    for (tv, dv, rt, ci, k, accepted, row_emitted), count in row_counts.items():
        key = (tv, dv, rt, ctx_labels[ci], k)
        a = acc.get(key)
        if a is None:
            a = acc[key] = _AcceptanceAcc(k)
        a.rows += count
        a.accepted += accepted * count
        a.emitted += row_emitted * count
        a.hist[accepted] += count
    return Aggregate(
        acceptance=tuple(_acceptance_window(key, a) for key, a in sorted(acc.items())),
        cost=tuple(_cost_window(key, c) for key, c in sorted(cost.items())),
        rounds=n,
        rejected=rejected,
    )


def _acceptance_window(key: AcceptanceKey, a: _AcceptanceAcc) -> AcceptanceWindow:
    tv, dv, rt, cb, k = key
    return AcceptanceWindow(
        target_version=tv, draft_version=dv, request_type=rt, context_bucket=cb, k=k,
        rows=a.rows, drafted=a.rows * k, accepted=a.accepted, emitted=a.emitted, hist=tuple(a.hist),
    )


def _cost_window(key: CostKey, c: _CostAcc) -> CostWindow:
    tv, dv, bb, cb, max_k = key
    p50, p95, p99 = percentiles(c.latencies)
    return CostWindow(
        target_version=tv, draft_version=dv, batch_bucket=bb, context_bucket=cb, max_k=max_k,
        rounds=c.rounds,
        tokens_verified=c.tokens_verified,  # packed (records.py): sum over rows of k + 1
        emitted=c.emitted, batch_rows=c.batch_rows,
        draft_s=_stat(c.draft), verify_s=_stat(c.verify), other_s=_stat(c.other),
        latency_p50=p50, latency_p95=p95, latency_p99=p99,
    )
