"""Hierarchical Beta model of per-position acceptance, shared by model-based policies.

For each position i (1..K) the conditional acceptance ``p_i = P(accepted >= i | accepted >= i - 1)`` gets a
Beta posterior per (versions, request type, context bucket). Counts come from acceptance histograms: a row that
drafted k tokens and kept a of them is a trial at positions 1..min(a + 1, k) and a success at 1..a. Positions
do not depend on k (the draft proposes the same tokens whatever k is), so every k shares the same curve.
Little data is shrunk toward the request-type curve, that toward the versions' global curve, and a new model
version starts from the previous version's curve with a small (discounted) pseudo-count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from telemetry.records import AcceptanceWindow

WILD = "*"


def counts_from_hist(hist: tuple[int, ...] | list[int], positions: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-position successes and trials from an acceptance histogram.

    Args:
        hist: ``[k + 1]`` rows that accepted exactly 0..k drafts.
        positions: K, the length of the returned arrays (positions beyond k get zero counts).

    Returns:
        ``(successes [K], trials [K])``.
    """
    h = np.asarray(hist, dtype=float)
    k = h.size - 1
    tail = np.cumsum(h[::-1])[::-1]  # tail[i] = rows with accepted >= i
    s, n = np.zeros(positions), np.zeros(positions)
    m = min(k, positions)
    s[:m] = tail[1 : m + 1]
    n[:m] = tail[:m]
    return s, n


class AcceptanceModel:
    """Beta posteriors over the acceptance curve with a three-level hierarchy and version carry-over.

    Args:
        positions: K, number of positions modelled (the policy's k_max).
        prior_mean: acceptance assumed before any data.
        bucket_strength: pseudo-rows pulling a bucket toward its request-type curve.
        type_strength: pseudo-rows pulling a request-type curve toward the global (or previous-version) curve.
        version_strength: pseudo-rows of the previous version's curve a new version starts from (discounted).
        decay: multiplier on old counts per observed window of the same key (forgetting, for drift).
    """

    def __init__(self, positions: int, prior_mean: float = 0.6, bucket_strength: float = 30.0,
                 type_strength: float = 60.0, version_strength: float = 10.0, decay: float = 0.995) -> None:
        self.K = positions
        self.prior_mean, self.decay = prior_mean, decay
        self.bucket_strength, self.type_strength = bucket_strength, type_strength
        self.version_strength = version_strength
        self._s: dict[str, np.ndarray] = {}
        self._n: dict[str, np.ndarray] = {}
        self._rows: dict[str, float] = {}  # decayed rows per (t, d, type, ctx): the request mix
        self._versions: list[str] = []  # "t|d" in order of first appearance

    def observe(self, w: AcceptanceWindow) -> None:
        vd = f"{w.target_version}|{w.draft_version}"
        if vd not in self._versions:
            self._versions.append(vd)
        bkey = f"{vd}|{w.request_type}|{w.context_bucket}"
        self._rows[bkey] = self._rows.get(bkey, 0.0) * self.decay + w.rows
        if w.k == 0 or w.rows == 0:
            return
        s, n = counts_from_hist(w.hist, self.K)
        for key in (bkey, f"{vd}|{w.request_type}|{WILD}", f"{vd}|{WILD}|{WILD}"):
            self._s[key] = self._s.get(key, np.zeros(self.K)) * self.decay + s
            self._n[key] = self._n.get(key, np.zeros(self.K)) * self.decay + n

    def _counts(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        return self._s.get(key, np.zeros(self.K)), self._n.get(key, np.zeros(self.K))

    def _previous(self, vd: str) -> str | None:
        """The most recent other (target, draft) versions seen before ``vd`` (or last seen, if vd is new)."""
        if vd in self._versions:
            i = self._versions.index(vd)
            return self._versions[i - 1] if i > 0 else None
        return self._versions[-1] if self._versions else None

    def type_mean(self, vd: str, rtype: str, depth: int = 0) -> np.ndarray:
        """``[K]`` posterior mean of the request-type curve, shrunk toward global / previous version."""
        prev = self._previous(vd) if depth < 2 else None
        base = np.full(self.K, self.prior_mean)
        if prev is not None and (prev + f"|{rtype}|{WILD}") in self._n:
            base = self.type_mean(prev, rtype, depth + 1)
        gs, gn = self._counts(f"{vd}|{WILD}|{WILD}")
        glob = (gs + self.version_strength * base) / (gn + self.version_strength)
        ts, tn = self._counts(f"{vd}|{rtype}|{WILD}")
        return np.asarray((ts + self.type_strength * glob) / (tn + self.type_strength))

    def beta_params(self, vd: str, rtype: str, ctx: str) -> tuple[np.ndarray, np.ndarray]:
        """``([K], [K])`` Beta(a, b) parameters of the bucket's per-position acceptance."""
        m = np.clip(self.type_mean(vd, rtype), 1e-3, 1 - 1e-3)
        s, n = self._counts(f"{vd}|{rtype}|{ctx}")
        strength = self.bucket_strength
        return s + strength * m, (n - s) + strength * (1.0 - m)

    def cond(self, vd: str, rtype: str, ctx: str, rng: np.random.Generator | None) -> np.ndarray:
        """``[K]`` conditional acceptance: a Thompson draw when ``rng`` is given, else the posterior mean."""
        a, b = self.beta_params(vd, rtype, ctx)
        if rng is None:
            return a / (a + b)
        return rng.beta(a, b)

    def mix(self, vd: str, ctx: str) -> dict[str, float]:
        """Recent rows per request type for (versions, context bucket)."""
        pre = f"{vd}|"
        out: dict[str, float] = {}
        for key, rows in self._rows.items():
            if key.startswith(pre) and key.endswith(f"|{ctx}") and rows > 0:
                out[key[len(pre) : -len(ctx) - 1]] = rows
        return out

    def get_state(self) -> dict[str, Any]:
        return {"s": {k: v.tolist() for k, v in self._s.items()}, "n": {k: v.tolist() for k, v in self._n.items()},
                "rows": dict(self._rows), "versions": list(self._versions)}

    def set_state(self, st: dict[str, Any]) -> None:
        self._s = {k: np.asarray(v, dtype=float) for k, v in st["s"].items()}
        self._n = {k: np.asarray(v, dtype=float) for k, v in st["n"].items()}
        self._rows = {k: float(v) for k, v in st["rows"].items()}
        self._versions = [str(v) for v in st["versions"]]
