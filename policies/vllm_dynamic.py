"""``vllm_dynamic``: vLLM's Dynamic SD manager — K per batch size from an ITL sweep and online acceptance rates.

Source: ``vllm/v1/spec_decode/dynamic/manager.py`` (vllm-project/vllm PR #32374),
``DynamicSpeculativeDecodingManager``. An offline sweep (``process_benchmark_results.py``) stores the median
inter-token latency ``ITL(bs, K)`` of each swept batch size and K — one engine step, since a step streams its
accepted tokens at once — as ``batch_stats = {bs: {K: itl}}`` (every bs has K = 0 and K = 1). Online, after
``warmup_steps`` (10) engine steps, the per-position acceptance rates replace the configured prior:
``acc_i = num_accepted_tokens_per_pos[i] / num_draft_tokens_per_pos[i]`` (0 where position i was never drafted),
counted over every request since start. For every batch size it then picks

    K* = argmax_K (1 + sum_{i < K} acc_i) / ITL(bs, K),   K = 0..max K, the first maximum on ties,

with ``ITL(bs, .)`` linear in bs between the nearest swept batch sizes below and above (the end ones beyond the
swept range, ``_get_batch_stats``) and linear in K between swept Ks (``_get_itl``). Pure functions below:
:func:`interpolate_batch_stats`, :func:`itl_of`, :func:`optimal_k`, :func:`acceptance_rates`.

Adaptation (what reaches a policy instead of an engine's own counters):

- **acceptance** comes from acceptance windows: a row that ran k drafts drafted positions ``0..k-1`` and had
  position ``i`` accepted iff it accepted more than ``i`` drafts (``hist``). As in vLLM one vector serves every
  request, pooled over request types and contexts; it is kept per (target, draft) versions because a model
  update restarts a vLLM server. Engine steps for the warm-up are the ``rounds`` of cost windows.
- **ITL** comes from a sweep table in the config when given (``batch_stats``, seconds), as vLLM takes it.
  Otherwise the policy runs the sweep itself from cost windows: ``ITL(bs, K)`` is the mean round seconds
  (draft + verify + other) of the rounds at that batch bucket and largest k — mergeable aggregates carry no
  median — kept per (versions, context bucket), since a round's cost depends on its context. A batch bucket
  counts as swept once every K in ``0..k_max`` has ``sweep_rounds`` rounds; until then a bucket that has
  traffic is served the next K it lacks (one K for the whole cell, the same for every request type: a sweep),
  and only swept batch buckets are interpolated between. ``decide(explore=False)`` never sweeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import Decision, DecisionKind, Policy, Window
from telemetry.records import AcceptanceWindow, Bucket

# vLLM dynamic.py's example prior ("E1": an EAGLE-1 head on Llama-3.1-8B), acceptance_rate_per_pos
VLLM_E1_ACCEPTANCE = (0.68, 0.39, 0.20, 0.10, 0.06, 0.03, 0.02)
WARMUP_STEPS = 10  # DynamicSpeculativeDecodingManager(warmup_steps=10): steps before observed rates are used
SWEEP_ROUNDS = 8  # rounds at one (batch bucket, K) before its mean round seconds counts (a window at batch 64
#                   holds a handful of rounds; one at batch 1 about a hundred)
UNSWEPT_K = 1  # the answer without any ITL for the bucket's context: vLLM cannot run without a sweep either

Versions = tuple[str, str]  # (target version, draft version)
SweepKey = tuple[str, str, str]  # (target version, draft version, context bucket): one online sweep


@dataclass(frozen=True)
class VLLMDynamicConfig:
    """What vLLM's ``DynamicSpeculativeConfig`` holds, plus how the policy sweeps when no table is given."""

    # Offline sweep: batch size -> {K: ITL seconds}; None = sweep online from cost windows.
    batch_stats: Mapping[int, Mapping[int, float]] | None = None
    # acceptance_rate_per_pos used until warm-up ends (positions past its length count 0).
    acceptance_prior: tuple[float, ...] = VLLM_E1_ACCEPTANCE
    warmup_steps: int = WARMUP_STEPS  # engine steps (rounds) before the observed rates replace the prior
    sweep_rounds: int = SWEEP_ROUNDS  # online sweep: rounds per (batch bucket, K) before its ITL counts

    def __post_init__(self) -> None:
        if not all(0.0 <= a <= 1.0 for a in self.acceptance_prior):
            raise ValueError(f"acceptance_prior values must be in [0, 1], got {self.acceptance_prior}")
        if self.warmup_steps < 0 or self.sweep_rounds < 1:
            raise ValueError("warmup_steps must be >= 0 and sweep_rounds >= 1")
        if self.batch_stats is None:
            return
        if 1 not in self.batch_stats:
            raise ValueError(f"batch_stats must include batch size 1 (as vLLM requires), "
                             f"got {sorted(self.batch_stats)}")
        ks = None
        for bs, stats in self.batch_stats.items():
            if bs < 1 or 0 not in stats or 1 not in stats:
                raise ValueError(f"batch_stats[{bs}]: batch sizes must be >= 1 and each must have K = 0 and K = 1")
            if any(not itl > 0.0 for itl in stats.values()):
                raise ValueError(f"batch_stats[{bs}]: every ITL must be > 0 seconds")
            if ks is not None and set(stats) != ks:
                raise ValueError("every swept batch size must have the same Ks (vLLM interpolates K by K)")
            ks = set(stats)


