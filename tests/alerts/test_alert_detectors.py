"""Change detection on seeded synthetic windows: quiet when nothing moves, prompt when acceptance or cost does.

Unit of delay: a round. The watched bucket is assumed to get one row per round (a sparse bucket: a batch of 32
rows spread over three request types, four context buckets and a few k), ten rounds to a window, so the
delay in rounds is the delay in rows; a denser bucket is caught proportionally sooner.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from alert_synth import acceptance_hists, acceptance_rate, acceptance_window, cost_window, positional_hists

from controller.service.alerts import (
    ACCEPTANCE_MONITOR,
    AlertConfig,
    AlertManager,
    DetectorSpec,
    MonitorConfig,
    estimate_change_point,
)
from telemetry.alerts import ACCEPTANCE_DRIFT, COST_DRIFT, FIRST_DRAFT_STATISTIC, Alert

K = 4
ALPHA = 0.8
ROWS_PER_WINDOW = 10  # one row per round, ten rounds per window


def _detections(m: AlertManager) -> int:
    return sum(v for name, v in m.stats.items() if name.startswith("detections_"))


def test_acceptance_detector_is_quiet_on_1e5_stationary_windows() -> None:
    m = AlertManager()
    hists = acceptance_hists(np.random.default_rng(1), 100_000, 8, K, ALPHA)  # 800k rows
    for i, h in enumerate(hists):
        assert m.observe_acceptance(acceptance_window(h, K), float(i)) is None
    assert _detections(m) == 0, dict(m.stats)


def test_cost_detector_is_quiet_on_1e5_stationary_windows() -> None:
    m = AlertManager()
    rng = np.random.default_rng(2)
    for i in range(100_000):
        assert m.observe_cost(cost_window(1e-3 * rng.lognormal(0.0, 0.2, size=10)), float(i)) is None
    assert _detections(m) == 0, dict(m.stats)


def _acceptance_delay(seed: int, drop: float, m: AlertManager | None = None) -> tuple[int | None, Alert | None]:
    """Rounds from the change to the alert of the per-k monitor (None: missed within 3000 rounds), and the alert."""
    m = m or AlertManager(AlertConfig(first_draft=None))
    rng = np.random.default_rng(seed)
    before, after = 300, 300
    hists = np.concatenate([acceptance_hists(rng, before, ROWS_PER_WINDOW, K, ALPHA),
                            acceptance_hists(rng, after, ROWS_PER_WINDOW, K, ALPHA - drop)])
    for i, h in enumerate(hists):
        alert = m.observe_acceptance(acceptance_window(h, K), float(i))
        if alert is not None:
            return (i - before + 1) * ROWS_PER_WINDOW, alert
    return None, None


def _delays(drop: float, confirm: bool) -> list[int]:
    acceptance = ACCEPTANCE_MONITOR if confirm else replace(ACCEPTANCE_MONITOR, confirm_windows=0)
    delays = []
    for seed in range(20):
        d, _ = _acceptance_delay(100 + seed, drop, AlertManager(AlertConfig(acceptance=acceptance, first_draft=None)))
        assert d is not None and d > 0, f"seed {seed}: missed, or a false alarm before the change"
        delays.append(d)
    return delays


def test_a_drop_of_010_is_detected_within_300_rounds() -> None:
    """The detector alone (no confirmation across windows)."""
    delays = _delays(0.10, confirm=False)
    # Measured: median 275, p90 382, max 400 rounds at one row of the bucket per round.
    assert float(np.median(delays)) <= 300, delays
    assert max(delays) <= 600, delays


def test_a_drop_of_010_is_confirmed_within_450_rounds() -> None:
    """The sidecar's default: every detection is held 12 windows and tested against the level's swings. At one
    row per round and ten rounds per window that is 120 rows more; a test that is not yet clear looks again."""
    delays = _delays(0.10, confirm=True)
    # Measured: median 395, max 520 rounds; none missed.
    assert float(np.median(delays)) <= 450, delays
    assert max(delays) <= 700, delays


def test_a_drop_alert_says_what_moved_where_and_when() -> None:
    _, alert = _acceptance_delay(7, 0.20)
    assert alert is not None
    a = alert
    assert a.kind == ACCEPTANCE_DRIFT and a.direction == "down"
    assert a.bucket == "t1|d1|structured|*|<=512" and a.k == K
    assert a.before == pytest.approx(acceptance_rate(ALPHA, K), abs=0.03)
    assert a.after == pytest.approx(acceptance_rate(ALPHA - 0.20, K), abs=0.08)
    assert a.count_unit == "rows" and a.before_count >= 2500 and a.after_count > 0
    assert a.change_at is not None and abs(a.change_at - 300) <= 10  # the window the change began in
    assert a.detected_at >= a.change_at
    assert a.detector == "adwin(clock=16, delta=0.001)"


def test_a_30_percent_cost_increase_is_caught() -> None:
    m = AlertManager()
    rng = np.random.default_rng(3)
    alert = None
    for i in range(400):
        base = 1e-3 if i < 300 else 1.3e-3
        alert = m.observe_cost(cost_window(base * rng.lognormal(0.0, 0.2, size=10)), float(i))
        if alert is not None:
            break
    assert alert is not None and alert.kind == COST_DRIFT and alert.direction == "up"
    assert 300 <= alert.detected_at <= 360  # measured: 42-47 windows after the change
    assert alert.after is not None and alert.before is not None
    assert alert.after / alert.before == pytest.approx(1.3, abs=0.08)
    assert alert.bucket == "t1|d1|*|32|<=512" and alert.k == 4 and alert.count_unit == "windows"


def test_same_seed_same_alerts() -> None:
    a1 = _acceptance_delay(5, 0.10)[1]
    a2 = _acceptance_delay(5, 0.10)[1]
    assert a1 == a2


@pytest.mark.parametrize("name,params", [("hddm_a", {"drift_confidence": 1e-4}), ("page_hinkley", {"threshold": 30.0})])
def test_the_detector_is_chosen_by_name(name: str, params: dict[str, float]) -> None:
    cfg = AlertConfig(acceptance=MonitorConfig(DetectorSpec(name, params), history=4096, min_before=500,
                                               min_relative_shift=0.05))
    d, alert = _acceptance_delay(9, 0.20, AlertManager(cfg))
    assert d is not None and d > 0
    assert alert is not None and alert.detector is not None and alert.detector.startswith(name)


def test_detector_specs_are_checked_at_the_edge() -> None:
    with pytest.raises(ValueError, match="unknown change detector"):
        DetectorSpec("cusum")
    with pytest.raises(ValueError, match="rejects parameters"):
        DetectorSpec("adwin", {"no_such": 1})
    with pytest.raises(ValueError, match="needs samples in"):
        AlertConfig(cost=MonitorConfig(DetectorSpec("hddm_a"), history=100, min_before=10, min_relative_shift=0.1))


def test_estimate_change_point_finds_a_step() -> None:
    x = np.concatenate([np.zeros(70), np.ones(30)])
    assert estimate_change_point(x) == 70
    rng = np.random.default_rng(0)
    y = np.concatenate([rng.normal(0.6, 0.2, 400), rng.normal(0.4, 0.2, 100)])
    assert abs(estimate_change_point(y) - 400) <= 15


def test_bad_windows_are_counted_not_raised() -> None:
    m = AlertManager()
    good = acceptance_window(np.array([1, 1, 1, 1, 1]), K)
    bad = acceptance_window(np.array([1, 1, 1]), K)  # hist of k = 2 under k = 4
    assert m.observe_acceptance(good, 0.0) is None
    assert m.observe_acceptance(bad, 1.0) is None
    assert m.stats["skipped_bad_hist"] == 1


# Conditional acceptance by position of target-v1 / draft-v1 on code (bench/results/engine.json, xl): the first
# position is kept least often, so accepted / k and the pooled per-position rate both rise with k.
CODE_COND = np.array([0.64, 0.74, 0.70, 0.71, 0.69, 0.69, 0.75, 0.79])


def test_the_monitor_across_k_is_quiet_while_a_policy_moves_k() -> None:
    """k switches among 1, 2, 4 and 8 every 25 windows with nothing else changing: no acceptance alert. (Each
    per-k monitor sees a steady level of its own k; the first-draft rate is the same at every k.)"""
    m = AlertManager()
    rng = np.random.default_rng(21)
    ks = (1, 2, 4, 8)
    for i in range(20_000):
        k = ks[(i // 25) % len(ks)]
        hist = positional_hists(rng, 1, ROWS_PER_WINDOW, k, CODE_COND)[0]
        assert m.observe_acceptance(acceptance_window(hist, k), float(i)) is None
    assert _detections(m) == 0, dict(m.stats)


def _drift_with_a_new_k(m: AlertManager) -> Alert | None:
    """The demo's silent drift: structured rows at k=7 keep their first draft 95% of the time; then the schema
    changes (first draft kept 78%) just as the policy moves to k=8."""
    rng = np.random.default_rng(4)
    cond_before, cond_after = np.full(8, 0.95), np.array([0.78, 0.75, 0.8, 0.85, 0.9, 0.9, 0.9, 0.9])
    for i in range(300):
        hist = positional_hists(rng, 1, 20, 7, cond_before)[0]
        assert m.observe_acceptance(acceptance_window(hist, 7), float(i)) is None
    for i in range(300, 400):
        hist = positional_hists(rng, 1, 20, 8, cond_after)[0]
        if (alert := m.observe_acceptance(acceptance_window(hist, 8), float(i))) is not None:
            return alert
    return None


def test_a_drift_that_coincides_with_a_change_of_k_is_caught_across_k() -> None:
    alert = _drift_with_a_new_k(AlertManager())
    assert alert is not None and alert.kind == ACCEPTANCE_DRIFT and alert.direction == "down"
    assert alert.statistic == FIRST_DRAFT_STATISTIC and alert.k is None
    assert alert.bucket == "t1|d1|structured|*|<=512" and "across every k" in alert.message
    assert alert.before == pytest.approx(0.95, abs=0.02) and alert.before_count >= 5000
    assert alert.after is not None and alert.after == pytest.approx(0.78, abs=0.1)
    assert alert.detected_at - 300 <= 20  # measured: 7 windows (141 rows) after the change
    # Per k only, nothing is raised: k=8 has no level before the change, and k=7 no rows after it.
    assert _drift_with_a_new_k(AlertManager(AlertConfig(first_draft=None))) is None


def test_one_change_seen_at_two_ks_raises_one_alert() -> None:
    """Both a per-k monitor and the monitor across k detect the same drop: one alert (the cool-down is per
    acceptance bucket, whatever the k or statistic)."""
    m = AlertManager()
    rng = np.random.default_rng(8)
    raised = []
    for i in range(800):
        alpha = ALPHA if i < 300 else ALPHA - 0.3
        hist = acceptance_hists(rng, 1, 40, K, alpha)[0]
        if (a := m.observe_acceptance(acceptance_window(hist, K), float(i))) is not None:
            raised.append(a)
    assert len(raised) == 1, raised
    assert m.stats["detections_acceptance_drift"] >= 2 and m.stats["suppressed_cooldown"] >= 1, dict(m.stats)


def test_a_forged_window_of_2_61_rows_is_skipped_not_expanded() -> None:
    """Rows are fed to the detectors one by one: a window the wire allows (int64 counts) but no engine sends would
    take the sidecar's memory; it is counted and skipped."""
    m = AlertManager()
    big = 1 << 61
    hist = np.array([big - 2, 0, 0, 0, 2])
    assert m.observe_acceptance(acceptance_window(hist, K), 0.0) is None
    assert m.stats["skipped_implausible"] == 1
