"""Seeded synthetic windows for the alert tests, built with numpy.

Acceptance follows the i.i.d. model (each draft token kept with probability ``alpha`` until the first rejection),
so a row's accepted count is ``min(Geometric - 1, k)``; cost windows carry lognormal round times.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from telemetry.records import AcceptanceWindow, CostWindow, Stat


def acceptance_hists(rng: np.random.Generator, n: int, rows: int, k: int, alpha: float) -> np.ndarray:
    """``[n, k + 1]`` histograms of ``n`` windows of ``rows`` rows each."""
    acc = np.minimum(rng.geometric(1.0 - alpha, size=(n, rows)) - 1, k)  # [n, rows]
    counts = np.zeros((n, k + 1), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(n), rows), acc.ravel()), 1)
    return counts


def acceptance_window(hist: np.ndarray, k: int, *, target: str = "t1", draft: str = "d1",
                      request_type: str = "structured", context: str = "<=512") -> AcceptanceWindow:
    h = tuple(int(x) for x in hist)
    rows = sum(h)
    accepted = sum(i * c for i, c in enumerate(h))
    return AcceptanceWindow(target, draft, request_type, context, k, rows, rows * k, accepted, accepted + rows, h)


def cost_window(round_s: np.ndarray, *, tokens_per_round: int = 40, target: str = "t1", draft: str = "d1",
                max_k: int = 4) -> CostWindow:
    """A window of ``len(round_s)`` rounds, each spending ``round_s[i]`` seconds verifying (a fifth drafting)."""
    n = len(round_s)
    verify = Stat(n, float(round_s.sum()), float((round_s ** 2).sum()), float(round_s.max()))
    draft_s = Stat(n, verify.total / 5, verify.sumsq / 25, verify.max / 5)
    return CostWindow(target, draft, 32, "<=512", max_k, n, n * tokens_per_round, n * 32, n * 32, draft_s, verify,
                      Stat(), 0.001, 0.002, 0.003)


def acceptance_rate(alpha: float, k: int) -> float:
    """E[accepted / k] under the i.i.d. model: (alpha + alpha^2 + ... + alpha^k) / k."""
    return sum(alpha ** i for i in range(1, k + 1)) / k


def positional_hists(rng: np.random.Generator, n: int, rows: int, k: int, cond: np.ndarray) -> np.ndarray:
    """``[n, k + 1]`` histograms when the draft at position i is kept with probability ``cond[i]`` (given that
    every earlier one was): acceptance that is not i.i.d. over positions, as measured on real pairs, where a
    pooled per-position rate moves with k even though nothing changed."""
    kept = rng.random((n, rows, k)) < cond[:k]  # [n, rows, k]
    acc = np.cumprod(kept, axis=2).sum(axis=2)  # [n, rows] drafts kept before the first rejection
    counts = np.zeros((n, k + 1), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(n), rows), acc.ravel()), 1)
    return counts


def request_hists(rng: np.random.Generator, n: int, rounds: int, k: int, slots: int,
                  alpha_of_request: Callable[[np.random.Generator, int], float],
                  lifetime: tuple[int, int] = (20, 60)) -> np.ndarray:
    """``[n, k + 1]`` histograms of windows of ``rounds`` rounds where rows come from requests, as on an engine.

    ``slots`` requests decode at a time, one row per round each; a finished request is replaced at once. Every
    request draws its own acceptance ``alpha_of_request(rng, window)`` (the i.i.d. model within the request)
    and lives a uniform number of rows in ``lifetime``. Rows of one request share its alpha: what makes a
    bucket's level at low load swing with whichever requests are decoding, with nothing changing.
    """
    counts = np.zeros((n, k + 1), dtype=np.int64)
    alpha = [alpha_of_request(rng, 0) for _ in range(slots)]
    left = [int(rng.integers(*lifetime)) for _ in range(slots)]
    for w in range(n):
        for _ in range(rounds):
            for s in range(slots):
                acc = min(int(rng.geometric(1.0 - alpha[s])) - 1, k)
                counts[w, acc] += 1
                left[s] -= 1
                if left[s] == 0:
                    alpha[s], left[s] = alpha_of_request(rng, w), int(rng.integers(*lifetime))
    return counts
