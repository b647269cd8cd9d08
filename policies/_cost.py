"""Round-cost model: draft / verify / other seconds per round as functions of batch, context and k.

Why this form: what a policy needs from the cost model is the *shape* of round seconds across k in a cell it
has seen at one k only (or not at all) — and the shape changes with the batch: at batch 1 verifying k + 1 tokens
costs little more than one, at high batch it grows with every token. A model linear in log batch extrapolates
a batch of 64 from batches 1 and 4 to plain rounds 2.7x too cheap, and a policy planning with it switches
speculation off where it wins 1.25x (measured on the reference engine).

So each part of a round is a non-negative combination of the work it does (fitted by non-negative least squares
on the aggregated cost windows, relative errors: scikit-learn's ``LinearRegression(positive=True)``). Rows of one
round draft different k (packed verification): m is the round's largest k (the draft steps it runs), D the
tokens drafted over all rows (step j runs only the rows with k > j, so the steps together run D row-steps), and
the target verifies B + D tokens:

- draft  = d0 m + d1 D + d2 D C                      m draft forwards (fixed overhead) over D row-steps
           + [m > 0] (d3 + d4 B)                     (per-row compute and attention), the first one wider by
                                                     the catch-up;
- verify = v0 + v1 (B + D) + v2 B C + v3 D C         one target forward over B + D tokens: overhead, GEMM work,
           + [m > 0] (v4 + v5 B + v6 B C)            the KV read once per row, attention compute; a multi-token
                                                     verify takes other kernels than a one-token step
                                                     (bench/results/engine.json, batch 64, long context: 2
                                                     positions cost 1.29x one, 3 cost 1.44x);
- other  = o0 + o1 B + o2 D                          set-up and bookkeeping (admitting new requests is
                                                     timed apart, ``RoundRecord.prefill_s``: it is the same
                                                     work whatever k is).

With one k for every row, D = B k. B is the mean batch of the cell, C the context bucket's representative
length. Windows are keyed by the largest k; a window's D comes from its verified tokens (``tokens_verified -
batch_rows``). :meth:`CostModel.predict` answers for one k shared by every row; :meth:`CostModel.per_token`
gives the seconds one drafted token adds (its D columns), which is what a row drafting less than the round's
largest k saves. Non-negative coefficients keep
every extrapolation monotone in B, C and k. What batches 1 and 4 cannot tell apart (a fixed cost or one per
row) decides the extrapolation to batch 64, so a policy should measure a second k in a cell beyond the
measured range (:meth:`CostModel.extrapolating`) rather than trust the guess.

A cell's own measurements then correct the shared fit: each cell has a scale factor (its observed seconds over
the model's, shrunk toward 1 with ``prior_windows``); a cell measured at three k > 0 (or two, 3 apart)
corrects the shared slope in k with its own (a residual linear in k); and a k the cell was measured at is
predicted from its measurement (shrunk toward the corrected model the same way). Each k's measurement is first
moved from the mean batch it ran at to the batch asked about, along the shared fit: the batch moves within its
bucket and the ks served are not served at random moments, so on ``bench vllm`` batch bucket 16 ran k = 3 at
14.8 rows and k = 4 at 13.6, and k = 4 looked cheaper for the rows it did not have.
The machine's speed moves (another tenant steals a core): a window measured in a slow spell must not make its k
look dear next to ks measured in a quiet one. Every window of a (cell, k) already measured over
``ESTABLISHED_WINDOWS`` windows is compared with what the model predicts for it; the median of the last
``speed_memory`` such ratios is the machine's current slowness, and every window's seconds are divided by it
before they are added. Windows taken close together are thereby compared at one speed (a paired comparison),
and a spell of contention moves the speed estimate, not the cost of whichever k happened to be served in it.
The median (not a mean) lets one odd window move nothing.
For Thompson sampling the seconds of a k the cell was never measured at are drawn around the prediction
(log-normal, ``explore_spread``): a mis-extrapolated k then gets tried and measured instead of being ruled out
for good by a deterministic guess. A measured k is drawn within its standard error (the cell's window spread over
the square root of its windows, never wider than ``explore_spread``: a measurement never leaves a k less certain
than no measurement), so a k measured in a few unlucky windows is tried again, and one measured in many is not.
Model versions are not a feature: a new target of the same architecture keeps the cost learnt so far.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
from sklearn.linear_model import LinearRegression

from telemetry.records import context_length

PRIOR_DRAFT_PER_K = 0.1  # before any fit: one draft step costs 10% of a verify forward (Leviathan's c)
PARTS = ("draft", "verify", "other")
MIN_OWN_SLOPE_SPAN = 3  # two ks closer than this give a cell's own slope from noise, not from cost
ROUNDS_PER_FULL_WINDOW = 10.0  # a window of r rounds counts r / (r + 10) windows of evidence
ESTABLISHED_WINDOWS = 2.0  # a (cell, k) with this much evidence votes on the machine's current speed
# Before a cell's windows say how much a window's seconds per round scatter, assume this relative spread, worth
# this many windows (see CostModel.spread).
PRIOR_SPREAD = 0.1
PRIOR_SPREAD_WINDOWS = 2.0

CostCell = tuple[int, str]  # (batch-size bucket, context bucket): what a round's cost is learnt per


@dataclass(slots=True)
class CostAggregate:
    """Decayed sums over the cost windows of one (cell, k)."""

    rounds: float = 0.0
    batch_rows: float = 0.0  # rows summed over rounds: batch_rows / rounds is the cell's mean batch
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    windows: float = 0.0  # evidence in windows, each weighted r / (r + ROUNDS_PER_FULL_WINDOW)
    drafted: float = 0.0  # tokens drafted over every row and round (verified tokens minus rows)
    window_s: float = 0.0  # sum over windows of weight x the window's seconds per round
    window_s2: float = 0.0  # the same of its square: how much windows of this (cell, k) scatter

    def add(self, decay: float, rounds: float, batch_rows: float, draft_s: float, verify_s: float,
            other_s: float, windows: float, drafted: float) -> None:
        """Decay the sums by ``decay`` and add one window's (``windows``: its weight as evidence)."""
        x = (draft_s + verify_s + other_s) / rounds if rounds > 0 else 0.0
        self.window_s = self.window_s * decay + windows * x
        self.window_s2 = self.window_s2 * decay + windows * x * x
        self.rounds = self.rounds * decay + rounds
        self.batch_rows = self.batch_rows * decay + batch_rows
        self.draft_s = self.draft_s * decay + draft_s
        self.verify_s = self.verify_s * decay + verify_s
        self.other_s = self.other_s * decay + other_s
        self.windows = self.windows * decay + windows
        self.drafted = self.drafted * decay + drafted

    def per_round(self) -> np.ndarray:
        """``[3]`` mean (draft, verify, other) seconds per round."""
        return np.array([self.draft_s, self.verify_s, self.other_s]) / self.rounds


