"""``spectune ingest`` and ``spectune export`` (hooked into ``controller/cli.py``'s ``main``).

Expected failures raise :class:`~telemetry.errors.SpectuneError` subclasses (or ``ValueError`` from a config),
which ``controller.cli.main`` prints as one ``error:`` line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.offline.ingest import (
    MODEL_FREE_SOURCES,
    SOURCES,
    IngestConfig,
    IngestError,
    Ingestor,
    RejectsFile,
    all_rejected,
    follow,
    ingest_paths,
    summary_lines,
)
from controller.signals import install_stop_signals
from telemetry.store import DEFAULT_DB_URL

COMMANDS = ("ingest", "export")
REPLAY_WINDOW_S = 0.5  # wall seconds of one replayed window (as spectune tune's default)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spectune", description="Work with serving engines outside spectune.")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("ingest", help="store an engine's spec-decode telemetry as windows",
                       description="Sources: vllm-prom (Prometheus text; files of '# SCRAPE [unix s]'-separated "
                                   "scrapes, or --follow URL), vllm-log (log lines), vllm-request (per-request "
                                   "metrics JSON lines), sglang (meta_info JSON lines), sglang-prom (gauges; "
                                   "reported only), trtllm (iteration stats JSON lines).")
    p.add_argument("source", choices=SOURCES)
    p.add_argument("paths", nargs="*", help="files to read ('-' for stdin)")
    p.add_argument("--follow", metavar="URL", default=None, help="poll this /metrics URL (vllm-prom, sglang-prom)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between polls with --follow")
    p.add_argument("--duration", type=float, default=None, help="stop following after this many seconds")
    p.add_argument("--scrapes", type=int, default=None, help="stop following after this many scrapes")
    p.add_argument("--version", default=None, help="target version of every window (default: the model name)")
    p.add_argument("--model", default=None, help="model name for records that name none (logs, TensorRT-LLM)")
    p.add_argument("--draft-version", default="unknown")
    p.add_argument("--request-type", default="unknown", help="when the whole source is one request type")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--db-url", default=DEFAULT_DB_URL)
    p.add_argument("--auto-upgrade", action="store_true", help="create or migrate the database first")
    p.add_argument("--rejects", type=Path, default=None,
                   help="JSON lines of rejected and skipped records (default: spectune-rejects-SOURCE.jsonl)")
    p.add_argument("--summary-json", type=Path, default=None, help="write the run's counts and observations here")
    p.add_argument("--dry-run", action="store_true", help="parse and count; store nothing")

    p = sub.add_parser("export", help="the policy table in an engine's own format, with the projection's loss")
    p.add_argument("engine", choices=("vllm", "trtllm", "sglang", "sglang-adaptive", "hf"))
    p.add_argument("--table", type=Path, default=None, help="policy table JSON (default: latest in --db-url)")
    p.add_argument("--db-url", default=None, help="the store: latest table and the observed traffic mix")
    p.add_argument("--target-version", default=None, help="versions to look the table up for (default: most "
                                                          "traffic)")
    p.add_argument("--draft-version", default=None)
    p.add_argument("--context-grid", action="store_true", help="vllm: [bs_lo, bs_hi, ctx_lo, ctx_hi, K] entries")
    p.add_argument("--max-batch-size", type=int, default=None, help="trtllm: the engine's largest batch")
    p.add_argument("--base", default=None, help="vllm: JSON merged into the speculative config (vLLM 0.32 "
                                                 "SpeculativeConfig fields: method, model, ...)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="vllm, trtllm: the draft model directory or Hub id (vLLM's model, TensorRT-LLM's "
                        "speculative_model_dir)")
    p.add_argument("--method", default=None, help="vllm: the speculative method (default draft_model with "
                                                   "--draft-model)")
    p.add_argument("--decoding-type", default="Draft_Target", choices=("Draft_Target", "NGram"),
                   help="trtllm: speculative_config.decoding_type")
    p.add_argument("--table-only", action="store_true",
                   help="vllm, trtllm: write the schedule without the draft model or method the engine needs to "
                        "start (a note says it is not startable as is)")
    p.add_argument("--out", type=Path, default=None, help="write the config here instead of stdout")
    p.add_argument("--calibration", type=Path, default=None,
                   help="a recorded sweep for the cost of the prediction, as `spectune tune --calibration` (default: "
                        "the cost model fitted on the stored cost windows)")
    p.add_argument("--profile", default="xl", help="the --calibration sweep's profile (as spectune tune's)")
    return ap


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    return _ingest(args) if args.cmd == "ingest" else _export(args)


# ------------------------------------------------------------------------------------------------ ingest
def _ingest(args: argparse.Namespace) -> int:
    from telemetry.store import Store

    if bool(args.paths) == bool(args.follow):
        raise IngestError("give files to read or --follow URL (one of them)")
    if args.follow and args.source not in ("vllm-prom", "sglang-prom"):
        raise IngestError("--follow polls a Prometheus /metrics endpoint: use it with vllm-prom or sglang-prom")
    if args.interval <= 0:
        raise IngestError("--interval must be > 0 seconds")
    if args.source in MODEL_FREE_SOURCES and not (args.model or args.version):
        raise IngestError(f"{args.source} records name no model: pass --model NAME (the served model's name) or "
                          "--version V (the target version every window is stored under)")
    cfg = IngestConfig(source=args.source, version=args.version, model=args.model,
                       draft_version=args.draft_version, request_type=args.request_type, engine_id=args.engine_id)
    rejects_path = args.rejects or Path(f"spectune-rejects-{args.source}.jsonl")
    store = None if args.dry_run else Store(args.db_url, auto_upgrade=args.auto_upgrade)
    rejects = RejectsFile(rejects_path)  # opened at the first reject; never removed or replaced
    try:
        ing = Ingestor(cfg, store, rejects)
        if args.follow:
            stop = threading.Event()
            install_stop_signals(stop)
            if args.duration is not None:
                timer = threading.Timer(args.duration, stop.set)
                timer.daemon = True  # --scrapes may end the run first; the timer must not hold the process
                timer.start()
            print(f"following {args.follow} every {args.interval:g}s (Ctrl-C stops)", file=sys.stderr)
            follow(ing, args.follow, args.interval, stop, max_scrapes=args.scrapes,
                   on_scrape=lambda n: print(f"scrape {n}: {ing.summary.acceptance_windows} acceptance "
                                             "windows so far", file=sys.stderr))
            stop.set()
        else:
            ingest_paths(ing, args.paths)
    finally:
        rejects.close()
        if store is not None:
            store.close()
    for line in summary_lines(ing.summary, str(rejects_path) if rejects.written else None):
        print(line)
    if args.summary_json is not None:
        args.summary_json.write_text(json.dumps(ing.summary.to_dict(), indent=1, default=str))
    if all_rejected(ing.summary):
        print(f"error: every record was rejected ({sum(ing.summary.malformed.values())}); nothing was stored. "
              f"See the reasons above and the records in {rejects_path}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------------ export
def _export(args: argparse.Namespace) -> int:
    from controller.offline import export as ex
    from controller.offline import project as pj
    from telemetry.policy_table import policy_table_from_json
    from telemetry.records import DEFAULT_BUCKETS
    from telemetry.store import Store

    acc: list[Any] = []
    cost: list[Any] = []
    stored: tuple[list[Any], list[Any]] = ([], [])
    table = None
    if args.table is not None:
        try:
            table = policy_table_from_json(args.table.read_bytes())
        except OSError as e:
            raise ex.ExportError(f"cannot read {args.table}: {e}") from e
    if args.db_url is not None:
        with Store(args.db_url) as store:
            if table is None:
                table = store.latest_policy_version()
            stored = (store.acceptance_windows(), store.cost_windows())
            acc = [w.window for w in stored[0]]
            cost = [w.window for w in stored[1]]
    if table is None:
        raise ex.ExportError("no policy table: pass --table FILE, or --db-url of a store a sidecar has published to")
    versions = None
    if args.target_version or args.draft_version:
        if not (args.target_version and args.draft_version):
            raise ex.ExportError("give both --target-version and --draft-version")
        versions = (args.target_version, args.draft_version)
    traffic = pj.traffic_from_windows(acc, cost, table, versions)
    full = pj.table_k(table, traffic)
    schedule = pj.project_batches(traffic, full)
    contexts = DEFAULT_BUCKETS.context_labels()
    grid = pj.project_grid(traffic, full, contexts) if args.context_grid else None
    replay = _replay(stored, table, args.calibration, args.profile)
    if replay is not None:  # cost windows stored: the packed-round cost model chooses among the table's ks
        replayed = replay.best_schedule(table)
        schedule = pj.within_measured({**schedule, **replayed}, replayed)
        if grid is not None:
            replayed_g = replay.best_schedule(table, by_context=True)
            # each context bucket's batch buckets held between its replayed ones
            grid = pj.per_context({**grid, **replayed_g}, lambda ctx, g: pj.within_measured(
                g, [b for b, c in replayed_g if c == ctx]))
    if args.engine == "vllm":
        base = _json_arg(args.base, "--base") if args.base else None
        out = ex.vllm_export(schedule, grid, contexts, base, draft_model=args.draft_model, method=args.method,
                             table_only=args.table_only)
    elif args.engine == "trtllm":
        out = ex.trtllm_export(schedule, args.max_batch_size, draft_model=args.draft_model,
                               decoding_type=args.decoding_type, table_only=args.table_only)
    elif args.engine == "sglang":
        out = ex.sglang_export(pj.best_k(traffic, full, traffic.batches))
    elif args.engine == "sglang-adaptive":
        cands = {b: sorted({full(c[0], b, c[1]) for c in traffic.mix}) for b in traffic.batches}
        out = ex.sglang_adaptive_export(cands, schedule, str(args.out or "adaptive.json"))
    else:
        out = ex.hf_export(schedule[min(traffic.batches)] if 1 not in schedule else schedule[1])
    text = out.render()
    if args.out is not None:
        args.out.write_text(text + "\n")
    else:
        print(text)
    err = sys.stderr
    if out.args:
        print("flags: " + " ".join(_quote(a) for a in out.args), file=err)
    for note in (*traffic.notes, *out.notes):
        print(f"note: {note}", file=err)
    if replay is not None:
        types = replay.load.types
        full_g = replay.score_table(table).tok_s
        proj_g = replay.score(lambda spec, bb: tuple(min(out.k_of(rt, bb, spec.context), replay.cal.K)
                                                     for rt in types)).tok_s
        unit, how = "tok/s", f"replay of {replay.windows} stored windows (packed rounds; {replay.notes[0]})"
    else:
        full_g = pj.predicted(traffic, full, out.batches)
        proj_g = pj.predicted(traffic, out.k_of, out.batches)
        unit = "tok/s" if traffic.has_seconds else "x plain decoding"
        how = f"analytic per-row model, traffic-weighted, for {'|'.join(traffic.versions)}"
    loss, gain_note = pj.projection_loss(full_g, proj_g)
    print(f"predicted goodput ({how}; table v{table.version}): full table {full_g:.3f} {unit}, exported "
          f"{proj_g:.3f} {unit} ({100 * loss:.1f}% lost to the projection)", file=err)
    if gain_note is not None:
        print(f"note: {gain_note}", file=err)
    return 0


def _replay(stored: tuple[list[Any], list[Any]], table: Any, calibration: Path | None = None,
            profile: str | None = None) -> Any:
    """The stored windows as a replay, the one ``spectune tune`` predicts with (None without cost windows nor a
    calibration, or when they cannot be replayed)."""
    from controller.offline.replay import ReplayError, Slice, store_replay

    if not stored[1] and calibration is None:
        return None
    try:
        return store_replay(Slice(tuple(stored[0]), tuple(stored[1])), table.k_max, calibration, profile,
                            REPLAY_WINDOW_S)
    except ReplayError as e:
        print(f"note: the stored windows cannot be replayed ({e}); projecting with the per-row model",
              file=sys.stderr)
        return None


def _json_arg(text: str, what: str) -> dict[str, Any]:
    from controller.offline.export import ExportError

    try:
        v = json.loads(text)
    except ValueError as e:
        raise ExportError(f"{what} is not JSON: {e}") from e
    if not isinstance(v, dict):
        raise ExportError(f"{what} must be a JSON object")
    return v


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)
