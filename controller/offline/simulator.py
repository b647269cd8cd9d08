"""A round-level simulator of a speculative-decoding engine, calibrated only from engine measurements.

Every number comes from a calibration file in the engine benchmark's format (``bench/results/engine.json``;
tests use the labelled fixture ``tests/policies/fixture_engine.json``):

- **acceptance**: per (request type, context) the per-position conditional acceptance, pooled over every k and
  batch size of the cells (rejection sampling makes position i's acceptance independent of how many drafts
  follow it, so pooling only removes noise), and turned back into ``P(accepted = a | k)``. The updated
  target's histograms (``version_acceptance``) were measured at short context only; its long-context curve
  applies the v1 long/short ratio of per-position conditional acceptance.
- **cost**: ``round_s[k]`` (draft, verify, other seconds per round for the whole batch), averaged over request
  types, then (``smooth="linear"``, the default) least-squares fitted per (batch, context) as linear in k — the
  draft runs k steps and verify scores ``batch * (k + 1)`` positions — because a few contended-CPU rounds per k
  are noisy; ``smooth="none"`` keeps the raw means. Between and beyond measured batch sizes the cost is
  interpolated / extrapolated log-log (a power law from the nearest two measured sizes).
- **gaps**: a context class the calibration did not measure (a quick plan measures only ``short``) takes the
  nearest measured class's cost and acceptance (constant extrapolation in context length); batch sizes the
  workload uses but the calibration lacks are extrapolated as above. Every such gap is listed in
  :attr:`Calibration.gaps` and in the benchmark's JSON.
- **packed rounds**: rows of one round draft their own k, as on the reference engine. A round runs draft steps
  up to its largest k m, step j only for the rows with k > j, and verifies B + D tokens (D drafted over all
  rows). Its cost is the measured cost of every row drafting m, corrected by what the calibration says about
  fewer rows and tokens: each draft step costs the per-step draft slope at its own row count (log-log in batch,
  as above) instead of at B, and verify is the measured verify at ``k = D / B`` (linear between measured k).
  With one k for every row this is the measured cost itself. Seeded multiplicative noise (``noise`` per round)
  is the only invented quantity.

The engine batches rows of mixed request types; per round the rows' types are drawn from the workload mix. Every
``window_s`` seconds the simulator emits :class:`AcceptanceWindow` / :class:`CostWindow` aggregates to
``policy.observe`` and asks the policy for each bucket's k for the next window (the table model: decisions travel
as a policy table, per window). k above the calibration's largest measured k is clamped to it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import binom

from engine.profiles import UNLABELLED_PROFILE
from policies.base import Policy
from telemetry.aggregate import aggregate
from telemetry.records import DEFAULT_BUCKETS, Bucket, RoundRecord, RowRecord

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


CONTEXT_CLASSES = ("short", "long")  # the engine benchmark's context classes, in order of length
# Prompt bytes of each context class, as the engine benchmark measures them; the models train on windows of 256
# and then 1024. An unmeasured class is bucketed at its prompt length plus what the nearest measured one generated.
CONTEXT_PROMPT_BYTES = {"short": 128, "long": 1024}
SMOOTHING = ("linear", "none")


class Calibration:
    """Acceptance and cost tables read from an ``engine.json``.

    Args:
        path: the calibration file.
        mode: which cells to use (``"sample"`` or ``"greedy"``).
        smooth: ``"linear"`` fits each (batch, context) cost as linear in k; ``"none"`` keeps the raw means.
        profile: which profile's cells (``"small"``, ``"xl"``); None takes the file's only profile. Cells without
            a profile field are ``"small"`` (files written before profiles existed). Mixed cells are not read.
    """

    def __init__(self, path: str | Path, mode: str = "sample", smooth: str = "linear",
                 profile: str | None = None) -> None:
        if smooth not in SMOOTHING:
            raise ValueError(f"smooth must be one of {SMOOTHING}, got {smooth!r}")
        try:
            data = json.loads(Path(path).read_text())
            cells = [c for c in data["cells"] if c.get("mode", "sample") == mode and c["request_type"] != "mixed"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CalibrationError(f"cannot read calibration {path}: {e!r}; run the engine benchmark first "
                                   "or pass --calibration tests/policies/fixture_engine.json") from e
        profiles = sorted({c.get("profile", UNLABELLED_PROFILE) for c in cells})
        if profile is None and len(profiles) > 1:
            raise CalibrationError(f"{path} holds the profiles {profiles}: choose one (--profile)")
        if profile is not None:
            cells = [c for c in cells if c.get("profile", UNLABELLED_PROFILE) == profile]
        if not cells:
            raise CalibrationError(f"{path} has no {mode!r} cells" + (f" for profile {profile!r}" if profile else ""))
        self.profile = profile or profiles[0]
        self.device = str(data.get("device", "?"))
        self.smooth = smooth
        self.types = sorted({c["request_type"] for c in cells})
        self.batches = sorted({int(c["batch_size"]) for c in cells})
        self.measured_contexts = sorted({c["context"] for c in cells}, key=_context_order)
        self.contexts = self.measured_contexts  # indexable classes of the cost tables
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
        self.gaps: list[str] = []
        for bi, b in enumerate(self.batches):  # a batch measured at one context only: the other takes its cost
            have = [ci for ci in range(len(self.contexts)) if n[bi, ci] > 0]
            for ci in range(len(self.contexts)):
                if n[bi, ci] == 0:
                    near = min(have, key=lambda h: abs(h - ci))
                    cost[bi, ci], n[bi, ci] = cost[bi, near] / n[bi, near], 1
                    self.gaps.append(f"batch {b} not measured at {self.contexts[ci]!r}: cost of "
                                     f"{self.contexts[near]!r} at the same batch")
        self.raw_cost = cost / n[:, :, None, None]
        self.cost = _linear_in_k(self.raw_cost) if smooth == "linear" else self.raw_cost
        self._pmf: dict[tuple[str, str, str], np.ndarray] = {}  # (version, type, ctx) -> [K+1, K+1] pmf rows
        for t in self.types:
            for cx in self.contexts:
                self._pmf[(BASE_VERSION, t, cx)] = pmf_from_cond(cond_from_pmf(hist[t][cx]), self.K)
        for ver, by_type in data.get("version_acceptance", {}).items():
            for t, hs in by_type.items():
                h2 = np.zeros((self.K + 1, self.K + 1))
                for k, h in hs.items():
                    h2[int(k), : len(h)] += h
                short = pmf_from_cond(cond_from_pmf(h2), self.K)
                for cx in self.contexts:
                    ratio = cond_from_pmf(self._pmf[(BASE_VERSION, t, cx)]) / np.maximum(
                        cond_from_pmf(self._pmf[(BASE_VERSION, t, self.contexts[0])]), 1e-6)
                    self._pmf[(ver, t, cx)] = short if cx == self.contexts[0] else pmf_from_cond(
                        np.clip(cond_from_pmf(short) * ratio, 0.0, 1.0), self.K)
        self.versions = sorted({v for v, _, _ in self._pmf})
        self._step_cache: dict[tuple[int, str], float] = {}
        self._alias = {cx: cx for cx in self.measured_contexts}
        for cx in CONTEXT_CLASSES:
            if cx not in self._alias:  # nearest measured class in the benchmark's order of length
                near = min(self.measured_contexts, key=lambda m: abs(_context_order(m) - _context_order(cx)))
                self._alias[cx] = near
                self.context_len[cx] = _unmeasured_context_len(cx, near, self.context_len[near])
                self.gaps.append(f"context {cx!r} not measured: cost and acceptance of {near!r} "
                                 f"(constant extrapolation), bucketed at {self.context_len[cx]} tokens")
        if smooth == "linear":
            self.gaps.append("cost per (batch, context) least-squares linear in k (raw means are noisy)")

    def note_batches(self, batch_sizes: Sequence[int]) -> None:
        """Record in :attr:`gaps` the workload's batch sizes the calibration lacks (inter/extrapolated)."""
        lo, hi = self.batches[0], self.batches[-1]
        for b in sorted(set(batch_sizes) - set(self.batches)):
            how = "interpolated" if lo < b < hi else "extrapolated"
            note = f"batch {b} not measured: cost {how} log-log from batches {self.batches}"
            if note not in self.gaps:
                self.gaps.append(note)

    def _ctx(self, context: str) -> str:
        try:
            return self._alias[context]
        except KeyError as e:
            raise CalibrationError(f"unknown context class {context!r}; known: {sorted(self._alias)}") from e

    def pmf(self, version: str, rtype: str, context: str, k: int) -> np.ndarray:
        """``[k + 1]`` P(accepted = a) for a row drafting k tokens."""
        return self._pmf[(version, rtype, self._ctx(context))][k, : k + 1]

    def acceptance(self, version: str, rtype: str, context: str) -> np.ndarray:
        """``[K + 1, K + 1]`` P(accepted = a | k): row k for a row drafting k tokens (zero beyond a = k)."""
        return self._pmf[(version, rtype, self._ctx(context))]

    def with_acceptance(self, version: str, rtype: str, context: str, pmf: np.ndarray) -> Calibration:
        """A copy whose (version, type, context) acceptance is ``pmf`` ``[K + 1, K + 1]`` (what-if calibrations:
        a worse-matched draft, a silent drift); everything else is shared with this one."""
        if pmf.shape != (self.K + 1, self.K + 1):
            raise ValueError(f"pmf must be [K + 1, K + 1] = {(self.K + 1, self.K + 1)}, got {pmf.shape}")
        out = copy.copy(self)
        out._pmf = {**self._pmf, (version, rtype, self._ctx(context)): pmf}
        return out

    def with_cost_factor(self, factor: float) -> Calibration:
        """A copy whose every round costs ``factor`` times as much (a slower machine, a busy neighbour)."""
        out = copy.copy(self)
        out.cost, out.raw_cost = self.cost * factor, self.raw_cost * factor
        out._step_cache = {}
        return out

    def emitted(self, version: str, context: str) -> np.ndarray:
        """``[T, K + 1]`` expected emitted tokens per row for each request type and k."""
        out = np.ones((len(self.types), self.K + 1))
        for i, t in enumerate(self.types):
            p = self._pmf[(version, t, self._ctx(context))]
            out[i] = 1.0 + (p * np.arange(self.K + 1)[None, :]).sum(axis=1)
        return out

    def round_s(self, batch_size: float, context: str) -> np.ndarray:
        """``[K + 1, 3]`` (draft, verify, other) seconds per round, log-log interpolated in batch size."""
        ci = self.contexts.index(self._ctx(context))
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

    def step_s(self, rows: int, context: str) -> float:
        """Seconds of one draft step over ``rows`` rows: the slope in k of the draft at that batch size."""
        key = (rows, self._ctx(context))
        if key not in self._step_cache:
            d = self.round_s(float(rows), context)[:, 0]
            self._step_cache[key] = float((d[self.K] - d[1]) / (self.K - 1)) if self.K > 1 else float(d[1])
        return self._step_cache[key]

    def packed_round_s(self, batch_size: int, context: str, max_k: np.ndarray, rows_per_step: np.ndarray,
                       drafted: np.ndarray) -> np.ndarray:
        """``[N, 3]`` (draft, verify, other) seconds of N rounds whose rows draft their own k.

        Args:
            batch_size: rows per round, B.
            max_k: ``[N]`` the largest k of each round.
            rows_per_step: ``[N, K]`` rows drafting at step j (rows with k > j).
            drafted: ``[N]`` tokens drafted over all rows, D.
        """
        uni = self.round_s(batch_size, context)  # [K+1, 3]: every row drafting m
        out = uni[max_k].copy()
        full = self.step_s(batch_size, context)
        fewer = np.vectorize(lambda r: self.step_s(int(r), context) - full if 0 < r < batch_size else 0.0,
                             otypes=[float])(rows_per_step)  # [N, K]
        out[:, 0] = np.maximum(out[:, 0] + fewer.sum(axis=1), 0.0)
        out[:, 1] = np.interp(drafted / batch_size, np.arange(self.K + 1), uni[:, 1])
        return out

    def bucket_label(self, context: str) -> str:
        self._ctx(context)
        return DEFAULT_BUCKETS.context_bucket(self.context_len[context])


