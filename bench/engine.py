"""`spectune bench engine`: tokens/s of plain vs speculative decoding on the reference engine, side by side.

For every cell (mode, request type, batch size, context) one engine is filled with real held-out prompts of that
type, prefilled once, and then decodes round after round with the draft length cycling through 0..8 in a
shuffled order per repetition, so that every k sees the same rows, the same contexts and the same machine state.
tokens/s of a k is its mean tokens emitted per round over its median round wall time.
The main setting is exact speculative sampling at temperature 1.0 (``"mode": "sample"``); greedy is reported
beside it.

Besides the figures the issue asks for, each cell keeps the acceptance histogram and the mean seconds per round
(draft / verify / other) per k: the policy simulator is calibrated from them. ``version_acceptance`` holds the
acceptance histograms of the updated target (target-v2) with the same draft, for drift and model-update studies.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._common import write_results

RESULTS = Path(__file__).resolve().parent / "results"
K_VALUES = tuple(range(0, 9))  # 0 = plain decoding
REQUEST_TYPES = ("code", "prose", "structured")
CONTEXTS = {"short": 128, "long": 1024}  # prompt bytes; the models train on windows of 256 and then 1024


@dataclass(frozen=True)
class BenchPlan:
    """What one run measures."""

    modes: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    contexts: tuple[str, ...]
    reps: dict[int, int]  # batch size -> repetitions of the k cycle
    version_reps: int  # repetitions for the updated target's acceptance
    seed: int = 0


FULL = BenchPlan(
    modes=("sample", "greedy"),
    batch_sizes=(1, 4, 16, 64),
    contexts=("short", "long"),
    reps={1: 30, 4: 16, 16: 8, 64: 3},
    version_reps=16,
)
QUICK = BenchPlan(modes=("sample",), batch_sizes=(1, 16), contexts=("short",), reps={1: 3, 16: 2}, version_reps=2)


def _run_cell(models: Any, mode: str, rtype: str, bsz: int, ctx: str, reps: int, seed: int,
              target: Any = None, version: str | None = None) -> dict[int, dict[str, Any]]:
    """Measure one cell. Returns per-k emitted tokens, wall seconds, round seconds and acceptance histograms."""
    import torch

    from engine.corpus import held_out_prompts
    from engine.loop import EngineConfig, Request, SpecEngine

    k_max = max(K_VALUES)
    prompt_len = CONTEXTS[ctx]
    per_cycle = sum(k + 1 for k in K_VALUES)  # most tokens a row can emit in one cycle through every k
    room = models.target.cfg.max_seq_len - prompt_len - 2 * k_max - 8
    reps = max(1, min(reps, room // per_cycle - 1))  # long prompts leave room for fewer cycles
    # Enough new tokens that no row finishes during the measurement: every round emits at most k_max + 1.
    max_new = (reps + 1) * per_cycle + 8
    cfg = EngineConfig(max_batch=bsz, max_context=prompt_len + max_new + 2 * k_max + 4, k_max=k_max, seed=seed)
    eng = SpecEngine(target if target is not None else models.target, models.draft, cfg,
                     version or models.target_version, models.draft_version)
    temperature = 1.0 if mode == "sample" else 0.0
    for j, p in enumerate(held_out_prompts(rtype, bsz, prompt_len, seed=seed + 17 * bsz)):
        ok = eng.submit(Request(f"{rtype}-{j}", rtype, p, max_new, temperature=temperature, stop_at_eos=False))
        assert ok, eng.rejected
    state: dict[str, int] = {"k": 0}

    def policy(_t: str, _b: int, _c: int) -> int:
        return state["k"]

    # Warm-up: prefill (k = 0) and one round of each k so the draft has caught up and allocators are warm.
    for k in K_VALUES:
        state["k"] = k
        eng.step(policy)
    rng = random.Random(seed)
    out: dict[int, dict[str, Any]] = {
        k: {"emitted": 0, "wall": 0.0, "draft": 0.0, "verify": 0.0, "other": 0.0, "rounds": 0,
            "hist": [0] * (k + 1), "contexts": [], "round_wall": []}
        for k in K_VALUES
    }
    for _ in range(reps):
        order = list(K_VALUES)
        rng.shuffle(order)
        for k in order:
            state["k"] = k
            rec = eng.step(policy)
            assert rec is not None and rec.batch_size == bsz, "a row finished during the measurement"
            o = out[k]
            o["emitted"] += rec.emitted
            o["wall"] += rec.wall_s
            o["draft"] += rec.draft_s
            o["verify"] += rec.verify_s
            o["other"] += rec.other_s + rec.prefill_s  # the calibration's "other" has always included admission
            o["rounds"] += 1
            o["contexts"].append(rec.max_context)
            o["round_wall"].append(rec.wall_s)
            for row in rec.rows:
                o["hist"][row.accepted] += 1
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _cell_json(mode: str, rtype: str, bsz: int, ctx: str, m: dict[int, dict[str, Any]]) -> dict[str, Any]:
    # Mean tokens emitted per round over the median round time: the mean keeps acceptance unbiased (a median of
    # per-round rates is not, emitted counts being discrete), the median keeps a round that another process
    # interrupted from moving the figure.
    tok_s = {k: (m[k]["emitted"] / m[k]["rounds"]) / statistics.median(m[k]["round_wall"]) for k in K_VALUES}
    plain = tok_s[0]
    spec = {str(k): round(tok_s[k], 2) for k in K_VALUES if k > 0}
    mal = {str(k): round(m[k]["emitted"] / max(1, sum(m[k]["hist"])), 4) for k in K_VALUES if k > 0}
    best_k = max(K_VALUES, key=lambda k: tok_s[k])
    best_spec = max((k for k in K_VALUES if k > 0), key=lambda k: tok_s[k])
    return {
        "mode": mode,
        "request_type": rtype,
        "batch_size": bsz,
        "context": ctx,
        "context_len": int(statistics.median(c for k in K_VALUES for c in m[k]["contexts"])),
        "plain_tok_s": round(plain, 2),
        "spec_tok_s": spec,
        "mean_accept_len": mal,
        "best_k": best_k,
        "best_speedup": round(tok_s[best_spec] / plain, 4),
        "accept_hist": {str(k): m[k]["hist"] for k in K_VALUES if k > 0},
        "round_s": {
            str(k): {p: m[k][p] / m[k]["rounds"] for p in ("draft", "verify", "other")} for k in K_VALUES
        },
    }


def run(plan: BenchPlan, checkpoints: str | None, device: str | None, progress: bool = True) -> dict[str, Any]:
    """Run the plan and return the JSON document."""
    import torch
    from rich.progress import Progress

    from engine.loader import load_models
    from engine.loop import EngineConfig, SpecEngine

    models = load_models(checkpoints, device, with_update=True)
    cells: list[dict[str, Any]] = []
    todo = [(m, t, b, c) for m in plan.modes for t in REQUEST_TYPES for b in plan.batch_sizes for c in plan.contexts]
    t0 = time.perf_counter()
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("engine cells", total=len(todo) + len(REQUEST_TYPES))
        for mode, rtype, bsz, ctx in todo:
            bar.update(task, description=f"{mode} {rtype} batch {bsz} {ctx}")
            m = _run_cell(models, mode, rtype, bsz, ctx, plan.reps[bsz], plan.seed)
            cells.append(_cell_json(mode, rtype, bsz, ctx, m))
            bar.advance(task)
        version_acc: dict[str, Any] = {}
        assert models.target_v2 is not None
        for rtype in REQUEST_TYPES:
            bar.update(task, description=f"target-v2 acceptance {rtype}")
            vbsz = min(8, max(plan.batch_sizes))
            for name, tgt in ((models.target_version, models.target), (models.target_v2_version, models.target_v2)):
                m = _run_cell(models, "sample", rtype, vbsz, "short", plan.version_reps, plan.seed + 1, tgt, name)
                version_acc.setdefault(name, {})[rtype] = {str(k): m[k]["hist"] for k in K_VALUES if k > 0}
            bar.advance(task)
    biggest = max(plan.batch_sizes)
    eng = SpecEngine(models.target, models.draft,
                     EngineConfig(max_batch=biggest, max_context=CONTEXTS["long"] + 512), "m", "m")
    return {
        "device": models.device.label,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "plan": {
            "modes": plan.modes,
            "batch_sizes": plan.batch_sizes,
            "contexts": {c: CONTEXTS[c] for c in plan.contexts},
            "reps": {str(b): r for b, r in plan.reps.items()},
            "k_values": K_VALUES,
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "memory_bytes": {"batch_size": biggest, "max_context": CONTEXTS["long"] + 512, **eng.memory_report()},
        "cells": cells,
        "version_acceptance": version_acc,
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({c["context"] for c in doc["cells"]}, key=list(CONTEXTS).index)
    modes = [m for m in ("sample", "greedy") if any(c["mode"] == m for c in doc["cells"])]
    fig, axes = plt.subplots(len(modes) * len(contexts), len(REQUEST_TYPES),
                             figsize=(4.2 * len(REQUEST_TYPES), 3.2 * len(modes) * len(contexts)), squeeze=False)
    for i, (mode, ctx) in enumerate((m, c) for m in modes for c in contexts):
        for j, rtype in enumerate(REQUEST_TYPES):
            ax = axes[i][j]
            for cell in doc["cells"]:
                if (cell["mode"], cell["context"], cell["request_type"]) != (mode, ctx, rtype):
                    continue
                ks = [0, *(int(k) for k in cell["spec_tok_s"])]
                ratio = [1.0, *(v / cell["plain_tok_s"] for v in cell["spec_tok_s"].values())]
                ax.plot(ks, ratio, marker="o", ms=3, label=f"batch {cell['batch_size']}")
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_title(f"{rtype} · {ctx} context · {mode}", fontsize=9)
            ax.set_xlabel("draft length k (0 = plain)")
            ax.set_ylabel("tokens/s ÷ plain")
            ax.legend(fontsize=7)
    fig.suptitle(f"spectune reference engine — {doc['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="speculative vs plain decoding (tokens/s)")
    for col in ("mode", "type", "batch", "ctx", "plain tok/s", "best k", "best spec ×", "accept len @k=4"):
        t.add_column(col, justify="right")
    for c in doc["cells"]:
        t.add_row(c["mode"], c["request_type"], str(c["batch_size"]), c["context"], f"{c['plain_tok_s']:.1f}",
                  str(c["best_k"]), f"{c['best_speedup']:.2f}", f"{c['mean_accept_len'].get('4', 0):.2f}")
    Console().print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="spectune bench engine", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=RESULTS / "engine.json", help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="a reduced plan that runs in about a minute")
    ap.add_argument("--checkpoints", default=None, help="checkpoint folder (default: the shipped checkpoints)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    plan = BenchPlan(plan.modes, plan.batch_sizes, plan.contexts, plan.reps, plan.version_reps, args.seed)
    doc = run(plan, args.checkpoints, args.device)
    write_results(doc, args.json, plot, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