AGGREGATE_FIELDS = tuple(f.name for f in fields(CostAggregate))


def _features(b: np.ndarray, c: np.ndarray, m: np.ndarray, d: np.ndarray) -> list[np.ndarray]:
    """Per-part design matrices (see the module docstring).

    Args:
        b: ``[N]`` mean batch size; c: ``[N]`` context length; m: ``[N]`` largest draft length of the round;
        d: ``[N]`` tokens drafted per round over all rows (``b * m`` when every row drafts ``m``).
    Returns:
        ``[draft [N, 5], verify [N, 7], other [N, 3]]``.
    """
    kib = c / 1024.0  # context in KiB keeps the columns within a few orders of magnitude
    one = np.ones_like(b)
    on = (m > 0).astype(float)
    return [
        np.stack([m, d, d * kib, on, on * b], axis=1),
        np.stack([one, b + d, b * kib, d * kib, on, on * b, on * b * kib], axis=1),
        np.stack([one, b, d], axis=1),
    ]


# Per part, the design-matrix columns that grow with each drafted token: (column, grows by C in KiB, not by 1).
_PER_TOKEN_COLUMNS: tuple[tuple[tuple[int, bool], ...], ...] = (((1, False), (2, True)), ((1, False), (3, True)),
                                                                ((2, False),))


