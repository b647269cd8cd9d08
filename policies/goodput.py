"""``goodput``: the policy spectune ships — model-based choice of k that maximises emitted tokens per second.

Vocabulary as in ``telemetry/records.py`` (a round emits ``accepted + 1`` tokens per row; goodput is emitted
tokens per wall second for the whole batch). Expected tokens per round follow Leviathan et al. 2023
(arXiv:2211.17192) eq. 1 in its general form, ``1 + sum_i P(accepted >= i)``, with the per-position acceptance
curve learnt as Beta posteriors (:mod:`policies._acceptance`). Round seconds come from a non-negative model of
the work in a round, shared across buckets (:mod:`policies._cost`): at high batch the verify cost grows with
``k + 1`` and speculation can lose, so k = 0 is always a candidate.

A round costs what its largest k costs, so k is chosen jointly for the request types that share a batch
(:func:`policies.analytic.batch_goodput`, with the recent request mix of the context bucket); a bucket's k is its
type's entry in that joint choice. The incumbent k changes only when the posterior-mean gain exceeds
``switch_margin``, and then holds for ``hold_decisions`` (vLLM issue #49548: K flipping 2 <-> 0 collapses
throughput); turning speculation off needs ``off_margin`` and a measurement of k = 0 in that cell (switching
back on costs the draft a catch-up of every token it missed). Exploration is Thompson sampling over the
acceptance posteriors and the seconds of ks a cell was never measured at: when a draw favours another k by the
margin, that k is served for one decision (measured, not adopted) — one k for the whole cell (mixed ks pay the
largest k's verify), within ``explore_radius`` of the incumbent, never 0 and never from a cell that is off. A
cell seen at one k only, beyond the batch/context range the cost model has measured, is probed once at a
second k; a cell that is off is re-probed every ``probe_every`` decisions. A model update shows up as new
versions in the bucket; their acceptance starts from the previous version's type curve with a small
pseudo-count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from policies._acceptance import AcceptanceModel
from policies._cost import CostModel
from policies.analytic import batch_goodput, emitted_by_k
from policies.base import Decision, Policy, Window, cell_key
from telemetry.records import AcceptanceWindow, Bucket, CostWindow

MIN_TYPE_WEIGHT = 0.02  # a type absent from the recent mix still gets a say (it is being asked about)
TRIM_FROM_ROUNDS = 4  # cost windows of at least this many rounds drop their slowest round (see _observe)


class GoodputPolicy(Policy):
    """Bayesian acceptance x learnt cost -> k per bucket, maximising batch goodput.

    Args:
        k_max: see :class:`~policies.base.Policy`.
        seed: Thompson sampling seed.
        objective: ``"goodput"`` (tokens/s) or ``"latency"`` (same objective, restricted to k whose predicted
            round seconds keep per-token p99 latency under ``latency_p99_s``; k = 0 always allowed).
        latency_p99_s: p99 per-token latency bound for ``"latency"``; a row may emit only one token in a round,
            so the bound applies to round seconds.
        switch_margin: relative expected gain required to change k.
        off_margin: relative expected gain required to turn speculation off (switching it back on costs the
            draft a catch-up of every token it missed).
        explore_radius: Thompson exploration tries ks within this distance of the incumbent (never 0).
        hold_decisions: decisions to keep k after a change.
        probe_every: decisions with speculation off before one exploratory decision with it on.
        prior_mean, bucket_strength, type_strength, version_strength, acceptance_decay: see
            :class:`~policies._acceptance.AcceptanceModel`.
        cost_prior_windows, refit_every: see :class:`~policies._cost.CostModel`.
        slope_cells: once this many cells have been seen at two or more k, a new cell seen at one k that lies
            within their batch and context range is not probed: it borrows the shared slope in k (the point of a
            shared cost model). A cell beyond that range is probed once.
    """

    name = "goodput"

    def __init__(self, k_max: int = 8, seed: int = 0, objective: str = "goodput", latency_p99_s: float | None = None,
                 switch_margin: float = 0.03, hold_decisions: int = 3, probe_every: int = 50,
                 prior_mean: float = 0.6, bucket_strength: float = 30.0, type_strength: float = 60.0,
                 version_strength: float = 10.0, acceptance_decay: float = 0.995, cost_prior_windows: float = 2.0,
                 refit_every: int = 16, slope_cells: int = 2, off_margin: float = 0.10,
                 explore_radius: int = 2) -> None:
        super().__init__(k_max=k_max, seed=seed)
        if objective not in ("goodput", "latency"):
            raise ValueError(f"objective must be 'goodput' or 'latency', got {objective!r}")
        if objective == "latency" and (latency_p99_s is None or latency_p99_s <= 0):
            raise ValueError("objective='latency' needs latency_p99_s > 0")
        if switch_margin < 0 or off_margin < 0 or hold_decisions < 0 or probe_every < 1 or explore_radius < 1:
            raise ValueError("switch_margin, off_margin, hold_decisions must be >= 0; probe_every, explore_radius >= 1")
        self.off_margin, self.explore_radius = off_margin, explore_radius
        self.objective, self.latency_p99_s = objective, latency_p99_s
        self.switch_margin, self.hold_decisions, self.probe_every = switch_margin, hold_decisions, probe_every
        self.slope_cells = slope_cells
        self._acc = AcceptanceModel(max(k_max, 1), prior_mean, bucket_strength, type_strength, version_strength,
                                    acceptance_decay)
        self._cost = CostModel(k_max, cost_prior_windows, refit_every)
        # cell -> {"ks": {type: k} served now, "base": {type: k} incumbent, "hold", "off", "probed", "epoch"}
        self._cells: dict[str, dict[str, Any]] = {}

    # ----------------------------------------------------------------------------------------- learning
    def _observe(self, window: Window) -> None:
        if isinstance(window, AcceptanceWindow):
            self._acc.observe(window)
        elif isinstance(window, CostWindow) and window.max_k <= self.k_max:
            w = window
            rounds, rows = w.rounds, w.batch_rows
            parts = [w.draft_s.total, w.verify_s.total, w.other_s.total]
            if rounds >= TRIM_FROM_ROUNDS:
                # The slowest round of a window is set aside: after speculation was off the first round at k > 0
                # feeds the draft every token it missed — a one-time cost of switching on, not the cost of k.
                # Kept in, it makes k look dear after every stretch at k = 0 and keeps speculation off.
                parts = [st.total - st.max for st in (w.draft_s, w.verify_s, w.other_s)]
                rows -= round(rows / rounds)
                rounds -= 1
            self._cost.observe(w.batch_bucket, w.context_bucket, w.max_k, rounds, rows, *parts)

    # ----------------------------------------------------------------------------------------- deciding
    def _evaluate(self, bucket: Bucket, types: list[str], weights: np.ndarray,
                  rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Joint combos ``[C, T]``, their goodput ``[C]`` and the shared-k goodput ``[K + 1]``."""
        vd = f"{bucket.target_version}|{bucket.draft_version}"
        cond = np.stack([self._acc.cond(vd, t, bucket.context_bucket, rng) for t in types])  # [T, K]
        emitted = emitted_by_k(cond[:, : self.k_max])  # [T, K+1]
        b = self._cost.mean_batch(bucket.batch_bucket, bucket.context_bucket)
        secs = self._cost.predict(bucket.batch_bucket, bucket.context_bucket, b, rng).sum(axis=1)  # [K+1]
        combos, g = batch_goodput(emitted, weights, b, secs)
        _, g_shared = batch_goodput(emitted, weights, b, secs, shared_k=True)
        if self.objective == "latency" and self._cost.fitted:
            assert self.latency_p99_s is not None
            allowed = (secs <= self.latency_p99_s) | (np.arange(secs.size) == 0)
            g = np.where(allowed[combos.max(axis=1)], g, -np.inf)
            g_shared = np.where(allowed, g_shared, -np.inf)
        return combos, g, g_shared

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        b = bucket
        ckey = cell_key(b.target_version, b.draft_version, b.batch_bucket, b.context_bucket)
        vd = f"{b.target_version}|{b.draft_version}"
        mix = self._acc.mix(vd, b.context_bucket)
        total = sum(mix.values())
        types = sorted(set(mix) | {b.request_type})
        w = np.array([max(mix.get(t, 0.0) / total if total else 0.0, MIN_TYPE_WEIGHT) for t in types])
        st = self._cells.get(ckey)
        if explore and st is not None and st["epoch"] == self._n_windows and b.request_type in st["ks"]:
            return self._result(st, b.request_type, "cached")  # one decision per cell per batch of windows
        combos, g_mean, g_shared = self._evaluate(b, types, w, None)
        best_mean = combos[int(np.argmax(g_mean))]
        expected = {k: float(v) for k, v in enumerate(g_shared) if np.isfinite(v)}
        if not explore:  # the incumbent, not a probe or draw served this epoch
            inc = st.get("base", st["ks"]) if st is not None else {}
            ks = inc if all(t in inc for t in types) else dict(zip(types, best_mean, strict=True))
            return Decision(k=int(ks[b.request_type]), expected_goodput=expected, reason="current best, no exploration")
        combos, g, g_draw = self._evaluate(b, types, w, self._rng)  # Thompson draw
        if st is None:
            st = {"ks": {}, "base": {}, "hold": 0, "off": 0, "probed": False, "epoch": -1}
            self._cells[ckey] = st
        base = st.setdefault("base", dict(st["ks"]))  # the incumbent: what exploitation serves
        cur = [int(base.get(t, -1)) for t in types]
        reason, exploring = "current best", False
        if any(k < 0 for k in cur):  # first decision for (some of) these types: the posterior mean's best
            new, reason = [int(x) for x in best_mean], "first decision"
            if max(new) == 0 and self._cost.extrapolating(b.batch_bucket, b.context_bucket):
                # Off on an extrapolation alone is a guess; off is decided on this cell's measurements.
                new, reason = [int(np.argmax(g_shared[1:]) + 1)] * len(types), "first decision (on until measured)"
            base.update(zip(types, new, strict=True))
        else:
            ci = int(np.flatnonzero((combos == np.array(cur)).all(axis=1))[0])
            new = cur
            if st["hold"] > 0:
                st["hold"] -= 1
                reason = "holding after a switch"
            elif g_mean.max() > g_mean[ci] * (1.0 + self._margin(max(cur), int(best_mean.max()))):
                new = [int(x) for x in best_mean]
                if max(new) == 0 and 0 not in self._cost.ks_seen(b.batch_bucket, b.context_bucket):
                    # Off on a predicted cost alone is a guess: measure k = 0 here for one decision first.
                    reason, exploring = "probe k=0 before turning speculation off", True
                else:
                    # Switch on the posterior mean only, then hold: no flapping (vLLM #49548).
                    reason = "switch: expected gain above margin"
                    base.update(zip(types, new, strict=True))
                    st["hold"] = self.hold_decisions
            elif max(cur) > 0:
                # Exploration tries one k for the whole cell (mixed ks pay the largest k's verify), near the
                # incumbent, never k = 0: turning the draft off and on costs a catch-up of every token it missed,
                # so k = 0 is reached by the mean (with off_margin) or by a cost probe, not by a lucky draw. For
                # the same reason a cell that is off is not explored by draws either: it is re-probed every
                # probe_every decisions, or switched back on by the mean.
                centre = max(cur)
                r = self.explore_radius
                near = np.arange(max(1, centre - r), min(self.k_max, centre + r) + 1)
                k_draw = int(near[np.argmax(g_draw[near])])
                if k_draw != max(cur) and g_draw[k_draw] > g[ci] * (1.0 + self.switch_margin):
                    # Served for one decision to measure it; the incumbent stays, and the next decision switches
                    # only if the measurement moved the mean.
                    new, reason, exploring = [k_draw] * len(types), "explore: Thompson draw", True
        seen = self._cost.ks_seen(b.batch_bucket, b.context_bucket)
        # Identify this cell's cost slope in k, unless enough other cells already pin the shared slope down and
        # the cell lies within their range (interpolation is trusted, extrapolation is measured).
        borrow = (self._cost.cells_with_slope() >= self.slope_cells
                  and not self._cost.extrapolating(b.batch_bucket, b.context_bucket))
        if len(seen) == 1 and not st["probed"] and not borrow:
            only = next(iter(seen))
            if only == 0:
                alt = int(np.argmax(g_shared[1:]) + 1)
            elif not self._cost.k0_measured():  # the jump at k > 0 is identified by measuring k = 0 once
                alt = 0
            else:  # a second k > 0 identifies the slope without paying a catch-up
                alt = only + 2 if only + 2 <= self.k_max else max(1, only - 2)
            new, reason, exploring, st["probed"] = [alt] * len(types), f"cost probe at k={alt}", True, True
        st["off"] = st["off"] + 1 if max(new) == 0 else 0
        if st["off"] >= self.probe_every:
            alt = int(np.argmax(g_shared[1:]) + 1)
            new, reason, exploring, st["off"] = [alt] * len(types), f"re-probe k={alt} after speculation off", True, 0
        st["ks"] = dict(zip(types, new, strict=True))
        st["epoch"] = self._n_windows
        st["reason"], st["exploring"], st["expected"] = reason, exploring, expected
        return self._result(st, b.request_type, reason)

    def _margin(self, k_from: int, k_to: int) -> float:
        """Relative gain a switch must promise; turning speculation off must promise ``off_margin``."""
        return self.off_margin if k_to == 0 < k_from else self.switch_margin

    @staticmethod
    def _result(st: dict[str, Any], rtype: str, reason: str) -> Decision:
        return Decision(k=int(st["ks"][rtype]), expected_goodput=dict(st.get("expected", {})),
                        exploring=bool(st.get("exploring", False)), reason=str(st.get("reason", reason)))

    # ----------------------------------------------------------------------------------------- state
    def _get_state(self) -> dict[str, Any]:
        cells = {k: {**v, "ks": {t: int(x) for t, x in v["ks"].items()},
                     "base": {t: int(x) for t, x in v.get("base", v["ks"]).items()},
                     "expected": {str(kk): vv for kk, vv in v.get("expected", {}).items()}}
                 for k, v in self._cells.items()}
        return {"acceptance": self._acc.get_state(), "cost": self._cost.get_state(), "cells": cells}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._acc.set_state(state["acceptance"])
        self._cost.set_state(state["cost"])
        self._cells = {k: {**v, "expected": {int(kk): float(vv) for kk, vv in v.get("expected", {}).items()}}
                       for k, v in state["cells"].items()}
