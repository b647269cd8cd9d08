"""goodput with ``start_k``: a deployment's static k is where every cell starts, and nothing is adopted unmeasured."""

from __future__ import annotations

import pytest

from policies import DecisionKind, GoodputPolicy
from telemetry.records import AcceptanceWindow, Bucket, CostWindow, Stat

CELL = Bucket("t1", "d1", "code", 4, "<=512")


def _cost(bb: int, k: int, secs: float) -> CostWindow:
    st = Stat(10, 10 * secs, 10 * secs * secs, secs)
    zero = Stat(10, 0.0, 0.0, 0.0)
    return CostWindow(target_version="t1", draft_version="d1", batch_bucket=bb, context_bucket="<=512", max_k=k,
                      rounds=10, tokens_verified=10 * bb * (k + 1), emitted=10 * bb, batch_rows=10 * bb,
                      draft_s=zero, verify_s=st, other_s=zero, latency_p50=secs, latency_p95=secs,
                      latency_p99=secs)


def _acc(k: int, hist: tuple[int, ...]) -> AcceptanceWindow:
    rows = sum(hist)
    acc = sum(i * n for i, n in enumerate(hist))
    return AcceptanceWindow(target_version="t1", draft_version="d1", request_type="code", context_bucket="<=512",
                            k=k, rows=rows, drafted=rows * k, accepted=acc, emitted=acc + rows, hist=hist)


def _flat_cost(p: GoodputPolicy) -> None:
    """Drafting costs almost nothing in two other cells: every accepted draft is worth its k."""
    for bb in (1, 16):
        p.observe(_cost(bb, 0, 0.010))
        p.observe(_cost(bb, 4, 0.0102))


def test_a_new_cell_starts_at_start_k_whatever_the_prior_guesses() -> None:
    # Every draft accepted and drafting nearly free: the prior's best is the deepest k, 4; the deployment said 2.
    free = GoodputPolicy(k_max=4, seed=0)
    safe = GoodputPolicy(k_max=4, seed=0, start_k=2)
    for p in (free, safe):
        _flat_cost(p)
        p.observe(_acc(4, (0, 0, 0, 0, 400)))
    assert free.decide(CELL).k == 4
    d = safe.decide(CELL)
    assert (d.k, d.kind, d.exploring) == (2, DecisionKind.FIRST, False)
    # A table asked for before any exploring decision starts the cell at start_k too.
    quiet = GoodputPolicy(k_max=4, seed=0, start_k=2)
    _flat_cost(quiet)
    quiet.observe(_acc(4, (0, 0, 0, 0, 400)))
    assert quiet.decide(CELL, explore=False).k == 2


def test_a_better_choice_is_measured_once_before_it_is_adopted() -> None:
    p = GoodputPolicy(k_max=4, seed=0, start_k=2, hold_decisions=0)
    _flat_cost(p)
    p.observe(_acc(4, (0, 0, 0, 0, 400)))
    assert p.decide(CELL).k == 2  # first decision: start_k
    p.observe(_cost(4, 2, 0.0101))  # the cell measures its incumbent
    probe = p.decide(CELL)
    # The mean prefers k = 4, which this cell never served: it is served once, to measure it, not adopted.
    assert (probe.k, probe.kind, probe.exploring) == (4, DecisionKind.PROBE, True)
    assert p.decide(CELL, explore=False).k == 2  # the incumbent is still 2
    p.observe(_cost(4, 4, 0.0102))  # measured as cheap as predicted, but one window of 10 rounds is half a window
    again = p.decide(CELL)  # of evidence: served again, still not adopted
    assert (again.k, again.kind) == (4, DecisionKind.PROBE) and p.decide(CELL, explore=False).k == 2
    p.observe(_cost(4, 4, 0.0102))
    d = p.decide(CELL)
    assert (d.k, d.kind) == (4, DecisionKind.SWITCH)
    assert p.decide(CELL, explore=False).k == 4


def test_a_probe_that_measures_dear_is_not_adopted() -> None:
    p = GoodputPolicy(k_max=4, seed=0, start_k=2, hold_decisions=0, explore_radius=1)
    _flat_cost(p)
    p.observe(_acc(4, (0, 0, 0, 0, 400)))
    p.decide(CELL)
    p.observe(_cost(4, 2, 0.0101))
    assert p.decide(CELL).kind is DecisionKind.PROBE
    for _ in range(3):  # in this cell k = 4 turns out three times dearer than k = 2
        p.observe(_cost(4, 4, 0.030))
    d = p.decide(CELL)
    assert d.kind is not DecisionKind.SWITCH and p.decide(CELL, explore=False).k == 2


def test_the_measured_choices_survive_a_snapshot() -> None:
    p = GoodputPolicy(k_max=4, seed=0, start_k=2, hold_decisions=0)
    _flat_cost(p)
    p.observe(_acc(4, (0, 0, 0, 0, 400)))
    p.decide(CELL)
    p.observe(_cost(4, 2, 0.0101))
    assert p.decide(CELL).kind is DecisionKind.PROBE
    p.observe(_cost(4, 4, 0.0102))
    p.observe(_cost(4, 4, 0.0102))
    q = GoodputPolicy(k_max=4, seed=0, start_k=2, hold_decisions=0)
    q.restore(p.snapshot())
    assert q.decide(CELL).kind is DecisionKind.SWITCH  # not probed again: the restored cell remembers it measured 4


@pytest.mark.parametrize("bad", [-1, 5])
def test_start_k_outside_the_bounds_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="start_k"):
        GoodputPolicy(k_max=4, start_k=bad)


def test_with_start_k_the_first_cost_probe_is_not_speculation_off() -> None:
    # A cell beyond every measured batch is probed at a second k; without start_k, while k = 0 was never measured
    # anywhere, that probe is k = 0 (a whole decision with speculation off); with start_k it is another k > 0.
    def probed(start_k: int | None) -> int:
        p = GoodputPolicy(k_max=4, seed=0, start_k=start_k)
        p.observe(_acc(2, (10, 20, 70)))
        p.observe(_cost(4, 2, 0.0101))  # the only cell, seen at k = 2 only
        d = p.decide(CELL)  # the first decision, then the cost probe that overrides it
        assert d.kind is DecisionKind.PROBE and d.reason.startswith("cost probe")
        return d.k

    assert probed(None) == 0
    assert probed(2) == 4
