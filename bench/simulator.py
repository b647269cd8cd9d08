"""A round-level simulator of a speculative-decoding engine, calibrated only from engine measurements.

Every number comes from a calibration file in the engine benchmark's format (``bench/results/engine.json``;
tests use the labelled fixture ``tests/policies/fixture_engine.json``):

- **acceptance**: ``accept_hist[k]`` per (request type, batch size, context) cell, pooled over batch sizes
  (acceptance is a row property, keyed by versions, type, context and k). The updated target's histograms
  (``version_acceptance``) were measured at short context only; its long-context curve applies the v1
  long/short ratio of per-position conditional acceptance.
- **cost**: ``round_s[k]`` (draft, verify, other seconds per round for the whole batch), averaged over request
  types, interpolated log-log in batch size and context length (a power law between and beyond measured points).
  A round's cost is that of its largest k. Seeded multiplicative noise (``noise`` per round) is the only
  invented quantity.

The engine batches rows of mixed request types; per round the rows' types are drawn from the workload mix. Every
``window_s`` seconds the simulator emits :class:`AcceptanceWindow` / :class:`CostWindow` aggregates to
``policy.observe`` and asks the policy for each bucket's k for the next window (the table model: decisions travel
as a policy table, per window). k above the calibration's largest measured k is clamped to it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policies.base import Policy
from telemetry.records import DEFAULT_BUCKETS, AcceptanceWindow, Bucket, CostWindow, Stat

DRAFT_VERSION = "draft-v1"
BASE_VERSION = "target-v1"
WINDOW_S = 0.5  # wall seconds per telemetry window (the engine's emitter aggregates over fixed time)
NOMINAL_ROUNDS_PER_WINDOW = 20  # used only to size a workload given in rounds


class CalibrationError(ValueError):
    """The calibration file is missing or not in the engine benchmark's format."""


@dataclass(frozen=True)
class WindowSpec:
    """What the engine serves for one window: load, context class, request mix and target version."""

    batch_size: int
    context: str  # "short" | "long" (the calibration's context classes)
    mix: tuple[float, ...]  # fraction of rows per request type (Calibration.types order)
    version: str


