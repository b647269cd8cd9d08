"""Benchmark: every policy against the per-bucket oracle, on the calibrated simulator and on the real engine.

Run: ``python -m bench.policies [--quick] [--calibration bench/results/engine.json] [--checkpoints DIR]
[--no-engine | --no-sim] [--engine-plan quick|full|long] [--policies a,b,...] [--json PATH]``. Writes the JSON
(``{"simulator": {...}, "engine": {...}}``) and a cumulative-regret PNG (one panel per section) next to it.
Full: 300k simulated rounds (about 6 minutes on one core), then on the engine one 48-window sweep of six static
ks and three 48-window replays of every policy (about 35 minutes for the xl pair on one CPU thread, 4.6 GB peak:
every policy's engines keep their KV caches while the policies run interleaved; about 590 rounds per policy);
``--engine-plan long``: 264 windows, over 3,000 rounds per policy per repeat (hours: ``--policies`` narrows the
lineup); ``--quick``: 60k rounds, 12 windows, one replay (about a minute in all). The engine section runs on one thread.

**Workload** (:data:`controller.offline.simulator.PHASES`, recorded in each section's ``"workload"``): six phases, load
staying put for 3-10 windows at a time — low load (batch 1/4, short contexts, balanced mix), load rising
(4/16/64), long contexts arriving (1/16/64, 60% long), the mix turning code-heavy (1..64, 30% long), load falling
(1/4), and the model update target-v1 -> target-v2 for the last 35% (1/4/16/64, 40% long); each phase visits
its batch sizes in seeded shuffled cycles. Buckets differ for real reasons only: batch 1 is latency-bound
(verify cost nearly flat in k) while batch 64 pays for every verified position; long contexts cost more per
position and accept differently; request types accept differently. The numbers come from the calibration
alone (see :mod:`controller.offline.simulator`, whose ``gaps`` say what a partial calibration lacked and how it was
filled).
The engine replays the same phases with fewer windows and shorter stretches (2-3 windows), batch <= 64 at short
and <= 16 at long context (a CPU core needs ~20 s to prefill 64 long prompts), 128-byte short and 768-byte long
prompts, 192 new tokens per request, sampling at T = 1.

- **oracle**: per cost cell (versions, batch size, context) the best static per-type k by exhaustive sweep on
  the same workload (simulator: analytic expectations from the calibration; engine: see
  :func:`run_engine_section`), then run like any policy.
- **static**: the best single global k by sweep (reported as ``k``).
- **batch_table**: the best k per batch-size bucket across types, contexts and versions, by sweep (what a
  careful operator would write into vLLM's ``num_speculative_tokens_per_batch_size``; reported as
  ``schedule``); **trtllm_schedule** the same schedule as TensorRT-LLM's ``draft_len_schedule``.
- **vllm_dynamic**: vLLM's dynamic K with its offline ITL sweep taken from the same measurements (simulator:
  the calibration's round seconds at short context; engine: the static sweep's median seconds per round per
  batch size and K), and per-position acceptance learnt online.
- **hf_heuristic**, **sglang_adaptive**, **sglang_adaptive_bs**, **ucb**, **goodput**: their defaults, learning
  online.
- Metrics per policy: tok_s, ratio_to_oracle, rounds_to_90_cold / _after_update (per bucket, rounds of presence
  up to the end of the first window from which a 3-window mean of goodput is >= 90% of the oracle's in the same
  windows — analytic on the simulator, measured on the engine; median and worst over buckets, and how many
  never did), k_changes_per_1000 (bucket-rounds), early_regret (tokens lost against the oracle over the policy's
  first 200 rounds, cold and from the model update on, as a share of the oracle's tokens in that time).
- Simulator section, ``busy``: the oracle, static and goodput again with a busy neighbour slowing 30% of the
  windows (seeded spells, :func:`controller.offline.simulator.interference_factors`), and how far goodput's ratio to the
  oracle falls against the quiet run (``goodput_ratio_fall``).
- Per section: ``goodput_over`` (goodput's tok/s over each other policy's, the ratios the targets are stated in)
  and ``oracle_over_static``, the ceiling of any "x static" ratio on this workload and calibration (a calibration
  where one k is best everywhere leaves no room to beat static k by much, however good the policy).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from controller.offline.simulator import (
    BASE_VERSION,
    NOMINAL_ROUNDS_PER_WINDOW,
    WINDOW_S,
    Calibration,
    SimResult,
    WindowSpec,
    buckets_of,
    describe_workload,
    expected_goodput,
    simulate,
    to_jsonable,
    workload,
)
from engine.profiles import DEFAULT_PROFILE, PROFILE_NAMES
from policies import (
    REGISTRY,
    BatchTablePolicy,
    GoodputPolicy,
    Policy,
    StaticPolicy,
    TRTLLMSchedulePolicy,
    VLLMDynamicPolicy,
)
from policies.base import Decision
from policies.vllm_dynamic import VLLMDynamicConfig
from telemetry.policy_table import RowLookup
from telemetry.records import DEFAULT_BUCKETS, REQUEST_TYPES, Bucket

K_MAX = 8
ROLLING = 3  # windows averaged when checking "reached 90% of oracle"
EARLY_ROUNDS = 200  # issue 31's cold-start horizon: regret over a policy's first rounds, cold and after the update


class TablePolicy(Policy):
    """A fixed bucket-key -> k table (the oracle). Not registered: it needs the future."""

    name = "oracle"

    def __init__(self, table: dict[str, int], k_max: int = K_MAX, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        self._table = dict(table)

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        return Decision(k=self._table.get(bucket.key(), 1), reason="oracle table")

    def _get_state(self) -> dict[str, Any]:
        return {"table": self._table}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._table = dict(state["table"])


def _cell(spec: WindowSpec) -> tuple[str, int, str]:
    return spec.version, spec.batch_size, spec.context


def oracle_table(cal: Calibration, specs: Sequence[WindowSpec]) -> dict[str, int]:
    """Per cell, the per-type k vector maximising total tokens / total seconds over the workload."""
    combos = list(itertools.product(range(K_MAX + 1), repeat=len(cal.types)))
    by_cell: dict[tuple[str, int, str], list[WindowSpec]] = defaultdict(list)
    for s in specs:
        by_cell[_cell(s)].append(s)
    table: dict[str, int] = {}
    for group in by_cell.values():
        uniq = {s: group.count(s) for s in set(group)}
        best, best_g = combos[0], -1.0
        for c in combos:
            tok = secs = 0.0
            for s, n in uniq.items():
                g = expected_goodput(cal, s, c)
                tok += n * g
                secs += n
            if tok / secs > best_g:
                best, best_g = c, tok / secs
        for b, k in zip(buckets_of(cal, group[0]), best, strict=True):
            table[b.key()] = int(k)
    return table


def _time_weighted(cal: Calibration, specs: Sequence[WindowSpec], ks_for: Any) -> float:
    """Mean analytic goodput over windows (windows last the same wall time, so this is tokens / seconds)."""
    return float(np.mean([expected_goodput(cal, s, ks_for(s)) for s in specs])) if specs else 0.0


def best_static_k(cal: Calibration, specs: Sequence[WindowSpec]) -> int:
    n = len(cal.types)
    return max(range(K_MAX + 1), key=lambda k: _time_weighted(cal, specs, lambda s: [k] * n))


def best_batch_schedule(cal: Calibration, specs: Sequence[WindowSpec]) -> list[list[int]]:
    """vLLM ``[[start_bs, end_bs, K], ...]`` with the best K per batch bucket (across types/contexts/versions)."""
    n = len(cal.types)
    best: dict[int, int] = {}
    for e in DEFAULT_BUCKETS.batch_edges:
        group = [s for s in specs if DEFAULT_BUCKETS.batch_bucket(s.batch_size) == e]
        if group:
            best[e] = max(range(K_MAX + 1), key=lambda kk: _time_weighted(cal, group, lambda s: [kk] * n))
    return schedule_from_best(best)


def schedule_from_best(best: dict[int, int]) -> list[list[int]]:
    """A vLLM schedule from the best K per served batch bucket, as an operator would write it.

    Batch buckets never served take the K of the nearest smaller served one (vLLM fills gaps with the previous
    range's K; before the first served bucket, the first served K); adjacent ranges with the same K are merged.
    """
    sched: list[list[int]] = []
    lo, last = 1, best[min(best)] if best else 1
    for e in DEFAULT_BUCKETS.batch_edges:
        last = best.get(e, last)
        if sched and sched[-1][2] == last:
            sched[-1][1] = e
        else:
            sched.append([lo, e, last])
        lo = e + 1
    return sched


def bucket_metrics(res: SimResult, oracle: SimResult, specs: Sequence[WindowSpec]) -> dict[str, Any]:
    ratio = res.expected_goodput / oracle.expected_goodput
    per_bucket: dict[str, list[tuple[float, int, float]]] = defaultdict(list)  # key -> [(ratio, rounds, k)]
    for wi, ks in enumerate(res.ks):
        for key, k in ks.items():
            per_bucket[key].append((float(ratio[wi]), int(res.rounds[wi]), float(k)))
    base = specs[0].version if specs else BASE_VERSION  # the workload starts on the target before the update
    cold: list[int | None] = []
    after: list[int | None] = []
    changes = bucket_rounds = 0
    for key, seq in per_bucket.items():
        r = np.array([x[0] for x in seq])
        rounds = np.cumsum([x[1] for x in seq])
        k_seq = np.array([x[2] for x in seq])
        changes += int((np.diff(k_seq) != 0).sum())
        bucket_rounds += int(rounds[-1])
        roll = np.convolve(r, np.ones(ROLLING) / ROLLING, mode="valid") if r.size >= ROLLING else r[-1:]
        hit = np.flatnonzero(roll >= 0.9)
        # Reached at the end of the first window from which the next ROLLING windows average >= 90%: the rounds
        # of the two windows after it are not counted (at batch 1 a window holds ~100 rounds, so counting them
        # would put a floor of ~300 rounds under a policy that is right from its first window).
        reached = int(rounds[hit[0]]) if hit.size else None
        (cold if key.startswith(base + "|") else after).append(reached)

    def summary(xs: list[int | None]) -> dict[str, Any]:
        done = [x for x in xs if x is not None]
        return {"median": float(np.median(done)) if done else None, "worst": max(done) if done else None,
                "never": len(xs) - len(done), "buckets": len(xs)}

    return {"rounds_to_90_cold": summary(cold), "rounds_to_90_after_update": summary(after),
            "k_changes_per_1000": 1000.0 * changes / max(bucket_rounds, 1),
            "early_regret": {"rounds": EARLY_ROUNDS, "cold": early_regret(res, oracle, 0),
                             "after_update": early_regret(res, oracle, first_update_window(specs))}}


def first_update_window(specs: Sequence[WindowSpec]) -> int | None:
    """Index of the first window served by another target version than the first window's (None: no update)."""
    return next((i for i, s in enumerate(specs) if s.version != specs[0].version), None) if specs else None


def early_regret(res: SimResult, oracle: SimResult, start: int | None, n_rounds: int = EARLY_ROUNDS) -> float | None:
    """Tokens lost against the oracle over the policy's first ``n_rounds`` rounds from window ``start``, as a share
    of the oracle's tokens in the same wall time: ``1 - sum(w * g) / sum(w * g_oracle)`` over the windows those
    rounds fall in, ``g`` each window's goodput (analytic in the simulator, measured on the engine) and ``w`` the
    share of the window's rounds counted (1 but for the last, cut at ``n_rounds``). Windows last the same time for
    every policy, so goodput weighs as tokens. None when ``start`` is None or the workload ends first."""
    if start is None:
        return None
    g, g_or, rounds = res.expected_goodput[start:], oracle.expected_goodput[start:], res.rounds[start:]
    before = np.concatenate(([0.0], np.cumsum(rounds)[:-1]))  # [W'] rounds played before each window
    w = np.clip((n_rounds - before) / np.maximum(rounds, 1e-9), 0.0, 1.0)  # [W'] share of each window counted
    if float(np.sum(w * rounds)) < n_rounds - 1e-6:
        return None
    return float(1.0 - np.sum(w * g) / max(float(np.sum(w * g_or)), 1e-12))


def trtllm_schedule_of(schedule: list[list[int]]) -> dict[int, int]:
    """The swept vLLM schedule as TensorRT-LLM's ``draft_len_schedule`` (keys are upper bounds).

    TensorRT-LLM runs batch sizes above the largest key with speculation off and wants its smallest key's value
    to be the largest; the schedule's last range is open-ended up to the workload's largest batch, so its upper
    bound is kept, and later ranges drafting more than the first are clamped to the first's K (what an operator
    must write: TensorRT-LLM cannot express it).
    """
    first = schedule[0][2]
    return {int(hi): min(int(k), first) for _, hi, k in schedule}


def itl_sweep(round_s: dict[int, dict[int, float]] | None) -> VLLMDynamicConfig | None:
    """vLLM's offline sweep (``batch_stats``): median round seconds per (batch size, K) — one round is one
    inter-token interval of every row. Batch sizes the sweep lacks at K = 0 or 1 are dropped (vLLM needs both);
    without batch size 1 there is no valid sweep (None: the policy sweeps online)."""
    stats = {bs: dict(by_k) for bs, by_k in (round_s or {}).items() if 0 in by_k and 1 in by_k}
    if 1 not in stats:
        return None
    ks = set.intersection(*(set(v) for v in stats.values()))
    return VLLMDynamicConfig(batch_stats={bs: {k: v for k, v in by_k.items() if k in ks} for bs, by_k in stats.items()})


def lineup(static_k: int, schedule: list[list[int]], seed: int,
           itl: dict[int, dict[int, float]] | None = None, only: Sequence[str] | None = None) -> dict[str, Policy]:
    """Every registered policy, in registry order, configured as a careful operator would from the same sweep:
    ``static`` at the swept k, ``batch_table`` with the swept schedule, ``trtllm_schedule`` with the same schedule
    in TensorRT-LLM's form, ``vllm_dynamic`` with the offline ITL sweep ``itl`` (batch size -> K -> seconds; None:
    it sweeps online), the others with their defaults. ``only`` keeps those named and :data:`REQUIRED_POLICIES`."""
    out: dict[str, Policy] = {}
    for name, cls in REGISTRY.items():
        if only is not None and name not in only and name not in REQUIRED_POLICIES:
            continue
        if name == "static":
            out[name] = StaticPolicy(k=static_k, k_max=K_MAX, seed=seed)
        elif name == "batch_table":
            out[name] = BatchTablePolicy(schedule=schedule, k_max=K_MAX, seed=seed)
        elif name == "trtllm_schedule":
            out[name] = TRTLLMSchedulePolicy(draft_len_schedule=trtllm_schedule_of(schedule), k_max=K_MAX, seed=seed)
        elif name == "vllm_dynamic":
            out[name] = VLLMDynamicPolicy(itl_sweep(itl), k_max=K_MAX, seed=seed)
        else:
            out[name] = cls(k_max=K_MAX, seed=seed)
    return out


def run_simulator_section(cal: Calibration, quick: bool, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    total = 60_000 if quick else 300_000
    specs = workload(cal.types, total, seed)
    cal.note_batches([s.batch_size for s in specs])
    static_k = best_static_k(cal, specs)
    schedule = best_batch_schedule(cal, specs)
    itl = {b: {k: float(v) for k, v in enumerate(cal.round_s(b, "short").sum(axis=1))} for b in cal.batches}
    policies = lineup(static_k, schedule, seed, itl)
    oracle = simulate(TablePolicy(oracle_table(cal, specs)), cal, specs, seed=seed)
    out: dict[str, Any] = {"oracle_tok_s": oracle.tok_s, "rounds": int(oracle.rounds.sum()),
                           "windows": len(specs), "window_s": WINDOW_S, "calibration_device": cal.device,
                           "calibration_gaps": list(cal.gaps), "workload": describe_workload(specs, cal.types),
                           "policies": {}}
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, pol in policies.items():
        t0 = time.perf_counter()
        res = simulate(pol, cal, specs, seed=seed)
        entry = {"tok_s": res.tok_s, "ratio_to_oracle": res.tok_s / oracle.tok_s, **bucket_metrics(res, oracle, specs),
                 "sim_seconds": time.perf_counter() - t0}
        if name == "static":
            entry["k"] = static_k
        if name == "batch_table":
            entry["schedule"] = schedule
        out["policies"][name] = entry
        regret = np.cumsum(res.rounds * (1.0 - res.expected_goodput / oracle.expected_goodput))
        curves[name] = (np.cumsum(res.rounds), regret)
    out["busy"] = busy_neighbour(cal, specs, static_k, out, seed)
    return out, curves


BUSY_SHARE = 0.3  # share of windows in busy spells when the simulator adds a busy neighbour


def busy_neighbour(cal: Calibration, specs: Sequence[WindowSpec], static_k: int, quiet: dict[str, Any],
                   seed: int) -> dict[str, Any]:
    """The same workload with a busy neighbour (:func:`controller.offline.simulator.interference_factors`): the
    oracle, static and goodput again, and how much goodput's ratio to the oracle falls against the quiet run."""
    oracle = simulate(TablePolicy(oracle_table(cal, specs)), cal, specs, seed=seed, busy_share=BUSY_SHARE)
    out: dict[str, Any] = {"busy_share": BUSY_SHARE, "oracle_tok_s": oracle.tok_s, "policies": {}}
    for name, pol in (("static", StaticPolicy(k=static_k, k_max=K_MAX, seed=seed)),
                      ("goodput", GoodputPolicy(k_max=K_MAX, seed=seed))):
        res = simulate(pol, cal, specs, seed=seed, busy_share=BUSY_SHARE)
        out["policies"][name] = {"tok_s": res.tok_s, "ratio_to_oracle": res.tok_s / oracle.tok_s}
    busy_ratio = out["policies"]["goodput"]["ratio_to_oracle"]
    out["goodput_over_static"] = out["policies"]["goodput"]["tok_s"] / out["policies"]["static"]["tok_s"]
    out["goodput_ratio_fall"] = 1.0 - busy_ratio / quiet["policies"]["goodput"]["ratio_to_oracle"]
    return out


@dataclass(frozen=True)
class EnginePlan:
    """How long and how wide the engine section runs (CPU-sized: every policy replays the whole workload)."""

    windows: int  # workload length in windows (the simulator's workload shape, fewer windows)
    window_s: float  # engine seconds per telemetry window (sum of the rounds' draft + verify + other)
    sweep_ks: tuple[int, ...]  # static k values swept to find static, batch_table and the oracle
    batch_cap: int  # largest batch served (the simulator's 64 where the CPU allows it)
    long_batch_cap: int  # largest batch at long context: prefilling 64 long prompts takes ~20 s on a CPU core
    stretch: tuple[int, int]  # windows a load stays put: shorter than the simulator's 3-10 so every phase visits
    # several loads in few windows
    repeats: int  # policy replays after the one sweep; figures are per-repeat ratios' medians (windows vary
    # +-10-20% with the machine's speed, and a learning policy's decisions follow its own noisy measurements)
    prompt_bytes: tuple[tuple[str, int], ...] = (("short", 128), ("long", 768))  # per context class
    max_new_tokens: int = 192  # per request; rows retire and are replaced, so admission cost is in the rounds


ENGINE_PLANS = {
    # k = 8 is left out of the full sweep: on a CPU a draft step costs ~15% of a verify forward, so even at an
    # acceptance of 0.8 the best k is about 5 (Leviathan et al. 2023, Theorem 3.8); policies may still pick 8.
    "full": EnginePlan(windows=48, window_s=0.5, sweep_ks=(0, 1, 2, 3, 4, 6), batch_cap=64, long_batch_cap=16,
                       stretch=(2, 3), repeats=3),
    "quick": EnginePlan(windows=12, window_s=0.25, sweep_ks=(0, 1, 3), batch_cap=16, long_batch_cap=4,
                        stretch=(1, 2), repeats=1),
    # Issue 31's instrument: at least 3,000 rounds per policy per repeat (the xl pair runs about 12 rounds per
    # 0.5 s window), so a cold start's exploration is a small part of the run, as it is in serving.
    "long": EnginePlan(windows=264, window_s=0.5, sweep_ks=(0, 1, 2, 3, 4, 6), batch_cap=64, long_batch_cap=16,
                       stretch=(2, 3), repeats=3),
}
# The policies issue 31's figures name; ``--policies`` narrows a long engine run to them (the lineup's others are
# variants: trtllm_schedule is batch_table's schedule, sglang_adaptive_bs and ucb are not targets).
REQUIRED_POLICIES = ("static", "goodput")


class _WindowDecisions:
    """The engine's ``policy_fn`` for one window: one ``policy.decide`` per bucket, cached (the table model)."""

    def __init__(self, policy: Policy, target_version: str, draft_version: str) -> None:
        self.policy = policy
        self.used: dict[str, int] = {}  # bucket key -> k decided this window
        self._lookup = RowLookup(self._decide, target_version, draft_version)  # the engines' row -> k lookup

    def _decide(self, b: Bucket) -> int:
        k = self.used[b.key()] = self.policy.decide(b).k
        return k

    def __call__(self, rtype: str, batch_size: int, context_len: int) -> int:
        return self._lookup(rtype, batch_size, context_len)


class _EngineRun:
    """One policy replaying the workload on real engines, one engine per (batch size, context class).

    Load is closed-loop: a window of spec batch B runs on the engine sized B, whose finished rows are replaced at
    once with new requests (type drawn from the window's mix), so every round has exactly B rows. Engines not in
    use keep their rows (preempted, as a scheduler would), so a returning load resumes where it stopped. Windows
    last ``window_s`` of engine time. Decisions are cached per bucket per window (the table model).
    """

    def __init__(self, models: Any, plan: EnginePlan, prompts: dict[tuple[str, str], list[bytes]],
                 seed: int) -> None:
        self.models, self.plan, self.seed = models, plan, seed
        self.types = sorted(REQUEST_TYPES)
        self.prompt_len = dict(plan.prompt_bytes)
        self.prompts = prompts
        self.rng = random.Random(seed)  # request types and prompts: the same stream for every policy
        self.engines: dict[tuple[int, str], Any] = {}
        self.n_requests = 0

    def _request(self, spec: WindowSpec, max_new: int | None = None) -> Any:
        from engine.loop import Request

        rtype = self.rng.choices(self.types, weights=spec.mix)[0]
        prompt = self.rng.choice(self.prompts[(rtype, spec.context)])
        self.n_requests += 1
        return Request(f"r{self.n_requests}", rtype, prompt, max_new or self.plan.max_new_tokens, stop_at_eos=False)

    def _engine(self, spec: WindowSpec) -> Any:
        from engine.loop import EngineConfig, SpecEngine

        m = self.models
        key = (spec.batch_size, spec.context)
        eng = self.engines.get(key)
        if eng is None:
            need = 1 + self.prompt_len[spec.context] + self.plan.max_new_tokens + 2 * (K_MAX + 1)
            cfg = EngineConfig(max_batch=spec.batch_size, max_context=need, k_max=K_MAX, seed=self.seed)
            target = target_of(m, spec.version)
            eng = self.engines[key] = SpecEngine(target, m.draft, cfg, spec.version, m.draft_version)
            for i in range(spec.batch_size):  # staggered lengths: rows then retire one by one, not all at once
                eng.submit(self._request(spec, max(1, self.plan.max_new_tokens * (i + 1) // spec.batch_size)))
            eng.step(lambda _t, _b, _c: 0)  # prefill (and a first plain round), outside the measurement
        elif eng.target_version != spec.version:
            eng.swap_target(target_of(m, spec.version), spec.version)  # the model update (re-prefills live rows)
        return eng

    def window(self, policy: Policy, spec: WindowSpec) -> tuple[int, float, int, dict[str, int]]:
        """Serve one window of ``spec`` under ``policy``; feed it the window's aggregates.

        Returns:
            (emitted tokens, engine seconds, rounds, bucket key -> k decided).
        """
        from telemetry.aggregate import aggregate

        eng = self._engine(spec)
        decide = _WindowDecisions(policy, spec.version, self.models.draft_version)
        records = []
        secs = 0.0
        while secs < self.plan.window_s:
            rec = eng.step(decide)
            assert rec is not None, "closed-loop load keeps every engine busy"
            records.append(rec)
            secs += rec.wall_s
            for _ in eng.pop_finished():
                eng.submit(self._request(spec))
        agg = aggregate(records)
        for aw in agg.acceptance:
            policy.observe(aw)
        for cw in agg.cost:
            policy.observe(cw)
        return sum(r.emitted for r in records), secs, len(records), decide.used


def target_of(models: Any, version: str) -> Any:
    """The loaded target whose version id is ``version`` (the profile's target-v1 or target-v2).

    Matched by id, never by "not the first": the xl profile's ids are target-v1-xl4 / target-v2-xl4, and a window
    labelled with another id would otherwise decode with the updated target from the start.
    """
    by_version = {models.target_version: models.target, models.target_v2_version: models.target_v2}
    if version not in by_version or by_version[version] is None:
        raise ValueError(f"no loaded target has version {version!r}; loaded: {sorted(by_version)}")
    return by_version[version]


def replay_interleaved(models: Any, plan: EnginePlan, prompts: dict[tuple[str, str], list[bytes]], seed: int,
                       policies: dict[str, Policy], specs: Sequence[WindowSpec]) -> dict[str, SimResult]:
    """Every policy through the workload on its own engines, interleaved window by window.

    The machine is shared (a training run, other developers): interleaving makes a slow spell of contention fall
    on every policy alike instead of on whichever ran during it. The order rotates every window.
    """
    n_w = len(specs)
    runs = {name: _EngineRun(models, plan, prompts, seed) for name in policies}
    out = {name: SimResult(np.zeros(n_w), np.zeros(n_w), np.zeros(n_w), np.zeros(n_w)) for name in policies}
    names = list(policies)
    for wi, spec in enumerate(specs):
        for j in range(len(names)):
            name = names[(wi + j) % len(names)]
            tok, secs, rounds, used = runs[name].window(policies[name], spec)
            res = out[name]
            res.tokens[wi], res.seconds[wi], res.rounds[wi] = tok, secs, rounds
            res.expected_goodput[wi] = tok / secs  # measured: the engine has no analytic expectation
            res.ks.append(used)
    return out


def engine_prompts(plan: EnginePlan, seed: int, n: int = 32) -> dict[tuple[str, str], list[bytes]]:
    """(request type, context class) -> ``n`` held-out prompts. Shorter classes take the head of the longest
    class's prompts (reading the prose corpus costs seconds per call)."""
    from engine.corpus import held_out_prompts

    longest = max(b for _, b in plan.prompt_bytes)
    out = {}
    for t in sorted(REQUEST_TYPES):
        full = held_out_prompts(t, n, longest, seed=seed)
        for cx, size in plan.prompt_bytes:
            out[(t, cx)] = [p[:size] for p in full]
    return out


def _cell_of(spec: WindowSpec, cal_ctx: dict[str, str]) -> tuple[str, int, str]:
    return spec.version, DEFAULT_BUCKETS.batch_bucket(spec.batch_size), cal_ctx[spec.context]


def run_engine_section(quick: bool, seed: int = 0, checkpoints: str | None = None, profile: str = DEFAULT_PROFILE,
                       progress: bool = True, plan_name: str | None = None, only: Sequence[str] | None = None,
                       ) -> tuple[dict[str, Any] | None, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The same comparison on the real engine: the simulator's workload shape, shorter and CPU-sized.

    - **sweep**: the whole workload once per static k in ``plan.sweep_ks``. ``static`` is the k with the best
      total tokens/s; ``batch_table`` takes per batch bucket the k with the best tokens/s over that bucket's
      windows; the **oracle** takes per cost cell (versions, batch bucket, context bucket) the k with the best
      tokens/s over that cell's windows, and replays the workload with that table. Rows of every type share a
      round, so the engine oracle is per cell (one k for the types of a cell): an approximation of the
      per-bucket oracle that a policy choosing k per type can exceed.
    - then the oracle, static (re-run) and every other policy replay the same workload (same seeds: same request
      stream, prompts and engine RNG), interleaved window by window (:func:`replay_interleaved`) so that the
      shared machine's contention falls on all of them alike.
    - rounds to 90%: per bucket, the 3-window mean of measured window tokens/s over the oracle run's tokens/s in
      the same windows (same spec) reaches 0.9.

    ``plan_name`` picks an :data:`ENGINE_PLANS` entry over ``quick``; ``only`` narrows the replayed lineup (the
    oracle, static and goodput always run).

    Returns ``(None, {})`` with a message when torch or the checkpoints are missing.
    """
    try:
        import torch
    except ImportError as e:  # the simulator section runs without torch
        print(f"engine section skipped: {e}")
        return None, {}
    name = plan_name or ("quick" if quick else "full")
    plan = ENGINE_PLANS[name]
    # One engine thread: on a small machine a second one competes with the benchmark's own Python (policies,
    # aggregation) and whatever else runs, and every window's speed then depends on it; the figures are ratios
    # within one interleaved run, so the thread count favours no policy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out, curves = _engine_section(plan, seed, checkpoints, progress, profile, only)
    finally:
        torch.set_num_threads(threads)
    if out is not None:
        out["plan_name"] = name
    return out, curves


def _engine_section(
    plan: EnginePlan, seed: int, checkpoints: str | None, progress: bool, profile: str,
    only: Sequence[str] | None = None,
) -> tuple[dict[str, Any] | None, dict[str, tuple[np.ndarray, np.ndarray]]]:
    import torch

    from engine.loader import load_models

    try:
        models = load_models(checkpoints, "cpu" if not torch.cuda.is_available() else None, with_update=True,
                             profile=profile)
    except FileNotFoundError as e:
        print(f"engine section skipped: {e}")
        return None, {}
    t_start = time.perf_counter()
    types = sorted(REQUEST_TYPES)
    specs = workload(types, plan.windows * NOMINAL_ROUNDS_PER_WINDOW, seed, base_version=models.target_version,
                     update_version=models.target_v2_version, batch_cap=plan.batch_cap,
                     long_batch_cap=plan.long_batch_cap, stretch=plan.stretch)
    prompts = engine_prompts(plan, seed)
    ctx_label = {cx: DEFAULT_BUCKETS.context_bucket(1 + n + plan.max_new_tokens) for cx, n in plan.prompt_bytes}

    def stage(pols: dict[str, Policy], label: str) -> dict[str, SimResult]:
        t0 = time.perf_counter()
        res = replay_interleaved(models, plan, prompts, seed, pols, specs)
        gc.collect()  # each policy's engines hold their KV caches until here
        if progress:
            print(f"  engine {label}: " + ", ".join(f"{n} {r.tok_s:.1f} tok/s" for n, r in res.items())
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        return res

    sweep = stage({f"k={k}": StaticPolicy(k=k, k_max=K_MAX, seed=seed) for k in plan.sweep_ks}, "sweep")
    sweep_by_k = {k: sweep[f"k={k}"] for k in plan.sweep_ks}
    static_k = max(sweep_by_k, key=lambda k: sweep_by_k[k].tok_s)

    def best_k_by(group_of: Any) -> dict[Any, int]:
        tot: dict[Any, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
        for k, r in sweep_by_k.items():
            for wi, spec in enumerate(specs):
                acc = tot[group_of(spec)][k]
                acc[0] += r.tokens[wi]
                acc[1] += r.seconds[wi]
        return {g: max(by_k, key=lambda kk: by_k[kk][0] / by_k[kk][1]) for g, by_k in tot.items()}

    schedule = schedule_from_best(best_k_by(lambda s: DEFAULT_BUCKETS.batch_bucket(s.batch_size)))
    # vllm_dynamic's offline sweep: median seconds per round per (batch size, K) over the sweep's short-context
    # windows (vLLM sweeps at one context length too).
    per_bk: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for k, r in sweep_by_k.items():
        for wi, spec in enumerate(specs):
            if spec.context == "short" and r.rounds[wi] > 0:
                per_bk[spec.batch_size][k].append(float(r.seconds[wi] / r.rounds[wi]))
    itl = {b: {k: statistics.median(v) for k, v in by_k.items()} for b, by_k in per_bk.items()}
    cell_k = best_k_by(lambda s: _cell_of(s, ctx_label))
    table = {Bucket(v, models.draft_version, t, bb, cb).key(): k for (v, bb, cb), k in cell_k.items() for t in types}
    # static is re-run beside the others (its sweep run met other moments of contention); every repeat starts
    # every policy cold on the same workload, request stream and engine seeds
    repeats: list[dict[str, Any]] = []
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for rep in range(plan.repeats):
        pols: dict[str, Policy] = {"oracle": TablePolicy(table), **lineup(static_k, schedule, seed, itl, only)}
        results = stage(pols, f"policies {rep + 1}/{plan.repeats}")
        oracle = results.pop("oracle")
        entries: dict[str, Any] = {}
        for name, res in results.items():
            entries[name] = {"tok_s": res.tok_s, "ratio_to_oracle": res.tok_s / oracle.tok_s,
                             **bucket_metrics(res, oracle, specs)}
            if rep == 0:  # the plot shows the first repeat (curves of several repeats would overlap illegibly)
                rel = res.expected_goodput / np.maximum(oracle.expected_goodput, 1e-9)
                curves[name] = (np.cumsum(res.rounds), np.cumsum(res.rounds * (1.0 - rel)))
        repeats.append({"oracle_tok_s": oracle.tok_s, "rounds": int(oracle.rounds.sum()), "policies": entries})
    out: dict[str, Any] = {
        "profile": models.profile, "device": models.device.label, "threads": torch.get_num_threads(),
        "checkpoints": checkpoints or "checkpoints/", "windows": len(specs), "window_s": plan.window_s,
        "plan": {**asdict(plan), "prompt_bytes": dict(plan.prompt_bytes)},
        "workload": describe_workload(specs, types),
        "sweep_tok_s": {str(k): r.tok_s for k, r in sweep_by_k.items()},
        "oracle_k_by_cell": {"|".join(map(str, c)): k for c, k in sorted(cell_k.items())},
        **median_of_repeats(repeats),
    }
    out["policies"]["static"]["k"] = static_k
    if "batch_table" in out["policies"]:
        out["policies"]["batch_table"]["schedule"] = schedule
    out["seconds"] = time.perf_counter() - t_start
    return out, curves


def add_summary(section: dict[str, Any]) -> None:
    """Ratios the targets are stated in, and the ceiling the workload allows (oracle over the best static k)."""
    section.setdefault("goodput_over", goodput_over(section))
    section.setdefault("oracle_over_static", section["oracle_tok_s"] / section["policies"]["static"]["tok_s"])


def goodput_over(section: dict[str, Any]) -> dict[str, float]:
    pol = section["policies"]
    return {o: pol["goodput"]["tok_s"] / pol[o]["tok_s"] for o in pol if o != "goodput"}


def median_of_repeats(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One section out of several replays of the same workload: every ratio is the median of its per-repeat
    values (a ratio is taken within a repeat, where the policies ran interleaved, never across repeats).

    A policy's entry is its median repeat (by ratio to the oracle) with ``ratio_to_oracle_repeats`` added, so its
    rounds-to-90% figures come from one real run; ``goodput_over`` and ``oracle_over_static`` are per-repeat
    medians, listed per repeat under ``"repeats"``.
    """
    med = statistics.median_low  # an actual repeat's value, not the mean of two
    names = list(repeats[0]["policies"])
    per_rep = [{"oracle_tok_s": r["oracle_tok_s"], "goodput_over": goodput_over(r),
                "oracle_over_static": r["oracle_tok_s"] / r["policies"]["static"]["tok_s"],
                "ratio_to_oracle": {n: r["policies"][n]["ratio_to_oracle"] for n in names}} for r in repeats]
    policies: dict[str, Any] = {}
    for name in names:
        runs = sorted(repeats, key=lambda r: r["policies"][name]["ratio_to_oracle"])
        policies[name] = {**runs[(len(runs) - 1) // 2]["policies"][name],
                          "ratio_to_oracle_repeats": [r["policies"][name]["ratio_to_oracle"] for r in repeats]}
    return {
        "oracle_tok_s": med(r["oracle_tok_s"] for r in repeats), "rounds": repeats[0]["rounds"],
        "policies": policies,
        "goodput_over": {o: med(r["goodput_over"][o] for r in per_rep) for o in per_rep[0]["goodput_over"]},
        "oracle_over_static": med(r["oracle_over_static"] for r in per_rep),
        "repeats": per_rep,
    }


def plot_regret(panels: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]], path: Path) -> None:
    """One panel per section (simulator, engine): cumulative regret against rounds for every policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {k: v for k, v in panels.items() if v}
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 4.5), squeeze=False)
    for ax, (section, curves) in zip(axes[0], panels.items(), strict=True):
        for name, (x, y) in curves.items():
            ax.plot(x, y, label=name)
        ax.set_xlabel("rounds")
        ax.set_ylabel("cumulative regret (oracle-round equivalents lost)")
        ax.set_title(f"Policies vs per-bucket oracle ({section})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(section: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{title}: oracle {section['oracle_tok_s']:.1f} tok/s over {section['rounds']} rounds")
    for col in ("policy", "tok/s", "x oracle", "rounds to 90% cold (med/worst/never)",
                "after update (med/worst/never)", "k changes /1000", "regret 200 rounds (cold/update)"):
        t.add_column(col)
    for name, e in section["policies"].items():
        def f(d: dict[str, Any]) -> str:
            return f"{d['median']}/{d['worst']}/{d['never']}"
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x:.1%}"
        label = f"{name} (k={e['k']})" if "k" in e else name
        er = e.get("early_regret", {})
        t.add_row(label, f"{e['tok_s']:.1f}", f"{e['ratio_to_oracle']:.3f}", f(e["rounds_to_90_cold"]),
                  f(e["rounds_to_90_after_update"]), f"{e['k_changes_per_1000']:.1f}",
                  f"{pct(er.get('cold'))}/{pct(er.get('after_update'))}")
    Console().print(t)
    print(f"  ceiling oracle / static: {section['oracle_over_static']:.3f}; "
          + ", ".join(f"goodput / {o}: {r:.4f}" for o, r in section["goodput_over"].items()))
    if "busy" in section:
        b = section["busy"]
        print(f"  with a busy neighbour ({b['busy_share']:.0%} of windows): goodput x oracle "
              f"{b['policies']['goodput']['ratio_to_oracle']:.3f} (falls {b['goodput_ratio_fall']:.1%}), "
              f"goodput / static {b['goodput_over_static']:.3f}")


def _policy_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(REGISTRY))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policies {unknown}; registered: {sorted(REGISTRY)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--json", default="bench/results/policies.json")
    ap.add_argument("--quick", action="store_true",
                    help="60k simulated rounds instead of 300k; a 12-window engine run instead of 48")
    ap.add_argument("--calibration", default="bench/results/engine.json")
    ap.add_argument("--checkpoints", default=None, help="checkpoint folder for the engine section (default: shipped)")
    ap.add_argument("--no-engine", action="store_true", help="simulator section only")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, choices=PROFILE_NAMES,
                    help="the target/draft pair: calibration cells and engine (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-plan", choices=sorted(ENGINE_PLANS), default=None,
                    help="engine section plan (default: quick with --quick, else full); long: >= 3,000 rounds per "
                         "policy per repeat, 3 repeats (hours on one CPU thread: narrow it with --policies)")
    ap.add_argument("--policies", default=None, type=_policy_list,
                    help="comma-separated lineup for the engine section (oracle, static and goodput always run)")
    ap.add_argument("--no-sim", action="store_true", help="engine section only")
    args = ap.parse_args(argv)
    if args.no_sim and args.no_engine:
        ap.error("--no-sim and --no-engine leave nothing to run")
    sim: dict[str, Any] | None = None
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if not args.no_sim:
        cal = Calibration(args.calibration, profile=args.profile)
        sim, curves = run_simulator_section(cal, args.quick, args.seed)
        sim["profile"] = cal.profile
        add_summary(sim)
        print_table(sim, "simulator")
    engine, engine_curves = (None, {}) if args.no_engine else run_engine_section(
        args.quick, args.seed, args.checkpoints, args.profile, plan_name=args.engine_plan, only=args.policies)
    if engine is not None:
        add_summary(engine)
        print_table(engine, f"engine ({engine['device']}, {engine['seconds']:.0f} s)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable({"simulator": sim, "engine": engine}), indent=1) + "\n")
    plot_regret({"simulator": curves, "engine": engine_curves}, out.with_name(out.stem + "_regret.png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
