"""Replaying stored telemetry through the calibrated simulator (what ``spectune tune`` scores candidates on).

What is replayed, and where each number comes from:

- **workload**: every stored engine window becomes one simulator window
  (:class:`controller.offline.simulator.WindowSpec`) per (model versions, batch bucket, context bucket) it has
  cost windows for: its mean batch size (``batch_rows / rounds``), its context bucket, and its request-type mix
  (rows per type of the acceptance windows the same engine stored for the same window end, versions and context
  bucket; the slice's mix for that (versions, context) when the window has none). Every replayed window lasts the
  same wall time, as the engine's emitter aggregates over fixed time, so tokens/s of two tables compare on the
  same traffic.
- **acceptance**: per (versions, request type, context bucket) the per-position conditional acceptance pooled
  over every stored histogram (rejection sampling makes position i's acceptance independent of how many drafts
  follow it), turned back into ``P(accepted = a | k)``. A position never tried there borrows the request type's
  (any context), then the type's over every version, then every window's, then :data:`PRIOR_ALPHA`; positions
  beyond the deepest one measured repeat the last measured one.
- **cost**: either a recorded sweep (an engine benchmark calibration file,
  :class:`controller.offline.simulator.Calibration`, one profile), each context bucket taking the calibration's
  context class of the same bucket (else the nearest in log length); or :class:`policies._cost.CostModel` fitted
  on the stored cost windows (no forgetting, raw seconds), which extrapolates to ks and batches never measured.

Two scores: :meth:`Replay.score_table` is the simulator's analytic expectation of a packed round
(:func:`controller.offline.simulator.expected_round`) per window, deterministic (what optuna optimises);
:meth:`Replay.simulate` runs the round-level simulator (:func:`controller.offline.simulator.simulate`, seeded
noise, sampled acceptance) with any policy, a table or a learning one. p99 per-token latency is the 99th
percentile, over the rows served, of round seconds over the tokens the row emitted (the cost windows'
definition), from the same expected rounds.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from controller.offline.project import non_increasing, per_context, shallower
from controller.offline.simulator import Calibration, WindowSpec, expected_round, pmf_from_cond, simulate
from policies._cost import CostModel
from policies.base import Decision, Policy
from telemetry.errors import SpectuneError
from telemetry.policy_table import lookup
from telemetry.records import (
    DEFAULT_BUCKETS,
    AcceptanceWindow,
    Bucket,
    CostWindow,
    PolicyTable,
    context_length,
)
from telemetry.store import StoredWindow
from telemetry.wire import parse_bucket_key

EXHAUSTIVE_COMBOS = 4096  # joint ks of one cell's types searched exhaustively by Replay.best_per_cell (9^3 = 729)
PRIOR_ALPHA = 0.6  # acceptance of a position nothing measured (the policies' AcceptanceModel prior)
DEFAULT_WINDOW_S = 0.5  # wall seconds of one replayed window (tune's and export's default)
P99 = 0.99
NO_COST = ("no cost windows stored: the replay needs the batch sizes engines ran at (run a sidecar, `spectune "
           "ingest` a source that records them, or pass --calibration FILE, a recorded sweep)")

Pair = tuple[str, str]  # (target version, draft version)


class ReplayError(SpectuneError):
    """The stored telemetry cannot be replayed (too little of it, or a calibration that does not fit)."""


@dataclass(frozen=True)
class Score:
    """What a replay says about a decision rule."""

    tok_s: float  # emitted tokens per wall second, every window the same wall time
    p99_s: float  # p99 per-token latency in seconds (round seconds / tokens a row emitted)


# --------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Slice:
    """Stored windows of one stretch of time."""

    acceptance: tuple[StoredWindow[AcceptanceWindow], ...]
    cost: tuple[StoredWindow[CostWindow], ...]


def split_by_time(acc: Sequence[StoredWindow[AcceptanceWindow]], cost: Sequence[StoredWindow[CostWindow]],
                  holdout: float) -> tuple[Slice, Slice, float]:
    """(tune, held-out, cut time): windows that ended before the cut are tuned on, the rest held out.

    The cut is the end time of the first engine window of the last ``holdout`` share of stored engine windows
    (distinct (engine, window end) with cost windows; with none, with acceptance windows). Acceptance windows
    follow the same cut when that leaves some on each side. When it does not, because acceptance and cost come
    from different sources at different times (one engine's log lines ingested before another's iteration
    stats), acceptance windows are split by their own engine windows the same way, so that each side still has
    both kinds; a single engine window of acceptance stays on the tuning side.

    Raises:
        ReplayError: too few engine windows to leave some on each side.
    """
    if holdout <= 0:
        return Slice(tuple(acc), tuple(cost)), Slice((), ()), math.inf
    if not cost and not acc:
        raise ReplayError(NO_COST)
    cut = _cut(cost if cost else acc, holdout, "cost" if cost else "acceptance")
    a_cut = cut
    if acc and not (any(w.window_end < cut for w in acc) and any(w.window_end >= cut for w in acc)):
        try:
            a_cut = _cut(acc, holdout, "acceptance")
        except ReplayError:
            a_cut = math.inf  # one engine window of acceptance: it is needed to tune on
    tune = Slice(tuple(w for w in acc if w.window_end < a_cut), tuple(w for w in cost if w.window_end < cut))
    held = Slice(tuple(w for w in acc if w.window_end >= a_cut), tuple(w for w in cost if w.window_end >= cut))
    return tune, held, cut


def _cut(windows: Sequence[StoredWindow[Any]], holdout: float, what: str) -> float:
    """The end time of the first engine window of the last ``holdout`` share of ``windows``' engine windows."""
    ends = sorted({(w.window_end, w.engine_id) for w in windows})
    idx = int(len(ends) * (1.0 - holdout))
    if len(ends) < 2 or idx <= 0 or idx >= len(ends) or ends[idx][0] <= ends[0][0]:
        raise ReplayError(f"{len(ends)} stored engine windows with {what} windows cannot be split "
                          f"{1 - holdout:.0%} / {holdout:.0%} by time; store more telemetry or pass --holdout 0 (no "
                          "held-out check)")
    return float(ends[idx][0])