@dataclass(frozen=True)
class PositionCounts:
    """vLLM's ``num_draft_tokens_per_pos`` / ``num_accepted_tokens_per_pos`` for one pair of versions."""

    drafted: tuple[int, ...]  # [k_max] rows that drafted position i
    accepted: tuple[int, ...]  # [k_max] rows whose draft at position i was accepted
    steps: int = 0  # engine steps (rounds) observed: the warm-up clock

    def added(self, hist: Sequence[int]) -> PositionCounts:
        """With one acceptance window's ``hist`` (``hist[a]`` rows accepted exactly a of ``len(hist) - 1``)."""
        k, rows = len(hist) - 1, sum(hist)
        drafted = tuple(d + (rows if i < k else 0) for i, d in enumerate(self.drafted))
        accepted = tuple(a + (sum(hist[i + 1:]) if i < k else 0) for i, a in enumerate(self.accepted))
        return PositionCounts(drafted, accepted, self.steps)


@dataclass(frozen=True)
class SweepCell:
    """Round seconds summed at one (versions, context, batch bucket, K)."""

    seconds: float = 0.0
    rounds: int = 0


def acceptance_rates(drafted: Sequence[int], accepted: Sequence[int]) -> list[float]:
    """``acc_i = accepted_i / drafted_i``, 0 where never drafted (``compute_acceptance_rate_per_pos``)."""
    return [a / d if d else 0.0 for d, a in zip(drafted, accepted, strict=True)]


def interpolate_batch_stats(batch_stats: Mapping[int, Mapping[int, float]], batch_size: int) -> dict[int, float]:
    """``{K: ITL}`` at ``batch_size``: the swept one, else linear between the nearest swept sizes below and above
    (the end ones beyond the swept range), over the Ks both have (``_get_batch_stats``)."""
    if batch_size in batch_stats:
        return dict(batch_stats[batch_size])
    sizes = sorted(batch_stats)
    lo = max((b for b in sizes if b < batch_size), default=sizes[0])
    hi = min((b for b in sizes if b > batch_size), default=sizes[-1])
    if lo == hi:
        return dict(batch_stats[lo])
    r = (batch_size - lo) / (hi - lo)
    return {k: v + r * (batch_stats[hi][k] - v) for k, v in batch_stats[lo].items() if k in batch_stats[hi]}


def itl_of(stats: Mapping[int, float], k: int) -> float | None:
    """ITL at K: the swept value, else linear between the nearest swept Ks (``_get_itl``); None outside them."""
    if k in stats:
        return stats[k]
    below = [j for j in stats if j < k]
    above = [j for j in stats if j > k]
    if not below or not above:
        return None
    lo, hi = max(below), min(above)
    return stats[lo] + (k - lo) / (hi - lo) * (stats[hi] - stats[lo])


def optimal_k(acceptance: Sequence[float], stats: Mapping[int, float], k_max: int) -> tuple[int, dict[int, float]]:
    """``argmax_K (1 + sum_{i<K} acc_i) / ITL(K)`` over K = 0..k_max with an ITL, the first maximum on ties.

    Args:
        acceptance: per-position acceptance rates ``acc_i`` (positions past its length count 0).
        stats: ``{K: ITL seconds}`` at the batch size.
        k_max: the largest K considered.

    Returns:
        K* and, per K considered, the expected tokens per second of one row.
    """
    best, best_rate, rates = 0, -1.0, {}
    for k in range(k_max + 1):
        itl = itl_of(stats, k)
        if itl is None:
            continue
        rates[k] = (1.0 + sum(acceptance[:k])) / itl
        if rates[k] > best_rate:  # strict: the smallest K among equals, as vLLM's loop keeps the first
            best, best_rate = k, rates[k]
    return best, rates


