"""``ucb``: a per-bucket UCB1 bandit over k, as in BanditSpec.

BanditSpec (Hou et al. 2025, "BanditSpec: Adaptive Speculative Decoding via Bandit Algorithms",
arXiv:2505.15141) treats each draft-length setting as an arm and picks one with UCB each round, rewarding the
tokens per second the round achieved. Here the arms are k = 0..k_max, the reward is a cost window's goodput
(emitted tokens over wall seconds, for the whole batch), and the bandit is kept per cost cell (versions,
batch-size bucket, context bucket) — the finest bucket a goodput reward can be attributed to, since a round's
seconds are shared by all its rows. Rewards are scaled by the best goodput seen in the cell so the
exploration bonus ``c * sqrt(2 ln N / n)`` is unit-free. No sharing across cells: each one learns from scratch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from policies.base import Decision, DecisionKind, Policy, Window
from telemetry.records import Bucket, Cell, CostWindow


@dataclass(frozen=True)
class Arms:
    """One cell's bandit: pulls and summed scaled rewards per arm k = 0..k_max, and the scale."""

    n: tuple[int, ...]  # [K + 1] windows observed at each k
    sums: tuple[float, ...]  # [K + 1] summed rewards, each goodput / best
    best: float  # the best goodput seen in the cell (tokens/s): the reward scale

    @classmethod
    def empty(cls, k_max: int) -> Arms:
        return cls((0,) * (k_max + 1), (0.0,) * (k_max + 1), 0.0)

    def pulled(self, k: int, goodput: float) -> Arms:
        """The arms after one window of ``goodput`` at ``k``; past rewards rescale to a new maximum."""
        sums, best = self.sums, self.best
        if goodput > best:
            ratio = best / goodput if best > 0 else 0.0
            sums, best = tuple(x * ratio for x in sums), goodput
        n = tuple(c + (i == k) for i, c in enumerate(self.n))
        return Arms(n, tuple(x + (goodput / best if i == k else 0.0) for i, x in enumerate(sums)), best)


class UCBPolicy(Policy):
    """UCB1 over k per (versions, batch bucket, context bucket).

    Args:
        c: exploration weight on the UCB bonus.
        k_max: see :class:`~policies.base.Policy`.
        seed: breaks ties between equal scores.
    """

    name = "ucb"

    def __init__(self, c: float = 0.5, k_max: int = 8, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        if c < 0:
            raise ValueError(f"c must be >= 0, got {c}")
        self.c = c
        self._cells: dict[Cell, Arms] = {}

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        b = bucket
        cell = self._cells.get(b.cell)
        if cell is None:
            # unknown cell: start exploring from the arm order (the same one for every unknown bucket)
            return Decision(k=0 if explore else 1, exploring=explore, reason="unknown cell: first arm",
                            kind=DecisionKind.EXPLORE if explore else DecisionKind.FIRST)
        n, s, best = cell.n, cell.sums, max(cell.best, 1e-12)
        means = {k: s[k] / n[k] * best for k in range(self.k_max + 1) if n[k] > 0}
        if not explore:
            k = max(means, key=lambda j: means[j]) if means else 1
            return Decision(k=k, expected_goodput=means, reason="best mean", kind=DecisionKind.BEST)
        untried = [k for k in range(self.k_max + 1) if n[k] == 0]
        if untried:
            return Decision(k=untried[0], expected_goodput=means, exploring=True, reason="untried arm",
                            kind=DecisionKind.EXPLORE)
        total = sum(n)
        score = [s[k] / n[k] + self.c * math.sqrt(2.0 * math.log(total) / n[k]) for k in range(self.k_max + 1)]
        top = max(score)
        ties = [k for k, v in enumerate(score) if v >= top - 1e-12]
        k = int(ties[self._rng.integers(len(ties))]) if len(ties) > 1 else ties[0]
        greedy = max(means, key=lambda j: means[j])
        return Decision(k=k, expected_goodput=means, exploring=k != greedy, reason="ucb1",
                        kind=DecisionKind.EXPLORE if k != greedy else DecisionKind.BEST)

    def _observe(self, window: Window) -> None:
        if not isinstance(window, CostWindow):
            return
        w = window
        if w.max_k > self.k_max:
            return
        key = Cell(w.target_version, w.draft_version, w.batch_bucket, w.context_bucket)
        wall = w.draft_s.total + w.verify_s.total + w.other_s.total
        if wall <= 0:
            return
        self._cells[key] = self._cells.get(key, Arms.empty(self.k_max)).pulled(w.max_k, w.emitted / wall)

    def _get_state(self) -> dict[str, Any]:
        return {"cells": [[t, d, bb, c, list(a.n), list(a.sums), a.best]
                          for (t, d, bb, c), a in sorted(self._cells.items())]}

    def _set_state(self, state: dict[str, Any]) -> None:
        cells: dict[Cell, Arms] = {}
        for t, d, bb, c, n, sums, best in state["cells"]:
            if len(n) != self.k_max + 1 or len(sums) != self.k_max + 1:
                raise ValueError(f"cell {t}|{d}|{bb}|{c} has {len(n)} arms, this policy has {self.k_max + 1}")
            cells[Cell(str(t), str(d), int(bb), str(c))] = Arms(tuple(int(x) for x in n),
                                                               tuple(float(x) for x in sums), float(best))
        self._cells = cells
