"""The drift benchmark's logic on small inputs (the fixture calibration, tiny plans): injected changes are what
they say, windows reach the sidecar's AlertManager, drops are caught and nothing fires on a stationary stretch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import drift
from controller.offline.simulator import BASE_VERSION, Calibration, WindowSpec, expected_goodput

FIXTURE = Path(__file__).parents[1] / "policies" / "fixture_engine.json"
TINY = drift.SimPlan(stationary_rounds=3000, stationary_seeds=1, seeds_per_scenario=2, pre_rounds=(1500, 1600),
                     watch_rounds=1500, goodput_runs=1, goodput_warm_rounds=1500, goodput_after_rounds=400)


@pytest.fixture(scope="module")
def cal() -> Calibration:
    return Calibration(FIXTURE)


@pytest.fixture(scope="module")
def spec() -> WindowSpec:
    return WindowSpec(drift.BATCH, drift.CONTEXT, drift.MIX, BASE_VERSION)


@pytest.mark.parametrize("drop", drift.DROPS)
def test_a_drop_lowers_the_acceptance_rate_at_k_by_exactly_that(cal: Calibration, drop: float) -> None:
    k = 3
    before = drift.rate_at(cal.pmf(BASE_VERSION, "code", "short", k), k)
    after = drift.with_drop(cal, BASE_VERSION, "code", "short", k, drop)
    assert drift.rate_at(after.pmf(BASE_VERSION, "code", "short", k), k) == pytest.approx(before - drop, abs=1e-6)
    # Only that bucket moved, and the original calibration is untouched.
    assert np.array_equal(after.pmf(BASE_VERSION, "prose", "short", k), cal.pmf(BASE_VERSION, "prose", "short", k))
    assert drift.rate_at(cal.pmf(BASE_VERSION, "code", "short", k), k) == pytest.approx(before)


def test_cost_and_schema_changes(cal: Calibration) -> None:
    slow = drift.with_cost(cal, drift.COST_FACTOR)
    assert np.allclose(slow.round_s(16, "short"), drift.COST_FACTOR * cal.round_s(16, "short"))
    schema = drift.with_acceptance_of(cal, BASE_VERSION, "structured", "short", "target-v2")
    assert np.array_equal(schema.pmf(BASE_VERSION, "structured", "short", 4), cal.pmf("target-v2", "structured",
                                                                                      "short", 4))


def test_oracle_ks_beat_any_single_k(cal: Calibration, spec: WindowSpec) -> None:
    ks, g = drift.oracle_ks(cal, spec)
    assert len(ks) == len(cal.types)
    for k in range(cal.K + 1):
        assert g >= expected_goodput(cal, spec, (k,) * len(cal.types)) - 1e-9


def test_windows_are_batches_with_rounds_counted(cal: Calibration, spec: WindowSpec) -> None:
    ws = drift.windows(drift._Fixed({t: 2 for t in cal.types}, cal.K), [(0, cal)], spec, seed=1)
    first, second = next(ws), next(ws)
    assert first.rounds > 0 and second.rounds_before == first.rounds
    assert {a.request_type for a in first.batch.acceptance} == set(cal.types)
    assert all(a.k == 2 for a in first.batch.acceptance) and first.batch.cost


def test_stationary_is_quiet_and_a_large_drop_is_caught(cal: Calibration, spec: WindowSpec) -> None:
    ks = dict(zip(cal.types, drift.oracle_ks(cal, spec)[0], strict=True))
    quiet = drift.merge_stationary([drift.stationary_seed(cal, spec, ks, TINY.stationary_rounds, 1.0, ["adwin"], 0)],
                                   ["adwin"])
    assert quiet["rounds"] >= TINY.stationary_rounds and quiet["detectors"]["adwin"]["rounds"] == quiet["rounds"]
    assert quiet["detectors"]["adwin"]["false_alarms_per_million_rounds"] == 0
    caught = drift.injected(cal, spec, ks, TINY, ["adwin"], 0.20, seed0=5)
    d = caught["detectors"]["adwin"]
    assert d["missed"] == 0 and d["injected"] == 2 and d["false_alarms_before_change"] == 0
    assert 0 < d["detection_delay_rounds"]["median"] <= 300
    assert d["detection_delay_rows"]["median"] > 0
    assert [r["request_type"] for r in caught["runs"]] == cal.types[:2]  # injections rotate over the types


def test_goodput_reaction_reports_recovery(cal: Calibration, spec: WindowSpec) -> None:
    r = drift.goodput_reaction(cal, spec, TINY, drift.SCHEMA, True, seed=3, rtype="structured")
    assert r["alert_delay_rounds"] is not None and r["alert_delay_rounds"] > 0
    assert r["trace"] and r["trace"][-1][0] >= TINY.goodput_after_rounds
    assert r["rounds_to_90_after_drift"] is None or r["rounds_to_90_after_drift"] >= 0


def test_targets_are_judged_from_the_figures() -> None:
    def det(median: float | None, missed: int) -> dict[str, Any]:
        return {"adwin": {"detection_delay_rounds": {"median": median}, "missed": missed}}

    sim: dict[str, Any] = {
        "scenarios": {"acceptance_drop_0.05": {"drop": 0.05, "detectors": det(None, 3)},
                      "acceptance_drop_0.10": {"drop": 0.10, "detectors": det(120.0, 0)},
                      "structured_schema_drift": {"drop": drift.SCHEMA, "detectors": det(40.0, 0)}},
        "stationary": {"detectors": {"adwin": {"false_alarms_per_million_rounds": 0.0}}},
        "goodput": {"acceptance_drop_0.10": {"rounds_to_90_after_drift": {"median": 0.0}, "never_recovered": 0}},
    }
    t = drift.evaluate(sim, "adwin")
    assert all(v["met"] for v in t.values())  # a 0.05 drop missed is not a target
    sim["scenarios"]["acceptance_drop_0.10"]["detectors"] = det(400.0, 1)
    t = drift.evaluate(sim, "adwin")
    assert not t["median_delay_rounds_at_ge_0.10"]["met"] and not t["missed_at_ge_0.10"]["met"]
