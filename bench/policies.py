"""Benchmark: every policy on the calibrated simulator against the per-bucket oracle (and, later, the engine).

Run: ``python -m bench.policies [--quick] [--calibration bench/results/engine.json] [--json PATH]``.
Writes the JSON (``{"simulator": {...}, "engine": {...}}``) and a cumulative-regret PNG next to it.

- **oracle**: per cost cell (versions, batch size, context) the best static per-type k by exhaustive sweep
  on the same workload (analytic expectations from the calibration), then simulated like any policy.
- **static**: the best single global k by sweep (reported as ``k``).
- **batch_table**: the best k per batch-size bucket across types, contexts and versions (what a careful
  operator would write into vLLM's ``num_speculative_tokens_per_batch_size``).
- Metrics per policy: tok_s, ratio_to_oracle, rounds_to_90_cold / _after_update (per bucket, rounds of presence
  until a 3-window rolling mean of analytic goodput reaches 90% of the oracle's; median and worst over buckets),
  k_changes_per_1000 (bucket-rounds).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.simulator import (
    BASE_VERSION,
    WINDOW_S,
    Calibration,
    SimResult,
    WindowSpec,
    buckets_of,
    expected_goodput,
    simulate,
    to_jsonable,
    workload,
)
from policies import REGISTRY, BatchTablePolicy, Policy, StaticPolicy
from policies.base import Decision
from telemetry.records import DEFAULT_BUCKETS, Bucket

K_MAX = 8
ROLLING = 3  # windows averaged when checking "reached 90% of oracle"


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
    edges = DEFAULT_BUCKETS.batch_edges
    sched, lo = [], 1
    for e in edges:
        group = [s for s in specs if DEFAULT_BUCKETS.batch_bucket(s.batch_size) == e]
        k = max(range(K_MAX + 1), key=lambda kk: _time_weighted(cal, group, lambda s: [kk] * n)) if group else 1
        sched.append([lo, e, k])
        lo = e + 1
    return sched


def bucket_metrics(res: SimResult, oracle: SimResult, specs: Sequence[WindowSpec]) -> dict[str, Any]:
    ratio = res.expected_goodput / oracle.expected_goodput
    per_bucket: dict[str, list[tuple[float, int, float]]] = defaultdict(list)  # key -> [(ratio, rounds, k)]
    for wi, ks in enumerate(res.ks):
        for key, k in ks.items():
            per_bucket[key].append((float(ratio[wi]), int(res.rounds[wi]), float(k)))
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
        reached = int(rounds[hit[0] + min(ROLLING, r.size) - 1]) if hit.size else None
        (cold if key.startswith(BASE_VERSION + "|") else after).append(reached)

    def summary(xs: list[int | None]) -> dict[str, Any]:
        done = [x for x in xs if x is not None]
        return {"median": float(np.median(done)) if done else None, "worst": max(done) if done else None,
                "never": len(xs) - len(done), "buckets": len(xs)}

    return {"rounds_to_90_cold": summary(cold), "rounds_to_90_after_update": summary(after),
            "k_changes_per_1000": 1000.0 * changes / max(bucket_rounds, 1)}


def run_simulator_section(cal: Calibration, quick: bool, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    total = 60_000 if quick else 300_000
    specs = workload(cal.types, total, seed)
    static_k = best_static_k(cal, specs)
    schedule = best_batch_schedule(cal, specs)
    policies: dict[str, Policy] = {}
    for name, cls in REGISTRY.items():
        if name == "static":
            policies[name] = StaticPolicy(k=static_k, k_max=K_MAX, seed=seed)
        elif name == "batch_table":
            policies[name] = BatchTablePolicy(schedule=schedule, k_max=K_MAX, seed=seed)
        else:
            policies[name] = cls(k_max=K_MAX, seed=seed)
    oracle = simulate(TablePolicy(oracle_table(cal, specs)), cal, specs, seed=seed)
    out: dict[str, Any] = {"oracle_tok_s": oracle.tok_s, "rounds": int(oracle.rounds.sum()),
                           "windows": len(specs), "window_s": WINDOW_S, "calibration_device": cal.device,
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
    return out, curves


def run_engine_section(policies: Sequence[str], quick: bool) -> dict[str, Any] | None:
    """The same comparison on the real engine (shorter, same workload shape via :func:`bench.simulator.workload`).

    TODO(lead): wire ``engine.loop`` in: for each policy, drive the engine with the ``WindowSpec`` sequence from
    ``workload(...)`` (batch size, context class, request mix, target version per window), feed its windows to
    the policy and report the same metrics. Returns None until ``engine.loop`` exists.
    """
    if importlib.util.find_spec("engine.loop") is None:
        return None
    return None  # TODO(lead): engine run goes here


def plot_regret(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, (x, y) in curves.items():
        ax.plot(x, y, label=name)
    ax.set_xlabel("rounds")
    ax.set_ylabel("cumulative regret (oracle-round equivalents lost)")
    ax.set_title("Policies vs per-bucket oracle (simulator)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(sim: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"simulator: oracle {sim['oracle_tok_s']:.1f} tok/s over {sim['rounds']} rounds")
    for col in ("policy", "tok/s", "x oracle", "rounds to 90% cold (med/worst/never)",
                "after update (med/worst/never)", "k changes /1000"):
        t.add_column(col)
    for name, e in sim["policies"].items():
        def f(d: dict[str, Any]) -> str:
            return f"{d['median']}/{d['worst']}/{d['never']}"
        label = f"{name} (k={e['k']})" if "k" in e else name
        t.add_row(label, f"{e['tok_s']:.1f}", f"{e['ratio_to_oracle']:.3f}", f(e["rounds_to_90_cold"]),
                  f(e["rounds_to_90_after_update"]), f"{e['k_changes_per_1000']:.1f}")
    Console().print(t)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--json", default="bench/results/policies.json")
    ap.add_argument("--quick", action="store_true", help="60k simulated rounds instead of 300k")
    ap.add_argument("--calibration", default="bench/results/engine.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cal = Calibration(args.calibration)
    sim, curves = run_simulator_section(cal, args.quick, args.seed)
    engine = run_engine_section(list(REGISTRY), args.quick)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable({"simulator": sim, "engine": engine}), indent=1) + "\n")
    plot_regret(curves, out.with_name(out.stem + "_regret.png"))
    print_table(sim)
    g, pol = sim["policies"]["goodput"], sim["policies"]
    for other in ("static", "hf_heuristic", "sglang_adaptive", "batch_table", "ucb"):
        print(f"goodput / {other}: {g['tok_s'] / pol[other]['tok_s']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
