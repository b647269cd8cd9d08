"""Projecting spectune's (request type, batch, context) table onto what an engine can take, and what it costs.

Engines take a schedule keyed by batch size only (or batch size and context). For each batch bucket the
projection keeps one of the k values the table uses: the one with the highest predicted goodput over the observed
traffic mix of that batch bucket, under one physical constraint, that **k never rises with batch size**
(:func:`non_increasing`). A round's verification grows with the tokens verified while a draft step's cost does
not, so for the same traffic a larger batch is never served better deeper than a smaller one; a schedule that
says otherwise (k = 2 at batch 5-8, then 3 at 9-16) fits the noise of a few windows, and one that speculates at
k = 5 past the largest batch ever measured (the table's default there) is the kind of choice an operator stops
trusting the tool over. Batch buckets with no traffic take the model's own guess, held between the ks of the
nearest measured buckets around them (:func:`within_measured`).

The mix comes from the store: the share of rows per (request type, context bucket) from acceptance windows, and
the share of rows per batch bucket within a context bucket from cost windows.

Predicted goodput is the analytic model of :func:`policies.analytic.speedup` (Leviathan et al. 2023, Theorem
3.8), per row: ``speedup(alpha, k, c)`` with

- ``alpha`` per (request type, context bucket): pooled per-position acceptance of the stored histograms
  (accepted drafts over positions tried), falling back to the request type's, then every window's, then
  ``PRIOR_ALPHA``;
- ``c`` per (batch bucket, context bucket): one draft step's seconds over the verify seconds of a round, from cost
  windows with k > 0, falling back to the batch bucket's, every window's, then ``PRIOR_DRAFT_COST``.

Tokens per second are ``speedup * batch / forward seconds`` where cost windows give a round's verify seconds for
the cell; without them the figure is the speedup over plain decoding alone. The per-row model ignores that rows
of one round wait for its largest k, so it flatters the full table a little on engines with one k per batch.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from policies.analytic import speedup
from telemetry.policy_table import lookup
from telemetry.records import DEFAULT_BUCKETS, WILDCARD, AcceptanceWindow, Bucket, CostWindow, PolicyTable
from telemetry.wire import parse_bucket_key

PRIOR_ALPHA = 0.6  # the acceptance prior of policies' AcceptanceModel
PRIOR_DRAFT_COST = 0.1  # one draft step per verify forward, as policies._cost's PRIOR_DRAFT_PER_K

Cell = tuple[str, str]  # (request type, context bucket)
KFn = Callable[[str, int, str], int]  # (request type, batch bucket, context bucket) -> k
V = TypeVar("V")


@dataclass(frozen=True)
class Traffic:
    """The observed traffic mix and the model inputs derived from stored windows."""

    mix: dict[Cell, float]  # share of rows per (request type, context bucket); sums to 1
    batch_share: dict[str, dict[int, float]]  # context bucket -> batch bucket -> share within the context bucket
    alpha: dict[Cell, float]  # per-token acceptance per cell
    draft_cost: dict[tuple[int, str], float]  # c per (batch bucket, context bucket)
    forward_s: dict[tuple[int, str], float]  # verify seconds of one round per (batch bucket, context bucket)
    batches: tuple[int, ...]  # batch buckets the schedules cover
    observed: bool  # whether any window was stored (else uniform weights and priors)
    versions: tuple[str, str] = (WILDCARD, WILDCARD)  # (target, draft) the table is looked up for
    notes: tuple[str, ...] = field(default_factory=tuple)

    def weight(self, cell: Cell, batch: int) -> float:
        share = self.batch_share.get(cell[1]) or self.batch_share.get("*") or {}
        return self.mix[cell] * (share.get(batch, 0.0) if share else 1.0 / len(self.batches))

    def alpha_of(self, cell: Cell) -> float:
        return self.alpha.get(cell, PRIOR_ALPHA)

    def goodput(self, cell: Cell, batch: int, k: int) -> float:
        """Predicted tokens/s of rows of ``cell`` at ``batch`` drafting k (a speedup factor when no seconds)."""
        key = (batch, cell[1])
        c = self.draft_cost.get(key, self.draft_cost.get((batch, "*"), self.draft_cost.get((0, "*"),
                                                                                            PRIOR_DRAFT_COST)))
        s = speedup(self.alpha_of(cell), k, c)
        fwd = self.forward_s.get(key) or self.forward_s.get((batch, "*"))
        return s * batch / fwd if fwd else s

    @property
    def has_seconds(self) -> bool:
        return bool(self.forward_s)


def traffic_from_windows(acceptance: Sequence[AcceptanceWindow], cost: Sequence[CostWindow],
                         table: PolicyTable, versions: tuple[str, str] | None = None,
                         batches: Iterable[int] = DEFAULT_BUCKETS.batch_edges) -> Traffic:
    """The traffic mix and model inputs of stored windows (pure; :func:`traffic_from_store` reads them)."""
    acceptance = [a for a in acceptance if versions is None or (a.target_version, a.draft_version) == versions]
    cost = [c for c in cost if versions is None or (c.target_version, c.draft_version) == versions]
    if versions is None:
        versions = _versions(acceptance, cost, table)
    batch_set = sorted(set(batches) | _table_batches(table) | {c.batch_bucket for c in cost})
    rows: Counter[Cell] = Counter()
    succ: dict[Cell, float] = defaultdict(float)
    tried: dict[Cell, float] = defaultdict(float)
    for a in acceptance:
        cell = (a.request_type, a.context_bucket)
        rows[cell] += a.rows
        tail = a.rows
        for i in range(a.k):  # position i + 1 is tried by rows that accepted >= i, kept by rows that accepted > i
            tried[cell] += tail
            tail -= a.hist[i]
            succ[cell] += tail
    notes = []
    if not rows:
        cells = _table_cells(table)
        rows = Counter(dict.fromkeys(cells, 1))
        notes.append("no acceptance windows stored: every (request type, context) weighs the same, alpha is the "
                     f"prior {PRIOR_ALPHA}")
    total = sum(rows.values())
    alpha = _pooled(succ, tried, rows)
    share: dict[str, Counter[int]] = defaultdict(Counter)
    draft_per_k: dict[tuple[int, str], float] = defaultdict(float)
    verify: dict[tuple[int, str], float] = defaultdict(float)
    rounds: dict[tuple[int, str], float] = defaultdict(float)
    verify_k: dict[tuple[int, str], float] = defaultdict(float)
    for c in cost:
        for ctx in (c.context_bucket, "*"):
            share[ctx][c.batch_bucket] += c.batch_rows
            for key in ((c.batch_bucket, ctx), (0, "*")) if ctx == "*" else ((c.batch_bucket, ctx),):
                rounds[key] += c.rounds
                verify[key] += c.verify_s.total
                if c.max_k > 0:
                    draft_per_k[key] += c.draft_s.total / c.max_k
                    verify_k[key] += c.verify_s.total
    if not cost:
        notes.append(f"no cost windows stored: batch buckets weigh the same, c is the prior {PRIOR_DRAFT_COST}, "
                     "and goodput is a speedup over plain decoding, not tokens/s")
    batch_share = {ctx: {b: n / sum(cnt.values()) for b, n in cnt.items()} for ctx, cnt in share.items()}
    draft_cost = {key: draft_per_k[key] / verify_k[key] for key in draft_per_k if verify_k[key] > 0}
    forward = {key: verify[key] / rounds[key] for key in rounds if rounds[key] > 0 and key[0] > 0}
    return Traffic(mix={cell: n / total for cell, n in rows.items()}, batch_share=batch_share, alpha=alpha,
                   draft_cost=draft_cost, forward_s=forward, batches=tuple(batch_set), observed=bool(acceptance),
                   versions=versions, notes=tuple(notes))


def _pooled(succ: dict[Cell, float], tried: dict[Cell, float], rows: Counter[Cell]) -> dict[Cell, float]:
    """alpha per cell, falling back to its request type's, then to every cell's pooled acceptance."""
    by_type_s: dict[str, float] = defaultdict(float)
    by_type_n: dict[str, float] = defaultdict(float)
    for (rt, _), n in tried.items():
        by_type_s[rt] += succ[(rt, _)]
        by_type_n[rt] += n
    all_n = sum(tried.values())
    glob = sum(succ.values()) / all_n if all_n else PRIOR_ALPHA
    out = {}
    for cell in rows:
        if tried.get(cell):
            out[cell] = succ[cell] / tried[cell]
        elif by_type_n.get(cell[0]):
            out[cell] = by_type_s[cell[0]] / by_type_n[cell[0]]
        else:
            out[cell] = glob
    return out


def _versions(acc: Sequence[AcceptanceWindow], cost: Sequence[CostWindow], table: PolicyTable) -> tuple[str, str]:
    """The (target, draft) pair with the most rows, else the one the table names most, else wildcards."""
    seen: Counter[tuple[str, str]] = Counter()
    for a in acc:
        seen[(a.target_version, a.draft_version)] += a.rows
    for c in cost:
        seen[(c.target_version, c.draft_version)] += c.batch_rows
    if not seen:
        for key in table.entries:
            t, d, *_ = parse_bucket_key(key)
            if WILDCARD not in (t, d):
                seen[(t, d)] += 1
    return seen.most_common(1)[0][0] if seen else (WILDCARD, WILDCARD)


def _table_batches(table: PolicyTable) -> set[int]:
    return {p for key in table.entries if (p := parse_bucket_key(key)[3]) is not None}


def _table_cells(table: PolicyTable) -> list[Cell]:
    parts = [parse_bucket_key(key) for key in table.entries]
    types = sorted({p[2] for p in parts} - {WILDCARD}) or [WILDCARD]
    ctxs = sorted({p[4] for p in parts} - {WILDCARD}) or [WILDCARD]
    return [(t, c) for t in types for c in ctxs]


def table_k(table: PolicyTable, traffic: Traffic) -> KFn:
    """The full table as a function (request type, batch, context) -> k."""
    t, d = traffic.versions
    return lambda rt, b, ctx: lookup(table, Bucket(t, d, rt, b, ctx))


def predicted(traffic: Traffic, k_of: KFn, batches: Iterable[int] | None = None) -> float:
    """Traffic-weighted predicted goodput of a decision function over ``batches`` (default: all)."""
    bs = list(traffic.batches if batches is None else batches)
    num = den = 0.0
    for cell in traffic.mix:
        for b in bs:
            w = traffic.weight(cell, b)
            if w > 0:
                num += w * traffic.goodput(cell, b, k_of(cell[0], b, cell[1]))
                den += w
    return num / den if den else 0.0


def k_scores(traffic: Traffic, full: KFn, batches: Iterable[int], contexts: set[str] | None = None,
             candidates: Iterable[int] | None = None) -> dict[int, float]:
    """k -> predicted goodput summed over the traffic of ``batches`` (and ``contexts``), for ``candidates``
    (default: the ks the full table uses there); without observed windows, k -> the share of that traffic the
    table gives k (a vote). Weights are the traffic's own, so the scores of two batch buckets add up."""
    bs = list(batches)
    cells = [c for c in traffic.mix if contexts is None or c[1] in contexts]
    if not cells and contexts:  # no traffic seen in these contexts: the request types seen, at these contexts
        cells = [(rt, ctx) for rt in sorted({c[0] for c in traffic.mix}) for ctx in sorted(contexts)]
    weights = {(cell, b): traffic.weight(cell, b) if cell in traffic.mix else 0.0 for cell in cells for b in bs}
    if sum(weights.values()) <= 0:  # no traffic seen there: every cell weighs the same
        weights = {key: 1.0 for key in weights}
    cands = sorted(set(candidates) if candidates is not None else {full(cell[0], b, cell[1]) for cell, b in weights})
    if not traffic.observed:
        votes: dict[int, float] = dict.fromkeys(cands, 0.0)
        for (cell, b), w in weights.items():
            k = full(cell[0], b, cell[1])
            if k in votes:
                votes[k] += w
        return votes
    return {k: sum(w * traffic.goodput(cell, b, k) for (cell, b), w in weights.items()) for k in cands}


