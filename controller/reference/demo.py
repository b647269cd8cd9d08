"""``spectune demo``: the real engine on a mixed, changing workload, with the sidecar learning k live.

Everything runs in one process on embedded defaults: the reference engine (shipped checkpoints, CUDA when
present, else CPU), the engine hooks (policy client + telemetry emitter), the in-process transport, the sidecar
on a thread with the ``goodput`` policy, and a SQLite file in the run folder. ``--redis-url`` / ``--db-url``
switch the transport and the store to Redis and PostgreSQL.

The same workload (:data:`controller.reference.workload.WORKLOADS` ``"demo"``: code, prose and structured
requests; load rising to a large batch and falling; long-context requests; a structured-heavy stretch, then a silent
drift: structured prompts switch to a second JSON schema with no version change, which the learned run's sidecar
raises as an ``acceptance_drift`` naming structured; then the model update) is played:

1. **learned**: k from the sidecar, which starts knowing nothing and learns while the workload runs;
2. **static k** (``--static-k``, 3): one k for everything (what most deployments configure);
3. **static sweep** (``--sweep-ks``, 2 4 6): the same with other ks; the best static k in hindsight is the best of
   these runs and run 2;
4. **best per bucket (hindsight)**: for each (model version, batch bucket, context bucket), the k with the highest
   tokens/s measured in the runs before it, fixed for the whole run: the best a static table could have done with
   what those runs found.

Before all of them a **static k** run more is played (``static k=3 (before)``): the machine's speed drifts over
the minutes a demo takes (static k=3 three times in one process: 282, 300, 326 tokens/s, and 277, 317, 348 in
another; in a third demo the runs slowed from 369 to 237), so the fair baseline is the run played next to the
learned one. With static k played just before and just after it, the static k figure is the mean of the two
(``static_bracket`` in ``demo.json``) and a linear drift, either way, cancels out of learned / static k; the sweep
and the hindsight run come later, and a drift moves them.

Tokens per second compare fairly because each phase lasts the same wall time in every run. The summary prints
learned over static k, over the best static k and over the best per bucket, and writes them to ``demo.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from controller.client import ClientConfig, EngineHooks, build_engine_hooks
from controller.reference.demo_log import RoundLog, RowLog, RunLog
from controller.reference.engine_proc import model_update
from controller.reference.workload import WORKLOADS, Phase, PromptPool, RequestStream, drive, scaled, warm_up
from controller.service.build import SidecarSettings, build_sidecar
from controller.service.publish import CallbackPublisher
from controller.service.sidecar import Sidecar, SidecarConfig
from engine.profiles import DEFAULT_PROFILE, PROFILE_HELP, PROFILE_NAMES, get_profile
from telemetry.emitter import EmitterConfig
from telemetry.ingest import ConsumerConfig
from telemetry.policy_table import RowLookup, lookup
from telemetry.records import DEFAULT_BUCKETS, WILDCARD, Bucket, PolicyTable, RoundRecord
from telemetry.transport import InProcessTransport

QUICK_SCALE = 0.1  # --quick: each phase this fraction of its length (the whole demo in well under a minute)
QUICK_MAX_BATCH = 24  # --quick: a smaller peak, so prefill and the model update's re-prefill stay short
MIN_ROUNDS_FOR_BEST = 3  # rounds a (cell, k) needs before the hindsight table may pick it
# Rows of an acceptance bucket's old level before its drift is alerted, per k and across k (the sidecar's default
# is 500). The demo lasts about a minute per run and the policy moves k while it learns, so a bucket at one k
# rarely holds 500 rows before the silent drift, and on a machine slowed by another process the structured bucket
# holds fewer than 500 rows across k too (so, at the default, a slowed demo raises no alert). The guard against a
# young bucket that matters is the confirmation's: a detection is tested against at least four 12-window stretches
# of the bucket's history, windows that come as fast on a slowed machine (see
# controller.service.alerts.detectors.BucketMonitor).
DEMO_MIN_BEFORE = 100


@dataclass(frozen=True)
class DemoConfig:
    """One demo run."""

    out_root: Path = Path("runs")  # the report goes to out_root/demo-YYYYmmdd-HHMMSS
    checkpoints: Path | None = None  # None: the shipped checkpoints
    profile: str = DEFAULT_PROFILE  # target/draft pair (engine/profiles.py): xl = a large target's cost
    device: str | None = None  # None: CUDA when present, else CPU
    redis_url: str | None = None  # None: in-process transport
    db_url: str | None = None  # None: SQLite file in the run folder
    time_scale: float = 1.0  # multiplies every phase's length
    static_k: int = 3  # the static baseline's k
    sweep_ks: tuple[int, ...] = (2, 4, 6)  # more static runs: the best static k in hindsight is the best of all
    k_max: int = 8
    max_batch: int = 64  # the engine's rows; every phase's load is capped at it
    seed: int = 0
    prompt_cache: Path = Path(".spectune_cache")
    window_s: float = 0.25  # telemetry window

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("time scale must be > 0")
        get_profile(self.profile)  # a ValueError naming the profiles
        if not 0 <= self.static_k <= self.k_max:
            raise ValueError(f"--static-k must be in [0, k_max={self.k_max}]")
        if not all(0 <= k <= self.k_max for k in self.sweep_ks):
            raise ValueError(f"--sweep-ks must lie in [0, k_max={self.k_max}], got {list(self.sweep_ks)}")


def cell_of(r: RoundLog) -> tuple[str, int, str]:
    """(target version, batch bucket, context bucket) of a logged round."""
    return r.target_version, DEFAULT_BUCKETS.batch_bucket(r.batch_size), DEFAULT_BUCKETS.context_bucket(r.max_context)


def best_per_cell(logs: Sequence[RunLog]) -> dict[tuple[str, int, str], tuple[int, float]]:
    """Cell -> (k, tokens/s of rounds at that largest k), the best measured in ``logs``."""
    acc: dict[tuple[tuple[str, int, str], int], list[float]] = {}
    for log in logs:
        for r in log.rounds:
            a = acc.setdefault((cell_of(r), r.max_k), [0, 0.0, 0])
            a[0] += r.emitted
            a[1] += r.wall_s
            a[2] += 1
    best: dict[tuple[str, int, str], tuple[int, float]] = {}
    for (cell, k), (tok, secs, n) in acc.items():
        if n < MIN_ROUNDS_FOR_BEST or secs <= 0:
            continue
        g = tok / secs
        if cell not in best or g > best[cell][1]:
            best[cell] = (k, g)
    return best


class _Engine:
    """The engine, its models and the update, shared by the three runs (models load once)."""

    def __init__(self, cfg: DemoConfig) -> None:
        from engine.loader import load_models

        self.cfg = cfg
        self.models = load_models(cfg.checkpoints, cfg.device, with_update=True, profile=cfg.profile)
        self.pool = PromptPool(cfg.seed, cfg.prompt_cache)
        self.pool.get("structured", False, 0, schema=2)  # the silent drift's prompts, built before any clock runs
        warm_up(self.fresh(), self.pool)

    def fresh(self) -> Any:
        from engine.loop import EngineConfig, SpecEngine

        m = self.models
        return SpecEngine(m.target, m.draft, EngineConfig(max_batch=self.cfg.max_batch, k_max=self.cfg.k_max,
                                                          seed=self.cfg.seed), m.target_version, m.draft_version)


def _play(name: str, eng: _Engine, phases: Sequence[Phase], decide: Callable[[str, int, int], int] | None,
          hooks: EngineHooks, progress: Callable[[RunLog, int, float], None]) -> RunLog:
    """One pass of the workload. k comes from ``decide`` when given (baselines), else from ``hooks`` (the learned
    run); rounds go to ``hooks`` either way (a baseline's sidecar then learns in shadow: same telemetry and
    sidecar work on the machine, decisions not applied)."""
    engine = eng.fresh()
    log = RunLog(name, started_at=time.time())
    phase_index = {id(p): i for i, p in enumerate(phases)}

    def on_round(r: RoundRecord, phase: Phase, t: float) -> None:
        hooks.record(r)
        pi = phase_index[id(phase)]
        log.rounds.append(RoundLog(t, pi, r.target_version, r.batch_size, r.max_context, r.max_k, r.emitted,
                                   r.wall_s))
        for row in r.rows:
            log.rows.append(RowLog(t, pi, r.target_version, row.request_type, row.k, row.accepted, row.emitted))
        progress(log, pi, t)

    log.wall_s = drive(engine, decide or hooks.decide, phases, RequestStream(eng.pool, eng.cfg.seed), on_round,
                       model_update(engine, eng.models, hooks))
    return log


def _live_run(cfg: DemoConfig, eng: _Engine, phases: Sequence[Phase], run_dir: Path, name: str,
              progress: Callable[[RunLog, int, float], None], decide: Callable[[str, int, int], int] | None = None,
              on_sidecar: Callable[[Sidecar], None] = lambda _s: None,
              alerts_on: bool | None = None) -> tuple[RunLog, Sidecar]:
    """A run with engine hooks -> transport -> sidecar thread (goodput) -> client.

    ``decide`` None: the learned run, k from the sidecar (store: ``cfg.db_url`` or the run folder's
    ``spectune.sqlite``). ``decide`` given: a baseline whose k is fixed while a sidecar learns in shadow beside
    it (store: ``shadow-<name>.sqlite`` in the run folder), so that every run carries the same telemetry and
    sidecar load on the machine (on two cores an in-process sidecar costs the engine a few percent) and the runs
    differ only in how k is chosen.

    The learned run's sidecar also raises alerts (the model update, any drift) into its store's ``alerts`` table
    and, with Redis, the ``{prefix}:alerts`` stream; the report lists them (:attr:`Sidecar.recent_alerts`).
    ``alerts_on`` overrides which runs raise them (None: the learned run only).
    """
    from controller.service.alerts import AlertConfig
    from controller.service.alerts.manager import ACCEPTANCE_MONITOR, FIRST_DRAFT_MONITOR

    m = eng.models
    tag = "" if decide is None else "-" + "-".join("".join(c if c.isalnum() else " " for c in name).split())
    prefix = f"spectune-demo-{run_dir.name}{tag}"
    if decide is None:
        url = cfg.db_url or f"sqlite:///{(run_dir / 'spectune.sqlite').resolve()}"
    else:
        url = f"sqlite:///{(run_dir / f'shadow{tag}.sqlite').resolve()}"
    raise_alerts = decide is None if alerts_on is None else alerts_on
    alerts = None
    if raise_alerts:
        alerts = AlertConfig(acceptance=replace(ACCEPTANCE_MONITOR, min_before=DEMO_MIN_BEFORE),
                             first_draft=replace(FIRST_DRAFT_MONITOR, min_before=DEMO_MIN_BEFORE), seed=cfg.seed)
    settings = SidecarSettings(
        db_url=url, redis_url=cfg.redis_url, prefix=prefix, auto_upgrade=True, policy="goodput", k_max=cfg.k_max,
        seed=cfg.seed, sidecar=SidecarConfig(publish_every_windows=6, publish_every_s=0.5, warm_start_windows=0,
                                             consumer=ConsumerConfig(consumer="demo", block_ms=50)),
        alerts=alerts, alert_sinks=("stream",) if alerts is not None and cfg.redis_url is not None else ())
    client_cfg = ClientConfig(m.target_version, m.draft_version, default_k=cfg.static_k, k_max=cfg.k_max,
                              redis_url=cfg.redis_url, prefix=prefix)
    emitter_cfg = EmitterConfig(engine_id=f"demo-engine{tag}", interval_s=cfg.window_s)
    if cfg.redis_url is not None:  # the engine's hooks get their own connection, as a separate engine would
        service = build_sidecar(settings)
        hooks = build_engine_hooks(client_cfg, emitter_cfg)
    else:  # one in-process queue: the hooks write it, the sidecar reads it, tables come back by callback
        transport = InProcessTransport()
        hooks = build_engine_hooks(client_cfg, emitter_cfg, transport)
        service = build_sidecar(settings, transport=transport, publisher=CallbackPublisher(hooks.client.apply))
    sidecar = service.sidecar
    on_sidecar(sidecar)
    sidecar.start()
    try:
        log = _play(name, eng, phases, decide, hooks, progress)
    finally:
        hooks.close()
        sidecar.stop()
    sidecar.drain()
    log.history = list(sidecar.history)
    service.close()
    return log, sidecar


def run_demo(cfg: DemoConfig) -> Path:
    """Play the three runs, write the report folder, print the summary. Returns the report folder."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from controller.reference.demo_report import write_report

    console = Console()
    run_dir = cfg.out_root / time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    phases = tuple(replace(p, load=min(p.load, cfg.max_batch)) for p in scaled(WORKLOADS["demo"], cfg.time_scale))
    total = sum(p.seconds for p in phases)
    with console.status("loading the models and the held-out prompts"):
        eng = _Engine(cfg)
    m = eng.models
    static_ks = [cfg.static_k, *(k for k in dict.fromkeys(cfg.sweep_ks) if k != cfg.static_k)]
    console.print(f"[bold]spectune demo[/]: target {m.target_version} -> {m.target_v2_version} midway, draft "
                  f"{m.draft_version}, on {m.device.label}; {len(phases)} phases, {total:.0f}s per run, "
                  f"{len(static_ks) + 3} runs")
    columns = (TextColumn("{task.description:<28}"), BarColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn())
    live: list[Sidecar] = []
    logs: list[RunLog] = []
    with Progress(*columns, console=console) as prog:

        def progress_for(task: Any) -> Callable[[RunLog, int, float], None]:
            last = [0.0]

            def cb(log: RunLog, pi: int, t: float) -> None:
                if t - last[0] < 0.25:
                    return
                last[0] = t
                recent = [r for r in log.rounds[-300:] if r.t > t - 2.0]
                tps = sum(r.emitted for r in recent) / max(1e-9, t - recent[0].t) if len(recent) > 1 else 0.0
                ver = f"  policy v{live[0].version}" if live and log.name == "learned" else ""
                info = f"{phases[pi].name:<13} batch {log.rounds[-1].batch_size:>2} {tps:6.0f} tok/s{ver}"
                prog.update(task, completed=min(t, total), info=info)

            return cb

        task = prog.add_task(f"static k={cfg.static_k} (before)", total=total, info="")
        before = _live_run(cfg, eng, phases, run_dir, f"static k={cfg.static_k} (before)", progress_for(task),
                           partial(_constant, cfg.static_k))[0]
        prog.update(task, completed=total)

        task = prog.add_task("learned (sidecar, live)", total=total, info="")
        learned, sidecar = _live_run(cfg, eng, phases, run_dir, "learned", progress_for(task),
                                     on_sidecar=live.append)
        prog.update(task, completed=total)
        logs.append(learned)

        statics: dict[int, RunLog] = {}
        for k in static_ks:
            task = prog.add_task(f"static k={k}", total=total, info="")
            statics[k] = _live_run(cfg, eng, phases, run_dir, f"static k={k}", progress_for(task),
                                   partial(_constant, k))[0]
            prog.update(task, completed=total)

        best = best_per_cell([learned, *statics.values()])
        task = prog.add_task("best per bucket (hindsight)", total=total, info="")
        per_bucket = _play_best(cfg, eng, phases, run_dir, {c: k for c, (k, _) in best.items()}, progress_for(task))
        prog.update(task, completed=total)

    result = demo_result(cfg, m.device.label, learned, statics, per_bucket, before)
    best_k = int(result["best_static_k"])
    shown = [learned, before, statics[cfg.static_k], *([statics[best_k]] if best_k != cfg.static_k else []),
             per_bucket]
    r = result["ratios"]
    write_report(run_dir, cfg.static_k, phases, shown, sidecar, best, console, m.target_v2_version, {
        f"learned / static k={cfg.static_k}": r["learned_over_static"],
        f"learned / best static k in hindsight (k={best_k})": r["learned_over_best_static"],
        "learned / best per bucket in hindsight": r["learned_over_best_per_bucket"]})
    (run_dir / "demo.json").write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"learned / static k={cfg.static_k}: [bold]{r['learned_over_static']:.3f}[/]; "
                  f"learned / best static in hindsight (k={best_k}): [bold]{r['learned_over_best_static']:.3f}[/]; "
                  f"learned / best per bucket in hindsight: [bold]{r['learned_over_best_per_bucket']:.3f}[/]")
    return run_dir


