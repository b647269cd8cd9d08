"""The analytic core against Leviathan et al. 2023 (arXiv:2211.17192)."""

from __future__ import annotations

import numpy as np
import pytest

from policies.analytic import (
    batch_goodput,
    emitted_by_k,
    expected_tokens,
    expected_tokens_from_curve,
    expected_tokens_vec,
    optimal_draft_length,
    slowest_type_seconds_per_token,
    solo_goodput,
    speedup,
    tail_weighted,
)


def test_eq1_values() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_tokens(0.0, 7) == 1.0


def test_alpha_to_one_limit() -> None:
    for k in range(6):
        assert expected_tokens(1.0, k) == k + 1
        assert expected_tokens(1 - 1e-7, k) == pytest.approx(k + 1, rel=1e-5)
    assert expected_tokens_vec(np.array([1.0, 0.5]), np.array([3, 3])) == pytest.approx([4.0, 1.875])


def test_monotone_in_alpha_and_k() -> None:
    alphas = np.linspace(0, 1, 21)
    for k in range(1, 8):
        e = expected_tokens_vec(alphas, np.full_like(alphas, k))
        assert np.all(np.diff(e) > 0)
        assert np.all(expected_tokens_vec(alphas, np.full_like(alphas, k + 1)) >= e)


def test_curve_form_matches_eq1() -> None:
    a, k = 0.7, 5
    curve = [a**i for i in range(1, k + 1)]
    assert expected_tokens_from_curve(curve) == pytest.approx(expected_tokens(a, k))
    assert emitted_by_k(np.full(k, a))[k] == pytest.approx(expected_tokens(a, k))
    with pytest.raises(ValueError):
        expected_tokens_from_curve([1.5])


def test_speedup_theorem_3_8() -> None:
    assert speedup(0.8, 0, 0.1) == 1.0
    assert speedup(0.8, 3, 0.05) == pytest.approx((1 - 0.8**4) / (0.2 * 1.15))


@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("c", [0.0, 0.01, 0.05, 0.2, 0.6, 1.0])
def test_optimal_k_brute_force(alpha: float, c: float) -> None:
    k = optimal_draft_length(alpha, c, 16)
    best = max(range(17), key=lambda j: (speedup(alpha, j, c), -j))
    assert speedup(alpha, k, c) == pytest.approx(speedup(alpha, best, c))


def test_no_speculation_when_draft_too_costly() -> None:
    assert optimal_draft_length(0.3, 0.5, 8) == 0  # alpha < c: nothing beats plain decoding (Corollary 3.9)


def test_batch_goodput_max_k_coupling() -> None:
    emitted = np.stack([emitted_by_k(np.full(4, 0.9)), emitted_by_k(np.full(4, 0.9))])
    secs = np.array([1.0, 1.2, 1.4, 1.6, 1.8])
    combos, g = batch_goodput(emitted, np.array([0.5, 0.5]), 64, secs)
    # at large batch the round always pays the largest k, so both types should share it
    best = combos[int(np.argmax(g))]
    assert best[0] == best[1]
    _, g1 = batch_goodput(emitted[:1], np.array([1.0]), 1, secs)
    assert g1 == pytest.approx(emitted[0] / secs)


def test_batch_goodput_packed_rows_draft_their_own_k() -> None:
    """Packed verification: a row drafting less than the round's largest k saves its tokens' cost."""
    emitted = np.stack([emitted_by_k(np.full(4, 0.95)), emitted_by_k(np.full(4, 0.3))])  # [2, 5]
    batch, per_token = 64, 0.01
    secs = 1.0 + 0.02 + per_token * batch * np.arange(5.0)  # every row drafting m: draft step + per-token work
    secs[0] = 1.0
    mix = np.array([0.5, 0.5])
    combos, g = batch_goodput(emitted, mix, batch, secs, per_token_s=per_token)
    best = tuple(int(x) for x in combos[int(np.argmax(g))])
    assert best[0] > best[1]  # the type that accepts well drafts deeper than the other
    # The expectation by hand for (4, 1): with 64 rows the largest k is 4 (P(no row of type 0) ~ 5e-20);
    # tokens below it: type 1 rows each leave 3 undrafted.
    i = int(np.flatnonzero((combos == (4, 1)).all(axis=1))[0])
    tok = batch * (0.5 * emitted[0, 4] + 0.5 * emitted[1, 1])
    assert g[i] == pytest.approx(tok / (secs[4] - per_token * batch * 0.5 * 3))
    # Padded verification (no saving) is the per_token_s = 0 case, and one shared k costs the same either way.
    _, g_pad = batch_goodput(emitted, mix, batch, secs)
    assert g_pad[i] < g[i]
    same = int(np.flatnonzero((combos == (2, 2)).all(axis=1))[0])
    assert g_pad[same] == pytest.approx(g[same])