class VLLMDynamicPolicy(Policy):
    """vLLM's Dynamic SD: per batch size the K maximising expected tokens per ITL.

    Args:
        config: the sweep table (or None to sweep online), the acceptance prior and the warm-up.
        k_max: see :class:`~policies.base.Policy` (vLLM's ``max_num_speculative_tokens``).
        seed: unused (deterministic rule).
    """

    name = "vllm_dynamic"

    def __init__(self, config: VLLMDynamicConfig | None = None, k_max: int = 8, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        self.config = config if config is not None else VLLMDynamicConfig()
        self._counts: dict[Versions, PositionCounts] = {}
        self._sweeps: dict[SweepKey, dict[int, dict[int, SweepCell]]] = {}  # -> batch bucket -> K -> seconds

    # ------------------------------------------------------------------------------------------- deciding
    def _acceptance(self, versions: Versions) -> list[float]:
        c = self._counts.get(versions)
        if c is None or c.steps <= self.config.warmup_steps:
            return list(self.config.acceptance_prior)
        return acceptance_rates(c.drafted, c.accepted)

    def _swept(self, key: SweepKey) -> dict[int, dict[int, float]]:
        """Batch bucket -> {K: mean round seconds} for the batch buckets whose sweep is complete."""
        n = self.config.sweep_rounds
        return {bs: {k: c.seconds / c.rounds for k, c in cells.items()}
                for bs, cells in self._sweeps.get(key, {}).items()
                if len(cells) == self.k_max + 1 and all(c.rounds >= n for c in cells.values())}

    def _next_to_sweep(self, key: SweepKey, batch_bucket: int) -> int | None:
        cells = self._sweeps.get(key, {}).get(batch_bucket, {})
        return next((k for k in range(self.k_max + 1)
                     if k not in cells or cells[k].rounds < self.config.sweep_rounds), None)

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        b = bucket
        if self.config.batch_stats is not None:
            stats = interpolate_batch_stats(self.config.batch_stats, b.batch_bucket)
        else:
            key = (b.target_version, b.draft_version, b.context_bucket)
            todo = self._next_to_sweep(key, b.batch_bucket)
            if explore and todo is not None:
                return Decision(k=todo, exploring=True, reason=f"ITL sweep at batch {b.batch_bucket}: K={todo}",
                                kind=DecisionKind.EXPLORE)
            swept = self._swept(key)
            if not swept:
                return Decision(k=UNSWEPT_K, reason="no batch size swept yet", kind=DecisionKind.FIRST)
            stats = interpolate_batch_stats(swept, b.batch_bucket)
        k, rates = optimal_k(self._acceptance((b.target_version, b.draft_version)), stats, self.k_max)
        return Decision(k=k, expected_goodput={j: r * b.batch_bucket for j, r in rates.items()},
                        reason=f"argmax (1 + sum acc) / ITL at batch {b.batch_bucket}", kind=DecisionKind.BEST)

    # ------------------------------------------------------------------------------------------- learning
    def _observe(self, window: Window) -> None:
        versions = (window.target_version, window.draft_version)
        counts = self._counts.get(versions) or PositionCounts((0,) * self.k_max, (0,) * self.k_max)
        if isinstance(window, AcceptanceWindow):
            if window.k > 0 and window.rows > 0:
                self._counts[versions] = counts.added(window.hist)
            return
        w = window
        self._counts[versions] = PositionCounts(counts.drafted, counts.accepted, counts.steps + w.rounds)
        if w.max_k > self.k_max:
            return
        cells = self._sweeps.setdefault((w.target_version, w.draft_version, w.context_bucket), {})
        at_bs = cells.setdefault(w.batch_bucket, {})
        cell = at_bs.get(w.max_k, SweepCell())
        seconds = w.draft_s.total + w.verify_s.total + w.other_s.total
        at_bs[w.max_k] = SweepCell(cell.seconds + seconds, cell.rounds + w.rounds)

    # ------------------------------------------------------------------------------------------- snapshot
    def _get_state(self) -> dict[str, Any]:
        return {
            "counts": [[t, d, list(c.drafted), list(c.accepted), c.steps]
                       for (t, d), c in sorted(self._counts.items())],
            "sweep": [[t, d, ctx, bs, k, c.seconds, c.rounds]
                      for (t, d, ctx), by_bs in sorted(self._sweeps.items())
                      for bs, by_k in sorted(by_bs.items()) for k, c in sorted(by_k.items())],
        }

    def _set_state(self, state: dict[str, Any]) -> None:
        counts: dict[Versions, PositionCounts] = {}
        for t, d, drafted, accepted, steps in state["counts"]:
            if len(drafted) != self.k_max or len(accepted) != self.k_max:
                raise ValueError(f"counts for {t}|{d} have {len(drafted)} positions, this policy has {self.k_max}")
            counts[(str(t), str(d))] = PositionCounts(tuple(int(x) for x in drafted), tuple(int(x) for x in accepted),
                                                      int(steps))
        sweeps: dict[SweepKey, dict[int, dict[int, SweepCell]]] = {}
        for t, d, ctx, bs, k, seconds, rounds in state["sweep"]:
            at_bs = sweeps.setdefault((str(t), str(d), str(ctx)), {}).setdefault(int(bs), {})
            at_bs[int(k)] = SweepCell(float(seconds), int(rounds))
        self._counts, self._sweeps = counts, sweeps
