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
from typing import Any

from policies.base import Decision, DecisionKind, Policy, Window, cell_key
from telemetry.records import Bucket, CostWindow


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
        self._cells: dict[str, dict[str, Any]] = {}  # key -> {"n": [K+1], "sum": [K+1], "best": float}

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        b = bucket
        cell = self._cells.get(cell_key(b.target_version, b.draft_version, b.batch_bucket, b.context_bucket))
        if cell is None:
            # unknown cell: start exploring from the arm order (the same one for every unknown bucket)
            return Decision(k=0 if explore else 1, exploring=explore, reason="unknown cell: first arm",
                            kind=DecisionKind.EXPLORE if explore else DecisionKind.FIRST)
        n, s, best = cell["n"], cell["sum"], max(cell["best"], 1e-12)
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
        key = cell_key(w.target_version, w.draft_version, w.batch_bucket, w.context_bucket)
        cell = self._cells.setdefault(key, {"n": [0] * (self.k_max + 1), "sum": [0.0] * (self.k_max + 1), "best": 0.0})
        wall = w.draft_s.total + w.verify_s.total + w.other_s.total
        if wall <= 0:
            return
        g = w.emitted / wall
        if g > cell["best"]:  # rescale past rewards to the new maximum
            ratio = cell["best"] / g if cell["best"] > 0 else 0.0
            cell["sum"] = [x * ratio for x in cell["sum"]]
            cell["best"] = g
        cell["n"][w.max_k] += 1
        cell["sum"][w.max_k] += g / cell["best"]

    def _get_state(self) -> dict[str, Any]:
        cells = {k: {"n": list(v["n"]), "sum": list(v["sum"]), "best": v["best"]} for k, v in self._cells.items()}
        return {"cells": cells}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._cells = {str(k): {"n": [int(x) for x in v["n"]], "sum": [float(x) for x in v["sum"]],
                                "best": float(v["best"])} for k, v in state["cells"].items()}
