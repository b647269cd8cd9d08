"""Policy.reopen: after an acceptance drift the bucket's evidence shrinks and its cells decide afresh; other
buckets and policies without a reopen rule are untouched."""

from __future__ import annotations

import numpy as np
import pytest

from policies import REGISTRY, GoodputPolicy
from telemetry.records import AcceptanceWindow, Bucket, CostWindow, RecordError, Stat


def _acc(rtype: str, hist: tuple[int, ...], ctx: str = "<=512") -> AcceptanceWindow:
    k, rows = len(hist) - 1, sum(hist)
    accepted = sum(i * n for i, n in enumerate(hist))
    return AcceptanceWindow("t1", "d1", rtype, ctx, k, rows, rows * k, accepted, accepted + rows, hist)


def _cost(bb: int, k: int) -> CostWindow:
    secs = 0.01 * (1 + bb / 4) * (1 + 0.2 * k)
    st = Stat(10, 10 * secs, 10 * secs * secs, secs)
    zero = Stat(10, 0.0, 0.0, 0.0)
    return CostWindow("t1", "d1", bb, "<=512", k, 10, 10 * bb * (k + 1), 10 * bb, 10 * bb, zero, st, zero,
                      secs, secs, secs)


def _fed() -> GoodputPolicy:
    p = GoodputPolicy(k_max=4, seed=0)
    for _ in range(40):
        p.observe(_acc("code", (10, 10, 20, 30, 30)))
        p.observe(_acc("prose", (40, 30, 20, 5, 5)))
        p.observe(_acc("code", (10, 10, 20, 30, 30), ctx="<=2048"))
        for bb in (1, 8):
            p.observe(_cost(bb, 2))
            p.observe(_cost(bb, 4))
    return p


def _strength(p: GoodputPolicy, rtype: str, ctx: str = "<=512") -> float:
    a, b = p._acc.beta_params(("t1", "d1"), rtype, ctx)
    return float(a[0] + b[0])


def test_reopen_shrinks_the_buckets_evidence_and_lets_its_cells_decide_afresh() -> None:
    p = _fed()
    for bb in (1, 8):
        p.decide(Bucket("t1", "d1", "code", bb, "<=512"))
    cells = [c for key, c in p._cells.items() if key[3] == "<=512"]
    for c in cells:
        c.hold, c.probed = 3, True
    before = {(rt, ctx): _strength(p, rt, ctx) for rt, ctx in (("code", "<=512"), ("prose", "<=512"),
                                                                ("code", "<=2048"))}
    mean_before = p._acc.cond(("t1", "d1"), "code", "<=512", None)
    p.reopen("t1", "d1", "code", "<=512")
    assert _strength(p, "code") <= p._acc.bucket_strength + p.reopen_rows + 1e-9 < before[("code", "<=512")]
    assert _strength(p, "prose") == before[("prose", "<=512")]  # other buckets keep their evidence
    assert _strength(p, "code", "<=2048") == before[("code", "<=2048")]
    # The curve's shape is kept (one factor on every position); the mean moves only toward the type curve.
    assert np.allclose(p._acc.cond(("t1", "d1"), "code", "<=512", None), mean_before, atol=0.1)
    assert all(c.hold == 0 and not c.probed and c.epoch == -1 for c in cells)
    d = p.decide(Bucket("t1", "d1", "code", 1, "<=512"))
    assert 0 <= d.k <= 4
    snap = p.snapshot()
    q = GoodputPolicy(k_max=4, seed=0)
    q.restore(snap)
    assert q.snapshot() == snap


def test_reopen_of_an_unknown_bucket_is_harmless_and_bad_names_are_refused() -> None:
    p = _fed()
    snap = p.snapshot()
    p.reopen("t9", "d9", "code", "<=512")
    assert p.snapshot() == snap
    with pytest.raises(RecordError):
        p.reopen("t1", "d1", "", "<=512")


@pytest.mark.parametrize("name", ["static", "ucb"])
def test_reopen_defaults_to_nothing(name: str) -> None:
    p = REGISTRY[name](k_max=4)
    snap = p.snapshot()
    p.reopen("t1", "d1", "code", "<=512")
    assert p.snapshot() == snap