def _pair(w: AcceptanceWindow | CostWindow) -> Pair:
    return (w.target_version, w.draft_version)


def version_tokens(pairs: set[Pair]) -> dict[Pair, str]:
    """The simulator's one version label per (target, draft): the target's name, unless two drafts share it."""
    targets = Counter(t for t, _ in pairs)
    return {(t, d): t if targets[t] == 1 else f"{t}+{d}" for t, d in sorted(pairs)}


@dataclass(frozen=True)
class Workload:
    """The replayed windows and what they were built from."""

    specs: tuple[WindowSpec, ...]  # one per stored (engine window, versions, batch bucket, context bucket)
    buckets: tuple[int, ...]  # [W] the stored batch bucket of each spec
    types: tuple[str, ...]  # request types, the order of WindowSpec.mix
    pair_of: dict[str, Pair]  # version label -> (target, draft)
    notes: tuple[str, ...] = ()


def workload(part: Slice, types: Sequence[str], tokens: dict[Pair, str]) -> Workload:
    """The windows to replay (see the module docstring)."""
    t_index = {t: i for i, t in enumerate(types)}
    mix_of: dict[tuple[Any, ...], np.ndarray] = defaultdict(lambda: np.zeros(len(types)))
    for sw in part.acceptance:
        a = sw.window
        vec = np.zeros(len(types))
        vec[t_index[a.request_type]] = a.rows
        mix_of[(sw.engine_id, sw.window_end, _pair(a), a.context_bucket)] += vec
        mix_of[(_pair(a), a.context_bucket)] += vec
    groups: dict[tuple[float, str, Pair, int, str], list[int]] = {}
    for cw in part.cost:
        c = cw.window
        g = groups.setdefault((cw.window_end, cw.engine_id, _pair(c), c.batch_bucket, c.context_bucket), [0, 0])
        g[0] += c.rounds
        g[1] += c.batch_rows
    specs, buckets, guessed = [], [], 0
    uniform = np.full(len(types), 1.0 / len(types))
    for (end, eng, pair, bb, ctx), (rounds, rows) in sorted(groups.items()):
        mix = mix_of.get((eng, end, pair, ctx))
        if mix is None or mix.sum() <= 0:
            mix = mix_of.get((pair, ctx))
            guessed += 1
        w = mix / mix.sum() if mix is not None and mix.sum() > 0 else uniform
        specs.append(WindowSpec(max(1, round(rows / rounds)), ctx, tuple(float(x) for x in w), tokens[pair]))
        buckets.append(bb)
    notes = []
    if guessed:
        notes.append(f"{guessed} of {len(specs)} windows had no acceptance window of their own: the request mix of "
                     "their versions and context bucket over the slice")
    return Workload(tuple(specs), tuple(buckets), tuple(types), {v: k for k, v in tokens.items()}, tuple(notes))