class CostModel:
    """Aggregates cost windows per (cell, k) and fits/predicts per-round seconds.

    Args:
        k_max: largest k predicted.
        prior_windows: pseudo-windows of the shared fit when a cell's own measurements correct it.
        refit_every: cost windows between refits once warmed up (early on it refits more often).
        decay: multiplier on old aggregates per window of the same (cell, k), for drift.
        explore_spread: log-normal sigma of sampled seconds for a k never measured in the cell.
        speed_memory: recent windows whose median ratio (observed / predicted) is the machine's slowness; 0 keeps
            raw seconds (see the module docstring).
        draw_measured: a Thompson draw (:meth:`predict` with ``rng``) also draws the seconds of a measured k,
            log-normal within its standard error (:meth:`spread` over the square root of its windows plus
            ``prior_windows``, at most ``explore_spread``); False keeps measured ks at their estimate.
    """

    def __init__(self, k_max: int, prior_windows: float = 2.0, refit_every: int = 16, decay: float = 0.999,
                 explore_spread: float = 0.1, speed_memory: int = 3, draw_measured: bool = True) -> None:
        if prior_windows < 0 or refit_every < 1 or not 0 < decay <= 1 or explore_spread < 0 or speed_memory < 0:
            raise ValueError("prior_windows, explore_spread, speed_memory must be >= 0, refit_every >= 1 and decay "
                             "in (0, 1]")
        self.k_max, self.prior_windows, self.refit_every, self.decay = k_max, prior_windows, refit_every, decay
        self.explore_spread, self.speed_memory, self.draw_measured = explore_spread, speed_memory, draw_measured
        self._speed: list[float] = []  # the last speed_memory ratios observed / predicted of established windows
        self._agg: dict[CostCell, dict[int, CostAggregate]] = {}  # cell -> k -> decayed sums
        self._since_fit = 0
        self._n_seen = 0
        self._coef: list[np.ndarray] | None = None  # shared fit: coefficients of the draft, verify, other features

    def observe(self, batch_bucket: int, ctx: str, k: int, rounds: int, batch_rows: int,
                draft_s: float, verify_s: float, other_s: float, drafted: float | None = None) -> None:
        """Add one cost window of rounds whose largest k is ``k``.

        ``drafted``: tokens drafted over all rows and rounds; None means every row drafted ``k``.
        """
        d = float(batch_rows * k) if drafted is None else float(drafted)
        if self.speed_memory and rounds > 0:
            slow = self._slowness(batch_bucket, ctx, k, rounds, batch_rows, d, draft_s + verify_s + other_s)
            draft_s, verify_s, other_s = draft_s / slow, verify_s / slow, other_s / slow
        cell = self._agg.setdefault((batch_bucket, ctx), {})
        new_key = k not in cell
        weight = rounds / (rounds + ROUNDS_PER_FULL_WINDOW)  # a window of a few rounds is a weak measurement
        cell.setdefault(k, CostAggregate()).add(self.decay, rounds, batch_rows, draft_s, verify_s, other_s, weight,
                                                d)
        self._since_fit += 1
        self._n_seen += 1
        # A (cell, k) never seen before refits at once: the first measurement of a cell or of a k is what
        # corrects an extrapolation most.
        if new_key or self._since_fit >= min(self.refit_every, max(1, self._n_seen // 4)):
            self.refit()

    def _slowness(self, batch_bucket: int, ctx: str, k: int, rounds: int, batch_rows: int, drafted: float,
                  seconds: float) -> float:
        """The machine's current slowness (1 = as measured so far), updated with this window if it can vote."""
        agg = self._cell(batch_bucket, ctx).get(k)
        if self._coef is not None and agg is not None and agg.windows >= ESTABLISHED_WINDOWS and k <= self.k_max:
            b = batch_rows / rounds
            want = float(self.predict(batch_bucket, ctx, b)[k].sum())
            want -= self.per_token(batch_bucket, ctx) * max(0.0, b * k - drafted / rounds)
            ratio = seconds / rounds / want if want > 0 else 0.0
            if 0.0 < ratio < math.inf:  # a window that took no time cannot say how fast the machine is
                self._speed.append(ratio)
                del self._speed[: -self.speed_memory]
        return float(np.median(self._speed)) if len(self._speed) >= min(3, self.speed_memory) else 1.0

    def _cell(self, batch_bucket: int, ctx: str) -> dict[int, CostAggregate]:
        """k -> aggregate of one cell (read only)."""
        return self._agg.get((batch_bucket, ctx), {})

    def ks_seen(self, batch_bucket: int, ctx: str) -> set[int]:
        return set(self._cell(batch_bucket, ctx))

    def _cells_with_slope(self) -> list[CostCell]:
        """Every cell measured at two or more k."""
        return [cell for cell, by_k in self._agg.items() if len(by_k) >= 2]

    def cells_with_slope(self) -> int:
        """Cells seen at two or more k: what identifies the shared slope in k that unprobed cells borrow."""
        return len(self._cells_with_slope())

    def k0_measured(self) -> bool:
        """Some cell was measured with speculation off (identifies the jump in cost at k > 0)."""
        return any(0 in by_k for by_k in self._agg.values())

    def extrapolating(self, batch_bucket: int, ctx: str) -> bool:
        """True when the cell lies beyond every cell measured at two or more k (larger batch or context)."""
        known = self._cells_with_slope()
        if not known:
            return True
        b = self.mean_batch(batch_bucket, ctx)
        c = context_length(ctx)
        return b > 1.01 * max(self.mean_batch(kb, kc) for kb, kc in known) or c > max(
            context_length(kc) for _, kc in known)

    def windows(self, batch_bucket: int, ctx: str) -> dict[int, float]:
        """k -> the cell's evidence at k, in (decayed, weighted) windows."""
        return {k: v.windows for k, v in self._cell(batch_bucket, ctx).items()}

    def spread(self, batch_bucket: int, ctx: str) -> float:
        """Relative standard deviation of one window's seconds per round in this cell, pooled over its ks.

        What a measured difference between two ks must be weighed against: on a shared 2-core VM the windows of
        one (cell, k) scatter by 10-30% (another tenant, the batch moving within its bucket, prompts admitted
        beside the decoding rows), so two ks measured in a few windows each can differ by several percent with
        no difference in cost. Each k's scatter is taken around its own mean (its windows' weights as evidence,
        one window of evidence spent on the mean), pooled over the cell's ks and shrunk toward ``PRIOR_SPREAD``
        with ``PRIOR_SPREAD_WINDOWS``.
        """
        num, den = PRIOR_SPREAD_WINDOWS * PRIOR_SPREAD ** 2, PRIOR_SPREAD_WINDOWS
        for v in self._cell(batch_bucket, ctx).values():
            if v.windows <= 1.0 or v.window_s <= 0.0:
                continue
            mean = v.window_s / v.windows
            sq = max(v.window_s2 - v.window_s * mean, 0.0)  # sum of weight x (x - mean)^2
            num += sq / mean ** 2
            den += v.windows - 1.0
        return math.sqrt(num / den)

    def mean_batch(self, batch_bucket: int, ctx: str) -> float:
        cell = self._cell(batch_bucket, ctx).values()
        r = sum(v.rounds for v in cell)
        b = sum(v.batch_rows for v in cell)
        return b / r if r > 0 else float(batch_bucket)

    def refit(self) -> None:
        self._since_fit = 0
        if not self._agg:
            return
        rows = sorted((((bb, ctx, k), agg) for (bb, ctx), by_k in self._agg.items() for k, agg in by_k.items()),
                      key=lambda row: row[0])
        rounds = np.array([agg.rounds for _, agg in rows])  # [N]
        y = np.array([[agg.draft_s, agg.verify_s, agg.other_s] for _, agg in rows]) / rounds[:, None]  # [N, 3]
        b = np.array([agg.batch_rows for _, agg in rows]) / rounds
        c = np.array([float(context_length(ctx)) for (_, ctx, _), _ in rows])
        k = np.array([float(kk) for (_, _, kk), _ in rows])
        d = np.array([agg.drafted for _, agg in rows]) / rounds
        feats = _features(b, c, k, d)
        # Relative errors, every observation weighted by how many rounds it holds (square root: a cell served
        # for hours must not drown out one seen for a minute).
        w = np.sqrt(rounds) / np.maximum(y.sum(axis=1), 1e-12)
        coef = []
        for j, x in enumerate(feats):
            use = k > 0 if j == 0 else np.ones_like(k, dtype=bool)
            if not use.any():
                coef.append(np.zeros(x.shape[1]))
                continue
            norm = np.maximum(np.abs(x[use]).max(axis=0), 1e-30)  # column scaling for a well-conditioned solve
            fit = LinearRegression(fit_intercept=False, positive=True).fit(
                x[use] / norm, y[use, j], sample_weight=w[use] ** 2)
            coef.append(fit.coef_ / norm)
        self._coef = coef

    def _model(self, b: float, c: float, ks: np.ndarray) -> np.ndarray:
        """``[len(ks), 3]`` seconds per round from the shared fit alone, every row drafting its round's k."""
        assert self._coef is not None
        n = ks.size
        feats = _features(np.full(n, b), np.full(n, c), ks, b * ks)
        return np.stack([x @ cf for x, cf in zip(feats, self._coef, strict=True)], axis=1)

    def _marginal(self, c: float) -> np.ndarray:
        """``[3]`` seconds one more drafted token adds to each part, from the shared fit (no cell correction)."""
        if self._coef is None:
            return np.zeros(len(PARTS))
        kib = c / 1024.0
        return np.array([sum(float(cf[j]) * (kib if by_context else 1.0) for j, by_context in cols)
                         for cf, cols in zip(self._coef, _PER_TOKEN_COLUMNS, strict=True)])

    def per_token(self, batch_bucket: int, ctx: str) -> float:
        """Seconds one drafted token adds to a round of this cell (the shared fit's D columns).

        What a row drafting fewer tokens than its round's largest k saves, per token it does not draft.
        """
        return float(self._marginal(float(context_length(ctx))).sum())

    def predict(self, batch_bucket: int, ctx: str, batch_size: float | None = None,
                rng: np.random.Generator | None = None) -> np.ndarray:
        """``[k_max + 1, 3]`` predicted (draft, verify, other) seconds per round for k = 0..k_max.

        With ``rng``, a Thompson draw: ks never measured in the cell are scaled by a log-normal factor
        (``explore_spread``), measured ones by one within their standard error (``draw_measured``).
        Before the first fit returns the relative prior ``(c k, 1, 0)`` (only ratios across k matter then).
        """
        ks = np.arange(self.k_max + 1, dtype=float)
        if self._coef is None:
            return np.stack([PRIOR_DRAFT_PER_K * ks, np.ones_like(ks), np.zeros_like(ks)], axis=1)
        b = batch_size if batch_size is not None else self.mean_batch(batch_bucket, ctx)
        c = float(context_length(ctx))
        y = self._model(max(b, 1.0), c, ks)
        # The cell's own measurements: a scale on the shared shape, and the measured k themselves.
        obs = {kk: v for kk, v in self._cell(batch_bucket, ctx).items() if kk <= self.k_max and v.rounds > 0}
        if obs:
            # Weights count windows, not rounds: what makes a measurement wrong is the machine's speed drifting
            # between windows (another tenant, clocks), which a window's hundreds of rounds do not average out.
            tau = self.prior_windows
            n_w = {kk: v.windows for kk, v in obs.items()}
            # Rows that drafted less than their round's largest k made the round cheaper than one k for every
            # row: add back what the tokens they did not draft would have cost, so a measurement answers for k.
            marg = self._marginal(c)
            per_round = {kk: v.per_round() + marg * max(0.0, (v.batch_rows * kk - v.drafted) / v.rounds)
                         for kk, v in obs.items()}
            # Each k was measured at its own mean batch (the batch moves within its bucket, and which k was served
            # when is not random): moved to the batch asked about along the shared fit, so a k measured while the
            # batch was smaller does not look cheaper for it (see the module docstring).
            km = np.array(sorted(obs), dtype=float)  # [M] the measured ks
            bm = np.array([max(obs[int(kk)].batch_rows / obs[int(kk)].rounds, 1.0) for kk in km])  # [M] their batches
            at = sum(x @ cf for x, cf in zip(_features(bm, np.full_like(bm, c), km, bm * km), self._coef,
                                                   strict=True))  # [M] the shared fit at each k's own batch
            for kk, a in zip(km.astype(int), at, strict=True):
                per_round[kk] = per_round[kk] * (float(y[kk].sum()) / a if a > 0 else 1.0)
            seen = sum(n_w[kk] * float(per_round[kk].sum()) for kk in obs)
            expect = sum(n_w[kk] * float(y[kk].sum()) for kk in obs)
            mean_pred = expect / sum(n_w.values())
            scale = (seen + tau * mean_pred) / max(expect + tau * mean_pred, 1e-30)
            y = y * scale
            # Measured at three k > 0, or two far enough apart: the cell's own slope in k corrects the shared one
            # (a residual linear in k, weighted by evidence) for the ks it has not measured. Two neighbouring ks
            # measured in different windows mostly measure the machine's drift between them.
            pos = sorted(kk for kk in obs if kk > 0)
            if len(pos) >= 3 or (len(pos) == 2 and pos[1] - pos[0] >= MIN_OWN_SLOPE_SPAN):
                kp = np.array(pos, dtype=float)
                res = np.array([per_round[kk].sum() - y[kk].sum() for kk in pos])
                sw = np.sqrt(np.array([n_w[kk] for kk in pos]))
                a, slope = np.linalg.lstsq(np.stack([np.ones_like(kp), kp], axis=1) * sw[:, None], res * sw,
                                           rcond=None)[0]
                tot = y[1:].sum(axis=1)
                y[1:] *= (np.maximum(tot + a + slope * ks[1:], 0.2 * tot) / np.maximum(tot, 1e-30))[:, None]
            for kk in obs:
                y[kk] = (n_w[kk] * per_round[kk] + tau * y[kk]) / (n_w[kk] + tau)
        if rng is not None and self.explore_spread > 0:
            unmeasured = np.array([kk not in obs for kk in range(ks.size)])
            y[unmeasured] *= np.exp(self.explore_spread * rng.standard_normal(int(unmeasured.sum())))[:, None]
        if rng is not None and self.draw_measured and obs:
            # A measured k is drawn within its standard error (see the module docstring); taken as exact, a k
            # measured in a few unlucky windows stayed behind for good (GoodputPolicy._explore has the case).
            # Never wider than a k nothing measured (explore_spread): a cell whose first windows scatter widely
            # would otherwise draw its measured ks further than its guesses, and explore from scratch.
            sd = self.spread(batch_bucket, ctx)
            for kk in sorted(obs):
                sigma = min(sd / math.sqrt(n_w[kk] + tau), self.explore_spread)
                y[kk] *= math.exp(sigma * float(rng.standard_normal()))
        y = np.maximum(y, 0.0)
        y[0, 0] = 0.0  # no draft steps at k = 0
        floor = 0.05 * max(float(y[0].sum()), 1e-9)
        y[:, 1] = np.maximum(y[:, 1], floor)  # a verify forward never costs (nearly) nothing
        return y

    @property
    def fitted(self) -> bool:
        return self._coef is not None

    def get_state(self) -> dict[str, Any]:
        """JSON-safe state: one record per (cell, k) aggregate, in the order they were first seen."""
        agg = [{"batch_bucket": bb, "context_bucket": ctx, "k": k, **asdict(a)}
               for (bb, ctx), by_k in self._agg.items() for k, a in by_k.items()]
        coef = None if self._coef is None else [c.tolist() for c in self._coef]
        return {"agg": agg, "since_fit": self._since_fit, "n_seen": self._n_seen, "coef": coef,
                "speed": list(self._speed)}

    def set_state(self, st: dict[str, Any]) -> None:
        """Inverse of :meth:`get_state`."""
        self._agg = {}
        for rec in st["agg"]:
            cell = self._agg.setdefault((int(rec["batch_bucket"]), str(rec["context_bucket"])), {})
            # window_s / window_s2 are absent from states saved before them: no spread measured yet
            cell[int(rec["k"])] = CostAggregate(**{f: float(rec.get(f, 0.0)) for f in AGGREGATE_FIELDS})
        self._since_fit, self._n_seen = int(st["since_fit"]), int(st["n_seen"])
        self._speed = [float(x) for x in st["speed"]]
        coef = st["coef"]
        if coef is not None and len(coef) != len(PARTS):
            raise ValueError(f"cost fit has {len(coef)} parts, expected {len(PARTS)}")
        self._coef = None if coef is None else [np.asarray(c, dtype=float) for c in coef]