class Calibration:
    """Acceptance and cost tables read from an ``engine.json``.

    Args:
        path: the calibration file.
        mode: which cells to use (``"sample"`` or ``"greedy"``).
    """

    def __init__(self, path: str | Path, mode: str = "sample") -> None:
        try:
            data = json.loads(Path(path).read_text())
            cells = [c for c in data["cells"] if c.get("mode", "sample") == mode]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CalibrationError(f"cannot read calibration {path}: {e!r}; run the engine benchmark first "
                                   "or pass --calibration tests/policies/fixture_engine.json") from e
        if not cells:
            raise CalibrationError(f"{path} has no {mode!r} cells")
        self.device = str(data.get("device", "?"))
        self.types = sorted({c["request_type"] for c in cells})
        self.batches = sorted({int(c["batch_size"]) for c in cells})
        self.contexts = sorted({c["context"] for c in cells}, key=lambda x: x != "short")
        self.context_len = {c["context"]: int(c["context_len"]) for c in cells}
        self.K = max(int(k) for c in cells for k in c["accept_hist"])
        # cost [B, C, K+1, 3] averaged over request types
        cost = np.zeros((len(self.batches), len(self.contexts), self.K + 1, 3))
        n = np.zeros((len(self.batches), len(self.contexts)))
        hist = {t: {c: np.zeros((self.K + 1, self.K + 1)) for c in self.contexts} for t in self.types}
        for c in cells:
            bi, ci = self.batches.index(int(c["batch_size"])), self.contexts.index(c["context"])
            for k in range(self.K + 1):
                r = c["round_s"][str(k)]
                cost[bi, ci, k] += (r["draft"], r["verify"], r["other"])
            n[bi, ci] += 1
            for k, h in c["accept_hist"].items():
                hist[c["request_type"]][c["context"]][int(k), : len(h)] += h
        self.cost = cost / n[:, :, None, None]
        self._pmf: dict[tuple[str, str, str], np.ndarray] = {}  # (version, type, ctx) -> [K+1, K+1] pmf rows
        for t in self.types:
            for cx in self.contexts:
                self._pmf[(BASE_VERSION, t, cx)] = _normalise(hist[t][cx])
        for ver, by_type in data.get("version_acceptance", {}).items():
            for t, hs in by_type.items():
                h2 = np.zeros((self.K + 1, self.K + 1))
                for k, h in hs.items():
                    h2[int(k), : len(h)] += h
                short = _normalise(h2)
                for cx in self.contexts:
                    ratio = _cond(self._pmf[(BASE_VERSION, t, cx)]) / np.maximum(
                        _cond(self._pmf[(BASE_VERSION, t, self.contexts[0])]), 1e-6)
                    self._pmf[(ver, t, cx)] = short if cx == self.contexts[0] else _pmf_from_cond(
                        np.clip(_cond(short) * ratio, 0.0, 1.0), self.K)
        self.versions = sorted({v for v, _, _ in self._pmf})

    def pmf(self, version: str, rtype: str, context: str, k: int) -> np.ndarray:
        """``[k + 1]`` P(accepted = a) for a row drafting k tokens."""
        return self._pmf[(version, rtype, context)][k, : k + 1]

    def emitted(self, version: str, context: str) -> np.ndarray:
        """``[T, K + 1]`` expected emitted tokens per row for each request type and k."""
        out = np.ones((len(self.types), self.K + 1))
        for i, t in enumerate(self.types):
            p = self._pmf[(version, t, context)]
            out[i] = 1.0 + (p * np.arange(self.K + 1)[None, :]).sum(axis=1)
        return out

    def round_s(self, batch_size: float, context: str) -> np.ndarray:
        """``[K + 1, 3]`` (draft, verify, other) seconds per round, log-log interpolated in batch size."""
        ci = self.contexts.index(context)
        lb = np.log(np.asarray(self.batches, dtype=float))
        x = np.log(max(batch_size, 1.0))
        i = int(np.clip(np.searchsorted(lb, x) - 1, 0, max(len(lb) - 2, 0)))
        if len(lb) == 1:
            return np.asarray(self.cost[0, ci])
        w = (x - lb[i]) / (lb[i + 1] - lb[i])
        lo, hi = np.log(np.maximum(self.cost[i, ci], 1e-9)), np.log(np.maximum(self.cost[i + 1, ci], 1e-9))
        out = np.exp(lo + w * (hi - lo))
        out[0, 0] = 0.0  # no draft at k = 0
        return out

    def bucket_label(self, context: str) -> str:
        return DEFAULT_BUCKETS.context_bucket(self.context_len[context])


def _normalise(h: np.ndarray) -> np.ndarray:
    """Row k of ``h`` ``[K+1, K+1]`` -> pmf over 0..k (k = 0 is all mass at 0)."""
    p = np.zeros_like(h)
    p[0, 0] = 1.0
    for k in range(1, h.shape[0]):
        s = h[k, : k + 1].sum()
        if s > 0:
            p[k, : k + 1] = h[k, : k + 1] / s
        else:  # unmeasured k: extend the largest measured k below it
            p[k, : k + 1] = _pmf_from_cond(_cond(p), k)[k, : k + 1]
    return p


def _cond(p: np.ndarray) -> np.ndarray:
    """``[K]`` per-position conditional acceptance pooled over every k's pmf ``p`` ``[K+1, K+1]``."""
    K = p.shape[0] - 1
    s, n = np.zeros(K), np.zeros(K)
    for k in range(1, K + 1):
        tail = np.cumsum(p[k, : k + 1][::-1])[::-1]
        s[:k] += tail[1 : k + 1]
        n[:k] += tail[:k]
    c = np.where(n > 0, s / np.maximum(n, 1e-12), 0.0)
    for i in range(1, K):  # positions never reached: repeat the last known one
        if n[i] == 0:
            c[i] = c[i - 1]
    return c