def workload_at_batches(part: Slice, types: Sequence[str], tokens: dict[Pair, str],
                        batch_sizes: Sequence[int]) -> Workload:
    """The windows to replay when no cost window says what batch sizes engines ran at: every engine window of
    acceptance (per versions and context bucket, its request mix) once at each of ``batch_sizes``, all weighing
    the same."""
    t_index = {t: i for i, t in enumerate(types)}
    mix_of: dict[tuple[float, str, Pair, str], np.ndarray] = defaultdict(lambda: np.zeros(len(types)))
    for sw in part.acceptance:
        a = sw.window
        mix_of[(sw.window_end, sw.engine_id, _pair(a), a.context_bucket)][t_index[a.request_type]] += a.rows
    specs, buckets = [], []
    for (_, _, pair, ctx), mix in sorted(mix_of.items()):
        w = mix / mix.sum() if mix.sum() > 0 else np.full(len(types), 1.0 / len(types))
        for b in batch_sizes:
            specs.append(WindowSpec(int(b), ctx, tuple(float(x) for x in w), tokens[pair]))
            buckets.append(DEFAULT_BUCKETS.batch_bucket(int(b)))
    note = (f"no cost windows: each of the {len(mix_of)} engine windows of acceptance replayed at every batch size "
            f"the sweep measured ({', '.join(map(str, batch_sizes))}), all weighing the same; cost windows of the "
            "engines (`spectune ingest` of a source with batch sizes and round times) weigh them by real traffic")
    return Workload(tuple(specs), tuple(buckets), tuple(types), {v: k for k, v in tokens.items()}, (note,))


def cost_measured_k(windows: Sequence[CostWindow]) -> dict[tuple[int, str], int]:
    """The largest k of the stored cost windows (with rounds) per (batch bucket, context bucket)."""
    out: dict[tuple[int, str], int] = {}
    for w in windows:
        if w.rounds > 0:
            key = (w.batch_bucket, w.context_bucket)
            out[key] = max(out.get(key, 0), w.max_k)
    return out


def measured_k(windows: Sequence[AcceptanceWindow]) -> dict[tuple[str, ...], int]:
    """The largest k drafted in acceptance windows (with rows): per ``("cell", request type, context bucket)``,
    per ``("type", request type)`` and over ``("all",)``; positions past it are extrapolated by the replay."""
    out: dict[tuple[str, ...], int] = {}
    for a in windows:
        if a.rows > 0:
            for key in (("cell", a.request_type, a.context_bucket), ("type", a.request_type), ("all",)):
                out[key] = max(out.get(key, 0), a.k)
    return out


# --------------------------------------------------------------------------------------------- acceptance
def pooled_cond(windows: Sequence[AcceptanceWindow], K: int) -> tuple[np.ndarray, np.ndarray]:
    """``([K] conditional acceptance per position, [K] rows that tried it)`` pooled over ``windows``."""
    kept, tried = np.zeros(K), np.zeros(K)
    for a in windows:
        tail = a.rows
        for i in range(min(a.k, K)):  # position i + 1: tried by rows that accepted >= i, kept by those > i
            tried[i] += tail
            tail -= a.hist[i]
            kept[i] += tail
    return np.where(tried > 0, kept / np.maximum(tried, 1), 0.0), tried


