"""`spectune bench engine`: tokens/s of plain vs speculative decoding on the reference engine, side by side.

Two profiles (``engine/profiles.py``): ``small`` (the trained 2.8M/0.4M pair) and ``xl`` (target-v1 widened 4x
function-preservingly, grouped-query attention: the same acceptance at a 38M model's cost, 94x the draft).

**Uniform cells** (one request type, batch size, context): one engine is filled with real held-out prompts of
that type, prefilled once, and then decodes round after round with the draft length cycling through 0..8 in a
shuffled order per repetition, so that every k sees the same rows, the same contexts and the same machine state.
tokens/s of a k is its mean tokens emitted per round over its median round wall time. The best k > 0 of the
sweep is then measured again beside plain decoding on the same rows restarted from their prompts
(``"confirmed"``): the sweep's maximum over eight noisy estimates is biased upward, the fresh pair is not. A
batch-1 cell is one row, one draw of its request type, so it runs on several engines filled with different prompts
(``Section.prompt_sets``) and merges their rounds.

**Mixed cells** (batch 16 and 64, one third each of code, prose and structured): the same, with one k per request
type. Verification is packed (the target's token-wise work is sum over rows of k + 1; attention runs per
contiguous run of rows with the same k), so a batch can draft deep for structured rows while code rows run
shallow or plain. The rows sit in one block per type, as the engine's ``grouped`` slot layout places them, and
restart from their prompts every ``MIXED_SPAN`` tokens so that every probe sees the same short context.
The final pair is measured again on rows with the types interleaved (``"interleaved"``, the ``first_free``
layout), where attention and drafting cannot split by type. The best uniform k is found by a sweep over
``MIXED_GRID``; the best per-type triple by coordinate search over ``MIXED_GRID``^3 from it, on the same rows, where
a probe's winner replaces the current triple only if it is still faster when the two are measured again side by
side. The two winners are then measured again side by side (fresh interleaved rounds), and those figures are
reported: the maximum over many noisy measurements is biased upward, a fresh paired measurement is not.

The main setting is exact speculative sampling at temperature 1.0 (``"mode": "sample"``); greedy is reported
beside it for the small profile. Each uniform cell keeps the acceptance histogram and the mean seconds per round
(draft / verify / other) per k: the policy simulator is calibrated from them. ``version_acceptance`` holds the
acceptance histograms of the updated target (target-v2) with the same draft, for drift and model-update studies
(measured on the small profile: xl computes the same function, so its acceptance is the same).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import write_results
from controller.offline.simulator import CONTEXT_PROMPT_BYTES
from engine.profiles import PROFILE_NAMES, UNLABELLED_PROFILE

RESULTS = Path(__file__).resolve().parent / "results"
K_VALUES = tuple(range(0, 9))  # 0 = plain decoding
REQUEST_TYPES = ("code", "prose", "structured")
CONTEXTS = CONTEXT_PROMPT_BYTES  # prompt bytes per context class; the simulator reads the cells by the same classes
MIXED_GRID = (0, 1, 2, 3, 4, 6, 8)  # ks searched per request type in mixed cells
MIXED = "mixed"  # request_type of a mixed cell
MIXED_SPAN = 128  # new tokens a mixed cell's rows decode before they restart from their prompts (context 129-265)

KConfig = dict[str, int]  # request type -> k for one measured configuration


@dataclass(frozen=True)
class Section:
    """What one profile measures."""

    profile: str
    modes: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    contexts: tuple[str, ...]
    reps: dict[int, int]  # batch size -> repetitions of the k cycle
    # batch size -> engines filled with different prompts, each measured ``reps`` cycles (absent: 1). One row is
    # one draw of its request type: a batch-1 cell needs several to say something about the type.
    prompt_sets: dict[int, int] = field(default_factory=dict)
    mixed_batches: tuple[int, ...] = ()  # batch sizes of the mixed cells (short context, sample mode)
    mixed_reps: tuple[int, int, int] = (3, 3, 10)  # reps: uniform sweep, search probe, confirmation and final pair
    mixed_passes: int = 2  # coordinate-search passes over the three request types


@dataclass(frozen=True)
class BenchPlan:
    """What one run measures."""

    sections: tuple[Section, ...]
    version_reps: int  # repetitions for the updated target's acceptance (small profile)
    seed: int = 0
    profiles: tuple[str, ...] = field(default=())  # run only these profiles (empty: all sections)

    def selected(self) -> tuple[Section, ...]:
        return tuple(s for s in self.sections if not self.profiles or s.profile in self.profiles)


FULL = BenchPlan(
    sections=(
        Section("small", ("sample", "greedy"), (1, 4, 16, 64), ("short", "long"), {1: 30, 4: 16, 16: 8, 64: 3},
                prompt_sets={1: 6}, mixed_batches=(16, 64)),
        Section("xl", ("sample",), (1, 4, 16, 64), ("short", "long"), {1: 40, 4: 16, 16: 5, 64: 3},
                prompt_sets={1: 4}, mixed_batches=(16, 64)),
    ),
    version_reps=16,
)
QUICK = BenchPlan(
    sections=(
        Section("small", ("sample",), (1, 16), ("short",), {1: 3, 16: 2}),
        Section("xl", ("sample",), (1, 64), ("short",), {1: 2, 64: 1}, mixed_batches=(64,), mixed_reps=(1, 1, 2),
                mixed_passes=1),
    ),
    version_reps=2,
)


class _Rows:
    """One engine filled with prompts, decoding round after round under configurations chosen by the caller."""

    def __init__(self, models: Any, mode: str, types: Sequence[str], ctx: str, max_new: int, seed: int,
                 target: Any = None, version: str | None = None, restart_every: int | None = None,
                 slot_layout: str = "grouped") -> None:
        from engine.corpus import held_out_prompts
        from engine.loop import EngineConfig, Request, SpecEngine

        k_max = max(K_VALUES)
        prompt_len = CONTEXTS[ctx]
        cfg = EngineConfig(max_batch=len(types), max_context=prompt_len + max_new + 2 * k_max + 4, k_max=k_max,
                           seed=seed, slot_layout=slot_layout)
        self.engine = SpecEngine(target if target is not None else models.target, models.draft, cfg,
                                 version or models.target_version, models.draft_version)
        temperature = 1.0 if mode == "sample" else 0.0
        by_type = {t: iter(held_out_prompts(t, types.count(t), prompt_len, seed=seed + 17 * len(types)))
                   for t in set(types)}
        for j, t in enumerate(types):
            req = Request(f"{t}-{j}", t, next(by_type[t]), max_new, temperature=temperature, stop_at_eos=False)
            assert self.engine.submit(req), self.engine.rejected
        self.batch = len(types)
        self.k: KConfig = {}
        # Rows go back to their prompts once one has generated this many tokens (None: never), so that every
        # measured round sees the context the cell is named for, not one that grows while the cell runs.
        self.restart_every = restart_every

    def policy(self, rtype: str, _b: int, _c: int) -> int:
        return self.k[rtype]

    def step(self, k: KConfig) -> Any:
        eng = self.engine
        if self.restart_every is not None and any(
                s is not None and len(s.generated) >= self.restart_every for s in eng.slots):
            eng.restart_active()
        self.k = k
        rec = self.engine.step(self.policy)
        assert rec is not None and rec.batch_size == self.batch, "a row finished during the measurement"
        return rec

    def measure(self, configs: Sequence[KConfig], reps: int, rng: random.Random) -> list[dict[str, Any]]:
        """Each configuration ``reps`` times, in a shuffled order per repetition. Returns per-config totals."""
        out: list[dict[str, Any]] = [
            {"emitted": 0, "draft": 0.0, "verify": 0.0, "other": 0.0, "rounds": 0, "contexts": [],
             "round_wall": [], "hist": {}, "emitted_by_type": {}, "rows_by_type": {}}
            for _ in configs
        ]
        for _ in range(reps):
            order = list(range(len(configs)))
            rng.shuffle(order)
            for i in order:
                rec = self.step(configs[i])
                o = out[i]
                o["emitted"] += rec.emitted
                o["draft"] += rec.draft_s
                o["verify"] += rec.verify_s
                o["other"] += rec.other_s + rec.prefill_s  # the calibration's "other" has always included admission
                o["rounds"] += 1
                o["contexts"].append(rec.max_context)
                o["round_wall"].append(rec.wall_s)
                for row in rec.rows:
                    h = o["hist"].setdefault(row.request_type, [0] * (row.k + 1))
                    h[row.accepted] += 1
                    o["emitted_by_type"][row.request_type] = o["emitted_by_type"].get(row.request_type, 0) + row.emitted
                    o["rows_by_type"][row.request_type] = o["rows_by_type"].get(row.request_type, 0) + 1
        return out


def _tok_s(m: dict[str, Any]) -> float:
    # Mean tokens emitted per round over the median round time: the mean keeps acceptance unbiased (a median of
    # per-round rates is not, emitted counts being discrete), the median keeps a round that another process
    # interrupted from moving the figure.
    return (m["emitted"] / m["rounds"]) / statistics.median(m["round_wall"])


def _release(rows: _Rows) -> None:
    import torch

    del rows.engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _uniform(ks: Sequence[int]) -> list[KConfig]:
    return [dict.fromkeys(REQUEST_TYPES, k) for k in ks]


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    """Add one prompt set's totals of a configuration (see :meth:`_Rows.measure`) to another's."""
    for key, v in more.items():
        if key == "hist":  # type -> rows by number of drafts accepted
            for t, h in v.items():
                into[key][t] = [a + b for a, b in zip(into[key].get(t, [0] * len(h)), h, strict=True)]
        elif isinstance(v, dict):  # type -> a count
            for t, n in v.items():
                into[key][t] = into[key].get(t, 0) + n
        else:  # numbers add, lists concatenate
            into[key] += v


def _measure_sets(sets: Sequence[_Rows], configs: Sequence[KConfig], reps: int,
                  rng: random.Random) -> list[dict[str, Any]]:
    """``reps`` shuffled cycles of ``configs`` on every prompt set in turn, totals merged across the sets."""
    total = sets[0].measure(configs, reps, rng)
    for rows in sets[1:]:
        for into, more in zip(total, rows.measure(configs, reps, rng), strict=True):
            _merge(into, more)
    return total


def _run_cell(models: Any, mode: str, rtype: str, bsz: int, ctx: str, reps: int, seed: int,
              target: Any = None, version: str | None = None, confirm: bool = False,
              prompt_sets: int = 1) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None]:
    """Measure one uniform cell. Returns per-k emitted tokens, round seconds and the acceptance histogram, and
    with ``confirm`` a fresh side-by-side measurement of plain decoding and the sweep's best k > 0.

    The sweep's best speedup is the largest of eight noisy estimates (at batch 1, 40 rounds a k: the mean
    tokens a round of one k moves +-10%), so it is biased upward; the confirmation restarts the rows from their
    prompts and measures only the two, ``reps`` rounds each, which is unbiased for the chosen k.

    ``prompt_sets`` engines are filled with different held-out prompts (seeds ``seed``, ``seed + 1000``, ...), each
    measured ``reps`` cycles, and their totals merged. At batch 1 one prompt is one draw of the request type: on
    the small profile, code at k = 5 ran 1.14x to 1.58x over six prompts (k = 8 accepted 2.98 to 5.67 tokens a
    round), so a single prompt's figure says more about that prompt than about code.
    """
    if prompt_sets < 1:
        raise ValueError(f"prompt_sets must be at least 1, got {prompt_sets}")
    per_cycle = sum(k + 1 for k in K_VALUES)  # most tokens a row can emit in one cycle through every k
    room = models.target.cfg.max_seq_len - CONTEXTS[ctx] - 2 * max(K_VALUES) - 8
    reps = max(1, min(reps, room // per_cycle - 1))  # long prompts leave room for fewer cycles
    configs = _uniform(K_VALUES)
    sets = []
    for s in range(prompt_sets):
        # Enough new tokens that no row finishes during the measurement (warm-up cycle included).
        rows = _Rows(models, mode, [rtype] * bsz, ctx, (reps + 1) * per_cycle + 8, seed + 1000 * s, target, version)
        # Warm-up: prefill (k = 0) and one round of each k so the draft has caught up and allocators are warm.
        for c in configs:
            rows.step(c)
        sets.append(rows)
    rng = random.Random(seed)
    res = _measure_sets(sets, configs, reps, rng)
    checked = None
    if confirm:
        best = max((k for k in K_VALUES if k > 0), key=lambda k: _tok_s(res[K_VALUES.index(k)]))
        pair = _uniform([0, best])
        for rows in sets:
            rows.engine.restart_active()
            for c in pair:
                rows.step(c)
        plain, spec = _measure_sets(sets, pair, reps, rng)
        checked = {"k": best, "plain_tok_s": round(_tok_s(plain), 2), "spec_tok_s": round(_tok_s(spec), 2),
                   "speedup": round(_tok_s(spec) / _tok_s(plain), 4),
                   "mean_accept_len": round(spec["emitted"] / max(1, spec["rounds"] * bsz), 4),
                   "context_len": int(statistics.median(plain["contexts"] + spec["contexts"]))}
    for rows in sets:
        _release(rows)
    out = {}
    for k, m in zip(K_VALUES, res, strict=True):
        m["hist"] = m["hist"].get(rtype, [0] * (k + 1))
        out[k] = m
    return out, checked


def _cell_json(profile: str, mode: str, rtype: str, bsz: int, ctx: str, m: dict[int, dict[str, Any]],
               confirmed: dict[str, Any] | None = None) -> dict[str, Any]:
    tok_s = {k: _tok_s(m[k]) for k in K_VALUES}
    plain = tok_s[0]
    best_k = max(K_VALUES, key=lambda k: tok_s[k])
    best_spec = max((k for k in K_VALUES if k > 0), key=lambda k: tok_s[k])
    return {
        "profile": profile,
        "mode": mode,
        "request_type": rtype,
        "batch_size": bsz,
        "context": ctx,
        "context_len": int(statistics.median(c for k in K_VALUES for c in m[k]["contexts"])),
        "plain_tok_s": round(plain, 2),
        "spec_tok_s": {str(k): round(tok_s[k], 2) for k in K_VALUES if k > 0},
        "mean_accept_len": {str(k): round(m[k]["emitted"] / max(1, sum(m[k]["hist"])), 4) for k in K_VALUES if k > 0},
        "best_k": best_k,
        "best_speedup": round(tok_s[best_spec] / plain, 4),
        "accept_hist": {str(k): m[k]["hist"] for k in K_VALUES if k > 0},
        "round_s": {
            str(k): {p: m[k][p] / m[k]["rounds"] for p in ("draft", "verify", "other")} for k in K_VALUES
        },
        **({"confirmed": confirmed} if confirmed is not None else {}),
    }


def _mixed_types(bsz: int, blocked: bool = True) -> list[str]:
    """One third each of code, prose and structured: in blocks of one type (the batch rows of a scheduler that
    keeps a type's rows together), or interleaved (every type spread over the batch, the engine's worst case)."""
    mixed = [REQUEST_TYPES[j % len(REQUEST_TYPES)] for j in range(bsz)]
    return sorted(mixed, key=REQUEST_TYPES.index) if blocked else mixed


def coordinate_search(tok_s_of: Callable[[Sequence[KConfig], int], list[float]], start: KConfig, passes: int,
                      probe_reps: int, confirm_reps: int) -> tuple[KConfig, list[dict[str, Any]]]:
    """Per-type ks by coordinate search over ``MIXED_GRID``, from ``start``; returns the triple and the search log.

    For each request type in turn, every k of the grid is measured ``probe_reps`` times with the other types held.
    The best of several noisy probes is biased upward (the winner's curse: with 3 probes per k at batch 64, a search
    that adopts probe winners unchecked can keep a triple that measures 0.88x the uniform k it started from), so a
    probe winner replaces the current triple only after the two are measured again side by side, ``confirm_reps``
    times each, and the winner is still faster: a fresh measurement of two configurations is unbiased.
    ``tok_s_of(configs, reps)`` measures configurations interleaved and returns tok/s.
    """
    triple = dict(start)
    log: list[dict[str, Any]] = []
    for _ in range(passes):
        for t in REQUEST_TYPES:
            cands = [{**triple, t: k} for k in MIXED_GRID]
            scores = tok_s_of(cands, probe_reps)
            winner = cands[max(range(len(cands)), key=lambda i: scores[i])]
            step: dict[str, Any] = {"vary": t, "tok_s": {str(k): round(v, 2) for k, v in zip(MIXED_GRID, scores,
                                                                                              strict=True)}}
            if winner != triple:
                held, challenger = tok_s_of([triple, winner], confirm_reps)
                step["confirm"] = {"held": round(held, 2), "challenger": round(challenger, 2)}
                if challenger > held:
                    triple = winner
            step["chosen"] = dict(triple)
            log.append(step)
    return triple, log


def _run_mixed(models: Any, sec: Section, bsz: int, seed: int) -> dict[str, Any]:
    """A mixed cell: best uniform k vs the best per-type k triple on the same rows (see the module docstring)."""
    sweep_reps, probe_reps, final_reps = sec.mixed_reps
    room = MIXED_SPAN + max(K_VALUES) + 2  # rows restart from their prompts after MIXED_SPAN new tokens
    rows = _Rows(models, "sample", _mixed_types(bsz), "short", room, seed, restart_every=MIXED_SPAN)
    rng = random.Random(seed)
    uniform = _uniform(MIXED_GRID)
    for c in uniform:  # warm-up, as in uniform cells
        rows.step(c)
    sweep = rows.measure(uniform, sweep_reps, rng)
    sweep_tok_s = {k: _tok_s(m) for k, m in zip(MIXED_GRID, sweep, strict=True)}
    best_uniform = max(MIXED_GRID, key=lambda k: sweep_tok_s[k])

    def tok_s_of(configs: Sequence[KConfig], reps: int) -> list[float]:
        return [_tok_s(m) for m in rows.measure(configs, reps, rng)]

    # A move is confirmed with as many rounds as the final pair: with a probe's 3, a slow moment of the machine
    # during the held triple's rounds is enough to let a worse triple in (xl batch 16: the held triple can measure
    # 981 tok/s against 1,556 in its own probe just before).
    triple, search = coordinate_search(tok_s_of, dict.fromkeys(REQUEST_TYPES, best_uniform), sec.mixed_passes,
                                       probe_reps, final_reps)
    # Plain, the best uniform k and the best triple side by side, fresh: only figures measured together compare.
    final = rows.measure([*_uniform([0, best_uniform]), triple], final_reps, rng)
    _release(rows)
    plain, uni_tok_s, per_type_tok_s = (_tok_s(m) for m in final)
    # The same two on rows with the types interleaved: attention and drafting then cannot run per type on
    # contiguous rows (see engine.model.attention_groups), so this is what per-type k is worth without a
    # type-aware slot layout.
    inter = _Rows(models, "sample", _mixed_types(bsz, blocked=False), "short", room, seed + 1,
                  restart_every=MIXED_SPAN, slot_layout="first_free")
    pair = [_uniform([best_uniform])[0], triple]
    for c in pair:
        inter.step(c)
    inter_uni, inter_per_type = (_tok_s(m) for m in inter.measure(pair, final_reps, rng))
    _release(inter)
    return {
        "profile": sec.profile,
        "mode": "sample",
        "request_type": MIXED,
        "types": {t: _mixed_types(bsz).count(t) for t in REQUEST_TYPES},
        "batch_size": bsz,
        "context": "short",
        "context_len": int(statistics.median(final[0]["contexts"])),
        "plain_tok_s": round(plain, 2),  # measured with the two winners, side by side
        "sweep_tok_s": {str(k): round(v, 2) for k, v in sweep_tok_s.items()},  # the search's first step
        "spec_tok_s": {str(best_uniform): round(uni_tok_s, 2)},
        "best_k": best_uniform,
        "best_speedup": round(uni_tok_s / plain, 4),
        "per_type_speedup": round(per_type_tok_s / plain, 4),
        "mean_accept_len": {t: round(final[2]["emitted_by_type"][t] / final[2]["rows_by_type"][t], 4)
                            for t in REQUEST_TYPES},
        "best_uniform_k": best_uniform,
        "best_uniform_tok_s": round(uni_tok_s, 2),
        "best_per_type_k": triple,
        "best_per_type_tok_s": round(per_type_tok_s, 2),
        "per_type_over_uniform": round(per_type_tok_s / uni_tok_s, 4),
        "interleaved": {"best_uniform_tok_s": round(inter_uni, 2), "best_per_type_tok_s": round(inter_per_type, 2),
                        "per_type_over_uniform": round(inter_per_type / inter_uni, 4)},
        "search": search,
    }


def run(plan: BenchPlan, checkpoints: str | None, device: str | None, progress: bool = True) -> dict[str, Any]:
    """Run the plan and return the JSON document."""
    import torch
    from rich.progress import Progress

    from engine.loader import load_models

    cells: list[dict[str, Any]] = []
    memory: dict[str, Any] = {}
    version_acc: dict[str, Any] = {}
    label = ""
    sections = plan.selected()
    t0 = time.perf_counter()
    with Progress(disable=not progress, transient=True) as bar:
        for sec in sections:
            models = load_models(checkpoints, device, with_update=sec.profile == "small", profile=sec.profile)
            label = models.device.label
            cells += _run_section(models, sec, plan.seed, bar)
            memory[sec.profile] = _memory(models, max(sec.batch_sizes))
            if sec.profile == "small" and models.target_v2 is not None:
                version_acc = _version_acceptance(models, plan, bar)
            del models
    return {
        "device": label,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "plan": {
            "sections": [
                {"profile": s.profile, "modes": s.modes, "batch_sizes": s.batch_sizes,
                 "contexts": {c: CONTEXTS[c] for c in s.contexts}, "reps": {str(b): r for b, r in s.reps.items()},
                 "prompt_sets": {str(b): s.prompt_sets.get(b, 1) for b in s.batch_sizes},
                 "mixed_batches": s.mixed_batches, "mixed_reps": s.mixed_reps, "mixed_passes": s.mixed_passes}
                for s in sections
            ],
            "k_values": K_VALUES,
            "mixed_grid": MIXED_GRID,
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "memory_bytes": memory,
        "cells": cells,
        "version_acceptance": version_acc,
    }


def _run_section(models: Any, sec: Section, seed: int, bar: Any) -> list[dict[str, Any]]:
    """Every uniform cell of ``sec``, then its mixed cells."""
    plan = [(m, t, b, c) for m in sec.modes for t in REQUEST_TYPES for b in sec.batch_sizes for c in sec.contexts]
    task = bar.add_task(sec.profile, total=len(plan) + len(sec.mixed_batches))
    cells = []
    for mode, rtype, bsz, ctx in plan:
        bar.update(task, description=f"{sec.profile} {mode} {rtype} batch {bsz} {ctx}")
        m, confirmed = _run_cell(models, mode, rtype, bsz, ctx, sec.reps[bsz], seed, confirm=True,
                                 prompt_sets=sec.prompt_sets.get(bsz, 1))
        cells.append(_cell_json(sec.profile, mode, rtype, bsz, ctx, m, confirmed))
        bar.advance(task)
    for bsz in sec.mixed_batches:
        bar.update(task, description=f"{sec.profile} mixed batch {bsz}")
        cells.append(_run_mixed(models, sec, bsz, seed))
        bar.advance(task)
    return cells


def _memory(models: Any, batch: int) -> dict[str, Any]:
    """Weights and KV cache of an engine at ``batch`` rows of the models' longest context (computed, not
    allocated: xl's cache at batch 64 is 1.2 GB)."""
    ctx = models.target.cfg.max_seq_len
    return {
        "batch_size": batch, "max_context": ctx,
        "target_params": models.target.num_params(), "draft_params": models.draft.num_params(),
        "target_weight_bytes": models.target.weight_bytes(), "draft_weight_bytes": models.draft.weight_bytes(),
        "target_kv_bytes": models.target.kv_cache_bytes(batch, ctx),
        "draft_kv_bytes": models.draft.kv_cache_bytes(batch, ctx),
    }