def _constant(k: int, _rtype: str, _batch: int, _ctx: int) -> int:
    return k


def demo_result(cfg: DemoConfig, device: str, learned: RunLog, statics: dict[int, RunLog],
                per_bucket: RunLog, before: RunLog | None = None) -> dict[str, Any]:
    """What ``demo.json`` holds: tokens/s of every run and the three ratios the demo is judged by.

    Every run plays the same phases for the same wall time, so ratios of tokens are ratios of tokens/s. ``before``
    is the static k run played just before the learned run: the static k figure is then the mean of it and the
    run just after (``static_bracket``), which cancels a linear drift of the machine's speed across the runs.
    """
    def tok_s(log: RunLog) -> float:
        return log.tokens() / max(log.wall_s, 1e-9)

    def bracketed(k: int, f: Callable[[RunLog], float]) -> float:
        return (f(before) + f(statics[k])) / 2 if before is not None and k == cfg.static_k else f(statics[k])

    def n_tokens(log: RunLog) -> float:
        return float(log.tokens())

    static_tokens = {k: bracketed(k, n_tokens) for k in statics}
    best_k = max(statics, key=lambda k: static_tokens[k])
    tokens = learned.tokens()
    out = {
        "profile": cfg.profile, "device": device, "time_scale": cfg.time_scale, "seed": cfg.seed,
        "static_k": cfg.static_k, "best_static_k": best_k,
        "tok_s": {"learned": tok_s(learned), **{f"static k={k}": bracketed(k, tok_s) for k in statics},
                  "best per bucket (hindsight)": tok_s(per_bucket)},
        "tokens": {"learned": tokens, **{f"static k={k}": v for k, v in static_tokens.items()},
                   "best per bucket (hindsight)": per_bucket.tokens()},
        "ratios": {
            "learned_over_static": tokens / max(1.0, static_tokens[cfg.static_k]),
            "learned_over_best_static": tokens / max(1.0, static_tokens[best_k]),
            "learned_over_best_per_bucket": tokens / max(1, per_bucket.tokens()),
        },
    }
    if before is not None:
        out["static_bracket"] = {"k": cfg.static_k, "before_tok_s": tok_s(before),
                                 "after_tok_s": tok_s(statics[cfg.static_k])}
    return out