def acceptance_pmfs(windows: Sequence[AcceptanceWindow], tokens: dict[Pair, str], types: Sequence[str],
                    contexts: Sequence[str], K: int) -> dict[tuple[str, str, str], np.ndarray]:
    """(version label, type, context) -> ``[K + 1, K + 1]`` P(accepted = a | k), with the fallbacks of the module
    docstring, for every label, type and context."""
    by: dict[tuple[Any, ...], list[AcceptanceWindow]] = defaultdict(list)
    for a in windows:
        v = tokens.get(_pair(a))
        by[("cell", v, a.request_type, a.context_bucket)].append(a)
        by[("vt", v, a.request_type)].append(a)
        by[("t", a.request_type)].append(a)
        by[("all",)].append(a)
    cache: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}

    def level(key: tuple[Any, ...]) -> tuple[np.ndarray, np.ndarray]:
        if key not in cache:
            cache[key] = pooled_cond(by.get(key, []), K)
        return cache[key]

    out = {}
    for v in tokens.values():
        for t in types:
            for cx in contexts:
                cond = np.full(K, np.nan)
                for key in (("cell", v, t, cx), ("vt", v, t), ("t", t), ("all",)):
                    c, n = level(key)
                    fill = np.isnan(cond) & (n > 0)
                    cond[fill] = c[fill]
                if np.isnan(cond).all():
                    cond[:] = PRIOR_ALPHA
                for i in range(K):  # never tried anywhere: repeat the position before it
                    if np.isnan(cond[i]):
                        cond[i] = cond[i - 1] if i > 0 else PRIOR_ALPHA
                out[(v, t, cx)] = pmf_from_cond(cond, K)
    return out


# ----------------------------------------------------------------------------------------------- cost
class CostSource:
    """``round_s(batch, context bucket) -> [K + 1, 3]`` (draft, verify, other) seconds per round, one k per row."""

    description = ""
    notes: tuple[str, ...] = ()

    def round_s(self, batch_size: float, context: str) -> np.ndarray:
        raise NotImplementedError


class SweepCost(CostSource):
    """Cost from a recorded engine sweep (a calibration file of the engine benchmark)."""

    def __init__(self, path: Path, profile: str | None, K: int, clip: bool = False) -> None:
        try:
            self._cal = Calibration(path, profile=profile)
        except ValueError as e:  # CalibrationError and a bad smoothing name
            raise ReplayError(str(e)) from e
        if self._cal.K < K and not clip:
            raise ReplayError(f"{path} measured k up to {self._cal.K}; pass --k-max {self._cal.K} or less")
        K = min(K, self._cal.K)  # clip: ks past the sweep are scored as its largest
        self.K = K
        self._class: dict[str, str] = {}
        self.description = f"recorded sweep {path} (profile {self._cal.profile}, device {self._cal.device})"
        self.notes = tuple(self._cal.gaps)

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes the sweep measured."""
        return list(self._cal.batches)

    def context_class(self, label: str) -> str:
        """The calibration's context class for a context bucket: the one of the same bucket, else the nearest."""
        if label not in self._class:
            cal = self._cal
            same = [c for c in cal.measured_contexts if DEFAULT_BUCKETS.context_bucket(cal.context_len[c]) == label]
            self._class[label] = same[0] if same else min(
                cal.measured_contexts, key=lambda c: abs(math.log(cal.context_len[c] / context_length(label))))
            if not same:
                self.notes = (*self.notes, f"context bucket {label!r} not in the sweep: cost of its nearest context "
                                           f"class {self._class[label]!r} ({cal.context_len[self._class[label]]} "
                                           "tokens)")
        return self._class[label]

    def round_s(self, batch_size: float, context: str) -> np.ndarray:
        return self._cal.round_s(batch_size, self.context_class(context))[: self.K + 1]


