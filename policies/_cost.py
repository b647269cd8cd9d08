"""Round-cost model: draft / verify / other seconds per round as functions of batch, context and k.

A scikit-learn ``Ridge`` (multi-output: draft, verify, other) on engineered features, fitted on aggregated cost
windows. Features are a smooth shared part — ``[1(k>0), k, k log2 B, k log2 C, k log2 B log2 C, log2 B, log2 C,
log2 B log2 C]`` — plus a per-cell intercept and per-cell slope in k (cell = batch bucket x context bucket).
The shared part is multiplied by ``SHARED_SCALE`` so the ridge penalty barely touches it, while the per-cell
terms are shrunk toward it: a cell seen at one k borrows its slope in k from the others (sharing strength).
Cost is linear in k within a cell: the draft runs k steps and verify scores ``batch * (k + 1)`` positions.
Model versions are not a feature: a new target of the same architecture keeps the cost learnt so far.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from sklearn.linear_model import Ridge

from policies.base import context_len_of

SHARED_SCALE = 10.0  # shared features x10 -> ridge penalty on them / 100
PRIOR_DRAFT_PER_K = 0.1  # before any fit: one draft step costs 10% of a verify forward (Leviathan's c)


def _features(lb: np.ndarray, lc: np.ndarray, k: np.ndarray, cell: np.ndarray, n_cells: int) -> np.ndarray:
    """Design matrix.

    Args:
        lb: ``[N]`` log2 batch size.
        lc: ``[N]`` log2 context length / 4 (keeps the products O(1)).
        k: ``[N]`` largest draft length of the round.
        cell: ``[N]`` cell index, or -1 for a cell never fitted.
        n_cells: number of fitted cells.

    Returns:
        ``[N, 8 + 2 * n_cells]``.
    """
    on = (k > 0).astype(float)
    shared = np.stack([on, k, k * lb, k * lc, k * lb * lc, lb, lc, lb * lc], axis=1) * SHARED_SCALE
    oh = np.zeros((k.size, n_cells))
    idx = np.nonzero(cell >= 0)[0]
    oh[idx, cell[idx]] = 1.0
    return np.concatenate([shared, oh, oh * k[:, None]], axis=1)


class CostModel:
    """Aggregates cost windows per (cell, k) and fits/predicts per-round seconds.

    Args:
        k_max: largest k predicted.
        alpha: ridge penalty (on the normalised target).
        refit_every: cost windows between refits once warmed up (early on it refits more often).
        decay: multiplier on old aggregates per window of the same (cell, k), for drift.
    """

    def __init__(self, k_max: int, alpha: float = 0.01, refit_every: int = 16, decay: float = 0.999) -> None:
        self.k_max, self.alpha, self.refit_every, self.decay = k_max, alpha, refit_every, decay
        self._agg: dict[str, list[float]] = {}  # "bb|ctx|k" -> [rounds, batch_rows, draft, verify, other]
        self._since_fit = 0
        self._n_seen = 0
        self._fit: dict[str, Any] | None = None  # {"cells": [...], "coef": [[...]], "intercept": [...], "scale": s}

    def observe(self, batch_bucket: int, ctx: str, k: int, rounds: int, batch_rows: int,
                draft_s: float, verify_s: float, other_s: float) -> None:
        key = f"{batch_bucket}|{ctx}|{k}"
        new_key = key not in self._agg
        old = self._agg.get(key, [0.0] * 5)
        self._agg[key] = [o * self.decay + x for o, x in zip(old, (rounds, batch_rows, draft_s, verify_s, other_s),
                                                             strict=True)]
        self._since_fit += 1
        self._n_seen += 1
        # A (cell, k) never seen before refits at once: until then a new cell is predicted from the others only,
        # and the first measurement of a cell or of a k is what corrects an extrapolation most.
        if new_key or self._since_fit >= min(self.refit_every, max(1, self._n_seen // 4)):
            self.refit()

    def ks_seen(self, batch_bucket: int, ctx: str) -> set[int]:
        pre = f"{batch_bucket}|{ctx}|"
        return {int(key[len(pre):]) for key in self._agg if key.startswith(pre)}

    def cells_with_slope(self) -> int:
        """Cells seen at two or more k: what identifies the shared slope in k that unprobed cells borrow."""
        ks: dict[str, set[str]] = {}
        for key in self._agg:
            cell, k = key.rsplit("|", 1)
            ks.setdefault(cell, set()).add(k)
        return sum(len(v) >= 2 for v in ks.values())

    def mean_batch(self, batch_bucket: int, ctx: str) -> float:
        pre = f"{batch_bucket}|{ctx}|"
        r = sum(v[0] for key, v in self._agg.items() if key.startswith(pre))
        b = sum(v[1] for key, v in self._agg.items() if key.startswith(pre))
        return b / r if r > 0 else float(batch_bucket)

    def refit(self) -> None:
        self._since_fit = 0
        if not self._agg:
            return
        keys = sorted(self._agg)
        parts = [k.rsplit("|", 2) for k in keys]
        cells = sorted({f"{p[0]}|{p[1]}" for p in parts})
        cidx = {c: i for i, c in enumerate(cells)}
        vals = np.array([self._agg[k] for k in keys])  # [N, 5]
        rounds = vals[:, 0]
        y = vals[:, 2:5] / rounds[:, None]  # [N, 3] mean seconds per round
        scale = float(np.median(y.sum(axis=1)))
        lb = np.log2(vals[:, 1] / rounds)
        lc = np.array([math.log2(context_len_of(p[1])) / 4 for p in parts])
        # Centred on what was observed: a direction never varied (one context bucket so far) has zero features,
        # so ridge leaves its coefficients at 0 and an unseen cell is predicted like its nearest seen ones
        # instead of along an unidentified slope.
        center = [float(lb.mean()), float(lc.mean())]
        x = _features(lb - center[0], lc - center[1], np.array([float(p[2]) for p in parts]),
                      np.array([cidx[f"{p[0]}|{p[1]}"] for p in parts]), len(cells))
        tot = y.sum(axis=1)
        weight = rounds * (scale / np.maximum(tot, 1e-12)) ** 2  # relative errors: every cell counts
        model = Ridge(alpha=self.alpha).fit(x, y / scale, sample_weight=weight / weight.mean())
        self._fit = {"cells": cells, "coef": model.coef_.tolist(), "intercept": model.intercept_.tolist(),
                     "scale": scale, "center": center}

    def predict(self, batch_bucket: int, ctx: str, batch_size: float | None = None) -> np.ndarray:
        """``[k_max + 1, 3]`` predicted (draft, verify, other) seconds per round for k = 0..k_max.

        Before the first fit returns the relative prior ``(c k, 1, 0)`` (only ratios across k matter then).
        """
        ks = np.arange(self.k_max + 1, dtype=float)
        if self._fit is None:
            return np.stack([PRIOR_DRAFT_PER_K * ks, np.ones_like(ks), np.zeros_like(ks)], axis=1)
        cells = self._fit["cells"]
        cell = f"{batch_bucket}|{ctx}"
        ci = cells.index(cell) if cell in cells else -1
        b = batch_size if batch_size is not None else self.mean_batch(batch_bucket, ctx)
        n = ks.size
        c_lb, c_lc = self._fit.get("center", (0.0, 0.0))
        x = _features(np.full(n, math.log2(max(b, 1.0)) - c_lb), np.full(n, math.log2(context_len_of(ctx)) / 4 - c_lc),
                      ks, np.full(n, ci), len(cells))
        y = (x @ np.asarray(self._fit["coef"]).T + np.asarray(self._fit["intercept"])) * self._fit["scale"]
        y = np.maximum(y, 0.0)
        y[0, 0] = 0.0  # no draft steps at k = 0
        floor = 0.05 * max(float(y[0].sum()), 1e-9)
        y[:, 1] = np.maximum(y[:, 1], floor)  # a verify forward never costs (nearly) nothing
        return y

    @property
    def fitted(self) -> bool:
        return self._fit is not None

    def get_state(self) -> dict[str, Any]:
        return {"agg": {k: list(v) for k, v in self._agg.items()}, "since_fit": self._since_fit,
                "n_seen": self._n_seen, "fit": self._fit}

    def set_state(self, st: dict[str, Any]) -> None:
        self._agg = {k: [float(x) for x in v] for k, v in st["agg"].items()}
        self._since_fit, self._n_seen, self._fit = int(st["since_fit"]), int(st["n_seen"]), st["fit"]