def _play_best(cfg: DemoConfig, eng: _Engine, phases: Sequence[Phase], run_dir: Path,
               table: dict[tuple[str, int, str], int], progress: Callable[[RunLog, int, float], None]) -> RunLog:
    """A fixed table per (version, batch bucket, context bucket): the hindsight baseline (static k elsewhere)."""
    draft = eng.models.draft_version
    engine_versions = {"v": eng.models.target_version}
    # Any request type (the cells do not split by it), the static k where no cell was measured.
    hindsight = PolicyTable(version=1, default_k=cfg.static_k, entries={
        Bucket(t, draft, WILDCARD, bb, cb).key(): k for (t, bb, cb), k in table.items()})
    lookups: dict[str, RowLookup] = {}  # target version -> the engines' row -> k lookup

    def decide(rtype: str, batch: int, ctx: int) -> int:
        v = engine_versions["v"]
        if v not in lookups:
            lookups[v] = RowLookup(partial(lookup, hindsight), v, draft)
        return lookups[v](rtype, batch, ctx)

    def track(log: RunLog, pi: int, t: float) -> None:
        if log.rounds:
            engine_versions["v"] = log.rounds[-1].target_version
        progress(log, pi, t)

    return _live_run(cfg, eng, phases, run_dir, "best per bucket (hindsight)", track, decide)[0]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spectune demo", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help=f"each phase x{QUICK_SCALE} (under a minute)")
    ap.add_argument("--time-scale", type=float, default=None, help="multiply every phase's length")
    ap.add_argument("--out", type=Path, default=Path("runs"), help="the report folder goes under here")
    ap.add_argument("--checkpoints", type=Path, default=None, help="checkpoint folder (default: shipped)")
    ap.add_argument("--profile", choices=PROFILE_NAMES, default=DEFAULT_PROFILE, help=PROFILE_HELP)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--redis-url", default=None, help="use Redis instead of the in-process transport")
    ap.add_argument("--db-url", default=None, help="use this database (e.g. PostgreSQL) instead of SQLite")
    ap.add_argument("--static-k", type=int, default=3, help="k of the static baseline")
    ap.add_argument("--sweep-ks", type=int, nargs="*", default=[2, 4, 6],
                    help="more static runs, for the best static k in hindsight (none: only --static-k)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-cache", type=Path, default=Path(".spectune_cache"))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``spectune demo [--quick] [--redis-url URL] [--db-url URL] ...``; prints the report folder."""
    args = build_parser().parse_args(argv)
    scale = args.time_scale if args.time_scale is not None else (QUICK_SCALE if args.quick else 1.0)
    cfg = DemoConfig(out_root=args.out, checkpoints=args.checkpoints, profile=args.profile, device=args.device,
                     redis_url=args.redis_url, db_url=args.db_url, time_scale=scale, static_k=args.static_k,
                     sweep_ks=tuple(args.sweep_ks),
                     seed=args.seed, prompt_cache=args.prompt_cache, max_batch=QUICK_MAX_BATCH if args.quick else 64)
    run_dir = run_demo(cfg)
    print(f"report: {run_dir / 'summary.md'}")
    return 0