def best_k(traffic: Traffic, full: KFn, batches: Iterable[int], contexts: set[str] | None = None) -> int:
    """The k, among those the full table uses in ``batches`` (and ``contexts``), with the highest predicted
    goodput over their traffic; without observed windows, the k most of their traffic gets (ties: the smaller)."""
    return _argmax(k_scores(traffic, full, batches, contexts))


def _argmax(scores: Mapping[int, float]) -> int:
    """The k with the highest score (ties: the smaller)."""
    return max(scores, key=lambda k: (scores[k], -k))


def non_increasing(scores: Mapping[int, Mapping[int, float]]) -> dict[int, int]:
    """Batch bucket -> k maximising the summed score, with k never rising from one batch bucket to a larger one.

    ``scores`` maps each batch bucket to ``{k: score}``; a k a bucket has no score for is not chosen there unless
    nothing else keeps the schedule non-increasing. A dynamic programme over the buckets in ascending order (a
    few buckets x a few ks). Among schedules of equal score the one with the smaller ks wins (drafting costs
    memory and latency for nothing).
    """
    order = sorted(scores)
    if not order:
        return {}
    ks = sorted(set().union(*(set(v) for v in scores.values())))
    neg = float("-inf")
    # best[k]: (score, -(sum of ks)) of the best schedule of the buckets so far ending at k
    best: dict[int, tuple[float, int]] = {k: (scores[order[0]].get(k, neg), -k) for k in ks}
    back: list[dict[int, int]] = []  # back[i][k]: the k of bucket i before, on the best schedule ending at k
    for b in order[1:]:
        nxt: dict[int, tuple[float, int]] = {}
        prev: dict[int, int] = {}
        for k in ks:
            p = max((kk for kk in ks if kk >= k), key=lambda kk: best[kk])
            s, t = best[p]
            nxt[k] = (s + scores[b].get(k, neg), t - k)
            prev[k] = p
        best = nxt
        back.append(prev)
    k = max(ks, key=lambda kk: best[kk])
    out = {order[-1]: k}
    for i in range(len(order) - 1, 0, -1):
        k = back[i - 1][k]
        out[order[i - 1]] = k
    return out


