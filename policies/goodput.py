"""``goodput``: the policy spectune ships — model-based choice of k that maximises emitted tokens per second.

Vocabulary as in ``telemetry/records.py`` (a round emits ``accepted + 1`` tokens per row; goodput is emitted
tokens per wall second for the whole batch). Expected tokens per round follow Leviathan et al. 2023
(arXiv:2211.17192) eq. 1 in its general form, ``1 + sum_i P(accepted >= i)``, with the per-position acceptance
curve learnt as Beta posteriors (:mod:`policies._acceptance`). Round seconds come from a non-negative model of
the work in a round, shared across buckets (:mod:`policies._cost`): at high batch the verify cost grows with
``k + 1`` and speculation can lose, so k = 0 is always a candidate.

Request types share batches, so k is chosen jointly for them (:func:`policies.analytic.batch_goodput`, with
the recent request mix of the context bucket); a bucket's k is its type's entry in that joint choice. At batch
bucket 1 a round holds one row, so each type is scored on its own rounds (:func:`policies.analytic.solo_goodput`:
a type's requests need their tokens whatever k is, and a k that shortens its rounds but emits less per round makes
them take more rounds). A round
runs draft steps up to its largest k, and under packed verification (``packed=True``, the reference engine and
any engine that verifies only the tokens each row drafted) every token a row does not draft is saved, at the
cost model's seconds per drafted token: types that accept well draft deep while the others stay shallow or
plain. With ``packed=False`` a round costs what its largest k costs (engines that pad rows to one length).

A round is costed at its longest row's context, so the rows sharing a cell's rounds are not the rows whose
acceptance that context bucket learnt (a batch of short rows beside one long prompt is decided in the long cell).
What each cell's rounds emitted at each k corrects the acceptance model's prediction there
(:mod:`policies._emitted`): a level for the cell, then each measured k from its own measurement.

The incumbent k changes only when the posterior-mean gain exceeds ``switch_margin`` plus ``noise_z`` standard errors
of the cell's measured difference in cost between the two ks (windows scatter; a gain inside their scatter is not
followed), and then holds for ``hold_decisions`` (vLLM issue #49548: K flipping 2 <-> 0 collapses throughput);
turning speculation off needs ``off_margin`` and a measurement of k = 0 in that cell (switching
back on costs the draft a catch-up of every token it missed). Exploration is Thompson sampling over the
acceptance posteriors and the seconds of ks a cell was never measured at: when a draw favours the incumbent
moved up or down (every type that drafts by the same step, within ``explore_radius``) by ``explore_margin``, that
is served for one decision (measured, not adopted), never turning a type off and never from a cell that is off;
each exploration of a measured k the mean does not follow doubles the gain the next draw of one must promise
once the mean puts that k a standard error behind, until a switch or an acceptance drift starts it over
(exploration stops in a settled cell). Draws sample a measured k's seconds within their standard error too. The
mean's best is adopted only at a largest k the cell has measured: a better k beyond them is served once first. A
cell seen at one k only, beyond the batch/context range the cost model has measured, is probed once at a
second k; a cell that is off is re-probed every ``probe_every`` decisions. A model update shows up as new
versions in the bucket; their acceptance starts from the previous version's type curve with a small
pseudo-count.

With ``tail_weight`` the choices are scored by goodput times the slowest request type's token rate relative to its
best, to that power: TPOT p99 is set by the requests that accept least.

The decision for a cell is an ordered list of small rules, each ``(cell state, estimate) -> choice or None``:
the first that answers picks the ks the cell serves (first decision, hold, probe k = 0, switch, explore, keep
the incumbent), then the measurement overrides run in order and may replace it (a cost probe, a re-probe after
a long stretch off). Each answer carries a :class:`~policies.base.DecisionKind`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies._acceptance import AcceptanceModel, Versions
from policies._cost import CostModel
from policies._emitted import EmittedCalibration
from policies.analytic import batch_goodput, emitted_by_k, slowest_type_seconds_per_token, solo_goodput, tail_weighted
from policies.base import Decision, DecisionKind, Policy, Window
from telemetry.records import AcceptanceWindow, Bucket, Cell, CostWindow

MIN_TYPE_WEIGHT = 0.02  # a type absent from the recent mix still gets a say (it is being asked about)
MAX_REPROBE_DOUBLINGS = 4  # a cell whose re-probes (re-checks) keep confirming off (on) waits up to 16x probe_every
# The jump in cost at k > 0 is measured (a cost probe at k = 0) only in a cell where the posterior mean puts k = 0
# within this share of the best k > 0. Where k = 0 is far behind (batch 1 on a memory-bound target: 0.43-0.46 of
# the best in the simulator's cold starts) its measurement cannot change a choice and costs a window at half speed;
# the jump is then measured in the first cell where speculation off is a contender (larger batches).
K0_PROBE_WITHIN = 0.25
TRIM_FROM_ROUNDS = 4  # cost windows of at least this many rounds drop their slowest round (see _observe)
# Exploration of a measured k slows down (explore_doublings) only once the mean puts it this many standard errors of
# the measured difference behind the incumbent: "settled" by the confidence interval, not by a count of tries.
SETTLED_Z = 1.0
# A smaller batch bucket's incumbent caps the larger ones (batch_cap) once its k is measured there in this many
# windows: the cost model's prior pseudo-windows are 2, so at 4 the cell's own rounds outweigh the shared fit.
CAP_WINDOWS = 4.0
# explore_off: a cell that is on re-checks k = 0 (GoodputPolicy._recheck_off) until k = 0 has this many windows of its
# own evidence: twice the cost model's prior pseudo-windows, so the cell's rounds outweigh the shared fit 2:1.
OFF_EVIDENCE_WINDOWS = 4.0
# Kinds that serve something other than the incumbent, to measure it.
EXPLORING_KINDS = frozenset({DecisionKind.EXPLORE, DecisionKind.PROBE, DecisionKind.PROBE_OFF, DecisionKind.REPROBE})



@dataclass(slots=True)
class _Cell:
    """What the policy keeps per cost cell. One choice covers every request type sharing the cell's batches."""

    incumbent: dict[str, int] = field(default_factory=dict)  # type -> k that exploitation serves
    served: dict[str, int] = field(default_factory=dict)  # type -> k served this epoch (incumbent, probe or draw)
    kind: DecisionKind = DecisionKind.FIRST  # the rule that chose ``served``
    reason: str = ""  # the same, for people
    expected: dict[int, float] = field(default_factory=dict)  # k -> posterior-mean goodput with one shared k
    hold: int = 0  # decisions left before the incumbent may change again
    off: int = 0  # consecutive decisions that served speculation off
    reprobes: int = 0  # re-probes since the cell was last on by choice: each doubles the wait before the next
    on: int = 0  # consecutive decisions that served speculation on (``explore_off``)
    rechecks: int = 0  # off re-checks since the incumbent last changed: each doubles the wait before the next
    explored: int = 0  # draws of measured ks served since the incumbent last changed: each doubles the next margin
    probed: bool = False  # the cell's one cost probe has been served
    epoch: int = -1  # windows observed when ``served`` was chosen: one choice per cell per batch of windows