class ModelCost(CostSource):
    """Cost from :class:`policies._cost.CostModel` fitted on stored cost windows."""

    def __init__(self, windows: Sequence[CostWindow], K: int) -> None:
        if not windows:
            raise ReplayError("no cost windows to fit the cost model on; pass --calibration FILE (a recorded sweep)")
        self._model = CostModel(K, decay=1.0, speed_memory=0)  # offline: every window counts, raw seconds
        for w in windows:
            if w.max_k <= K:
                self._model.observe(w.batch_bucket, w.context_bucket, w.max_k, w.rounds, w.batch_rows,
                                    w.draft_s.total, w.verify_s.total, w.other_s.total,
                                    drafted=float(w.tokens_verified - w.batch_rows))
        self._model.refit()
        self._cache: dict[tuple[float, str], np.ndarray] = {}
        ks = sorted({w.max_k for w in windows})
        self.description = f"cost model fitted on {len(windows)} stored cost windows (k measured: {ks})"
        self.notes = (f"cost of k in {sorted(set(range(K + 1)) - set(ks))} extrapolated by the fitted cost model",) if (
            set(range(K + 1)) - set(ks)) else ()

    def round_s(self, batch_size: float, context: str) -> np.ndarray:
        key = (batch_size, context)
        if key not in self._cache:
            bb = DEFAULT_BUCKETS.batch_bucket(max(1, round(batch_size)))
            self._cache[key] = self._model.predict(bb, context, batch_size)
        return self._cache[key]


class ReplayCalibration(Calibration):
    """The simulator's calibration interface, filled from stored telemetry: acceptance from acceptance windows,
    cost from a :class:`CostSource`. Contexts are the stored context buckets themselves."""

    def __init__(self, pmfs: dict[tuple[str, str, str], np.ndarray], types: Sequence[str],
                 contexts: Sequence[str], K: int, cost: CostSource) -> None:  # no super(): nothing is read from a file
        self.profile, self.device, self.smooth = "replay", "replay", "none"
        self.types = list(types)
        self.K = K
        self.contexts = self.measured_contexts = list(contexts)
        self.context_len = {c: context_length(c) for c in contexts}
        self.batches = list(DEFAULT_BUCKETS.batch_edges)
        self.gaps = []  # the cost source's notes travel with the Replay
        self._pmf = pmfs
        self.versions = sorted({v for v, _, _ in pmfs})
        self._step_cache = {}
        self._alias = {c: c for c in contexts}
        self._cost = cost
        self._emitted: dict[tuple[str, str], np.ndarray] = {}

    def round_s(self, batch_size: float, context: str) -> np.ndarray:
        out = np.array(self._cost.round_s(batch_size, self._ctx(context)), dtype=float)
        out[0, 0] = 0.0  # no draft at k = 0
        return out

    def emitted(self, version: str, context: str) -> np.ndarray:
        key = (version, context)
        if key not in self._emitted:
            self._emitted[key] = super().emitted(version, context)
        return self._emitted[key]

    def with_acceptance(self, version: str, rtype: str, context: str, pmf: np.ndarray) -> Calibration:
        out = super().with_acceptance(version, rtype, context, pmf)
        assert isinstance(out, ReplayCalibration)
        out._emitted = {}  # emitted tokens follow acceptance: the copy computes its own
        return out

    def bucket_label(self, context: str) -> str:
        return self._ctx(context)


# ----------------------------------------------------------------------------------------------- replay
class TablePolicy(Policy):
    """Serves a policy table in the simulator, looked up with each replayed window's real versions."""

    name = "replay_table"

    def __init__(self, table: PolicyTable, pair_of: dict[str, Pair], k_max: int) -> None:
        super().__init__(k_max=k_max)
        self._table, self._pair_of = table, pair_of

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        t, d = self._pair_of[bucket.target_version]
        k = lookup(self._table, Bucket(t, d, bucket.request_type, bucket.batch_bucket, bucket.context_bucket))
        return Decision(k=k, reason=f"table v{self._table.version}")

    def _get_state(self) -> dict[str, Any]:
        return {}

    def _set_state(self, state: dict[str, Any]) -> None:
        pass