def _pmf_from_cond(cond: np.ndarray, K: int) -> np.ndarray:
    p = np.zeros((K + 1, K + 1))
    surv = np.concatenate([[1.0], np.cumprod(np.resize(cond, K))])
    for k in range(K + 1):
        p[k, :k] = surv[:k] - surv[1 : k + 1]
        p[k, k] = surv[k]
    return p


@dataclass
class SimResult:
    """Per-window records of one run (arrays indexed by window)."""

    tokens: np.ndarray  # [W] emitted tokens
    seconds: np.ndarray  # [W] wall seconds
    rounds: np.ndarray  # [W]
    expected_goodput: np.ndarray  # [W] analytic goodput of the chosen ks
    ks: list[dict[str, int]] = field(default_factory=list)  # [W] bucket key -> k

    @property
    def tok_s(self) -> float:
        return float(self.tokens.sum() / self.seconds.sum())


def workload(types: Sequence[str], total_rounds: int, seed: int, window_rounds: int = NOMINAL_ROUNDS_PER_WINDOW,
             update_version: str = "target-v2") -> list[WindowSpec]:
    """Phases: low load, load rising, long contexts arriving, request-mix change, load falling, model update."""
    rng = np.random.default_rng(seed)
    t = list(types)

    def mix(**w: float) -> tuple[float, ...]:
        v = np.array([w.get(x, 0.0) for x in t]) + 1e-9
        return tuple(float(x) for x in v / v.sum())

    balanced, code_heavy = mix(code=0.4, prose=0.4, structured=0.2), mix(code=0.7, prose=0.1, structured=0.2)
    phases = [  # (share of rounds, batch sizes, P(long), mix, version)
        (0.10, (1, 4), 0.0, balanced, BASE_VERSION),
        (0.15, (4, 16, 64), 0.0, balanced, BASE_VERSION),
        (0.15, (1, 16, 64), 0.6, balanced, BASE_VERSION),
        (0.15, (1, 4, 16, 32, 64), 0.3, code_heavy, BASE_VERSION),
        (0.10, (1, 4), 0.2, code_heavy, BASE_VERSION),
        (0.35, (1, 4, 16, 64), 0.4, balanced, update_version),
    ]
    out: list[WindowSpec] = []
    for share, batches, p_long, m, ver in phases:
        n_windows = max(1, round(share * total_rounds / window_rounds))
        while n_windows > 0:
            run = min(n_windows, int(rng.integers(3, 11)))  # load stays put for a few windows at a time
            spec = WindowSpec(int(rng.choice(batches)), "long" if rng.random() < p_long else "short", m, ver)
            out.extend([spec] * run)
            n_windows -= run
    return out


def expected_goodput(cal: Calibration, spec: WindowSpec, ks: Sequence[int]) -> float:
    """Analytic long-run goodput of per-type draft lengths ``ks`` ``[T]`` for a window spec."""
    tok, secs = expected_round(cal, spec, ks)
    return tok / secs


def expected_round(cal: Calibration, spec: WindowSpec, ks: Sequence[int]) -> tuple[float, float]:
    """(expected emitted tokens, expected seconds) of one round with per-type draft lengths ``ks`` ``[T]``."""
    e = cal.emitted(spec.version, spec.context)
    w = np.asarray(spec.mix)
    k = np.asarray(ks)
    tok = spec.batch_size * float((e[np.arange(len(k)), k] * w).sum())
    secs = cal.round_s(spec.batch_size, spec.context).sum(axis=1)
    m = np.arange(cal.K + 1)
    cdf = np.clip(1.0 - ((k[:, None] > m[None, :]) * w[:, None]).sum(axis=0), 0.0, 1.0) ** spec.batch_size
    return tok, float(np.diff(cdf, prepend=0.0) @ secs)


def buckets_of(cal: Calibration, spec: WindowSpec) -> list[Bucket]:
    bb = DEFAULT_BUCKETS.batch_bucket(spec.batch_size)
    return [Bucket(spec.version, DRAFT_VERSION, t, bb, cal.bucket_label(spec.context)) for t in cal.types]


