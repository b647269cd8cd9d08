"""Hierarchical Beta model of per-position acceptance, shared by model-based policies.

For each position i (1..K) the conditional acceptance ``p_i = P(accepted >= i | accepted >= i - 1)`` gets a
Beta posterior per (versions, request type, context bucket). Counts come from acceptance histograms: a row that
drafted k tokens and kept a of them is a trial at positions 1..min(a + 1, k) and a success at 1..a. Positions
do not depend on k (the draft proposes the same tokens whatever k is), so every k shares the same curve.
Little data is shrunk toward the request-type curve, that toward the versions' global curve, and a new model
version starts from the previous version's curve with a small (discounted) pseudo-count.

Each level is shrunk toward its parent's curve *shifted by the level's own pooled acceptance*: over every
position it has trials at, a level's successes against what the parent predicts at those trials give one
log-odds offset (shrunk toward 0 with ``level_strength`` pseudo-trials), applied to every position. So positions a
level was never served deep enough to see are predicted from the positions it has seen, not from the flat prior:
a request type that accepts 0.9 at positions 1-3 is predicted near 0.9 at 4-8 after its first window at k = 3,
where a flat prior of 0.6 would keep it at k = 3-4 until exploration reached deeper ks (Leviathan et al. 2023
model acceptance as one rate per request type). Per-position data still decide every position they exist at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from telemetry.records import AcceptanceWindow

Versions = tuple[str, str]  # (target version, draft version)
_EPS = 1e-3  # acceptance probabilities are kept within [_EPS, 1 - _EPS]


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1.0 - _EPS)
    return np.asarray(np.log(p / (1.0 - p)))


def level_shift(parent: np.ndarray, s: np.ndarray, n: np.ndarray, strength: float) -> np.ndarray:
    """The parent's curve shifted in log-odds by one level's pooled acceptance.

    Args:
        parent: ``[..., K]`` the parent level's per-position mean.
        s, n: ``[..., K]`` the level's successes and trials.
        strength: pseudo-trials at the parent's own rate: the offset is shrunk toward 0 with them.
    Returns:
        ``[..., K]`` the shifted curve; the parent itself where the level has no trials.
    """
    trials = n.sum(axis=-1, keepdims=True)  # [..., 1]
    predicted = np.clip(parent, _EPS, 1.0 - _EPS)
    r_parent = (n * predicted).sum(axis=-1, keepdims=True) / np.maximum(trials, 1e-12)  # [..., 1] at its trials
    r_parent = np.where(trials > 0, r_parent, 0.5)
    r_level = (s.sum(axis=-1, keepdims=True) + strength * r_parent) / (trials + strength)  # [..., 1]
    offset = _logit(r_level) - _logit(r_parent)  # [..., 1]; 0 without trials
    return np.asarray(1.0 / (1.0 + np.exp(-(_logit(parent) + offset))))


def level_mean(parent: np.ndarray, s: np.ndarray, n: np.ndarray, strength: float,
               shift_strength: float) -> np.ndarray:
    """``[..., K]`` a level's posterior mean: its counts over ``strength`` pseudo-trials of the shifted parent."""
    base = level_shift(parent, s, n, shift_strength)
    return np.asarray((s + strength * base) / (n + strength))


@dataclass(slots=True)
class Counts:
    """Decayed per-position successes and trials of one level of the hierarchy."""

    s: np.ndarray  # [K] successes
    n: np.ndarray  # [K] trials