@dataclass(frozen=True)
class _Estimate:
    """What a decision for one cell knows: the request types sharing its batches and the score of each joint choice
    (goodput; weighed by the slowest type's token rate under ``tail_weight``)."""

    bucket: Bucket
    types: tuple[str, ...]  # request types of the cell, sorted: the columns of ``combos``
    combos: np.ndarray  # [C, T] joint ks, one column per type
    g_mean: np.ndarray  # [C] posterior-mean score of each joint choice
    g_shared: np.ndarray  # [K + 1] posterior-mean score with one k for every type
    g_draw: np.ndarray  # [C] a Thompson draw of g_mean
    g_draw_shared: np.ndarray  # [K + 1] the same draw with one k for every type

    @property
    def best(self) -> tuple[int, ...]:
        """The posterior mean's best joint ks."""
        return tuple(int(x) for x in self.combos[int(np.argmax(self.g_mean))])

    @property
    def best_on(self) -> int:
        """The posterior mean's best k > 0 shared by every type."""
        return int(np.argmax(self.g_shared[1:]) + 1)

    def index(self, ks: tuple[int, ...]) -> int:
        """Row of ``combos`` holding the joint ks ``ks``; the nearest row (L1) when the grid cannot hold them: with
        many types the grid is one shared k per row, while incumbents kept from fewer types may differ per type."""
        return int(np.argmin(np.abs(self.combos - np.array(ks)).sum(axis=1)))  # [C] distances; 0 on an exact row

    def shared(self, k: int) -> tuple[int, ...]:
        """One k for every type."""
        return (k,) * len(self.types)


@dataclass(frozen=True)
class _CellDecision:
    """A rule's answer for a whole cell: one k per type of the estimate."""

    kind: DecisionKind
    ks: tuple[int, ...]
    reason: str


Rule = Callable[[_Cell, _Estimate], _CellDecision | None]