def shallower(used: Iterable[int], here: Iterable[int]) -> list[int]:
    """The candidates of one bucket under :func:`non_increasing`: the ks ``here`` (what the table uses in it) and
    every smaller k in ``used`` (what it uses anywhere). The smallest k used anywhere is a candidate everywhere, so
    a non-increasing schedule always exists."""
    top = max(here, default=0)
    return sorted({k for k in used if k <= top} | set(here))


def within_measured(schedule: Mapping[int, int], measured: Iterable[int]) -> dict[int, int]:
    """``schedule`` with each bucket nothing measured held between the ks of the nearest measured buckets around
    it: no deeper than the measured bucket below it (past the largest batch measured, the largest's k) and no
    shallower than the one above it. Measured buckets keep their k."""
    m = sorted(b for b in set(measured) if b in schedule)
    out = dict(schedule)
    for b, k in schedule.items():
        if b in m:
            continue
        below = [x for x in m if x < b]
        above = [x for x in m if x > b]
        lo = schedule[above[0]] if above else 0
        hi = schedule[below[-1]] if below else max(k, lo)
        out[b] = min(max(k, lo), hi)
    return out


def project_batches(traffic: Traffic, full: KFn) -> dict[int, int]:
    """Batch bucket -> k (a batch-size-only schedule): the best non-increasing schedule over the batch buckets
    with traffic, the others held between them (see the module docstring)."""
    return _project(traffic, full, None)


