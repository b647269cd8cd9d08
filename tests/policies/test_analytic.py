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
    speedup,
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
