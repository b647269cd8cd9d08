"""goodput's emitted-token calibration: a cost cell's own rounds correct acceptance learnt from other rows."""

from __future__ import annotations

import numpy as np

from policies import GoodputPolicy
from policies._emitted import EmittedCalibration
from telemetry.records import AcceptanceWindow, Bucket, Cell, CostWindow, Stat

LONG = "<=2048"
CELL = Cell("t1", "d1", 16, LONG)


def _cost(k: int, secs: float, accepted_per_row: float, rounds: int = 10, rows_per_round: int = 16,
          drafted_per_row: float | None = None) -> CostWindow:
    rows = rounds * rows_per_round
    drafted = rows * (k if drafted_per_row is None else drafted_per_row)
    st = Stat(rounds, rounds * secs, rounds * secs * secs, secs)
    zero = Stat(rounds, 0.0, 0.0, 0.0)
    return CostWindow(target_version="t1", draft_version="d1", batch_bucket=16, context_bucket=LONG, max_k=k,
                      rounds=rounds, tokens_verified=int(rows + drafted), emitted=int(rows * (1 + accepted_per_row)),
                      batch_rows=rows, draft_s=zero, verify_s=st, other_s=zero, latency_p50=secs, latency_p95=secs,
                      latency_p99=secs)


def _long_rows_accept_everything(p: GoodputPolicy, k: int = 5) -> None:
    """Acceptance learnt from the rows whose own context is long: every draft accepted (structured output)."""
    for _ in range(20):
        p.observe(AcceptanceWindow(target_version="t1", draft_version="d1", request_type="structured",
                                   context_bucket=LONG, k=k, rows=50, drafted=50 * k, accepted=50 * k,
                                   emitted=50 * (k + 1), hist=(0,) * k + (50,)))


def test_a_cells_own_rounds_correct_acceptance_learnt_from_its_long_rows() -> None:
    # A batch of 16 is costed and decided at its longest row's context, but most of its rows are short ones that
    # accept about one draft per round: the long rows' acceptance (all five) must not decide the cell.
    p = GoodputPolicy(k_max=5, seed=0, one_k_per_batch=True)
    _long_rows_accept_everything(p)
    for _ in range(30):
        p.observe(_cost(5, 0.080, accepted_per_row=1.0))
        p.observe(_cost(3, 0.070, accepted_per_row=1.0))
    b = Bucket("t1", "d1", "structured", 16, LONG)
    d = p.decide(b, explore=False)
    measured = {5: 16 * 2.0 / 0.080, 3: 16 * 2.0 / 0.070}  # emitted tokens per second the cell measured
    for k, g in measured.items():
        assert abs(d.expected_goodput[k] / g - 1.0) < 0.05, (k, d.expected_goodput[k], g)
    assert d.k < 5  # k = 3 emits as much in less time (k = 4, never measured here, may be tried first)

    q = GoodputPolicy(k_max=5, seed=0, one_k_per_batch=True)  # the same acceptance, no rounds of the cell
    _long_rows_accept_everything(q)
    for _ in range(30):
        q.observe(CostWindow(**{**_cost(5, 0.080, 1.0).__dict__, "batch_bucket": 4}))
        q.observe(CostWindow(**{**_cost(3, 0.070, 1.0).__dict__, "batch_bucket": 4}))
    assert q.decide(b, explore=False).k == 5  # acceptance alone says five accepted drafts a row


def test_rounds_whose_rows_drafted_different_ks_do_not_calibrate() -> None:
    cal = EmittedCalibration()
    mixed = _cost(5, 0.08, 1.0, drafted_per_row=3.5)  # packed rounds: rows drafted 5 or fewer
    assert not cal.observe(CELL, 5, mixed.rounds, mixed.batch_rows, mixed.tokens_verified - mixed.batch_rows,
                           mixed.emitted)
    assert not cal.observe(CELL, 0, 10, 160, 0.0, 160)  # k = 0 accepts nothing by construction
    # One row a round: that row's acceptance is already learnt at its own type and context.
    assert not cal.observe(Cell("t1", "d1", 1, LONG), 5, 10, 10, 50.0, 30)
    one_k = _cost(5, 0.08, 1.0)
    assert cal.observe(CELL, 5, one_k.rounds, one_k.batch_rows, one_k.tokens_verified - one_k.batch_rows,
                       one_k.emitted)
    assert cal.measured(CELL) == {5: (1.0, 0.5)}  # 10 rounds weigh half a window


def test_little_evidence_stays_near_the_model_and_is_drawn_widely() -> None:
    cal = EmittedCalibration(prior_windows=2.0)
    model = 1.0 + np.array([[0.0, 0.9, 1.7, 2.4, 3.0, 3.5]])  # [1, K + 1] one type's emitted per row
    for _ in range(40):  # k = 5 measured at length: the cell accepts 70% of what the model says
        cal.observe(CELL, 5, 10, 160, 160 * 5, 160 * (1 + 0.7 * 3.5))
    cal.observe(CELL, 3, 2, 32, 32 * 3, 32 * (1 + 2.4))  # k = 3 once, briefly, exactly as the model says
    mean = cal.adjust(CELL, model, np.ones(1))[0] - 1.0  # [K + 1] accepted per row
    assert abs(mean[5] - 0.7 * 3.5) < 0.05  # measured at length: the measurement
    level = 0.7 * 2.4  # the cell's level applied to the model at k = 3 ...
    assert level < mean[3] < level + 0.3 * (2.4 - level)  # ... moved only a little by one short window
    assert abs(mean[4] / 3.0 - mean[1] / 0.9) < 1e-9  # unmeasured ks: the model's shape at the cell's level
    assert mean[4] / 3.0 < 0.8  # ... a level below the model's, as the cell measured
    draws = np.array([cal.adjust(CELL, model, np.ones(1), np.random.default_rng(s))[0] - 1.0 for s in range(200)])
    spread = np.log(draws[:, 1:] / mean[1:]).std(axis=0)  # [K] for k = 1..K
    assert spread[3 - 1] > 2 * spread[5 - 1]  # the briefly measured k is still uncertain: exploration tries it again
    assert np.allclose(cal.adjust(Cell("t1", "d1", 1, LONG), model, np.ones(1)), model)  # unmeasured cell: as is


def test_state_round_trips_and_a_drift_drops_the_versions_cells() -> None:
    p = GoodputPolicy(k_max=5, seed=0, one_k_per_batch=True)
    _long_rows_accept_everything(p)
    for _ in range(5):
        p.observe(_cost(5, 0.080, accepted_per_row=1.0))
    q = GoodputPolicy(k_max=5, seed=0, one_k_per_batch=True)
    q.restore(p.snapshot())
    b = Bucket("t1", "d1", "structured", 16, LONG)
    assert q.decide(b, explore=False).expected_goodput == p.decide(b, explore=False).expected_goodput
    old = p.snapshot()
    del old["state"]["emitted"]  # a state saved before the calibration existed still loads
    GoodputPolicy(k_max=5, seed=0, one_k_per_batch=True).restore(old)
    p.reopen("t1", "d1", "structured", LONG)
    assert p._emitted.measured(CELL) == {}