def simulate(policy: Policy, cal: Calibration, specs: Sequence[WindowSpec], window_s: float = WINDOW_S,
             seed: int = 0, noise: float = 0.03) -> SimResult:
    """Run ``policy`` over the workload; returns per-window tokens, seconds and analytic goodput.

    Windows last ``window_s`` of wall time (as the engine's emitter aggregates), so a policy that makes rounds
    cheaper runs more of them: every policy spends the same time in every window and tok/s totals compare fairly.
    """
    rng = np.random.default_rng(seed)
    n_w = len(specs)
    res = SimResult(np.zeros(n_w), np.zeros(n_w), np.zeros(n_w), np.zeros(n_w))
    T = len(cal.types)
    for wi, spec in enumerate(specs):
        buckets = buckets_of(cal, spec)
        ks = np.array([min(policy.decide(b).k, cal.K) for b in buckets])  # [T]
        tok_round, s_round = expected_round(cal, spec, [int(k) for k in ks])
        N = max(1, round(window_s / s_round))
        res.ks.append({b.key(): int(k) for b, k, m in zip(buckets, ks, spec.mix, strict=True) if m > 0.01})
        counts = rng.multinomial(spec.batch_size, spec.mix, size=N)  # [N, T] rows per type per round
        maxk = np.where(counts > 0, ks[None, :], 0).max(axis=1)  # [N]
        parts = cal.round_s(spec.batch_size, spec.context)[maxk] * (1.0 + noise * rng.standard_normal((N, 1)))
        parts = np.maximum(parts, 0.0)  # [N, 3]
        wall = parts.sum(axis=1)
        emitted_round = np.zeros(N)
        lat_rounds, lat_vals = [], []
        for ti in range(T):
            rows = int(counts[:, ti].sum())
            if rows == 0:
                continue
            k = int(ks[ti])
            acc = rng.choice(k + 1, size=rows, p=cal.pmf(spec.version, cal.types[ti], spec.context, k))
            ridx = np.repeat(np.arange(N), counts[:, ti])
            emitted_round += np.bincount(ridx, weights=acc + 1.0, minlength=N)
            lat_rounds.append(ridx)
            lat_vals.append(wall[ridx] / (acc + 1.0))
            hist = np.bincount(acc, minlength=k + 1)
            b = buckets[ti]
            policy.observe(AcceptanceWindow(
                target_version=b.target_version, draft_version=b.draft_version, request_type=b.request_type,
                context_bucket=b.context_bucket, k=k, rows=rows, drafted=rows * k, accepted=int(acc.sum()),
                emitted=int(acc.sum()) + rows, hist=tuple(int(x) for x in hist)))
        lr, lv = np.concatenate(lat_rounds), np.concatenate(lat_vals)
        for mk in np.unique(maxk):
            sel = maxk == mk
            rows_sel = sel[lr]
            lat = lv[rows_sel] if rows_sel.any() else np.zeros(1)
            p50, p95, p99 = (float(x) for x in np.percentile(lat, [50, 95, 99]))
            brows = int(counts[sel].sum())
            policy.observe(CostWindow(
                target_version=spec.version, draft_version=DRAFT_VERSION, batch_bucket=buckets[0].batch_bucket,
                context_bucket=buckets[0].context_bucket, max_k=int(mk), rounds=int(sel.sum()),
                tokens_verified=brows * (int(mk) + 1), emitted=int(emitted_round[sel].sum()), batch_rows=brows,
                draft_s=_stat(parts[sel, 0]), verify_s=_stat(parts[sel, 1]), other_s=_stat(parts[sel, 2]),
                latency_p50=p50, latency_p95=p95, latency_p99=p99))
        res.tokens[wi], res.seconds[wi], res.rounds[wi] = emitted_round.sum(), wall.sum(), N
        res.expected_goodput[wi] = tok_round / s_round
    return res


def _stat(x: np.ndarray) -> Stat:
    return Stat(count=int(x.size), total=float(x.sum()), sumsq=float((x * x).sum()), max=float(x.max(initial=0.0)))


def to_jsonable(x: Any) -> Any:
    """For result files: numpy -> plain Python."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x
