"""The simulator reads only its calibration, is seeded, and is fast."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from controller.offline.simulator import (
    Calibration,
    CalibrationError,
    cond_from_pmf,
    expected_goodput,
    pmf_from_cond,
    simulate,
    workload,
)
from policies import StaticPolicy

FIXTURE = Path(__file__).with_name("fixture_engine.json")


def test_calibration_reads_fixture() -> None:
    cal = Calibration(FIXTURE)
    assert cal.types == ["code", "prose", "structured"] and cal.batches == [1, 4, 16, 64] and cal.K == 8
    for ver in ("target-v1", "target-v2"):
        for t in cal.types:
            for cx in cal.contexts:
                p = cal.pmf(ver, t, cx, 5)
                assert p.shape == (6,) and p.sum() == pytest.approx(1.0)
    # measured points are reproduced exactly; between them the interpolation is monotone in batch
    assert cal.round_s(16, "short")[3] == pytest.approx(cal.cost[2, 0, 3])
    v = [cal.round_s(b, "long")[4, 1] for b in (1, 2, 4, 8, 16, 32, 64)]
    assert all(np.diff(v) > 0)
    with pytest.raises(CalibrationError):
        Calibration(FIXTURE.with_name("missing.json"))


def test_acceptance_round_trips_and_what_if_copies_leave_the_original_alone() -> None:
    cal = Calibration(FIXTURE)
    p = cal.acceptance("target-v1", "code", "short")  # [K+1, K+1]
    assert np.allclose(pmf_from_cond(cond_from_pmf(p), cal.K), p)
    # hand-built: alpha 0.5 at every position gives accepted = 0, 1, 2 with 1/2, 1/4, 1/4 at k = 2
    assert np.allclose(pmf_from_cond(np.full(3, 0.5), 3)[2, :3], [0.5, 0.25, 0.25])
    worse = cal.with_acceptance("target-v1", "code", "short", pmf_from_cond(cond_from_pmf(p) * 0.5, cal.K))
    assert worse.pmf("target-v1", "code", "short", 4)[0] > cal.pmf("target-v1", "code", "short", 4)[0]
    assert np.array_equal(cal.acceptance("target-v1", "code", "short"), p)
    slow = cal.with_cost_factor(2.0)
    assert slow.round_s(16, "short") == pytest.approx(2.0 * cal.round_s(16, "short"))
    with pytest.raises(ValueError, match="K \\+ 1"):
        cal.with_acceptance("target-v1", "code", "short", np.ones((2, 2)))


def test_simulation_is_seeded_and_honest() -> None:
    cal = Calibration(FIXTURE)
    specs = workload(cal.types, 20_000, seed=1)
    a = simulate(StaticPolicy(k=2), cal, specs, seed=4)
    b = simulate(StaticPolicy(k=2), cal, specs, seed=4)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.seconds, b.seconds)
    # simulated goodput agrees with the calibration's analytic expectation within noise
    expect = np.mean([expected_goodput(cal, s, [2, 2, 2]) for s in specs])
    assert a.tok_s == pytest.approx(expect, rel=0.03)


def test_simulator_covers_a_long_workload() -> None:
    # Speed is a benchmark matter (bench/policies.py reports it); here: a long workload runs to the end.
    cal = Calibration(FIXTURE)
    specs = workload(cal.types, 100_000, seed=2)
    res = simulate(StaticPolicy(k=3), cal, specs, seed=0)
    assert res.rounds.sum() > 50_000


def test_every_policy_spends_the_same_wall_time_in_every_stretch() -> None:
    # Windows last window_s for every policy: a round that overshoots one window is owed by the next, so tok/s is
    # not weighted by how each policy's round times round to whole rounds (k=0 and k=8 rounds differ several-fold).
    cal = Calibration(FIXTURE)
    specs = workload(cal.types, 20_000, seed=1)
    window_s = 0.5
    runs = [simulate(StaticPolicy(k=k), cal, specs, window_s=window_s, seed=4) for k in (0, 8)]
    for r in runs:
        clock = np.cumsum(r.seconds)
        ends = window_s * np.arange(1, len(specs) + 1)
        longest = float(np.max(r.seconds / r.rounds))  # one round's wall time, at most
        assert np.all(np.abs(clock - ends) <= 2 * longest)  # within a round (noise makes rounds differ a little)
    assert runs[0].seconds.sum() == pytest.approx(runs[1].seconds.sum(), rel=0.01)
