"""Tuning benchmark: ingest throughput per engine format, and ``tune`` / ``export`` on recorded xl telemetry.

Run: ``spectune bench tuning [--quick] [--json bench/results/tuning.json]``.

Sections:

1. **ingest**: records/s that ``spectune ingest`` parses and stores into a fresh SQLite store, per source format
   (vLLM Prometheus scrapes, vLLM log lines, vLLM per-request metrics, SGLang ``meta_info``, TensorRT-LLM iteration
   stats). The records are generated from a seeded RNG in each engine's documented shape (the same shapes as the
   parser tests' fixtures under ``tests/offline/fixtures``), so every record yields a window. Median of
   ``--repeats`` runs; ``parse_records_per_s`` is the same run without a store (``--dry-run``).
2. **record**: the reference engine (``--profile``, xl by default: target-v1 widened 4x, a 38M model's cost) decodes
   a mixed workload whose load cycles through batch 1, 4, 16, 48 and a long-context phase, every phase a few
   seconds, the cycle repeated so that the time split of ``tune`` (the last 30% held out) sees every phase. Its k
   per (request type, context bucket) is redrawn every ``EXPLORE_EVERY_S`` (:class:`Explorer`, so that every k is
   measured in every bucket); its telemetry goes through the real emitter, the in-process
   transport and the sidecar's consumer into a SQLite store, as an embedded sidecar's would.
3. **tune**: ``spectune tune --target table`` on that store (the optuna study in the same database), seeded with the
   default table (static k=3 everywhere, StaticPolicy's default), cost from the cost model fitted on the stored cost
   windows. Then the exported tables: the tuned table projected onto a vLLM ``num_speculative_tokens_per_batch_size``
   schedule and a TensorRT-LLM ``draft_len_schedule``: per batch bucket, the k of the tuned table with the highest
   replayed tokens/s over the tune windows of that bucket (:meth:`Replay.best_schedule`, as ``spectune export``).
   Every table is scored twice: ``predicted_tok_s`` (analytic replay of the windows it was tuned on) and
   ``replayed_tok_s`` (round-level replay of the held-out windows, which no table was tuned on).
   ``tuned_over_default`` and ``exported_vllm_over_full_table`` are ratios of ``replayed_tok_s``.
4. **engine check** (``--engine-json``, default ``bench/results/engine.json``): every tuned bucket with at least 2%
   of the traffic, its k's tok/s in the matching ``bench engine`` cell over that cell's best k's
   (:func:`engine_check`). Meaningful only when both ran on the same machine in the same session.

A benchmark never asserts: it prints, saves JSON and a PNG, and leaves judging to the reader. The recorded
telemetry's costs are wall time on this machine: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._common import write_results

EXPLORE_EVERY_S = 0.5  # the recording explorer redraws its ks this often
DEFAULT_K = 3  # the default table's k (StaticPolicy's default; what engines ship as num_speculative_tokens)
K_MAX = 8
MODEL = "bench/llama-stand-in"  # the model name the generated engine records carry
SOURCES_BENCHED = ("vllm-prom", "vllm-log", "vllm-request", "sglang", "trtllm")
RECORD_CYCLE: tuple[tuple[str, int, float], ...] = (  # (phase, load, long fraction): one cycle of the recording
    ("b1", 1, 0.0), ("b4", 4, 0.0), ("b16", 16, 0.0), ("b48", 48, 0.0), ("long8", 8, 1.0),
)


@dataclass(frozen=True)
class Preset:
    ingest_records: int  # records generated per format
    repeats: int  # ingest runs per format (median)
    record_s: float  # seconds of engine recording
    phase_s: float  # seconds per phase of the cycle
    trials: int  # optuna trials


PRESETS = {
    "full": Preset(ingest_records=20_000, repeats=3, record_s=180.0, phase_s=3.0, trials=80),
    "quick": Preset(ingest_records=1_000, repeats=1, record_s=30.0, phase_s=1.5, trials=10),
}


# ------------------------------------------------------------------------------------------------ ingest
def _pos_accepts(rng: random.Random, drafts: int, k: int) -> list[int]:
    """Accepted tokens per draft position over ``drafts`` drafts of length ``k`` (non-increasing)."""
    out, alive = [], drafts
    for _ in range(k):
        alive = sum(1 for _ in range(alive) if rng.random() < 0.7)
        out.append(alive)
    return out


def gen_vllm_prom(n: int, seed: int) -> str:
    """``n`` scrapes of one vLLM v1 engine (k = 3), counters cumulative, 10 s apart."""
    rng = random.Random(seed)
    lab = f'engine="0",model_name="{MODEL}"'
    drafts = tokens = accepted = itl = 0
    per_pos = [0, 0, 0]
    parts = []
    for i in range(n):
        d = rng.randint(50, 200)
        pa = _pos_accepts(rng, d, 3)
        drafts, tokens, accepted = drafts + d, tokens + 3 * d, accepted + sum(pa)
        per_pos = [a + b for a, b in zip(per_pos, pa, strict=True)]
        itl += d * 2
        rows = [f"# SCRAPE {1000 + 10 * i}",
                f"vllm:num_requests_running{{{lab}}} {rng.randint(1, 64)}.0",
                f"vllm:spec_decode_num_drafts_total{{{lab}}} {drafts}.0",
                f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {tokens}.0",
                f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {accepted}.0"]
        rows += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{p}"}} {v}.0'
                 for p, v in enumerate(per_pos)]
        rows += [f'vllm:inter_token_latency_seconds_bucket{{{lab},le="0.025"}} {itl // 2}.0',
                 f'vllm:inter_token_latency_seconds_bucket{{{lab},le="+Inf"}} {itl}.0',
                 f"vllm:inter_token_latency_seconds_count{{{lab}}} {itl}.0",
                 f"vllm:inter_token_latency_seconds_sum{{{lab}}} {itl * 0.02:.3f}"]
        parts.append("\n".join(rows))
    return "\n".join(parts) + "\n"


def gen_vllm_log(n: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        d = rng.randint(50, 200)
        pa = _pos_accepts(rng, d, 3)
        acc = sum(pa)
        rates = ", ".join(f"{a / d:.3f}" for a in pa)
        lines.append(f"INFO 09-01 12:{i // 60 % 60:02d}:{i % 60:02d} [metrics.py:96] SpecDecoding metrics: Mean "
                     f"acceptance length: {1 + acc / d:.2f}, Accepted throughput: {acc / 10:.2f} tokens/s, Drafted "
                     f"throughput: {3 * d / 10:.2f} tokens/s, Accepted: {acc} tokens, Drafted: {3 * d} tokens, "
                     f"Per-position acceptance rate: {rates}, Avg Draft acceptance rate: {100 * acc / (3 * d):.1f}%")
    return "\n".join(lines) + "\n"


def _histogram(rng: random.Random, steps: int, k: int) -> list[int]:
    """``acceptance_histogram``: steps by accepted count 0..k."""
    hist = [0] * (k + 1)
    for _ in range(steps):
        a = 0
        while a < k and rng.random() < 0.7:
            a += 1
        hist[a] += 1
    return hist


def gen_vllm_request(n: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        steps = rng.randint(10, 60)
        hist = _histogram(rng, steps, 3)
        acc = sum(a * c for a, c in enumerate(hist))
        sd = {"mean_acceptance_length": 1 + acc / steps, "draft_acceptance_rate": acc / (3 * steps),
              "acceptance_histogram": hist, "num_spec_steps": steps, "num_accepted_draft_tokens": acc,
              "num_draft_tokens": 3 * steps, "num_spec_tokens": 3}
        lines.append(json.dumps({"id": f"chatcmpl-{i}", "object": "chat.completion", "model": MODEL, "choices": [],
                                 "usage": {"prompt_tokens": 100, "completion_tokens": steps + acc,
                                           "total_tokens": 100 + steps + acc},
                                 "metrics": {"speculative_decoding": sd}}))
    return "\n".join(lines) + "\n"


def gen_sglang(n: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        steps = rng.randint(10, 60)
        hist = _histogram(rng, steps, 5)
        acc = sum(a * c for a, c in enumerate(hist))
        meta = {"id": f"r{i}", "prompt_tokens": 300, "completion_tokens": steps + acc,
                "spec_accept_rate": acc / (5 * steps), "spec_accept_length": (steps + acc) / steps,
                "spec_num_correct_drafts": acc, "spec_num_proposed_drafts": 5 * steps, "spec_verify_ct": steps,
                "spec_correct_drafts_histogram": hist}
        lines.append(json.dumps({"id": f"cmpl-{i}", "model": MODEL,
                                 "choices": [{"index": 0, "text": "...", "meta_info": meta}]}))
    return "\n".join(lines) + "\n"


def gen_trtllm(n: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        b = rng.randint(1, 64)
        acc = sum(_pos_accepts(rng, b, 3))
        lat = 10 + 0.3 * b + rng.random()
        lines.append(json.dumps({
            "timestamp": "09-01-2026 12:00:00", "iter": i, "iterLatencyMS": lat, "numActiveRequests": b,
            "numQueuedRequests": 0,
            "inflightBatchingStats": {"numScheduledRequests": b, "numContextRequests": 0, "numGenRequests": b,
                                      "numPausedRequests": 0},
            "specDecodingStats": {"numDraftTokens": 3 * b, "numAcceptedTokens": acc, "numRequestsWithDraftTokens": b,
                                  "acceptanceLength": (b + acc) / b, "iterLatencyMS": lat * 0.15,
                                  "draftOverhead": 0.15}}))
    return "\n".join(lines) + "\n"


GENERATORS: dict[str, Callable[[int, int], str]] = {
    "vllm-prom": gen_vllm_prom, "vllm-log": gen_vllm_log, "vllm-request": gen_vllm_request, "sglang": gen_sglang,
    "trtllm": gen_trtllm,
}


def _ingest_once(source: str, path: Path, db_url: str | None) -> tuple[float, dict[str, Any]]:
    from controller.offline.ingest import IngestConfig, Ingestor, ingest_paths
    from telemetry.store import Store

    store = Store(db_url, auto_upgrade=True) if db_url is not None else None
    try:
        ing = Ingestor(IngestConfig(source=source, model=MODEL), store)
        t0 = time.perf_counter()
        ingest_paths(ing, [str(path)])
        wall = time.perf_counter() - t0
    finally:
        if store is not None:
            store.close()
    return wall, ing.summary.to_dict()


def bench_ingest(preset: Preset, seed: int, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for source in SOURCES_BENCHED:
        path = work / f"{source}.txt"
        path.write_text(GENERATORS[source](preset.ingest_records, seed))
        stored, parsed = [], []
        summary: dict[str, Any] = {}
        for r in range(preset.repeats):
            db = f"sqlite:///{work / f'ingest-{source}-{r}.sqlite'}"
            wall, summary = _ingest_once(source, path, db)
            stored.append(summary["records"] / wall)
            wall_p, _ = _ingest_once(source, path, None)
            parsed.append(summary["records"] / wall_p)
        out[source] = {
            "records": summary["records"], "acceptance_windows": summary["acceptance_windows"],
            "cost_windows": summary["cost_windows"], "malformed": sum(summary["malformed"].values()),
            "records_per_s": statistics.median(stored), "records_per_s_runs": stored,
            "parse_records_per_s": statistics.median(parsed),
        }
        say(f"ingest {source}: {out[source]['records_per_s']:,.0f} records/s stored "
            f"({out[source]['parse_records_per_s']:,.0f} parsed only), {summary['acceptance_windows']} acceptance "
            f"and {summary['cost_windows']} cost windows from {summary['records']} records")
    return out


# ------------------------------------------------------------------------------------------------ record
class Explorer:
    """The recording's policy: every period a cap m is drawn uniformly from 0..k_max, then k per (request type,
    context bucket) uniformly from 0..m. A round's cost depends on its largest k (draft steps) and the tokens it
    drafted: drawing the cap first spreads the largest k over every value (independent draws per type would make
    almost every round's largest k 6-8, and the cost of small ks would be extrapolated, not measured)."""

    def __init__(self, seed: int, k_max: int, every_s: float) -> None:
        from telemetry.records import DEFAULT_BUCKETS

        self._rng = random.Random(seed)
        self._k_max, self._every = k_max, every_s
        self._buckets = DEFAULT_BUCKETS
        self._ks: dict[tuple[str, str], int] = {}
        self._cap = k_max
        self._next = 0.0

    def decide(self, request_type: str, batch_size: int, context_len: int) -> int:
        now = time.monotonic()
        if now >= self._next:
            self._next, self._ks = now + self._every, {}
            self._cap = self._rng.randint(0, self._k_max)
        key = (request_type, self._buckets.context_bucket(context_len))
        if key not in self._ks:
            self._ks[key] = self._rng.randint(0, self._cap)
        return self._ks[key]


def record(db_url: str, profile: str, preset: Preset, seed: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Decode the recording workload on the reference engine; its telemetry lands in ``db_url``."""
    from controller.reference.workload import Phase, PromptPool, RequestStream, drive, warm_up
    from engine.loader import load_models
    from engine.loop import EngineConfig, SpecEngine
    from telemetry.emitter import Emitter, EmitterConfig
    from telemetry.ingest import Consumer, ConsumerConfig
    from telemetry.store import Store
    from telemetry.transport import InProcessTransport

    models = load_models(None, None, with_update=False, profile=profile)
    engine = SpecEngine(models.target, models.draft, EngineConfig(max_batch=64, k_max=K_MAX, seed=seed),
                        models.target_version, models.draft_version)
    cycles = max(1, round(preset.record_s / (preset.phase_s * len(RECORD_CYCLE))))
    phases = [Phase(f"{name}#{c}", preset.phase_s, load=load, long_fraction=lf)
              for c in range(cycles) for name, load, lf in RECORD_CYCLE]
    pool = PromptPool(seed)
    warm_up(engine, pool, DEFAULT_K)
    transport = InProcessTransport(max_entries=1_000_000)
    emitter = Emitter(transport, EmitterConfig(engine_id="bench-tuning", interval_s=0.25))
    explorer = Explorer(seed, K_MAX, EXPLORE_EVERY_S)
    rounds = tokens = 0

    def on_round(r: Any, phase: Phase, t: float) -> None:
        nonlocal rounds, tokens
        emitter.record(r)
        rounds += 1
        tokens += r.emitted

    say(f"recording {cycles} cycles of {len(RECORD_CYCLE)} phases x {preset.phase_s:g}s on the {profile} profile "
        f"({models.target_version} / {models.draft_version}), k redrawn every {EXPLORE_EVERY_S}s")
    wall = drive(engine, explorer.decide, phases, RequestStream(pool, seed), on_round)
    emitter.close()
    stored = 0
    with Store(db_url, auto_upgrade=True) as store:
        consumer = Consumer(transport, store, ConsumerConfig(consumer="bench-tuning", block_ms=0))
        idle = 0
        while idle < 2:  # two empty reads: the emitter's windows are all stored
            got = consumer.step()
            stored += len(got)
            idle = 0 if got else idle + 1
        n_acc, n_cost = len(store.acceptance_windows()), len(store.cost_windows())
    es = emitter.stats()
    say(f"recorded {rounds} rounds, {tokens} tokens in {wall:.0f}s ({tokens / wall:.0f} tok/s); {stored} window "
        f"batches stored ({n_acc} acceptance, {n_cost} cost windows)")
    return {"profile": profile, "target_version": models.target_version, "draft_version": models.draft_version,
            "cycles": cycles, "phases": [list(p) for p in RECORD_CYCLE], "phase_s": preset.phase_s, "wall_s": wall,
            "rounds": rounds, "tokens": tokens, "batches_stored": stored, "windows_sent": es.windows_sent,
            "acceptance_windows": n_acc, "cost_windows": n_cost, "explore_every_s": EXPLORE_EVERY_S}


# ------------------------------------------------------------------------------------------------ tune
def _schedule_table(k_of: Callable[[str, int, str], int], cells: Sequence[tuple[str, int, str]]) -> Any:
    """An exported schedule as a policy table (one entry per replayed cell, any versions) for the replay."""
    from telemetry.records import WILDCARD, PolicyTable

    entries = {"|".join((WILDCARD, WILDCARD, rt, str(bb), ctx)): int(k_of(rt, bb, ctx)) for rt, bb, ctx in cells}
    return PolicyTable(version=1, default_k=DEFAULT_K, k_max=K_MAX, entries=entries, reason="exported schedule")


def tune_and_export(db_url: str, preset: Preset, seed: int, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    from controller.offline import export as ex
    from controller.offline import project as pj
    from controller.offline.replay import build_replay, split_by_time
    from controller.offline.tune import Candidate, TuneConfig, score, tune
    from telemetry.policy_table import policy_table_from_json, table_to_json
    from telemetry.records import PolicyTable
    from telemetry.store import Store

    seed_path = work / "default_table.json"
    seed_path.write_text(table_to_json(PolicyTable(version=1, default_k=DEFAULT_K, k_max=K_MAX,
                                                   reason=f"default: static k={DEFAULT_K}")))
    cfg = TuneConfig(db_url=db_url, study="bench-tuning", trials=preset.trials, seed=seed, k_max=K_MAX,
                     seed_table=seed_path, out=work / "tune-plots", progress=False)
    t0 = time.perf_counter()
    summary = tune(cfg, say=say)
    tune_s = time.perf_counter() - t0
    tuned = policy_table_from_json(json.dumps(summary["tuned_table"]))

    with Store(db_url) as store:
        acc, cost = store.acceptance_windows(), store.cost_windows()
    tune_part, held_part, _cut = split_by_time(acc, cost, cfg.holdout)
    replay = build_replay(tune_part, K_MAX, None, cfg.window_s)
    held = build_replay(held_part, K_MAX, None, cfg.window_s)
    traffic = pj.traffic_from_windows([w.window for w in tune_part.acceptance], [w.window for w in tune_part.cost],
                                      tuned, None)
    full = pj.table_k(tuned, traffic)
    # batch buckets the tune windows never saw keep the per-row model's projection
    schedule = {**pj.project_batches(traffic, full), **replay.best_schedule(tuned)}
    # only the schedules matter here (their decision functions), not a startable engine config
    exports = {"vllm": ex.vllm_export(schedule, table_only=True), "trtllm": ex.trtllm_export(schedule, table_only=True)}
    cells = sorted({(rt, bb, spec.context) for rep in (replay, held)
                    for spec, bb in zip(rep.load.specs, rep.load.buckets, strict=True) for rt in rep.load.types})
    tables: dict[str, Any] = {"default": policy_table_from_json(seed_path.read_bytes()), "tuned": tuned}
    for name, out in exports.items():
        tables[f"exported_{name}"] = _schedule_table(out.k_of, cells)
    scores: dict[str, dict[str, float]] = {}
    for name, table in tables.items():
        pred = replay.score_table(table)
        rep = score(cfg, held, Candidate(table=table), round_level=True)
        scores[name] = {"predicted_tok_s": pred.tok_s, "predicted_p99_s": pred.p99_s, "replayed_tok_s": rep.tok_s,
                        "replayed_p99_s": rep.p99_s}
        say(f"{name:>16}: predicted {pred.tok_s:8.1f} tok/s (tune windows), replayed {rep.tok_s:8.1f} tok/s "
            "(held-out windows)")
    rep_of = {n: s["replayed_tok_s"] for n, s in scores.items()}
    return {
        "study": summary["study"], "trials": summary["trials"], "tune_wall_s": tune_s, "cost": summary["cost"],
        "windows": summary["windows"], "buckets_tuned": len(summary.get("buckets", [])),
        "buckets": summary.get("buckets", []), "tune_summary_heldout_gain": summary.get("heldout_gain"),
        "tables": scores,
        "exports": {n: {"config": out.config, "args": out.args, "notes": list(out.notes)}
                    for n, out in exports.items()},
        "schedule": {str(b): k for b, k in sorted(schedule.items())},
        "tuned_over_default": rep_of["tuned"] / rep_of["default"],
        "tuned_over_default_predicted": scores["tuned"]["predicted_tok_s"] / scores["default"]["predicted_tok_s"],
        "exported_vllm_over_full_table": rep_of["exported_vllm"] / rep_of["tuned"],
        "exported_trtllm_over_full_table": rep_of["exported_trtllm"] / rep_of["tuned"],
        "exported_vllm_over_default": rep_of["exported_vllm"] / rep_of["default"],
    }


# ------------------------------------------------------------------------------------------------ engine check
ENGINE_CHECK_SHARE = 0.02  # buckets with at least this share of the tune windows are checked against bench engine
ENGINE_CHECK_RATIO = 0.93  # issue 31: a tuned k's measured tok/s at least this share of the cell's best


def _rank_cell(ctx: int, label: str) -> tuple[int, int]:
    """Order of a sweep cell measured at median context ``ctx`` for context bucket ``label``: cells inside the bucket
    first, the longest of them (a short-prompt cell that decoded past the bucket below belongs to that one); then
    the nearest to the bucket's representative length."""
    from telemetry.records import DEFAULT_BUCKETS, context_length

    if DEFAULT_BUCKETS.context_bucket(ctx) == label:
        return (0, -ctx)
    return (1, abs(ctx - context_length(label)))


def engine_check(buckets: Sequence[dict[str, Any]], engine_json: Path, profile: str,
                 min_share: float = ENGINE_CHECK_SHARE) -> dict[str, Any]:
    """The tuned table against what ``spectune bench engine`` measured: for every tuned bucket with at least
    ``min_share`` of the traffic, the measured tok/s of the cell (request type, batch size, context) at the tuned k
    over the best k's. A bucket whose (type, batch bucket) the sweep has no cell for is listed as unmeasured (the
    sweep runs batch 1, 4, 16, 64). Within a (type, batch bucket) the cell is the one whose median context lies in
    the bucket's context range (the longest, if several do), else the one nearest the bucket's length: a batch-1
    cell of the sweep's short prompts decodes past 512 tokens (median 560-1000 on the xl pair), and is still the
    short-context measurement. Each row names the context it was measured at. Run both benchmarks on the same
    machine in the same session: the sweep's speeds are that machine's."""
    from telemetry.records import DEFAULT_BUCKETS

    doc = json.loads(engine_json.read_text())
    measured: dict[tuple[str, int], list[tuple[int, dict[int, float]]]] = {}  # (type, batch bucket) -> cells
    for c in doc.get("cells", []):
        if c.get("profile") != profile or c.get("request_type") == "mixed" or "spec_tok_s" not in c:
            continue
        key = (c["request_type"], DEFAULT_BUCKETS.batch_bucket(int(c["batch_size"])))
        tok = {0: float(c["plain_tok_s"]), **{int(k): float(v) for k, v in c["spec_tok_s"].items()}}
        measured.setdefault(key, []).append((int(c["context_len"]), tok))
    rows = []
    for b in buckets:
        if b["share"] < min_share:
            continue
        key = (b["request_type"], int(b["batch_bucket"]))
        label = b["context_bucket"]
        row: dict[str, Any] = {"request_type": key[0], "batch_bucket": key[1], "context_bucket": label,
                               "share": b["share"], "tuned_k": b["tuned_k"]}
        cells = measured.get(key, [])
        if cells:
            ctx, tok = min(cells, key=lambda cell: _rank_cell(cell[0], label))
            if b["tuned_k"] in tok:
                best_k = max(tok, key=lambda k: tok[k])
                row.update(best_k=best_k, ratio=tok[b["tuned_k"]] / tok[best_k], measured_context=ctx)
        rows.append(row)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    return {"engine_json": str(engine_json), "engine_device": doc.get("device"), "min_share": min_share,
            "threshold": ENGINE_CHECK_RATIO, "buckets": rows, "checked": len(ratios),
            "unmeasured": len(rows) - len(ratios), "min_ratio": min(ratios) if ratios else None,
            "below_threshold": sum(1 for r in ratios if r < ENGINE_CHECK_RATIO)}


# ------------------------------------------------------------------------------------------------ output
def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ing = doc["ingest"]
    names = list(ing)
    a1.bar(names, [ing[n]["records_per_s"] for n in names], label="parse + store (SQLite)")
    a1.bar(names, [ing[n]["parse_records_per_s"] for n in names], alpha=0.35, label="parse only")
    a1.set_ylabel("records / s")
    a1.set_title("spectune ingest throughput per format")
    a1.tick_params(axis="x", rotation=20)
    a1.legend()
    tn = doc.get("tune")
    if tn:
        tabs = list(tn["tables"])
        xs = range(len(tabs))
        a2.bar([x - 0.2 for x in xs], [tn["tables"][t]["predicted_tok_s"] for t in tabs], width=0.4,
               label="predicted (tune windows)")
        a2.bar([x + 0.2 for x in xs], [tn["tables"][t]["replayed_tok_s"] for t in tabs], width=0.4,
               label="replayed (held-out windows)")
        a2.set_xticks(list(xs), tabs, rotation=15)
        a2.set_ylabel("tokens / s")
        a2.set_title(f"tables on recorded {doc['record']['profile']} telemetry: tuned/default "
                     f"{tn['tuned_over_default']:.3f}, vLLM export/full {tn['exported_vllm_over_full_table']:.3f}",
                     fontsize=9)
        a2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def report(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title="ingest (records/s, median)")
    for c in ("format", "stored", "parsed only", "acceptance windows", "cost windows"):
        t.add_column(c, justify="right")
    for n, r in doc["ingest"].items():
        t.add_row(n, f"{r['records_per_s']:,.0f}", f"{r['parse_records_per_s']:,.0f}", str(r["acceptance_windows"]),
                  str(r["cost_windows"]))
    con.print(t)
    tn = doc.get("tune")
    if tn:
        t = Table(title=f"tables on recorded {doc['record']['profile']} telemetry ({tn['trials']} trials)")
        for c in ("table", "predicted tok/s", "replayed tok/s (held-out)", "p99 s/token (held-out)"):
            t.add_column(c, justify="right")
        for n, s in tn["tables"].items():
            t.add_row(n, f"{s['predicted_tok_s']:.1f}", f"{s['replayed_tok_s']:.1f}", f"{s['replayed_p99_s']:.4f}")
        con.print(t)
        con.print(f"tuned_over_default {tn['tuned_over_default']:.3f} (predicted "
                  f"{tn['tuned_over_default_predicted']:.3f}); "
                  f"exported_vllm_over_full_table {tn['exported_vllm_over_full_table']:.3f}; "
                  f"exported_trtllm_over_full_table {tn['exported_trtllm_over_full_table']:.3f}")
    ec = doc.get("engine_check")
    if ec:
        t = Table(title=f"tuned k against bench engine ({ec['engine_json']}; buckets >= {ec['min_share']:.0%} of "
                        "traffic)")
        for c in ("bucket", "share", "tuned k", "measured best k", "at context", "tok/s at tuned k / best"):
            t.add_column(c, justify="right")
        for r in ec["buckets"]:
            ratio = f"{r['ratio']:.3f}" if "ratio" in r else "unmeasured"
            t.add_row(f"{r['request_type']}|{r['batch_bucket']}|{r['context_bucket']}", f"{r['share']:.1%}",
                      str(r["tuned_k"]), str(r.get("best_k", "-")), str(r.get("measured_context", "-")), ratio)
        con.print(t)
        mr = ec["min_ratio"]
        con.print(f"{ec['checked']} buckets checked, {ec['unmeasured']} unmeasured; worst "
                  f"{'-' if mr is None else f'{mr:.3f}'}; below {ec['threshold']}: {ec['below_threshold']}")


def run(preset_name: str, profile: str, seed: int, telemetry: Path | None, keep: Path | None,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    preset = PRESETS[preset_name]
    with tempfile.TemporaryDirectory(prefix="spectune-bench-tuning-") as tmp:
        work = Path(tmp)
        doc: dict[str, Any] = {"preset": preset_name, "seed": seed, "default_k": DEFAULT_K, "k_max": K_MAX}
        doc["ingest"] = bench_ingest(preset, seed, work, say)
        if telemetry is not None:
            db_path = telemetry
            doc["record"] = {"profile": profile, "from": str(telemetry)}
        else:
            db_path = keep or work / "recorded.sqlite"
            if db_path.exists():
                db_path.unlink()
            doc["record"] = record(f"sqlite:///{db_path}", profile, preset, seed, say)
        doc["tune"] = tune_and_export(f"sqlite:///{db_path}", preset, seed, work, say)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    from engine.profiles import PROFILE_NAMES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--json", default="bench/results/tuning.json", help="where to write the figures")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--profile", choices=PROFILE_NAMES, default="xl", help="the engine pair recorded")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--telemetry", type=Path, default=None,
                    help="tune on this SQLite file of recorded telemetry instead of recording (it gains a study)")
    ap.add_argument("--keep-telemetry", type=Path, default=None, help="record into this SQLite file and keep it")
    ap.add_argument("--engine-json", type=Path, default=Path("bench/results/engine.json"),
                    help="a `spectune bench engine` result from the same machine and session: each tuned bucket's k "
                         "is checked against that sweep's measured best (skipped when the file is absent)")
    args = ap.parse_args(argv)
    if args.telemetry is not None and not args.telemetry.is_file():
        raise SystemExit(f"error: --telemetry {args.telemetry} is not a file")
    doc = run("quick" if args.quick else "full", args.profile, args.seed, args.telemetry, args.keep_telemetry)
    if args.engine_json.is_file() and doc.get("tune"):
        doc["engine_check"] = engine_check(doc["tune"]["buckets"], args.engine_json, args.profile)
    write_results(doc, args.json, plot, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