def project_grid(traffic: Traffic, full: KFn, contexts: Sequence[str]) -> dict[tuple[int, str], int]:
    """(batch bucket, context bucket) -> k (vLLM's context-dependent schedule), non-increasing in batch within
    each context bucket."""
    out: dict[tuple[int, str], int] = {}
    for ctx in contexts:
        out.update({(b, ctx): k for b, k in _project(traffic, full, {ctx}).items()})
    return out


def per_context(grid: Mapping[tuple[int, str], V], f: Callable[[str, dict[int, V]], Mapping[int, int]]
                ) -> dict[tuple[int, str], int]:
    """A batch-bucket function applied to each context bucket's slice of a (batch bucket, context bucket) grid:
    ``f(context, {batch bucket: value})`` -> ``{batch bucket: k}``."""
    out: dict[tuple[int, str], int] = {}
    for ctx in dict.fromkeys(c for _, c in grid):
        out.update({(b, ctx): k for b, k in f(ctx, {b: v for (b, c), v in grid.items() if c == ctx}).items()})
    return out


def _project(traffic: Traffic, full: KFn, contexts: set[str] | None) -> dict[int, int]:
    own = {b: k_scores(traffic, full, [b], contexts) for b in traffic.batches}  # over the ks the table uses there
    guess = {b: _argmax(sc) for b, sc in own.items()}  # best_k, bucket by bucket
    cells = [c for c in traffic.mix if contexts is None or c[1] in contexts]
    measured = [b for b in traffic.batches if any(traffic.weight(c, b) > 0 for c in cells)]
    if not measured:
        return guess
    # a bucket chooses among the ks the table uses there and the smaller ks it uses anywhere: the constraint may
    # make a bucket draft less than its table says, never more
    used = set().union(*own.values())
    chosen = non_increasing({b: k_scores(traffic, full, [b], contexts, shallower(used, own[b])) for b in measured})
    return within_measured({**guess, **chosen}, measured)


def projection_loss(full: float, projected: float) -> tuple[float, str | None]:
    """The share of the full table's predicted goodput the projection loses, and a note when it predicts more.

    A projection only restricts the table's decisions (one k per batch bucket, or per engine), so against a table
    that is the prediction's own optimum it cannot gain. When the exported schedule predicts more, the table is
    not that optimum under this prediction (tuned with another cost source or on other windows, or with too few
    trials): nothing is lost, and the note says so instead of printing a negative loss.

    Returns:
        ``(loss >= 0, note or None)``; ``loss`` is a fraction of ``full`` (0 when ``full`` is not positive).
    """
    if full <= 0:
        return 0.0, None
    loss = 1.0 - projected / full
    if loss >= 0:
        return loss, None
    return 0.0, (f"the exported schedule predicts {-100 * loss:.1f}% more than the full table under this prediction: "
                 "the table is not its optimum (tuned with another cost source or on other windows, or with too few "
                 "trials), so nothing is lost to the projection")
