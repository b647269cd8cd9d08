"""The acceptance model's levels: positions never drafted are predicted from the positions a level has seen."""

from __future__ import annotations

import numpy as np

from policies._acceptance import AcceptanceModel, level_shift
from telemetry.records import AcceptanceWindow

VD = ("t1", "d1")


def _window(rtype: str, k: int, hist: tuple[int, ...]) -> AcceptanceWindow:
    rows = sum(hist)
    acc = sum(i * n for i, n in enumerate(hist))
    return AcceptanceWindow(target_version="t1", draft_version="d1", request_type=rtype, context_bucket="<=512",
                            k=k, rows=rows, drafted=rows * k, accepted=acc, emitted=acc + rows, hist=hist)


def _model(level_strength: float) -> AcceptanceModel:
    m = AcceptanceModel(8, level_strength=level_strength)
    m.observe(_window("structured", 3, (1, 1, 2, 46)))  # accepts nearly every draft at positions 1-3
    m.observe(_window("code", 3, (20, 10, 10, 10)))  # accepts about half
    return m


def test_positions_beyond_the_deepest_k_served_follow_the_type_level() -> None:
    m = _model(level_strength=10.0)
    structured, code = (m.cond(VD, t, "<=512", None) for t in ("structured", "code"))
    # After one window at k = 3, positions 4-8 are predicted from positions 1-3, not from the flat prior of 0.6.
    assert (structured[3:] > 0.9).all()
    assert (code[3:] < structured[3:] - 0.3).all()
    # Without the shift (an infinitely strong pull to the parent) they stay at the prior.
    flat = _model(level_strength=1e9).cond(VD, "structured", "<=512", None)
    assert np.allclose(flat[3:], 0.6, atol=1e-3)


def test_measured_positions_keep_their_own_counts() -> None:
    # A type whose position 1 is measured low and positions 2-3 high keeps that shape: one offset per level moves
    # the parent's curve, the counts at each position still decide it.
    m = AcceptanceModel(8)
    m.observe(_window("code", 3, (50, 0, 0, 50)))
    c = m.cond(VD, "code", "<=512", None)
    assert c[0] < 0.6 < c[1]


def test_a_level_without_trials_is_its_parent() -> None:
    parent = np.array([[0.9, 0.8, 0.7], [0.2, 0.3, 0.4]])  # [2, K]
    zeros = np.zeros_like(parent)
    assert np.allclose(level_shift(parent, zeros, zeros, 10.0), parent)
    # A level that accepts more than its parent predicts is shifted up at every position, in order.
    s, n = np.array([[9.0, 0.0, 0.0]]), np.array([[10.0, 0.0, 0.0]])
    up = level_shift(np.array([[0.5, 0.5, 0.4]]), s, n, 10.0)
    assert (up > np.array([[0.5, 0.5, 0.4]])).all() and up[0, 2] < up[0, 1]


def test_the_batched_path_agrees_with_the_single_type_path() -> None:
    m = _model(level_strength=10.0)
    m.observe(_window("structured", 5, (0, 0, 1, 1, 2, 30)))  # a second window, deeper, on the same type
    types = ["code", "prose", "structured"]  # prose: never seen, it follows the global level
    batched = m.conds(VD, types, "<=512", None)
    for i, t in enumerate(types):
        assert np.allclose(batched[i], m.cond(VD, t, "<=512", None))


def test_the_mix_follows_recent_traffic() -> None:
    # A long stretch of an even mix at a large batch (many rows per window), then a few seconds of mostly
    # structured traffic at a small batch: the mix a cell is decided with is the recent one, and every type fades
    # with the bucket's windows, not only with windows of its own type.
    m = AcceptanceModel(8)
    for _ in range(200):
        for t in ("code", "prose", "structured"):
            m.observe(_window(t, 1, (200, 200)))  # 400 rows a window
    for _ in range(40):
        m.observe(_window("structured", 1, (16, 16)))  # 32 rows a window
        if _ % 8 == 0:
            m.observe(_window("code", 1, (2, 2)))
    mix = m.mix(VD, "<=512")
    share = mix["structured"] / sum(mix.values())
    assert share > 0.7, mix
    assert mix["prose"] < mix["structured"] / 5  # prose stopped arriving: it faded with the others' windows


def test_mix_rows_is_validated() -> None:
    import pytest

    with pytest.raises(ValueError, match="mix_rows"):
        AcceptanceModel(8, mix_rows=0.0)