def test_solo_goodput_scores_each_type_on_its_own_rounds() -> None:
    """One row per round: a type whose rate is best at k = 1 keeps k = 1 beside a type that accepts far better.

    Pooling tokens over seconds at fixed round shares (``batch_goodput`` at batch 1) turns that type off, since its
    gain from drafting (0.52 tokens for 5 ms, 104 tok/s) is below the pool's rate; off makes it slower (47.6 tok/s
    against 58.5) and its requests take more rounds, so the whole load takes longer.
    """
    secs = np.array([0.021, 0.026, 0.029, 0.032, 0.035, 0.038])  # [K+1] one-row round at each k
    strong = emitted_by_k(np.full(5, 0.95))  # [6]
    prose = np.array([1.0, 1.52, 1.78, 1.9, 1.95, 1.98])  # [6]
    emitted = np.stack([strong, prose])  # [2, 6]
    mix = np.array([0.7, 0.3])
    pooled_combos, pooled = batch_goodput(emitted, mix, 1, secs)
    assert tuple(pooled_combos[int(np.argmax(pooled))]) == (5, 0)  # the fault this function exists to avoid
    combos, g = solo_goodput(emitted, mix, secs)
    best = tuple(int(x) for x in combos[int(np.argmax(g))])
    rates = emitted / secs[None, :]  # [2, 6]
    assert best == (int(np.argmax(rates[0])), int(np.argmax(rates[1]))) == (5, 2)  # each type's own best k
    i = int(np.flatnonzero((combos == best).all(axis=1))[0])
    assert g[i] == pytest.approx(1.0 / (0.7 / rates[0, 5] + 0.3 / rates[1, 2]))
    # The time to serve a fixed token demand is what it minimises: 70 + 30 tokens at these rates.
    off = int(np.flatnonzero((combos == (5, 0)).all(axis=1))[0])
    assert 70 / rates[0, 5] + 30 / rates[1, 2] < 70 / rates[0, 5] + 30 / rates[1, 0]
    assert g[i] > g[off]
    shared, g_shared = solo_goodput(emitted, mix, secs, shared_k=True)
    assert shared.shape == (6, 2) and (shared[:, 0] == shared[:, 1]).all()
    assert g_shared[3] == pytest.approx(g[int(np.flatnonzero((combos == (3, 3)).all(axis=1))[0])])


def test_the_slowest_type_sets_the_tail_of_a_shared_round() -> None:
    """One k per round: every row pays the round's seconds, and the type that keeps fewest drafts is slowest."""
    secs = np.array([0.040, 0.060, 0.080])  # [K+1] a round at each k
    emitted = np.array([[1.0, 1.9, 2.7],  # [T, K+1] structured accepts well
                        [1.0, 1.3, 1.4]])  # prose does not
    combos = np.array([[0, 0], [1, 1], [2, 2], [2, 0]])  # [C, T]
    both = np.array([True, True])
    got = slowest_type_seconds_per_token(combos, emitted, secs, both)
    # a round at its largest k: (2, 0) makes prose wait for structured's two drafts and keep one token
    assert got == pytest.approx([0.040, 0.060 / 1.3, 0.080 / 1.4, 0.080 / 1.0])
    # a type without requests does not set the tail; with none marked, every type counts
    assert slowest_type_seconds_per_token(combos, emitted, secs, np.array([True, False])) == pytest.approx(
        [0.040, 0.060 / 1.9, 0.080 / 2.7, 0.080 / 2.7])
    assert slowest_type_seconds_per_token(combos, emitted, secs, np.array([False, False])) == pytest.approx(got)
    # rounds of one row run each type's own k: (2, 0) costs prose a plain round
    assert slowest_type_seconds_per_token(combos, emitted, secs, both, solo=True)[3] == pytest.approx(
        max(0.080 / 2.7, 0.040 / 1.0))


def test_tail_weight_trades_goodput_for_the_slowest_types_rate() -> None:
    goodput = np.array([100.0, 110.0, 112.0, -np.inf])  # [C]; the last choice is masked (a cap)
    slowest = np.array([0.040, 0.045, 0.050, 0.001])  # [C]
    assert tail_weighted(goodput, slowest, 0.0) is goodput
    w1 = tail_weighted(goodput, slowest, 1.0)
    # the reference is the best allowed choice's tail, not the masked one's
    assert w1[:3] == pytest.approx([100.0, 110.0 * 0.040 / 0.045, 112.0 * 0.040 / 0.050])
    assert w1[3] == -np.inf
    assert int(np.argmax(w1)) == 0 and int(np.argmax(goodput)) == 2  # +12% goodput for a tail 25% slower loses
    assert int(np.argmax(tail_weighted(goodput, slowest, 0.1))) == 2  # a light weight keeps the deep k
