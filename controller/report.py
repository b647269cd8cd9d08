"""``spectune report --by k|position|cost``: views of the stored windows, as (title, columns, rows) of strings.

Conventions (``telemetry/records.py``): acceptance length = emitted tokens per row, counting the bonus token, as
vLLM does; the acceptance curve is P(accepted >= i | k) for i = 1..k, from each window's histogram of accepted
drafts; goodput = emitted tokens per second of round wall time (draft + verify + other), for the whole batch.
Windows are pooled by summing their counts, never by averaging their ratios.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from telemetry.records import AcceptanceWindow, CostWindow

View = tuple[str, list[str], list[list[str]]]
NO_VALUE = "-"


def report_by(view: str, acceptance: Sequence[AcceptanceWindow], cost: Sequence[CostWindow]) -> View:
    """One view of the windows: ``k``, ``position`` or ``cost``."""
    if view == "k":
        return by_k(acceptance)
    if view == "position":
        return by_position(acceptance)
    if view == "cost":
        return by_cost(cost)
    raise ValueError(f"unknown report view {view!r}: use k, position or cost")


def by_k(windows: Sequence[AcceptanceWindow]) -> View:
    """Per (versions, request type, k): rows, acceptance rate (accepted / drafted) and mean acceptance length."""
    sums: dict[tuple[str, str, str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for a in windows:
        s = sums[(a.target_version, a.draft_version, a.request_type, a.k)]
        s[0] += a.rows
        s[1] += a.drafted
        s[2] += a.accepted
        s[3] += a.emitted
    rows = [[t, d, rt, str(k), str(n), _ratio(acc, drafted, 3), _ratio(emitted, n, 3)]
            for (t, d, rt, k), (n, drafted, acc, emitted) in sorted(sums.items())]
    return ("acceptance length per k (emitted tokens per row, bonus token included)",
            ["target", "draft", "request type", "k", "rows", "acceptance rate", "mean acceptance length"], rows)


def by_position(windows: Sequence[AcceptanceWindow]) -> View:
    """Per (versions, request type, k > 0): P(accepted >= i | k) for i = 1..k, pooled over the windows."""
    hists: dict[tuple[str, str, str, int], list[int]] = {}
    skipped: dict[tuple[str, str, str, int], int] = defaultdict(int)
    for a in windows:
        if a.k == 0:
            continue
        key = (a.target_version, a.draft_version, a.request_type, a.k)
        if len(a.hist) != a.k + 1 or sum(a.hist) != a.rows:
            skipped[key] += a.rows  # a histogram that does not cover its rows cannot give the curve
            continue
        h = hists.setdefault(key, [0] * (a.k + 1))
        for i, n in enumerate(a.hist):
            h[i] += n
    rows = []
    for key in sorted(set(hists) | set(skipped)):
        h = hists.get(key, [])
        n = sum(h)
        curve = " ".join(_ratio(sum(h[i:]), n, 3) for i in range(1, key[3] + 1)) if n else NO_VALUE
        rows.append([*key[:3], str(key[3]), str(n), curve, str(skipped.get(key, 0))])
    return ("acceptance per position: P(accepted >= i | k), i = 1..k",
            ["target", "draft", "request type", "k", "rows", "P(accepted >= i), i = 1..k",
             "rows without a histogram"], rows)


def by_cost(windows: Sequence[CostWindow]) -> View:
    """Per (versions, batch bucket): rounds, mean batch size, mean round seconds, tokens verified per round and
    goodput."""
    sums: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0, 0, 0.0, 0, 0])
    ks: dict[tuple[str, str, int], set[int]] = defaultdict(set)
    for c in windows:
        key = (c.target_version, c.draft_version, c.batch_bucket)
        s = sums[key]
        s[0] += c.rounds
        s[1] += c.batch_rows
        s[2] += c.draft_s.total + c.verify_s.total + c.other_s.total
        s[3] += c.tokens_verified
        s[4] += c.emitted
        ks[key].add(c.max_k)
    rows = [[t, d, str(b), " ".join(str(k) for k in sorted(ks[(t, d, b)])), str(int(rounds)),
             _ratio(batch_rows, rounds, 1), _ratio(seconds * 1000, rounds, 2), _ratio(verified, rounds, 1),
             _ratio(emitted, seconds, 1)]
            for (t, d, b), (rounds, batch_rows, seconds, verified, emitted) in sorted(sums.items())]
    return ("cost per batch bucket (goodput: emitted tokens per second of round time)",
            ["target", "draft", "batch bucket", "largest k", "rounds", "mean batch", "mean round ms",
             "tokens verified / round", "goodput tok/s"], rows)


def _ratio(num: float, den: float, digits: int) -> str:
    return f"{num / den:.{digits}f}" if den else NO_VALUE