@dataclass(slots=True)
class _VersionCounts:
    """Everything learnt about one (target, draft) version pair."""

    glob: Counts  # every request type and context bucket
    by_type: dict[str, Counts] = field(default_factory=dict)  # request type -> counts over every context bucket
    by_bucket: dict[tuple[str, str], Counts] = field(default_factory=dict)  # (request type, context bucket) -> counts
    rows: dict[str, dict[str, float]] = field(default_factory=dict)  # context bucket -> type -> decayed rows (mix)


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
        level_strength: pseudo-trials pulling a level's pooled acceptance (every position together) toward its
            parent's; the difference shifts the parent's whole curve (see the module docstring).
        mix_rows: the request mix of a context bucket (:meth:`mix`) is that of about its last ``mix_rows`` rows: a
            window of ``r`` rows there weighs every type's earlier rows down by ``exp(-r / mix_rows)``. Every type
            fades, not only the window's own, and the memory is counted in rows, not windows: after a large-batch
            stretch (hundreds of rows a window) a few seconds of small batches still set the mix.
    """

    def __init__(self, positions: int, prior_mean: float = 0.6, bucket_strength: float = 30.0,
                 type_strength: float = 60.0, version_strength: float = 10.0, decay: float = 0.995,
                 level_strength: float = 10.0, mix_rows: float = 1000.0) -> None:
        if level_strength < 0:
            raise ValueError(f"level_strength must be >= 0, got {level_strength}")
        if not mix_rows > 0:
            raise ValueError(f"mix_rows must be > 0, got {mix_rows}")
        self.mix_rows = mix_rows
        self.K = positions
        self.prior_mean, self.decay, self.level_strength = prior_mean, decay, level_strength
        self.bucket_strength, self.type_strength = bucket_strength, type_strength
        self.version_strength = version_strength
        self._by_versions: dict[Versions, _VersionCounts] = {}  # in order of first appearance

    def _zeros(self) -> Counts:
        return Counts(np.zeros(self.K), np.zeros(self.K))

    def observe(self, w: AcceptanceWindow) -> None:
        vc = self._by_versions.get((w.target_version, w.draft_version))
        if vc is None:
            vc = self._by_versions[(w.target_version, w.draft_version)] = _VersionCounts(glob=self._zeros())
        mix = vc.rows.setdefault(w.context_bucket, {})
        fade = math.exp(-w.rows / self.mix_rows)
        for t in mix:  # the mix is recent traffic: a type that stopped arriving fades with the others' rows
            mix[t] *= fade
        mix[w.request_type] = mix.get(w.request_type, 0.0) + w.rows
        if w.k == 0 or w.rows == 0:
            return
        s, n = counts_from_hist(w.hist, self.K)
        # A level is created at its first counts: "a type curve exists" is what carries it to a new version.
        bucket = vc.by_bucket.setdefault((w.request_type, w.context_bucket), self._zeros())
        rtype = vc.by_type.setdefault(w.request_type, self._zeros())
        for c in (bucket, rtype, vc.glob):
            c.s = c.s * self.decay + s
            c.n = c.n * self.decay + n

    def forget(self, vd: Versions, rtype: str, ctx: str, keep_rows: float) -> None:
        """Shrink the (versions, type, context) bucket's own evidence to at most ``keep_rows`` rows (after an
        acceptance drift there): every position's counts scale by one factor, so the curve's shape is kept while
        its posterior widens and falls back toward the type curve; new windows then outweigh the old level fast.
        """
        vc = self._by_versions.get(vd)
        c = vc.by_bucket.get((rtype, ctx)) if vc is not None else None
        if c is None or c.n[0] <= keep_rows:  # n[0]: rows that drafted at all (every one is a trial at position 1)
            return
        f = keep_rows / float(c.n[0])
        c.s, c.n = c.s * f, c.n * f

    def drop(self, rtype: str | None = None, vd: Versions | None = None) -> None:
        """Forget a request type under every version pair, or a version pair whole."""
        if vd is not None:
            self._by_versions.pop(vd, None)
        if rtype is not None:
            for vc in self._by_versions.values():
                vc.by_type.pop(rtype, None)
                for key in [key for key in vc.by_bucket if key[0] == rtype]:
                    del vc.by_bucket[key]
                for mix in vc.rows.values():
                    mix.pop(rtype, None)

    def _previous(self, vd: Versions) -> Versions | None:
        """The most recent other (target, draft) versions seen before ``vd`` (or last seen, if vd is new)."""
        versions = list(self._by_versions)
        if vd in self._by_versions:
            i = versions.index(vd)
            return versions[i - 1] if i > 0 else None
        return versions[-1] if versions else None

    def type_means(self, vd: Versions, types: list[str], depth: int = 0) -> np.ndarray:
        """``[T, K]`` posterior means of the request-type curves, shrunk toward global / previous version."""
        zeros = np.zeros(self.K)
        base = np.full((len(types), self.K), self.prior_mean)  # [T, K] what each type curve shrinks toward
        prev = self._previous(vd) if depth < 2 else None
        if prev is not None:
            known = [i for i, t in enumerate(types) if t in self._by_versions[prev].by_type]
            if known:
                base[known] = self.type_means(prev, [types[i] for i in known], depth + 1)
        vc = self._by_versions.get(vd)
        glob_s, glob_n = (vc.glob.s, vc.glob.n) if vc is not None else (zeros, zeros)
        mean_glob = level_mean(base, glob_s, glob_n, self.version_strength, self.level_strength)  # [T, K]
        by_type = [vc.by_type.get(t) if vc is not None else None for t in types]
        t_s = np.stack([c.s if c is not None else zeros for c in by_type])  # [T, K]
        t_n = np.stack([c.n if c is not None else zeros for c in by_type])  # [T, K]
        return level_mean(mean_glob, t_s, t_n, self.type_strength, self.level_strength)

    def _beta(self, vd: Versions, types: list[str], ctx: str) -> tuple[np.ndarray, np.ndarray]:
        """``([T, K], [T, K])`` Beta(a, b) parameters of each (type, ``ctx``) bucket's per-position acceptance."""
        zeros = np.zeros(self.K)
        vc = self._by_versions.get(vd)
        by_bucket = [vc.by_bucket.get((t, ctx)) if vc is not None else None for t in types]
        c_s = np.stack([c.s if c is not None else zeros for c in by_bucket])  # [T, K]
        c_n = np.stack([c.n if c is not None else zeros for c in by_bucket])  # [T, K]
        m = np.clip(level_shift(self.type_means(vd, types), c_s, c_n, self.level_strength), _EPS, 1 - _EPS)
        return c_s + self.bucket_strength * m, (c_n - c_s) + self.bucket_strength * (1.0 - m)

    def beta_params(self, vd: Versions, rtype: str, ctx: str) -> tuple[np.ndarray, np.ndarray]:
        """``([K], [K])`` Beta(a, b) parameters of the bucket's per-position acceptance."""
        a, b = self._beta(vd, [rtype], ctx)
        return a[0], b[0]

    def cond(self, vd: Versions, rtype: str, ctx: str, rng: np.random.Generator | None) -> np.ndarray:
        """``[K]`` conditional acceptance: a Thompson draw when ``rng`` is given, else the posterior mean."""
        return self.conds(vd, [rtype], ctx, rng)[0]

    def conds(self, vd: Versions, types: list[str], ctx: str, rng: np.random.Generator | None) -> np.ndarray:
        """``[T, K]`` conditional acceptance of each of ``types``: Thompson draws when ``rng`` is given, else the
        posterior means."""
        a, b = self._beta(vd, types, ctx)
        if rng is None:
            return np.asarray(a / (a + b))
        return np.asarray(rng.beta(a, b))

    def mix(self, vd: Versions, ctx: str) -> dict[str, float]:
        """Recent rows per request type for (versions, context bucket): about the last ``mix_rows`` rows."""
        vc = self._by_versions.get(vd)
        rows = vc.rows.get(ctx, {}) if vc is not None else {}
        return {t: r for t, r in rows.items() if r > 0}

    def get_state(self) -> dict[str, Any]:
        """JSON-safe state: one record per version pair, levels as records, in the order they were first seen."""
        return {"versions": [
            {"target": t, "draft": d, "global": _counts_state(vc.glob),
             "types": [{"request_type": rt, **_counts_state(c)} for rt, c in vc.by_type.items()],
             "buckets": [{"request_type": rt, "context_bucket": cx, **_counts_state(c)}
                         for (rt, cx), c in vc.by_bucket.items()],
             "rows": [{"context_bucket": cx, "request_type": rt, "rows": r}
                      for cx, by_type in vc.rows.items() for rt, r in by_type.items()]}
            for (t, d), vc in self._by_versions.items()]}

    def set_state(self, st: dict[str, Any]) -> None:
        """Inverse of :meth:`get_state`."""
        self._by_versions = {}
        for v in st["versions"]:
            vc = _VersionCounts(glob=self._counts_of(v["global"]))
            vc.by_type = {str(r["request_type"]): self._counts_of(r) for r in v["types"]}
            vc.by_bucket = {(str(r["request_type"]), str(r["context_bucket"])): self._counts_of(r)
                            for r in v["buckets"]}
            for r in v["rows"]:
                vc.rows.setdefault(str(r["context_bucket"]), {})[str(r["request_type"])] = float(r["rows"])
            self._by_versions[(str(v["target"]), str(v["draft"]))] = vc

    def _counts_of(self, rec: dict[str, Any]) -> Counts:
        c = Counts(np.asarray(rec["s"], dtype=float), np.asarray(rec["n"], dtype=float))
        if c.s.shape != (self.K,) or c.n.shape != (self.K,):
            raise ValueError(f"acceptance counts must have {self.K} positions")
        return c


def _counts_state(c: Counts) -> dict[str, list[float]]:
    return {"s": c.s.tolist(), "n": c.n.tolist()}