def _context_order(cx: str) -> int:
    return CONTEXT_CLASSES.index(cx) if cx in CONTEXT_CLASSES else len(CONTEXT_CLASSES)


def _unmeasured_context_len(cx: str, near: str, near_len: int) -> int:
    """Bucketing length of an unmeasured class: its prompt length plus what ``near`` generated beyond its prompt."""
    if cx in CONTEXT_PROMPT_BYTES and near in CONTEXT_PROMPT_BYTES:
        return CONTEXT_PROMPT_BYTES[cx] + max(0, near_len - CONTEXT_PROMPT_BYTES[near])
    return near_len


def _linear_in_k(cost: np.ndarray) -> np.ndarray:
    """Least-squares fit of each ``[K+1]`` cost series of ``cost`` ``[B, C, K+1, 3]`` as linear in k.

    draft: ``a + b k`` for k >= 1 (0 at k = 0: no draft runs); verify: ``a + b k``; other: its mean. Slopes
    are clipped at 0 (more drafts never make a round cheaper); a fitted value never goes below 0.
    """
    out = np.empty_like(cost)
    kk = np.arange(cost.shape[2], dtype=float)
    for bi in range(cost.shape[0]):
        for ci in range(cost.shape[1]):
            d, v, o = cost[bi, ci, :, 0], cost[bi, ci, :, 1], cost[bi, ci, :, 2]
            out[bi, ci, :, 0] = 0.0
            out[bi, ci, 1:, 0] = _line(kk[1:], d[1:])
            out[bi, ci, :, 1] = _line(kk, v)
            out[bi, ci, :, 2] = float(o.mean())
    return out


