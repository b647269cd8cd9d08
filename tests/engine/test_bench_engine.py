"""The mixed cells: coordinate search (``bench.engine.coordinate_search``) against scripted measurements, the rows'
layout, restarts that hold the context still, and uniform cells measured over several prompt sets."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from bench.engine import (
    CONTEXTS,
    K_VALUES,
    MIXED_GRID,
    REQUEST_TYPES,
    KConfig,
    _mixed_types,
    _Rows,
    _run_cell,
    coordinate_search,
)
from engine.model import Transformer

START: KConfig = dict.fromkeys(REQUEST_TYPES, 2)


class Scripted:
    """Probes favour ``lucky`` for code; side-by-side confirmations return ``confirm`` (held, challenger)."""

    def __init__(self, lucky: KConfig, confirm: tuple[float, float]) -> None:
        self.lucky, self.confirm = lucky, confirm
        self.calls: list[tuple[list[KConfig], int]] = []

    def __call__(self, configs: Sequence[KConfig], reps: int) -> list[float]:
        self.calls.append((list(configs), reps))
        if len(configs) == 2:  # a confirmation: (current triple, probe winner)
            return list(self.confirm)
        return [110.0 if c == self.lucky else 100.0 for c in configs]


def test_a_probe_winner_that_loses_the_confirmation_is_not_adopted() -> None:
    lucky = {**START, "code": 6}
    fake = Scripted(lucky, confirm=(105.0, 98.0))
    triple, log = coordinate_search(fake, START, passes=1, probe_reps=3, confirm_reps=10)
    assert triple == START
    assert log[0]["confirm"] == {"held": 105.0, "challenger": 98.0}
    assert log[0]["chosen"] == START
    assert fake.calls[1] == ([START, lucky], 10)  # the held triple and the winner, side by side, confirm_reps each


def test_a_confirmed_winner_is_adopted_and_the_search_goes_on_from_it() -> None:
    lucky = {**START, "code": 6}
    fake = Scripted(lucky, confirm=(100.0, 108.0))
    triple, log = coordinate_search(fake, START, passes=1, probe_reps=3, confirm_reps=10)
    assert triple == lucky
    # The next type's probes hold code at 6.
    prose_probes = fake.calls[2][0]
    assert [c["code"] for c in prose_probes] == [6] * len(MIXED_GRID)
    assert [c["prose"] for c in prose_probes] == list(MIXED_GRID)
    assert [step["vary"] for step in log] == list(REQUEST_TYPES)


def test_no_confirmation_when_the_current_triple_wins_its_probes() -> None:
    fake = Scripted(START, confirm=(0.0, 1e9))  # a confirmation would adopt: none must run
    triple, log = coordinate_search(fake, START, passes=2, probe_reps=3, confirm_reps=10)
    assert triple == START
    assert all(len(configs) == len(MIXED_GRID) for configs, _ in fake.calls)
    assert len(log) == 2 * len(REQUEST_TYPES) and not any("confirm" in step for step in log)


def test_mixed_rows_sit_in_blocks_or_interleaved() -> None:
    assert _mixed_types(7) == ["code"] * 3 + ["prose"] * 2 + ["structured"] * 2
    assert _mixed_types(7, blocked=False) == ["code", "prose", "structured"] * 2 + ["code"]


def test_rows_restart_so_the_context_stays_where_the_cell_says(pair: tuple[Transformer, Transformer]) -> None:
    # 25 rounds at k = 4 would take a row 50-125 tokens past its prompt; restarting after 20 keeps every round's
    # context within 20 + k + 1 of it, and the rows never finish (a finished row would fail the measurement).
    models = SimpleNamespace(target=pair[0], draft=pair[1], target_version="t", draft_version="d")
    rows = _Rows(models, "sample", _mixed_types(3), "short", 20 + max(K_VALUES) + 2, 0, restart_every=20)
    prompt = CONTEXTS["short"] + 1  # BOS + prompt bytes
    recs = [rows.step(dict.fromkeys(REQUEST_TYPES, 4)) for _ in range(25)]
    assert max(r.max_context for r in recs) <= prompt + 20 + 4 + 1
    assert min(r.max_context for r in recs[1:]) >= prompt
    assert sum(r.max_context == prompt for r in recs[1:]) >= 2  # it did restart (more than once)


def test_a_cell_over_several_prompt_sets_merges_their_rounds(pair: tuple[Transformer, Transformer]) -> None:
    # Two engines, each filled with its own prompt, each measured the same cycles: every k's totals hold both
    # sets' rounds, and its histogram counts each round's row once.
    models = SimpleNamespace(target=pair[0], draft=pair[1], target_version="t", draft_version="d")
    one, _ = _run_cell(models, "sample", "code", 1, "short", 2, 0)
    two, confirmed = _run_cell(models, "sample", "code", 1, "short", 2, 0, confirm=True, prompt_sets=2)
    for k in K_VALUES:
        assert one[k]["rounds"] == 2 and two[k]["rounds"] == 4
        assert len(two[k]["round_wall"]) == 4 and len(two[k]["contexts"]) == 4
        assert len(two[k]["hist"]) == k + 1 and sum(two[k]["hist"]) == 4
        assert two[k]["emitted"] == sum((a + 1) * n for a, n in enumerate(two[k]["hist"]))
    assert confirmed is not None and confirmed["k"] > 0
    with pytest.raises(ValueError, match="prompt_sets"):
        _run_cell(models, "sample", "code", 1, "short", 2, 0, prompt_sets=0)