def _version_acceptance(models: Any, plan: BenchPlan, bar: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    task = bar.add_task("target-v2 acceptance", total=len(REQUEST_TYPES))
    vbsz = 8
    for rtype in REQUEST_TYPES:
        for name, tgt in ((models.target_version, models.target), (models.target_v2_version, models.target_v2)):
            m, _ = _run_cell(models, "sample", rtype, vbsz, "short", plan.version_reps, plan.seed + 1, tgt, name)
            out.setdefault(name, {})[rtype] = {str(k): m[k]["hist"] for k in K_VALUES if k > 0}
        bar.advance(task)
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uniform = [c for c in doc["cells"] if c["request_type"] != MIXED]
    mixed = [c for c in doc["cells"] if c["request_type"] == MIXED]
    panels = sorted({(c.get("profile", UNLABELLED_PROFILE), c["mode"], c["context"]) for c in uniform},
                    key=lambda p: (p[0] != "xl", p[1], list(CONTEXTS).index(p[2])))
    ncols = len(REQUEST_TYPES) + (1 if mixed else 0)
    fig, axes = plt.subplots(len(panels), ncols, figsize=(4.2 * ncols, 3.2 * len(panels)), squeeze=False)
    for i, (profile, mode, ctx) in enumerate(panels):
        for j, rtype in enumerate(REQUEST_TYPES):
            ax = axes[i][j]
            for cell in uniform:
                if (cell.get("profile", UNLABELLED_PROFILE), cell["mode"], cell["context"], cell["request_type"]) != (
                        profile, mode, ctx, rtype):
                    continue
                ks = [0, *(int(k) for k in cell["spec_tok_s"])]
                ratio = [1.0, *(v / cell["plain_tok_s"] for v in cell["spec_tok_s"].values())]
                ax.plot(ks, ratio, marker="o", ms=3, label=f"batch {cell['batch_size']}")
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_title(f"{profile} · {rtype} · {ctx} · {mode}", fontsize=9)
            ax.set_xlabel("draft length k (0 = plain)")
            ax.set_ylabel("tokens/s ÷ plain")
            ax.legend(fontsize=7)
        if mixed:
            ax = axes[i][-1]
            here = [c for c in mixed if c["profile"] == profile and mode == "sample" and ctx == "short"]
            if not here:
                ax.axis("off")
                continue
            x = range(len(here))
            ax.bar([v - 0.2 for v in x], [c["best_uniform_tok_s"] / c["plain_tok_s"] for c in here], 0.4,
                   label="best uniform k")
            ax.bar([v + 0.2 for v in x], [c["best_per_type_tok_s"] / c["plain_tok_s"] for c in here], 0.4,
                   label="best k per type")
            ax.set_xticks(list(x), [f"B{c['batch_size']}\n{_triple(c['best_per_type_k'])}" for c in here],
                          fontsize=7)
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_title(f"{profile} · mixed types · short · sample", fontsize=9)
            ax.set_ylabel("tokens/s ÷ plain")
            ax.legend(fontsize=7)
    fig.suptitle(f"spectune reference engine — {doc['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _triple(ks: dict[str, int]) -> str:
    return " ".join(f"{t[0]}{k}" for t, k in ks.items())


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="speculative vs plain decoding (tokens/s)")
    for col in ("profile", "mode", "type", "batch", "ctx", "plain tok/s", "best k", "best spec ×", "confirmed ×",
                "accept len @k=4"):
        t.add_column(col, justify="right")
    for c in doc["cells"]:
        if c["request_type"] == MIXED:
            continue
        t.add_row(c.get("profile", UNLABELLED_PROFILE), c["mode"], c["request_type"], str(c["batch_size"]),
                  c["context"], f"{c['plain_tok_s']:.1f}", str(c["best_k"]), f"{c['best_speedup']:.2f}",
                  f"{c['confirmed']['speedup']:.2f} (k={c['confirmed']['k']})" if "confirmed" in c else "-",
                  f"{c['mean_accept_len'].get('4', 0):.2f}")
    Console().print(t)
    m = Table(title="mixed batches (one third each type): best uniform k vs best k per type, measured side by side")
    for col in ("profile", "batch", "plain tok/s", "uniform k", "uniform tok/s", "per-type k", "per-type tok/s",
                "per-type ÷ uniform", "interleaved rows: ÷"):
        m.add_column(col, justify="right")
    for c in doc["cells"]:
        if c["request_type"] == MIXED:
            m.add_row(c["profile"], str(c["batch_size"]), f"{c['plain_tok_s']:.1f}", str(c["best_uniform_k"]),
                      f"{c['best_uniform_tok_s']:.1f}", _triple(c["best_per_type_k"]),
                      f"{c['best_per_type_tok_s']:.1f}", f"{c['per_type_over_uniform']:.3f}",
                      f"{c['interleaved']['per_type_over_uniform']:.3f}" if "interleaved" in c else "-")
    if m.row_count:
        Console().print(m)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="spectune bench engine", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=RESULTS / "engine.json", help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="a reduced plan that runs in under two minutes")
    ap.add_argument("--profile", action="append", choices=PROFILE_NAMES, default=None,
                    help="measure only this profile (repeatable; default: both)")
    ap.add_argument("--checkpoints", default=None, help="checkpoint folder (default: the shipped checkpoints)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    plan = BenchPlan(plan.sections, plan.version_reps, args.seed, tuple(args.profile or ()))
    doc = run(plan, args.checkpoints, args.device)
    write_results(doc, args.json, plot, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
