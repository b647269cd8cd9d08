"""Confirmation across windows: rows of one request are not independent, so a detection must hold up against the
bucket's own swings before it is raised (see controller.service.alerts.detectors.BucketMonitor)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from alert_synth import acceptance_hists, acceptance_window, request_hists

from controller.service.alerts import ACCEPTANCE_MONITOR, FIRST_DRAFT_MONITOR, AlertConfig, AlertManager
from controller.service.alerts.detectors import MIN_REFERENCE_STRETCHES, stretch_z
from telemetry.alerts import Alert

K = 3
ROUNDS = 8  # rounds per window; two requests decode at a time: 16 rows of the bucket per window
SLOTS = 2


def _wide(rng: np.random.Generator, _w: int) -> float:
    """A request's acceptance: prompts differ a lot (mean 0.5, sd 0.22), as code prompts do on the xl pair."""
    return float(np.clip(rng.beta(2.0, 2.0), 0.02, 0.98))


def _manager(confirm: bool, min_before: int = 200) -> AlertManager:
    acc, first = ACCEPTANCE_MONITOR, FIRST_DRAFT_MONITOR
    if not confirm:
        acc, first = replace(acc, confirm_windows=0), replace(first, confirm_windows=0)
    return AlertManager(AlertConfig(acceptance=replace(acc, min_before=min_before),
                                    first_draft=replace(first, min_before=min_before), cooldown_s=0.0))


def _feed(m: AlertManager, hists: np.ndarray) -> list[tuple[int, Alert]]:
    return [(i, a) for i, h in enumerate(hists) if (a := m.observe_acceptance(acceptance_window(h, K), float(i)))]


def test_stretch_z_measures_a_shift_in_the_level_s_own_swings() -> None:
    rng = np.random.default_rng(0)
    rows = np.full(200, 10.0)
    before = np.stack([rows, rows * (0.5 + 0.05 * rng.standard_normal(200))], axis=1)  # window means sd 0.05
    same = np.stack([rows[:10], rows[:10] * 0.5], axis=1)
    moved = np.stack([rows[:10], rows[:10] * 0.3], axis=1)
    z_same, z_moved = stretch_z(before, same, 10), stretch_z(before, moved, 10)
    assert z_same is not None and z_same < 1.0
    # Stretches of 10 windows swing by 0.05 / sqrt(10) = 0.016: a move of 0.2 is ~12 of them, beyond any alarm
    # threshold (the normal deviate of so small a tail saturates near 6).
    assert z_moved is not None and z_moved > 5.0
    assert stretch_z(before[: MIN_REFERENCE_STRETCHES - 1], moved[:1], 10) is None  # too little history: no verdict
    # Longer after, same shift: the level after is known better, the statistic grows.
    small = np.stack([rows[:10], rows[:10] * 0.47], axis=1)
    z10, z40 = stretch_z(before, small, 10), stretch_z(before, np.concatenate([small] * 4), 10)
    assert z10 is not None and z40 is not None and z40 > 1.5 * z10


def test_a_stationary_bucket_of_few_requests_raises_nothing() -> None:
    rng = np.random.default_rng(11)
    hists = request_hists(rng, 3000, ROUNDS, K, SLOTS, _wide)  # 48,000 rows, about 1,200 requests
    raw = _feed(_manager(confirm=False), hists)
    m = _manager(confirm=True)
    assert len(raw) >= 5, "the stream must be one that fools a detector taking rows as independent"
    assert _feed(m, hists) == [], dict(m.stats)
    assert m.stats["suppressed_unconfirmed"] >= 5


def _structured(rng: np.random.Generator, _w: int) -> float:
    """Structured prompts accept alike (mean 0.85, sd 0.06)."""
    return float(np.clip(rng.beta(30.0, 5.0), 0.02, 0.98))


def test_a_real_drop_in_a_bucket_of_few_requests_is_raised() -> None:
    """The demo's silent drift: structured prompts of a new schema accept less, every one of them."""
    rng = np.random.default_rng(12)
    before = request_hists(rng, 600, ROUNDS, K, 4, _structured)
    after = request_hists(rng, 200, ROUNDS, K, 4, lambda r, w: 0.75 * _structured(r, w))
    m = _manager(confirm=True)
    raised = _feed(m, np.concatenate([before, after]))
    assert raised, dict(m.stats)
    at, alert = raised[0]
    assert at >= 600 and alert.direction == "down"
    # Held at least confirm_windows windows after the detection, tested at most CONFIRM_TESTS times.
    assert 600 + ACCEPTANCE_MONITOR.confirm_windows <= at <= 600 + 120, at


@pytest.mark.parametrize("rows_per_window", [10, 3])
def test_confirmation_waits_windows_not_rows(rows_per_window: int) -> None:
    """A slowed machine sends fewer rows per window; a change is confirmed after as many windows."""
    rng = np.random.default_rng(13)
    hists = np.concatenate([acceptance_hists(rng, 400, rows_per_window, K, 0.85),
                            acceptance_hists(rng, 300, rows_per_window, K, 0.45)])
    m = _manager(confirm=True)
    raised = _feed(m, hists)
    assert raised, dict(m.stats)
    at = raised[0][0]
    assert 400 + ACCEPTANCE_MONITOR.confirm_windows <= at <= 400 + 80, at


def test_an_unconfirmed_detection_keeps_the_level() -> None:
    rng = np.random.default_rng(14)
    m = _manager(confirm=True)
    _feed(m, request_hists(rng, 1500, ROUNDS, K, SLOTS, _wide))
    assert m.stats["suppressed_unconfirmed"] >= 1
    level = next(iter(m._acceptance.values())).level  # the monitor's own level
    assert level[1] == 1500 * ROUNDS * SLOTS  # every row since the start: no change was taken