KsFn = Callable[[WindowSpec, int], tuple[int, ...]]  # (spec, stored batch bucket) -> k per request type


@dataclass
class Replay:
    """One slice of telemetry, ready to score decision rules on."""

    cal: ReplayCalibration
    load: Workload
    window_s: float
    notes: tuple[str, ...] = ()
    measured_k: dict[tuple[str, ...], int] = field(default_factory=dict)  # see :func:`measured_k`
    # (batch bucket, context bucket) -> the largest k the cost windows measured there (:func:`cost_measured_k`);
    # None when a recorded sweep gives the cost (it measured every k it has)
    cost_k: dict[tuple[int, str], int] | None = None
    _rounds: dict[tuple[WindowSpec, tuple[int, ...]], tuple[float, float]] = field(default_factory=dict)

    @property
    def windows(self) -> int:
        return len(self.load.specs)

    def cost_cap(self, batch_bucket: int, context: str) -> int | None:
        """The deepest k whose round cost was measured at this batch bucket or a larger one (in this context
        bucket, else in any; past the largest batch bucket measured, that bucket's): a deeper k's cost there is the
        fitted model's extrapolation across batch sizes, which verification's growth with the tokens verified makes
        too cheap where no draft was ever verified (a tuned table once drafted k = 5 at batch 32, where the live
        policy ran k = 0, and its export drafted 5 at every batch). A k measured at a larger batch is plausible at
        a smaller one, since a round's verification only grows with the batch. None: no cap (a recorded sweep, or
        no cost windows)."""
        if not self.cost_k:
            return None
        for same_context in (True, False):
            cells = [(b, k) for (b, c), k in self.cost_k.items() if c == context or not same_context]
            if not cells:
                continue
            above = [k for b, k in cells if b >= batch_bucket]
            if above:
                return max(above)
            top = max(b for b, _ in cells)
            return max(k for b, k in cells if b == top)
        return None

    def table_ks(self, table: PolicyTable) -> KsFn:
        def ks(spec: WindowSpec, bb: int) -> tuple[int, ...]:
            t, d = self.load.pair_of[spec.version]
            return tuple(min(lookup(table, Bucket(t, d, rt, bb, spec.context)), self.cal.K) for rt in self.load.types)
        return ks

    def score_table(self, table: PolicyTable) -> Score:
        """Analytic tokens/s and p99 latency of serving ``table`` (deterministic)."""
        return self.score(self.table_ks(table))

    def score(self, ks_of: KsFn) -> Score:
        """Analytic tokens/s and p99 latency of per-type ks chosen per window by ``ks_of``."""
        return self._score([ks_of(s, bb) for s, bb in zip(self.load.specs, self.load.buckets, strict=True)])

    def _score(self, chosen: Sequence[tuple[int, ...]]) -> Score:
        good = []
        lat: list[np.ndarray] = []
        wts: list[np.ndarray] = []
        for spec, ks in zip(self.load.specs, chosen, strict=True):
            tok, secs = self._round(spec, ks)
            good.append(tok / secs)
            rounds = self.window_s / secs
            for ti, rt in enumerate(self.load.types):
                w = spec.mix[ti]
                if w <= 0:
                    continue
                p = self.cal.pmf(spec.version, rt, spec.context, ks[ti])  # [k + 1]
                lat.append(secs / (np.arange(p.size) + 1.0))
                wts.append(rounds * spec.batch_size * w * p)
        return Score(float(np.mean(good)), weighted_quantile(np.concatenate(lat), np.concatenate(wts), P99))

    def best_schedule(self, table: PolicyTable, by_context: bool = False) -> dict[Any, int]:
        """Project ``table`` onto one k per batch bucket (``by_context``: per (batch bucket, context bucket)) for
        every request type: the schedule with the highest replayed tokens/s whose k never rises with batch size
        (per context bucket), each bucket choosing among the ks the table uses there and the smaller ones it uses
        anywhere (:func:`controller.offline.project.non_increasing`, whose docstring says why). The replay's cost
        is the packed round's (verification grows with the tokens verified at large batch), which a per-row
        speedup model misses: it projects onto the deepest k.

        Windows last the same wall time, so the schedule whose windows' summed goodput is highest maximises the
        whole replay's tokens/s. Returns only buckets the replay has windows for."""
        full = self.table_ks(table)
        groups: dict[Any, list[int]] = defaultdict(list)
        for i, (spec, bb) in enumerate(zip(self.load.specs, self.load.buckets, strict=True)):
            groups[(bb, spec.context) if by_context else bb].append(i)
        n_types = len(self.load.types)
        here = {key: {k for i in idx for k in full(self.load.specs[i], self.load.buckets[i])}
                for key, idx in groups.items()}
        used = set().union(*here.values()) if here else set()

        def total(k: int, idx: list[int]) -> float:
            return sum(tok / secs for tok, secs in (self._round(self.load.specs[i], (k,) * n_types) for i in idx))

        scores = {key: {k: total(k, idx) for k in shallower(used, here[key])} for key, idx in groups.items()}
        if not by_context:
            return non_increasing(scores)
        return per_context(scores, lambda _, sc: non_increasing(sc))

    def best_per_cell(self, caps: dict[tuple[str, int, str], int], base: KsFn,
                      max_combos: int = EXHAUSTIVE_COMBOS) -> dict[tuple[str, int, str], int]:
        """The k per (request type, batch bucket, context bucket) in ``caps`` (each searched in ``[0, cap]``) that
        maximises this replay's tokens/s, the other types' ks as ``base`` gives them.

        The objective separates by cost cell: every window lasts the same wall time, so the replay's tokens/s is the
        mean of its windows' goodput, and a window's goodput depends only on the ks of its own (batch bucket,
        context bucket). Each cell is searched alone, exhaustively over the joint ks of its tuned types (rows of
        every type share a round) while there are at most ``max_combos`` of them, else by coordinate ascent from
        ``base``. Ties keep the smaller k. This is the table the replay's model (acceptance per type and position,
        the fitted cost) calls best, with no sampler noise: a bucket with little traffic is decided on the same
        model as a busy one.
        """
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, (spec, bb) in enumerate(zip(self.load.specs, self.load.buckets, strict=True)):
            groups[(bb, spec.context)].append(i)
        types = self.load.types
        out: dict[tuple[str, int, str], int] = {}
        for (bb, ctx), idx in groups.items():
            tuned = [ti for ti, rt in enumerate(types) if (rt, bb, ctx) in caps]
            if not tuned:
                continue
            bases = [base(self.load.specs[i], bb) for i in idx]

            def total(choice: tuple[int, ...], idx: list[int] = idx, bases: list[tuple[int, ...]] = bases,
                      tuned: list[int] = tuned) -> float:
                acc = 0.0
                for i, ks in zip(idx, bases, strict=True):
                    full = list(ks)
                    for ti, k in zip(tuned, choice, strict=True):
                        full[ti] = min(k, self.cal.K)
                    tok, secs = self._round(self.load.specs[i], tuple(full))
                    acc += tok / secs
                return acc

            ranges = [range(caps[(types[ti], bb, ctx)] + 1) for ti in tuned]
            if math.prod(len(r) for r in ranges) <= max_combos:
                best = max(itertools.product(*ranges), key=lambda c: (total(c), [-k for k in c]))
            else:
                cur = [min(bases[0][ti], caps[(types[ti], bb, ctx)]) for ti in tuned]
                for _ in range(8):  # coordinate ascent: each type's k in turn, the others fixed
                    before = list(cur)
                    for j, r in enumerate(ranges):
                        scored = [(total((*cur[:j], k, *cur[j + 1:])), -k, k) for k in r]
                        cur[j] = max(scored)[2]
                    if cur == before:
                        break
                best = tuple(cur)
            out.update({(types[ti], bb, ctx): int(k) for ti, k in zip(tuned, best, strict=True)})
        return out

    def _round(self, spec: WindowSpec, ks: tuple[int, ...]) -> tuple[float, float]:
        """Expected (tokens, seconds) of one round of ``spec`` at ``ks`` (cached: optuna revisits them)."""
        key = (spec, ks)
        if key not in self._rounds:
            self._rounds[key] = expected_round(self.cal, spec, ks)
        return self._rounds[key]

    def simulate(self, policy: Policy, seed: int, noise: float = 0.03) -> Score:
        """Round-level replay (seeded noise, sampled acceptance); the policy decides and learns as it goes."""
        res = simulate(policy, self.cal, self.load.specs, window_s=self.window_s, seed=seed, noise=noise)
        chosen = []
        for ks in res.ks:
            by_type = {parse_bucket_key(key)[2]: k for key, k in ks.items()}
            chosen.append(tuple(by_type.get(rt, 0) for rt in self.load.types))
        return Score(res.tok_s, self._score(chosen).p99_s)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value whose weighted cumulative share reaches ``q``. values, weights: ``[N]``."""
    if values.size == 0 or weights.sum() <= 0:
        return 0.0
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][min(int(np.searchsorted(cum, q * cum[-1])), values.size - 1)])


def store_replay(part: Slice, K: int, calibration: Path | None = None, profile: str | None = None,
                 window_s: float = DEFAULT_WINDOW_S) -> Replay:
    """The replay a table's predicted tokens/s over stored windows comes from, for ``spectune tune`` (its figures
    over every stored window) and ``spectune export`` (the full table and its projection) alike, so that both give
    the same figure for the same table, windows and cost source.

    Args:
        part: the stored windows (every one, for both commands).
        K: the table's ``k_max`` (a recorded sweep that measured fewer ks scores the ks past it as its largest).
        calibration: a recorded sweep for the cost (``--calibration``); None fits the cost model on ``part``.
        profile: the sweep's profile.
        window_s: wall seconds of one replayed window (tokens/s do not depend on it).
    """
    cost = SweepCost(calibration, profile, K, clip=True) if calibration is not None else None
    return build_replay(part, cost.K if cost is not None else K, cost, window_s)


def build_replay(part: Slice, K: int, cost: CostSource | None, window_s: float) -> Replay:
    """A replay of one slice. ``cost`` None fits the cost model on the slice's own cost windows.

    Without cost windows a recorded sweep (:class:`SweepCost`) supplies the batch sizes too
    (:func:`workload_at_batches`).

    Raises:
        ReplayError: the slice has no cost windows and no sweep (no batch sizes to replay), or no acceptance
            windows.
    """
    acc = [w.window for w in part.acceptance]
    if not part.cost and not isinstance(cost, SweepCost):
        raise ReplayError(NO_COST)
    if not acc:
        raise ReplayError("no acceptance windows stored: nothing says how well the draft is accepted")
    types = sorted({a.request_type for a in acc})
    pairs = {_pair(w.window) for w in part.cost} | {_pair(a) for a in acc}
    tokens = version_tokens(pairs)
    if part.cost:
        load = workload(part, types, tokens)
    else:
        assert isinstance(cost, SweepCost)
        load = workload_at_batches(part, types, tokens, cost.batch_sizes)
    contexts = sorted({s.context for s in load.specs} | {a.context_bucket for a in acc}, key=context_length)
    source = cost if cost is not None else ModelCost([w.window for w in part.cost], K)
    for cx in contexts:  # resolves (and notes) how the source covers each context bucket
        source.round_s(1.0, cx)
    cal = ReplayCalibration(acceptance_pmfs(acc, tokens, types, contexts, K), types, contexts, K, source)
    return Replay(cal, load, window_s, notes=(source.description, *source.notes, *load.notes),
                  measured_k=measured_k(acc),
                  cost_k=None if isinstance(source, SweepCost) else cost_measured_k([w.window for w in part.cost]))