class GoodputPolicy(Policy):
    """Bayesian acceptance x learnt cost -> k per bucket, maximising batch goodput.

    Args:
        k_max: see :class:`~policies.base.Policy`.
        seed: Thompson sampling seed.
        objective: ``"goodput"`` (tokens/s) or ``"latency"`` (same objective, restricted to k whose predicted
            round seconds keep per-token p99 latency under ``latency_p99_s``; k = 0 always allowed).
        latency_p99_s: p99 per-token latency bound for ``"latency"``; a row may emit only one token in a round,
            so the bound applies to round seconds.
        switch_margin: relative expected gain required to change k (1%: at batch 64 on the xl calibration the
            best joint ks are often 1-3% apart, and 3% left goodput at 0.945 of the oracle against 0.977; turning
            speculation off is guarded by ``off_margin`` and ``hold_decisions`` instead).
        off_margin: relative expected gain required to turn speculation off (switching it back on costs the
            draft a catch-up of every token it missed).
        explore_radius: Thompson exploration tries ks within this distance of the incumbent (never 0).
        explore_margin: relative gain a Thompson draw must promise over the incumbent's draw before its ks are served
            to measure them (5%). A k measured in a few windows keeps a draw spread of a few percent, so at a 1%
            margin some neighbour wins a draw in 15-50% of a settled cell's decisions, each served at a k
            the mean puts behind: the demo's learned run spent 62 of 176 decisions exploring, and a steady cell whose
            neighbours lie 2-4% behind its best explored in 38 of 120 late decisions (5% margin: 11;
            ``tests/policies/test_goodput.py``). A draw promising 5% is an unmeasured k (10% spread) or a real doubt;
            a smaller gain the mean adopts by itself (``switch_margin``) once measurements show it. In the simulator
            (seeds 0-2) goodput / oracle went from 0.9835 / 0.9881 / 0.9886 at 1% to 0.9891 / 0.9911 / 0.9925, k
            changes per 1,000 rounds from 16 to 7-8; 3% gave 0.9865 / 0.9902 / 0.9894.
        hold_decisions: decisions to keep k after a change.
        probe_every: decisions with speculation off before one exploratory decision with it on.
        prior_mean, bucket_strength, type_strength, version_strength, acceptance_decay, level_strength,
            mix_rows: see :class:`~policies._acceptance.AcceptanceModel`. The request mix a cell is decided with
            is recent traffic: about the context bucket's last ``mix_rows`` rows (1,000: a few seconds of batch-4
            traffic). Before, each type's rows faded only with windows of its own type, so the demo's
            structured-heavy phase at batch 4 (80% structured) was decided on the peak phase's even mix (batch
            48), as 30% structured.
        cost_prior_windows, refit_every: see :class:`~policies._cost.CostModel`.
        slope_cells: once this many cells have been seen at two or more k, a new cell seen at one k that lies
            within their batch and context range is not probed: it borrows the shared slope in k (the point of a
            shared cost model). A cell beyond that range is probed once.
        packed: the engine verifies only the tokens each row drafted, so a row drafting less than the round's
            largest k saves its share (see the module docstring).
        reopen_rows: after an acceptance drift (:meth:`~policies.base.Policy.reopen`) the bucket keeps at most this
            many rows of its old evidence: its Thompson draws widen and the new level outweighs the old in a few
            windows.
        one_k_per_batch: the engine runs one k for the whole batch (vLLM: its scheduler sets one
            ``num_spec_tokens`` per step), so every request type of a cell is given the same k, costed as a round
            in which every row drafts it. Per-type ks would be folded by the engine into one k the policy never
            chose or costed. Except at batch bucket 1: a round of one row runs that row's k, so there each type
            keeps its own. One k there served code and prose alike at k = 5 on ``bench vllm``, where static k = 3
            matched its throughput and the TPOT p99 of the batch-1 phases was above 1.10x static k = 3's in five of
            six over three runs (a row that accepts little pays for five drafts it does not keep). Per type, prose
            took k = 3 and code and structured k = 5, and a batch-1 load went from 0.916x to 1.006x static k = 5
            (``bench/results/vllm-c1-*.json``, one run each). Each type there is scored on its own rounds
            (:func:`~policies.analytic.solo_goodput`, for every engine). A type new to a cell decided without
            exploration (the sidecar's quiet cells) joins the cell's k (the lower median of its incumbents, the
            engine's batch rule): on ``bench vllm`` at 5e61327 types that reached a cell at different times held
            code 1, prose 3 and structured 1 in batch 16 at <=2048, and the cap of batch 32 took prose's 3.
        noise_z: standard errors of the measured difference in cost between the incumbent's k and the new best
            that a switch must clear on top of its margin (see :meth:`_margin`); 0 switches on the margins alone.
        explore_doublings: exploration that stops. Each Thompson exploration of a measured k that leaves the
            incumbent standing doubles the gain the next draw of a measured k must promise (``explore_margin`` times
            2, 4, ... up to ``2 ** explore_doublings``; a k the cell has barely run keeps the plain margin); a
            switch or an acceptance drift (:meth:`~policies.base.Policy.reopen`) starts it over, not the clock. 0
            keeps ``explore_margin`` for good (see :meth:`_explore`).
        cost_draws: Thompson draws sample a measured k's seconds within their standard error too (see
            :class:`~policies._cost.CostModel`, ``draw_measured``); False draws only unmeasured ks' seconds and the
            acceptance.
        batch_cap: a cell never drafts deeper than the settled incumbent of a smaller batch bucket of the same
            versions and context bucket (:meth:`_cap`). With one k per batch a round verifies ``batch x (k + 1)``
            tokens while a draft step's cost hardly grows with the batch, so for the same traffic a larger batch
            is never served better at a deeper k: the rule the exported schedules follow
            (:func:`controller.offline.project.non_increasing`). Only a settled choice caps (:meth:`_cap` says
            when). The cap lowers an incumbent above it at once, masks the mean's and the draws' choices, and
            bounds the probes.
        explore_off: a cell that is on re-measures speculation off while its k = 0 rests on little evidence (see
            :meth:`_recheck_off`), the mirror of ``_reprobe``. For an engine where turning the draft off and on
            again costs little (vLLM under spectune's lazy draft sync: the catch-up is one batched pass of a small
            draft). False (the default) keeps k = 0 to the mean and the one cost probe, as the reference engine's
            catch-up costs a window.
        cost_speed_memory: the cost model's machine-speed normalisation (:class:`~policies._cost.CostModel`,
            ``speed_memory``): windows voting on the machine's current slowness; 0 learns raw seconds. vLLM's
            sidecar sets 0. The slowness is each window's seconds over a prediction built from windows already
            divided by earlier slowness estimates, so it has no anchor and walks. Replayed in order into this
            policy, the telemetry of ``bench vllm`` at 35545ee (2,429 cost windows) left batch 16 <=2048 predicted at
            42 ms a step at k = 3 and 34 ms at k = 5, against 215 and 242 ms measured there in 249 and 205 windows
            (the final slowness was 1.1-1.4; the windows' divisors had wandered), and batch 8 <=512 predicted
            cheaper at every deeper k. With raw seconds the same replay predicts 213 and 241 ms. The reference
            engine keeps 3 until it is re-measured without it.
        tail_weight: weighs each choice's goodput by the slowest request type's token rate relative to its best
            (:func:`~policies.analytic.tail_weighted`): the score is ``goodput * (best / this choice's slowest
            seconds per token) ** tail_weight``. A request's TPOT is its rounds' seconds over the tokens it keeps,
            so the type that accepts least sets the tail, and a deeper k at a large batch makes every row's round
            dearer while that type keeps little more. Replayed into this policy, the telemetry of ``bench vllm`` at
            6eb06ce (``bench/results/vllm-6eb06ce-run1-telemetry.sqlite.gz``) puts batch 16 at <=2048 at goodput
            0.943 / 0.989 / 1.0 for k = 0 / 1 / 2, and prose's seconds per token at 1.0 / 1.08 / 1.19: a 1-6% gain
            inside the cost model's error for a tail 8-19% slower, and there the run's TPOT p99 was 1.27x the
            phase's best static (k = 0) while the phase's tokens per second matched it. At 1 the same replay
            serves that cell k = 0 and keeps k = 3 at batch 4 <=512 (goodput +9% for a tail 8.5% slower). At batch
            bucket 1 each type runs its own k, so the slowest type's own best is the weight's reference and the
            others are free to draft deep. 0 (the default) is goodput alone; vLLM's sidecar sets 1.
    """

    name = "goodput"

    def __init__(self, k_max: int = 8, seed: int = 0, objective: str = "goodput", latency_p99_s: float | None = None,
                 switch_margin: float = 0.01, hold_decisions: int = 3, probe_every: int = 50,
                 prior_mean: float = 0.6, bucket_strength: float = 30.0, type_strength: float = 60.0,
                 version_strength: float = 10.0, acceptance_decay: float = 0.995, cost_prior_windows: float = 2.0,
                 refit_every: int = 16, slope_cells: int = 2, off_margin: float = 0.10,
                 explore_radius: int = 2, packed: bool = True, reopen_rows: float = 10.0,
                 one_k_per_batch: bool = False, level_strength: float = 10.0, mix_rows: float = 1000.0,
                 explore_margin: float = 0.05, noise_z: float = 1.0, explore_doublings: int = 3,
                 cost_draws: bool = True, batch_cap: bool = False, explore_off: bool = False,
                 cost_speed_memory: int = 3, tail_weight: float = 0.0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        if objective not in ("goodput", "latency"):
            raise ValueError(f"objective must be 'goodput' or 'latency', got {objective!r}")
        if objective == "latency" and (latency_p99_s is None or latency_p99_s <= 0):
            raise ValueError("objective='latency' needs latency_p99_s > 0")
        if (switch_margin < 0 or off_margin < 0 or explore_margin < 0 or hold_decisions < 0 or probe_every < 1
                or explore_radius < 1 or not noise_z >= 0 or explore_doublings < 0 or not tail_weight >= 0):
            raise ValueError("switch_margin, off_margin, explore_margin, hold_decisions, noise_z, explore_doublings, "
                             "tail_weight must be >= 0; probe_every, explore_radius >= 1")
        if reopen_rows < 0:
            raise ValueError(f"reopen_rows must be >= 0, got {reopen_rows}")
        self.off_margin, self.explore_radius, self.explore_margin = off_margin, explore_radius, explore_margin
        self.objective, self.latency_p99_s = objective, latency_p99_s
        self.switch_margin, self.hold_decisions, self.probe_every = switch_margin, hold_decisions, probe_every
        self.slope_cells, self.packed, self.reopen_rows = slope_cells, packed, reopen_rows
        self.one_k_per_batch, self.noise_z, self.explore_doublings = one_k_per_batch, noise_z, explore_doublings
        self.batch_cap, self.explore_off, self.tail_weight = batch_cap, explore_off, tail_weight
        self._acc = AcceptanceModel(max(k_max, 1), prior_mean, bucket_strength, type_strength, version_strength,
                                    acceptance_decay, level_strength, mix_rows)
        self._cost = CostModel(k_max, cost_prior_windows, refit_every, draw_measured=cost_draws,
                               speed_memory=cost_speed_memory)
        # What each cost cell's rounds emitted: corrects the acceptance model for the rows that share the cell's
        # rounds (a round is costed, and decided, at its longest row's context; see policies/_emitted.py).
        self._emitted = EmittedCalibration(cost_prior_windows, acceptance_decay)
        self._cells: dict[Cell, _Cell] = {}
        # cell -> (windows observed, the cap, the mean's best ks per type, expected goodput per shared k): every
        # bucket of a quiet cell asks for the same answer, so one evaluation serves them all until a window arrives
        self._best: dict[Cell, tuple[int, int, dict[str, int], dict[int, float]]] = {}
        # What a cell serves: the first of these rules that answers (the last one always does).
        self._rules: tuple[Rule, ...] = (self._first, self._hold, self._probe_off, self._switch, self._explore,
                                         self._keep)
        # Then, in order, measurements that override what the rules chose (each sees what the cell serves so far).
        self._overrides: tuple[Rule, ...] = (self._cost_probe, self._reprobe, self._recheck_off)

    # ----------------------------------------------------------------------------------------- learning
    def _observe(self, window: Window) -> None:
        if isinstance(window, AcceptanceWindow):
            self._acc.observe(window)
        elif isinstance(window, CostWindow) and window.max_k <= self.k_max:
            w = window
            rounds, rows = w.rounds, w.batch_rows
            drafted = float(w.tokens_verified - w.batch_rows)  # packed verification: rows draft their own k
            self._emitted.observe(Cell(w.target_version, w.draft_version, w.batch_bucket, w.context_bucket),
                                  w.max_k, rounds, rows, drafted, w.emitted)
            parts = [w.draft_s.total, w.verify_s.total, w.other_s.total]
            if rounds >= TRIM_FROM_ROUNDS:
                # The slowest round of a window is set aside: after speculation was off the first round at k > 0
                # feeds the draft every token it missed — a one-time cost of switching on, not the cost of k.
                # Kept in, it makes k look dear after every stretch at k = 0 and keeps speculation off.
                parts = [st.total - st.max for st in (w.draft_s, w.verify_s, w.other_s)]
                drafted -= drafted / rounds
                rows -= round(rows / rounds)
                rounds -= 1
            self._cost.observe(w.batch_bucket, w.context_bucket, w.max_k, rounds, rows, parts[0], parts[1], parts[2],
                               drafted=drafted)

    def _reopen(self, target_version: str, draft_version: str, request_type: str, context_bucket: str) -> None:
        """Acceptance drifted in (versions, type, context): shrink that bucket's evidence to ``reopen_rows`` rows,
        and let each cell of those versions and context bucket decide afresh at the next decision (no hold left,
        its cost probe allowed again): a widened draw can be served and the mean may switch at once."""
        self._acc.forget((target_version, draft_version), request_type, context_bucket, self.reopen_rows)
        # A cell's rounds hold rows of every context up to its own: what they emitted before the drift is stale in
        # every cell of these versions.
        self._emitted.forget((target_version, draft_version))
        self._best.clear()
        for (t, d, _bb, ctx), cell in self._cells.items():
            if (t, d, ctx) == (target_version, draft_version, context_bucket):
                cell.hold, cell.probed, cell.epoch, cell.reprobes, cell.explored = 0, False, -1, 0, 0
                cell.rechecks = 0

    def _forget(self, request_type: str | None, versions: tuple[str, str] | None) -> None:
        self._acc.drop(request_type, versions)
        if versions is not None:
            self._emitted.forget(versions)
        self._best.clear()
        for key in [key for key in self._cells if versions is not None and key[:2] == versions]:
            del self._cells[key]
        if request_type is not None:
            for cell in self._cells.values():
                cell.incumbent.pop(request_type, None)
                cell.served.pop(request_type, None)

    # ----------------------------------------------------------------------------------------- deciding
    def _cap(self, bucket: Bucket) -> int:
        """The deepest k the bucket's cell may serve (``batch_cap``); ``k_max`` when no smaller cell caps it.

        The smaller batch buckets of its versions and context bucket are walked from the smallest up. One caps
        the larger ones at its incumbent (its deepest type's k) when that k is its own settled choice: not holding
        after a switch, measured there in ``CAP_WINDOWS`` windows, the next deeper k measured there too (in the
        cost model's ``prior_windows``: the cell could have gone deeper and kept its k), and below the cap of the
        cells under it (one at its own cap adds nothing: what caps it caps the larger ones too, and a k forced
        down by a cap is not evidence). So neither a guess nor a cap's own consequence cascades up the batches.
        """
        cap = self.k_max
        if not self.batch_cap:
            return cap
        here = (bucket.target_version, bucket.draft_version, bucket.context_bucket)
        smaller = sorted((bb, cell) for (t, d, bb, ctx), cell in self._cells.items()
                         if (t, d, ctx) == here and bb < bucket.batch_bucket and cell.incumbent)
        for bb, cell in smaller:
            k = max(cell.incumbent.values())
            n = self._cost.windows(bb, bucket.context_bucket)
            if (k < cap and cell.hold <= 0 and n.get(k, 0.0) >= CAP_WINDOWS
                    and n.get(k + 1, 0.0) >= self._cost.prior_windows):
                cap = k
        return cap

    @staticmethod
    def _lower(cell: _Cell, cap: int) -> None:
        """An incumbent deeper than the cap comes down to it."""
        for t, k in cell.incumbent.items():
            if k > cap:
                cell.incumbent[t] = cap

    def _evaluate(self, bucket: Bucket, types: list[str], weights: np.ndarray,
                  rng: np.random.Generator | None, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Joint combos ``[C, T]``, their score ``[C]``, the shared-k score ``[K + 1]`` and the shared-k goodput
        ``[K + 1]``. The score is goodput, weighed by the slowest type's token rate under ``tail_weight``; a choice
        deeper than ``cap`` scores ``-inf``."""
        vd: Versions = (bucket.target_version, bucket.draft_version)
        cond = self._acc.conds(vd, types, bucket.context_bucket, rng)  # [T, K]
        emitted = self._emitted.adjust(bucket.cell, emitted_by_k(cond[:, : self.k_max]), weights, rng)  # [T, K+1]
        b = self._cost.mean_batch(bucket.batch_bucket, bucket.context_bucket)
        secs = self._cost.predict(bucket.batch_bucket, bucket.context_bucket, b, rng).sum(axis=1)  # [K+1]
        if bucket.batch_bucket == 1:  # one row per round: each type runs alone at its own k (see solo_goodput)
            combos, g = solo_goodput(emitted, weights, secs)
            _, g_shared = solo_goodput(emitted, weights, secs, shared_k=True)
        else:
            shared = self.one_k_per_batch  # the engine runs one k for the rows of a round
            packed = self.packed and not shared
            per_token = self._cost.per_token(bucket.batch_bucket, bucket.context_bucket) if packed else 0.0
            combos, g = batch_goodput(emitted, weights, b, secs, shared_k=shared, per_token_s=per_token)
            _, g_shared = batch_goodput(emitted, weights, b, secs, shared_k=True)
        if self.objective == "latency" and self._cost.fitted:
            assert self.latency_p99_s is not None
            allowed = (secs <= self.latency_p99_s) | (np.arange(secs.size) == 0)
            g = np.where(allowed[combos.max(axis=1)], g, -np.inf)
            g_shared = np.where(allowed, g_shared, -np.inf)
        if cap < self.k_max:
            g = np.where(combos.max(axis=1) <= cap, g, -np.inf)
            g_shared = np.where(np.arange(g_shared.size) <= cap, g_shared, -np.inf)
        expected = g_shared
        if self.tail_weight > 0 and self._cost.fitted:
            present = weights > MIN_TYPE_WEIGHT  # [T] types with more than the floor's share of recent rows
            solo = bucket.batch_bucket == 1
            shared_combos = np.repeat(np.arange(g_shared.size)[:, None], len(types), axis=1)  # [K+1, T]
            g = tail_weighted(g, slowest_type_seconds_per_token(combos, emitted, secs, present, solo),
                              self.tail_weight)
            g_shared = tail_weighted(g_shared, slowest_type_seconds_per_token(shared_combos, emitted, secs, present,
                                                                              solo), self.tail_weight)
        return combos, g, g_shared, expected

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        b = bucket
        key = b.cell
        mix = self._acc.mix((b.target_version, b.draft_version), b.context_bucket)
        total = sum(mix.values())
        types = sorted(set(mix) | {b.request_type})
        w = np.array([max(mix.get(t, 0.0) / total if total else 0.0, MIN_TYPE_WEIGHT) for t in types])
        cell = self._cells.get(key)
        if explore and cell is not None and cell.epoch == self._n_windows and b.request_type in cell.served:
            return self._result(cell, b.request_type)  # one decision per cell per batch of windows
        cap = self._cap(b)
        if not explore:  # the incumbent, not a probe or draw served this epoch
            # A type without an incumbent adopts the posterior mean's best, which then stays its incumbent: a
            # quiet cell keeps its last k while the shared cost model moves with other cells' traffic.
            if cell is None:
                cell = self._cells[key] = _Cell()
            cached = self._best.get(key)
            if cached is not None and cached[:2] == (self._n_windows, cap) and b.request_type in cached[2]:
                _, _, best, expected = cached
            else:
                combos, g_mean, _, g_expected = self._evaluate(b, types, w, None, cap)
                expected = {k: float(v) for k, v in enumerate(g_expected) if np.isfinite(v)}
                best = dict(zip(types, (int(k) for k in combos[int(np.argmax(g_mean))]), strict=True))
                self._best[key] = (self._n_windows, cap, best, expected)
            new = {t: k for t, k in best.items() if t not in cell.incumbent}
            if new and cell.incumbent and self.one_k_per_batch and b.batch_bucket != 1:
                # One k per step: a type new to the cell joins the k its batches run, not the mean's best of the
                # moment beside the others' incumbents (see one_k_per_batch).
                held = sorted(cell.incumbent.values())
                new = dict.fromkeys(new, held[(len(held) - 1) // 2])
            cell.incumbent.update(new)
            self._lower(cell, cap)
            ks = cell.incumbent
            return Decision(k=int(ks[b.request_type]), expected_goodput=dict(expected),
                            reason="current best, no exploration", kind=DecisionKind.BEST)
        combos, g_mean, g_shared, g_expected = self._evaluate(b, types, w, None, cap)
        expected = {k: float(v) for k, v in enumerate(g_expected) if np.isfinite(v)}
        _, g_draw, g_draw_shared, _ = self._evaluate(b, types, w, self._rng, cap)  # Thompson draw (same combos)
        if cell is None:
            cell = self._cells[key] = _Cell()
        self._lower(cell, cap)
        est = _Estimate(b, tuple(types), combos, g_mean, g_shared, g_draw, g_draw_shared)
        self._serve(cell, est, next(d for rule in self._rules if (d := rule(cell, est)) is not None), cap)
        for override in self._overrides:
            d = override(cell, est)
            if d is not None:
                self._serve(cell, est, d, cap)
        cell.epoch = self._n_windows
        cell.expected = expected
        return self._result(cell, b.request_type)

    @staticmethod
    def _serve(cell: _Cell, est: _Estimate, d: _CellDecision, cap: int) -> None:
        """Serve a rule's answer; no type deeper than the cap (a probe's or a first guess's k is not masked)."""
        cell.served = dict(zip(est.types, (min(k, cap) for k in d.ks), strict=True))
        GoodputPolicy._lower(cell, cap)  # a first decision's ks were adopted before the clamp
        cell.kind, cell.reason = d.kind, d.reason

    @staticmethod
    def _result(cell: _Cell, rtype: str) -> Decision:
        return Decision(k=int(cell.served[rtype]), expected_goodput=dict(cell.expected),
                        exploring=cell.kind in EXPLORING_KINDS, reason=cell.reason, kind=cell.kind)

    # ----------------------------------------------------------------------------------------- rules
    @staticmethod
    def _incumbent(cell: _Cell, est: _Estimate) -> tuple[int, ...]:
        return tuple(cell.incumbent[t] for t in est.types)

    def _margin(self, bucket: Bucket, k_from: int, k_to: int) -> float:
        """Relative gain a switch from ``k_from`` to ``k_to`` (a round's largest k) must promise.

        ``switch_margin`` (``off_margin`` to turn speculation off), plus ``noise_z`` standard errors of the
        difference between the two ks' measured seconds in this cell: each k's error is the cell's window spread
        (:meth:`~policies._cost.CostModel.spread`) over the square root of its evidence in windows (plus the
        shared fit's pseudo-windows, which is what its prediction blends in). A gain inside that error is the
        windows' scatter, not cost: followed, the incumbent moves with it (a steady cell with 20% window scatter:
        11 switches over four seeds at ``noise_z = 0``, 3 at 1; ``tests/policies/test_goodput.py``). It does not
        damp exploration: on ``bench vllm`` at c8b76bd most of the 270 tables were one-decision Thompson
        explorations and the return from them (``explore_margin`` and ``explore_doublings`` govern those).
        """
        base = self.off_margin if k_to == 0 < k_from else self.switch_margin
        if self.noise_z == 0.0 or k_from == k_to:
            return base
        return base + self.noise_z * self._diff_se(bucket, k_from, k_to)

    def _diff_se(self, bucket: Bucket, k_a: int, k_b: int) -> float:
        """Relative standard error of the measured difference in seconds between ``k_a`` and ``k_b`` in the cell:
        its window spread times the root of the two ks' inverse evidence (windows plus the fit's pseudo-windows)."""
        bb, ctx = bucket.batch_bucket, bucket.context_bucket
        n, tau = self._cost.windows(bb, ctx), self._cost.prior_windows
        return self._cost.spread(bb, ctx) * float(np.sqrt(1.0 / (n.get(k_a, 0.0) + tau)
                                                          + 1.0 / (n.get(k_b, 0.0) + tau)))

    def _beats_incumbent(self, cell: _Cell, est: _Estimate) -> bool:
        """The posterior mean's best beats the incumbent by the margin of that switch."""
        cur = self._incumbent(cell, est)
        margin = self._margin(est.bucket, max(cur), max(est.best))
        return bool(est.g_mean.max() > est.g_mean[est.index(cur)] * (1.0 + margin))

    def _first(self, cell: _Cell, est: _Estimate) -> _CellDecision | None:
        """A type without an incumbent: every type of the cell adopts the posterior mean's best."""
        if all(t in cell.incumbent for t in est.types):
            return None
        seen = self._cost.ks_seen(est.bucket.batch_bucket, est.bucket.context_bucket)
        top = max(seen, default=0)  # the largest k the cell's own rounds ran
        ks, reason = est.best, "first decision"
        if max(ks) == 0 and not (0 in seen and top > 0):
            # Off on the shared fit alone is a guess: what a round costs once speculation is on (a multi-token
            # verify, the draft) over what a plain step costs is the part of the cost the fit transfers worst
            # between batch sizes. Measured (the demo, batch 2): the fit put k = 2 at 2.3x a plain round, the
            # cell's own rounds at 1.13x, and the cell went off at first sight and lost 24% to static k = 3 there.
            # Off is decided on this cell's measurements of both (``_probe_off`` then ``_switch``).
            ks, reason = est.shared(est.best_on), "first decision (on until measured)"
        if top > 0 and max(ks) > top:
            # Deeper than the cell ever ran: adopted only once measured, as a switch would be (served once first).
            largest = est.combos.max(axis=1)  # [C]
            i = int(np.argmax(np.where((largest <= top) & (largest > 0), est.g_mean, -np.inf)))
            ks, reason = tuple(int(x) for x in est.combos[i]), f"first decision (within k={top}, measured)"
        cell.incumbent.update(zip(est.types, ks, strict=True))
        return _CellDecision(DecisionKind.FIRST, ks, reason)

    def _hold(self, cell: _Cell, est: _Estimate) -> _CellDecision | None:
        """After a switch the incumbent stays for ``hold_decisions``: k flipping collapses throughput (vLLM #49548)."""
        if cell.hold <= 0:
            return None
        cell.hold -= 1
        return _CellDecision(DecisionKind.HOLD, self._incumbent(cell, est), "holding after a switch")

    def _probe_off(self, cell: _Cell, est: _Estimate) -> _CellDecision | None:
        """The mean says turn speculation off, but k = 0 was never measured in this cell: measure it once first.

        Off on a predicted cost alone is a guess, and switching back on costs the draft a catch-up.
        """
        bb, ctx = est.bucket.batch_bucket, est.bucket.context_bucket
        if max(est.best) > 0 or 0 in self._cost.ks_seen(bb, ctx) or not self._beats_incumbent(cell, est):
            return None
        return _CellDecision(DecisionKind.PROBE_OFF, est.best, "probe k=0 before turning speculation off")

    def _switch(self, cell: _Cell, est: _Estimate) -> _CellDecision | None:
        """The posterior mean's best beats the incumbent by the margin: adopt it, then hold (no flapping).

        Only the mean switches: a lucky Thompson draw is served once (explore), never adopted.
        """
        if not self._beats_incumbent(cell, est):
            return None
        top = max(est.best)
        if top > 0 and top not in self._cost.ks_seen(est.bucket.batch_bucket, est.bucket.context_bucket):
            # The gain rests on an extrapolated cost: serve it once to measure it; adopting it (and holding it)
            # waits for the measurement. A cold cell's cost fit cannot yet tell a draft step's fixed cost from
            # its per-row cost, and a switch held on that guess cost 3 windows at 0.82 of the oracle.
            return _CellDecision(DecisionKind.EXPLORE, est.best, f"try k={top} before switching: cost unmeasured")
        cell.incumbent.update(zip(est.types, est.best, strict=True))
        cell.hold, cell.explored, cell.rechecks = self.hold_decisions, 0, 0
        if max(est.best) == 0:
            return _CellDecision(DecisionKind.OFF, est.best, "switch off: expected gain above off_margin")
        return _CellDecision(DecisionKind.SWITCH, est.best, "switch: expected gain above margin")

    def _explore(self, cell: _Cell, est: _Estimate) -> _CellDecision | None:
        """A Thompson draw favours the incumbent moved up or down by ``explore_margin``: serve it once to measure it.

        The candidates move every type that drafts by the same step, within ``explore_radius``: the types keep
        their order (one that accepts well stays deeper than one that does not), so a measurement of another
        largest k costs what that k costs, not what one shared k for every type would (at batch 4 a shared k
        served a structured/prose mix at 0.82-0.91 of the oracle). Only those few candidates compete: the best of
        every joint choice within the radius would win by its draw's noise alone and explore without end.
        Never k = 0: turning the draft off and on costs a catch-up of every token it missed, so k = 0 is reached by
        the mean (with ``off_margin``) or by a cost probe, not by a lucky draw. For the same reason a cell that is
        off is not explored by draws: it is re-probed every ``probe_every`` decisions, or switched back on by the
        mean. The incumbent stays; the next decision switches only if the measurement moved the mean.

        Each exploration the mean did not follow is evidence the choice is settled: the next draw of a k the cell
        has measured (at least the cost model's ``prior_windows`` of evidence) and that the mean puts at least
        ``SETTLED_Z`` standard errors of their measured difference behind the incumbent must promise twice the
        gain (up to ``2 ** explore_doublings`` times ``explore_margin``). Without that a cell whose neighbours lie
        a few percent behind keeps serving them on its draws' noise for as long as it runs: at c8b76bd most of
        ``bench vllm``'s 270 published tables were such one-decision explorations and the return from them. A k
        the cell has barely run keeps the plain margin and is not counted: it is being measured, not doubted (at
        8843a5d, which doubled for every k, the vLLM cells' alternatives were left at 0.2-1.2 windows of evidence
        and the run gave 0.941x static k = 3); so does a k whose gap to the incumbent is inside the error (with
        c39cacb's policy, k = 3 at batch 4 stopped after 5 windows reading 8% behind k = 4, with an error of about
        10%, while an engine held at k = 3 beside it measured 12% ahead). A switch or an acceptance drift starts it
        over (the drift alert, not the clock, re-opens exploration).
        """
        cur = self._incumbent(cell, est)
        if max(cur) == 0:
            return None
        here = np.array(cur)  # [T]
        i_cur = est.index(cur)
        moved = {est.index(tuple(int(x) for x in np.where(here > 0, np.clip(here + step, 1, self.k_max), 0)))
                 for step in range(-self.explore_radius, self.explore_radius + 1) if step}
        moved.discard(i_cur)
        if not moved:
            return None
        i_draw = max(sorted(moved), key=lambda i: float(est.g_draw[i]))
        k_draw = int(est.combos[i_draw].max())
        n_draw = self._cost.windows(est.bucket.batch_bucket, est.bucket.context_bucket).get(k_draw, 0.0)
        # Settled: more own evidence than the fit's pseudo-windows, and at least SETTLED_Z standard errors behind.
        gap = float(est.g_mean[i_cur] / max(float(est.g_mean[i_draw]), 1e-30)) - 1.0
        settled = (n_draw >= self._cost.prior_windows
                   and gap >= SETTLED_Z * self._diff_se(est.bucket, max(cur), k_draw))
        margin = self.explore_margin * (2.0 ** min(cell.explored, self.explore_doublings) if settled else 1.0)
        if not est.g_draw[i_draw] > est.g_draw[i_cur] * (1.0 + margin):
            return None
        cell.explored += settled
        return _CellDecision(DecisionKind.EXPLORE, tuple(int(x) for x in est.combos[i_draw]), "explore: Thompson draw")

    def _keep(self, cell: _Cell, est: _Estimate) -> _CellDecision:
        """Nothing else applies: serve the incumbent."""
        return _CellDecision(DecisionKind.BEST, self._incumbent(cell, est), "current best")

    def _cost_probe(self, cell: _Cell, est: _Estimate) -> _CellDecision | None:
        """A cell measured at one k only is served a second k once, to identify its cost slope in k.

        Not when enough other cells already pin the shared slope down and the cell lies within their range:
        interpolation is trusted, extrapolation is measured. The second k is 0 while no cell has measured k = 0 and
        the mean puts k = 0 within ``K0_PROBE_WITHIN`` of the best k > 0; otherwise two k > 0 apart.
        """
        bb, ctx = est.bucket.batch_bucket, est.bucket.context_bucket
        seen = self._cost.ks_seen(bb, ctx)
        if len(seen) != 1 or cell.probed:
            return None
        if self._cost.cells_with_slope() >= self.slope_cells and not self._cost.extrapolating(bb, ctx):
            return None
        only = next(iter(seen))
        if only == 0:
            alt = est.best_on
        elif not self._cost.k0_measured() and est.g_shared[0] >= (1.0 - K0_PROBE_WITHIN) * est.g_shared[est.best_on]:
            alt = 0  # the jump at k > 0 is identified by measuring k = 0 once, where off is a contender
        else:  # a second k > 0 identifies the slope without paying a catch-up
            alt = only + 2 if only + 2 <= self.k_max else max(1, only - 2)
        cell.probed = True
        return _CellDecision(DecisionKind.PROBE, est.shared(alt), f"cost probe at k={alt}")

    def _reprobe(self, cell: _Cell, est: _Estimate) -> _CellDecision | None:
        """A cell served speculation off for ``probe_every`` decisions in a row serves its best k > 0 once.

        Draws never explore a cell that is off (see :meth:`_explore`), so this is how it learns whether
        speculation pays again. Each re-probe that leaves the cell off doubles the wait before the next (up to
        ``2 ** MAX_REPROBE_DOUBLINGS`` times ``probe_every``): where speculation clearly loses (high batch on a
        compute-bound device) the probes, which cost throughput and tail latency, thin out. The wait starts
        over when the cell turns on by choice or an acceptance drift reopens it.
        """
        on = max(cell.served.values()) > 0
        if on and cell.kind not in EXPLORING_KINDS:
            cell.reprobes = 0
        cell.off = 0 if on else cell.off + 1
        if cell.off < self._probe_wait(cell.reprobes):
            return None
        cell.off = 0
        cell.reprobes += 1
        alt = est.best_on
        return _CellDecision(DecisionKind.REPROBE, est.shared(alt), f"re-probe k={alt} after speculation off")

    def _probe_wait(self, probes: int) -> int:
        """Decisions in one state (off for ``_reprobe``, on for ``_recheck_off``) before the other is measured once:
        ``probe_every``, doubled by each of the ``probes`` that left the cell as it was."""
        return self.probe_every * 2 ** min(probes, MAX_REPROBE_DOUBLINGS)

    def _recheck_off(self, cell: _Cell, est: _Estimate) -> _CellDecision | None:
        """``explore_off``: a cell on for ``probe_every`` decisions in a row, whose k = 0 has less than
        ``OFF_EVIDENCE_WINDOWS`` windows of its own evidence and which the mean puts within ``K0_PROBE_WITHIN`` of
        the incumbent, serves speculation off once to measure it.

        Draws never explore k = 0 (see :meth:`_explore`) and the one cost probe measures it in a window or two, so a
        cell's k = 0 can rest for good on the few windows that probe happened to catch: on ``bench vllm`` at 63cf837
        the batch-16 cell held 3 windows at k = 0 against 369 at k = 1, the mean put k = 0 9% behind, and static
        k = 0 servers ran 7-10% ahead of the live policy's k = 1-2 at that concurrency. Each re-check that leaves
        the incumbent standing doubles the wait before the next (up to ``2 ** MAX_REPROBE_DOUBLINGS`` times), and
        they stop once k = 0 is measured well enough: exploration that stops on evidence, as ``_explore``'s does.
        A switch or an acceptance drift starts the wait over.
        """
        on = max(cell.served.values()) > 0
        cell.on = cell.on + 1 if on else 0
        if not self.explore_off or not on or cell.kind in EXPLORING_KINDS:
            return None
        if cell.on < self._probe_wait(cell.rechecks):
            return None
        bb, ctx = est.bucket.batch_bucket, est.bucket.context_bucket
        off = est.shared(0)
        g_cur = est.g_mean[est.index(self._incumbent(cell, est))]
        if (self._cost.windows(bb, ctx).get(0, 0.0) >= OFF_EVIDENCE_WINDOWS
                or est.g_mean[est.index(off)] < (1.0 - K0_PROBE_WITHIN) * g_cur):
            return None
        cell.on = 0
        cell.rechecks += 1
        return _CellDecision(DecisionKind.PROBE, off, "re-check k=0: its cost rests on few windows")

    # ----------------------------------------------------------------------------------------- state
    def _get_state(self) -> dict[str, Any]:
        cells = [{"target_version": t, "draft_version": d, "batch_bucket": bb, "context_bucket": ctx,
                  "incumbent": dict(c.incumbent), "served": dict(c.served), "kind": c.kind.value, "reason": c.reason,
                  "expected": {str(k): g for k, g in c.expected.items()}, "hold": c.hold, "off": c.off,
                  "probed": c.probed, "epoch": c.epoch, "reprobes": c.reprobes, "explored": c.explored,
                  "on": c.on, "rechecks": c.rechecks}
                 for (t, d, bb, ctx), c in self._cells.items()]
        return {"acceptance": self._acc.get_state(), "cost": self._cost.get_state(), "cells": cells,
                "emitted": self._emitted.get_state()}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._best.clear()
        self._acc.set_state(state["acceptance"])
        self._cost.set_state(state["cost"])
        self._emitted.set_state(state.get("emitted", []))  # absent from states saved before it existed
        self._cells = {}
        for r in state["cells"]:
            key = Cell(str(r["target_version"]), str(r["draft_version"]), int(r["batch_bucket"]),
                       str(r["context_bucket"]))
            self._cells[key] = _Cell(
                incumbent={str(t): int(k) for t, k in r["incumbent"].items()},
                served={str(t): int(k) for t, k in r["served"].items()}, kind=DecisionKind(r["kind"]),
                reason=str(r["reason"]), expected={int(k): float(g) for k, g in r["expected"].items()},
                hold=int(r["hold"]), off=int(r["off"]), probed=bool(r["probed"]), epoch=int(r["epoch"]),
                reprobes=int(r.get("reprobes", 0)), explored=int(r.get("explored", 0)), on=int(r.get("on", 0)),
                rechecks=int(r.get("rechecks", 0)))