def _line(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``[N]`` values of the least-squares line through ``(x, y)`` with a slope clipped at 0, floored at 0."""
    if x.size < 2:
        return np.maximum(y, 0.0)
    slope, icpt = np.polyfit(x, y, 1)
    if slope < 0:
        slope, icpt = 0.0, float(y.mean())
    return np.maximum(icpt + slope * x, 0.0)


def cond_from_pmf(p: np.ndarray) -> np.ndarray:
    """``[K]`` per-position conditional acceptance pooled over every k of ``p`` ``[K+1, K+1]``.

    Row k of ``p`` is a histogram (counts: rows weigh by their number) or a pmf over accepted = 0..k.
    """
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


def pmf_from_cond(cond: np.ndarray, K: int) -> np.ndarray:
    """``[K+1, K+1]`` P(accepted = a | k): row k turns per-position conditional acceptance into a pmf over 0..k.

    Args:
        cond: ``[K]`` P(draft position i accepted | every position before it accepted); a shorter array is
            tiled to K.
        K: largest draft length.

    Returns:
        Row k holds P(accepted = a) for a = 0..k (zero beyond k): a accepted and the next one rejected, or all k kept.
    """
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


MIXES = {  # request mixes of the workload (fractions of rows per type)
    "balanced": {"code": 0.4, "prose": 0.4, "structured": 0.2},
    "code_heavy": {"code": 0.7, "prose": 0.1, "structured": 0.2},
}


@dataclass(frozen=True, slots=True)
class SimPhase:
    """A stretch of the simulated workload (its length a share of rounds, not seconds as in
    :class:`controller.reference.workload.Phase`, which a real engine plays)."""

    name: str
    share: float  # fraction of the workload's rounds
    batch_sizes: tuple[int, ...]  # loads visited in seeded shuffled cycles
    p_long: float  # probability that a stretch of windows runs at long context
    mix: str  # a key of MIXES
    version: str  # BASE_VERSION, or anything else for the updated target (workload's ``update_version``)


PHASES = (
    SimPhase("low load", 0.10, (1, 4), 0.0, "balanced", BASE_VERSION),
    SimPhase("load rising", 0.15, (4, 16, 64), 0.0, "balanced", BASE_VERSION),
    SimPhase("long contexts arrive", 0.15, (1, 16, 64), 0.6, "balanced", BASE_VERSION),
    SimPhase("mix turns code-heavy", 0.15, (1, 4, 16, 32, 64), 0.3, "code_heavy", BASE_VERSION),
    SimPhase("load falling", 0.10, (1, 4), 0.2, "code_heavy", BASE_VERSION),
    SimPhase("model update", 0.35, (1, 4, 16, 64), 0.4, "balanced", "target-v2"),
)


def workload(types: Sequence[str], total_rounds: int, seed: int, window_rounds: int = NOMINAL_ROUNDS_PER_WINDOW,
             base_version: str = BASE_VERSION, update_version: str = "target-v2", batch_cap: int | None = None,
             long_batch_cap: int | None = None, stretch: tuple[int, int] = (3, 10)) -> list[WindowSpec]:
    """Window specs through :data:`PHASES`: low load, load rising, long contexts arriving, request-mix change,
    load falling, model update. Load stays put for ``stretch`` windows at a time; each phase visits its batch
    sizes in seeded shuffled cycles.

    Args:
        types: request types (the calibration's, in its order).
        total_rounds: workload length in nominal rounds (``window_rounds`` per window).
        seed: seeds the draws of batch size and context per stretch of windows.
        window_rounds: nominal rounds per window, only to size the workload.
        base_version: the target version before the update (the engine section passes its profile's, e.g.
            target-v1-xl4).
        update_version: the target version of the last phase.
        batch_cap: largest batch served (a shorter engine run); larger draws run at the cap. None: no cap.
        long_batch_cap: largest batch served at long context (a CPU engine cannot prefill 64 long prompts in
            reasonable time); long windows above it run at the cap. None: no cap.
    """
    rng = np.random.default_rng(seed)
    t = list(types)

    def mix(name: str) -> tuple[float, ...]:
        v = np.array([MIXES[name].get(x, 0.0) for x in t]) + 1e-9
        return tuple(float(x) for x in v / v.sum())

    out: list[WindowSpec] = []
    lo, hi = stretch
    for ph in PHASES:
        version = update_version if ph.version != BASE_VERSION else base_version
        n_windows = max(1, round(ph.share * total_rounds / window_rounds))
        cycle: list[int] = []
        while n_windows > 0:
            run = min(n_windows, int(rng.integers(lo, hi + 1)))  # load stays put for a few windows at a time
            if not cycle:  # batch sizes in seeded shuffled cycles: a short run still visits each of the phase's
                cycle = [int(b) for b in rng.permutation(ph.batch_sizes)]
            bsz, ctx = cycle.pop(), "long" if rng.random() < ph.p_long else "short"
            if batch_cap is not None:
                bsz = min(bsz, batch_cap)
            if ctx == "long" and long_batch_cap is not None:
                bsz = min(bsz, long_batch_cap)
            out.extend([WindowSpec(bsz, ctx, mix(ph.mix), version)] * run)
            n_windows -= run
    return out


def describe_workload(specs: Sequence[WindowSpec], types: Sequence[str]) -> dict[str, Any]:
    """JSON-safe description of a workload: its phases and the share of windows per (version, batch, context)."""
    cells: dict[str, int] = {}
    for s in specs:
        key = f"{s.version}|batch {s.batch_size}|{s.context}"
        cells[key] = cells.get(key, 0) + 1
    return {
        "phases": [{"name": p.name, "share": p.share, "batch_sizes": list(p.batch_sizes), "p_long": p.p_long,
                    "mix": MIXES[p.mix], "version": p.version} for p in PHASES],
        "types": list(types),
        "windows": len(specs),
        "window_share": {k: round(v / len(specs), 4) for k, v in sorted(cells.items())},
    }


def expected_goodput(cal: Calibration, spec: WindowSpec, ks: Sequence[int]) -> float:
    """Analytic long-run goodput of per-type draft lengths ``ks`` ``[T]`` for a window spec."""
    tok, secs = expected_round(cal, spec, ks)
    return tok / secs


def expected_round(cal: Calibration, spec: WindowSpec, ks: Sequence[int]) -> tuple[float, float]:
    """(expected emitted tokens, expected seconds) of one packed round with per-type draft lengths ``ks`` ``[T]``.

    The expectation of :meth:`Calibration.packed_round_s` over the rows' types: the largest k follows
    ``P(max k <= m) = (1 - sum_{t: k_t > m} w_t) ** B``, the rows of step j are Binomial(B, sum_{t: k_t > j} w_t),
    and verify is taken at the expected drafted tokens per row (exact where verify is linear in k).
    """
    e = cal.emitted(spec.version, spec.context)
    w = np.asarray(spec.mix)
    k = np.asarray(ks)
    B = spec.batch_size
    tok = B * float((e[np.arange(len(k)), k] * w).sum())
    uni = cal.round_s(B, spec.context)  # [K+1, 3]
    m = np.arange(cal.K + 1)
    q = ((k[:, None] > m[None, :]) * w[:, None]).sum(axis=0)  # [K+1] P(a row drafts past m)
    pmf = np.diff(np.clip(1.0 - q, 0.0, 1.0) ** B, prepend=0.0)
    draft, other = float(pmf @ uni[:, 0]), float(pmf @ uni[:, 2])
    full = cal.step_s(B, spec.context)
    r = np.arange(1, B)  # fewer rows than the batch at a step
    fewer = np.array([cal.step_s(int(x), spec.context) - full for x in r])
    for j in range(int(k.max(initial=0))):
        if 0.0 < q[j] < 1.0:
            draft += float(binom.pmf(r, B, q[j]) @ fewer)
    verify = float(np.interp(float(k @ w), m, uni[:, 1]))
    return tok, max(draft, 0.0) + verify + other


def buckets_of(cal: Calibration, spec: WindowSpec) -> list[Bucket]:
    bb = DEFAULT_BUCKETS.batch_bucket(spec.batch_size)
    return [Bucket(spec.version, DRAFT_VERSION, t, bb, cal.bucket_label(spec.context)) for t in cal.types]


def interference_factors(n_windows: int, seed: int, busy_share: float, slowdown: float = 1.6,
                         stretch: tuple[int, int] = (2, 12)) -> np.ndarray:
    """``[W]`` per-window multipliers on round seconds: stretches of a busy neighbour stealing CPU.

    About ``busy_share`` of the windows fall in seeded busy stretches of ``stretch`` windows, during which every
    round costs ``slowdown`` times as much (one busy process on a 2-core machine: measured 1.5-1.8x on the
    reference engine). 0 gives a quiet machine.
    """
    out = np.ones(n_windows)
    if busy_share <= 0:
        return out
    rng = np.random.default_rng([seed, 7])
    wi = 0
    while wi < n_windows:
        n = int(rng.integers(stretch[0], stretch[1] + 1))
        if rng.random() < busy_share:
            out[wi: wi + n] = slowdown
        wi += n
    return out


def simulate(policy: Policy, cal: Calibration, specs: Sequence[WindowSpec], window_s: float = WINDOW_S,
             seed: int = 0, noise: float = 0.03, busy_share: float = 0.0) -> SimResult:
    """Run ``policy`` over the workload; returns per-window tokens, seconds and analytic goodput.

    Windows last ``window_s`` of wall time (as the engine's emitter aggregates), so a policy that makes rounds
    cheaper runs more of them: every policy spends the same time in every window and tok/s totals compare fairly.
    ``busy_share`` > 0 adds a busy neighbour (:func:`interference_factors`): every policy meets the same busy
    windows.
    """
    rng = np.random.default_rng(seed)
    slow = interference_factors(len(specs), seed, busy_share)
    n_w = len(specs)
    res = SimResult(np.zeros(n_w), np.zeros(n_w), np.zeros(n_w), np.zeros(n_w))
    T = len(cal.types)
    clock = 0.0  # wall seconds simulated so far
    for wi, spec in enumerate(specs):
        buckets = buckets_of(cal, spec)
        ks = np.array([min(policy.decide(b).k, cal.K) for b in buckets])  # [T]
        tok_round, s_round = expected_round(cal, spec, [int(k) for k in ks])
        s_round *= slow[wi]
        # Rounds until the clock reaches this window's end: what a round overshoots one window it owes the next, so
        # every policy spends the same wall time overall (within one round) and in every stretch of the workload.
        # (Rounding each window to window_s alone let a policy's rounds at batch 64, 0.2-0.4 s each, make its
        # windows 0.4-0.6 s, weighting tok/s by how each policy's round times happened to round.)
        N = max(1, round(((wi + 1) * window_s - clock) / s_round))
        res.ks.append({b.key(): int(k) for b, k, m in zip(buckets, ks, spec.mix, strict=True) if m > 0.01})
        counts = rng.multinomial(spec.batch_size, spec.mix, size=N)  # [N, T] rows per type per round
        maxk = np.where(counts > 0, ks[None, :], 0).max(axis=1)  # [N]
        steps = (ks[:, None] > np.arange(cal.K)[None, :]).astype(int)  # [T, K]: type t drafts at step j
        drafted = counts @ ks  # [N]
        parts = cal.packed_round_s(spec.batch_size, spec.context, maxk, counts @ steps, drafted.astype(float))
        parts = parts * (slow[wi] * (1.0 + noise * rng.standard_normal((N, 1))))
        parts = np.maximum(parts, 0.0)  # [N, 3]
        wall = parts.sum(axis=1)
        ctx_len = cal.context_len[spec.context]
        rows_of: list[list[RowRecord]] = [[] for _ in range(N)]  # [N] the rows of each round
        emitted_round = np.zeros(N)
        for ti in range(T):
            rows = int(counts[:, ti].sum())
            if rows == 0:
                continue
            k = int(ks[ti])
            acc = rng.choice(k + 1, size=rows, p=cal.pmf(spec.version, cal.types[ti], spec.context, k))
            emitted_round += np.bincount(np.repeat(np.arange(N), counts[:, ti]), weights=acc + 1.0, minlength=N)
            # One record per outcome, shared by every row that had it (records are frozen).
            outcome = [RowRecord(cal.types[ti], ctx_len, k, a, a + 1) for a in range(k + 1)]
            start = 0
            for n, end in enumerate(np.cumsum(counts[:, ti]).tolist()):
                rows_of[n].extend(map(outcome.__getitem__, acc[start:end].tolist()))
                start = end
        # Windows come from the engine's own aggregation code, so they cannot drift from real ones.
        agg = aggregate(
            RoundRecord(round_index=n, batch_size=spec.batch_size, max_k=int(maxk[n]),
                        tokens_verified=spec.batch_size + int(drafted[n]), draft_s=float(parts[n, 0]),
                        verify_s=float(parts[n, 1]), other_s=float(parts[n, 2]), target_version=spec.version,
                        draft_version=DRAFT_VERSION, rows=tuple(rows_of[n]))
            for n in range(N)
        )
        for a in agg.acceptance:
            policy.observe(a)
        for c in agg.cost:
            policy.observe(c)
        res.tokens[wi], res.seconds[wi], res.rounds[wi] = emitted_round.sum(), wall.sum(), N
        clock += float(wall.sum())
        res.expected_goodput[wi] = tok_round / s_round
    return res


def to_jsonable(x: Any) -> Any:
    """For result files: numpy -> plain Python."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x
