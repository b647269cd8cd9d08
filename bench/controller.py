"""Controller benchmark: the engine-side lookup, policy propagation through Redis, and the sidecar's CPU.

Run: ``python -m bench.controller [--quick] [--json bench/results/controller.json]`` (or
``spectune bench controller --json PATH``). Needs Redis (``--redis-url``); the store is a SQLite file in a
temporary folder unless ``--db-url`` names another database.

Figures (medians over ``--repeats`` runs):

1. ``decide_us``: p50 / p99 of one :meth:`controller.client.PolicyClient.decide` call (request type, batch size,
   context length -> k) over a seeded stream of mixed queries against a realistic table, each call timed alone
   with ``perf_counter_ns``. ``dict_lookup_us`` times a bare ``dict.get`` of a prebuilt tuple key the same way in
   the same run: the floor any lookup pays, timer included (``timer_us`` is the empty measurement).
2. ``propagation_ms``: p50 / p99 from a changed decision in the sidecar (the new table's ``created_at``, taken
   before it is stored in SQL) to the engine's client having applied it (``ClientStatus.last_update_at``): SQL
   insert, the Lua SET + PUBLISH in Redis, the pub/sub nudge, the client's GET, parse, validation and swap. Each
   change is a pin toggled on a bucket followed by :meth:`Sidecar.publish_now`, the operator's path.
3. ``sidecar_cpu_s_per_1000_windows``: ``time.process_time()`` of the sidecar process while it drains window
   batches that engines had already published to Redis (read, decode, validate, store, acknowledge, feed the
   goodput policy, decide and publish), per 1,000 window batches. Each batch is one engine's 250 ms window of
   ``rounds_per_window`` rounds, as :class:`telemetry.emitter.Emitter` ships them.

A benchmark never asserts: it prints, saves JSON and a PNG, and leaves judging to the reader.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench._common import write_results
from controller.client import ClientConfig, PolicyClient
from controller.service.build import SidecarSettings, build_sidecar
from controller.service.sidecar import SidecarConfig
from telemetry.emitter import Emitter, EmitterConfig
from telemetry.ingest import ConsumerConfig
from telemetry.records import DEFAULT_BUCKETS, REQUEST_TYPES, Bucket, PolicyTable
from telemetry.synthetic import synthetic_rounds
from telemetry.transport import RedisConfig, RedisKeys, RedisStreamsTransport

DECIDE_TARGET_P99_US = 10.0  # a lookup on the engine hot path must cost a small part of a round
PROPAGATION_TARGET_P99_MS = 100.0  # a decision reaches the engines within a fraction of a 250 ms window
VERSIONS = (("target-v1", "draft-v1"), ("target-v2", "draft-v1"))
PROPAGATION_GAP_S = 0.02  # pause between changes, so each propagation is measured on its own
PROPAGATION_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of one run; ``--quick`` picks the small preset."""

    decide_calls: int  # timed decide() calls (and as many dict lookups)
    propagations: int  # decisions changed and propagated
    windows: int  # window batches drained by the sidecar for the CPU figure
    rounds_per_window: int  # rounds one engine aggregates into one window
    engines: int  # engines sending those windows
    repeats: int

    def __post_init__(self) -> None:
        for name, v in self.__dict__.items():
            if v < 1:
                raise ValueError(f"BenchConfig.{name} must be >= 1, got {v}")


PRESETS = {
    "full": BenchConfig(decide_calls=200_000, propagations=200, windows=2_000, rounds_per_window=40, engines=8,
                        repeats=3),
    "quick": BenchConfig(decide_calls=20_000, propagations=40, windows=200, rounds_per_window=40, engines=4,
                         repeats=1),
}


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def realistic_table(version: int = 1) -> PolicyTable:
    """Every bucket of two model versions x three types x all batch and context buckets, plus wildcards."""
    rng = random.Random(version)
    entries = {
        Bucket(t, d, rt, bb, cb).key(): rng.randrange(0, 9)
        for t, d in VERSIONS for rt in REQUEST_TYPES for bb in DEFAULT_BUCKETS.batch_edges
        for cb in DEFAULT_BUCKETS.context_labels()
    }
    entries["*|*|*|*|*"] = 2
    return PolicyTable(version=version, default_k=2, k_max=8, entries=entries, created_at=time.time())


# ------------------------------------------------------------------------------------------ 1. lookups
def bench_decide(cfg: BenchConfig, seed: int) -> dict[str, float]:
    client = PolicyClient(ClientConfig(*VERSIONS[0], default_k=2, k_max=8))
    client.apply(realistic_table())
    rng = random.Random(seed)
    queries = [(rng.choice(REQUEST_TYPES), rng.randint(1, 256), rng.randint(1, 12_000))
               for _ in range(cfg.decide_calls)]
    table = {(rt, b, c): 1 for rt, b, c in queries}
    clock = time.perf_counter_ns
    decide = client.decide
    for q in queries[:1000]:  # warm the cache as an engine's first rounds would
        decide(*q)
    d_ns, l_ns, e_ns = [], [], []
    get = table.get
    for rt, b, c in queries:
        t0 = clock()
        decide(rt, b, c)
        t1 = clock()
        d_ns.append(t1 - t0)
    for key in queries:
        t0 = clock()
        get(key)
        t1 = clock()
        l_ns.append(t1 - t0)
    for _ in range(len(queries)):
        t0 = clock()
        t1 = clock()
        e_ns.append(t1 - t0)
    return {"decide_p50": _pct(d_ns, 50) / 1e3, "decide_p99": _pct(d_ns, 99) / 1e3,
            "dict_p50": _pct(l_ns, 50) / 1e3, "dict_p99": _pct(l_ns, 99) / 1e3, "timer_p50": _pct(e_ns, 50) / 1e3}


# -------------------------------------------------------------------------------------- 2. propagation
def bench_propagation(cfg: BenchConfig, redis_url: str, db_url: str) -> dict[str, float]:
    prefix = f"spectune-bench-{uuid.uuid4().hex[:8]}"
    service = build_sidecar(_settings(redis_url, db_url, prefix, block_ms=1))
    sidecar, store = service.sidecar, service.sidecar.store
    client = PolicyClient(ClientConfig(*VERSIONS[0], default_k=2, k_max=8, redis_url=redis_url, prefix=prefix,
                                       refresh_s=5.0))  # the timer is the safety net; the nudge is what we measure
    _wait(lambda: client.status().connected, "the client to reach Redis")
    key = "target-v1|draft-v1|code|*|*"
    lat_ms = []
    try:
        for i in range(cfg.propagations):
            store.pin(key, 1 + i % 2, "bench")
            table = sidecar.publish_now("bench")
            assert table is not None, "a changed pin always makes a new version"
            _wait(lambda v=table.version: client.version == v, "the client to apply the new version")
            applied = client.status().last_update_at
            assert applied is not None
            lat_ms.append((applied - table.created_at) * 1e3)
            time.sleep(PROPAGATION_GAP_S)
    finally:
        client.close()
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(RedisKeys(prefix).pattern))
        if keys:
            r.delete(*keys)
        r.close()
        service.close()
    return {"p50": _pct(lat_ms, 50), "p99": _pct(lat_ms, 99), "max": max(lat_ms)}


def _settings(redis_url: str, db_url: str, prefix: str, block_ms: int) -> SidecarSettings:
    """The benchmarked sidecar: the goodput policy, no replay, no lease, no alerts."""
    return SidecarSettings(db_url=db_url, redis_url=redis_url, prefix=prefix, auto_upgrade=True, policy="goodput",
                           k_max=8, sidecar=SidecarConfig(warm_start_windows=0,
                                                          consumer=ConsumerConfig(consumer="bench", block_ms=block_ms)))


def _wait(cond: Any, what: str) -> None:
    end = time.monotonic() + PROPAGATION_TIMEOUT_S
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.0005)


# ---------------------------------------------------------------------------------------- 3. sidecar CPU
def bench_sidecar_cpu(cfg: BenchConfig, redis_url: str, db_url: str, seed: int) -> dict[str, float]:
    prefix = f"spectune-bench-{uuid.uuid4().hex[:8]}"
    rc = RedisConfig(prefix=prefix)
    engine_side = RedisStreamsTransport(redis_url, rc)
    per_engine = -(-cfg.windows // cfg.engines)
    sent = 0
    for e in range(cfg.engines):
        em = Emitter(engine_side, EmitterConfig(f"bench-engine-{e}"), start=False)
        rounds = synthetic_rounds(per_engine * cfg.rounds_per_window, seed=seed * 100 + e)
        for i, rnd in enumerate(rounds):
            em.record(rnd)
            if i % cfg.rounds_per_window == cfg.rounds_per_window - 1:
                em.flush()
        em.flush()
        sent += em.stats().windows_sent
    service = build_sidecar(_settings(redis_url, db_url, prefix, block_ms=5))
    sidecar = service.sidecar
    try:
        c0, w0 = time.process_time(), time.perf_counter()
        got = sidecar.drain(idle_steps=2, max_steps=100_000)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    finally:
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(RedisKeys(prefix).pattern))
        if keys:
            r.delete(*keys)
        r.close()
        engine_side.close()
        service.close()
    return {"cpu_s_per_1000": cpu / max(1, got) * 1000, "wall_s_per_1000": wall / max(1, got) * 1000,
            "windows": float(got), "sent": float(sent), "versions": float(sidecar.version),
            "windows_per_batch": sidecar.windows_observed / max(1, got)}


# ------------------------------------------------------------------------------------------------ run
def run(cfg: BenchConfig, redis_url: str, db_url: str | None) -> dict[str, Any]:
    reps: dict[str, list[dict[str, float]]] = {"decide": [], "prop": [], "cpu": []}
    with tempfile.TemporaryDirectory(prefix="spectune-bench-") as d:
        for i in range(cfg.repeats):
            reps["decide"].append(bench_decide(cfg, seed=i))
            reps["prop"].append(bench_propagation(cfg, redis_url, db_url or f"sqlite:///{Path(d) / f'p{i}.sqlite'}"))
            reps["cpu"].append(bench_sidecar_cpu(cfg, redis_url, db_url or f"sqlite:///{Path(d) / f'c{i}.sqlite'}",
                                                 seed=i))

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in reps[kind])

    return {
        "decide_us": {"p50": med("decide", "decide_p50"), "p99": med("decide", "decide_p99")},
        "dict_lookup_us": {"p50": med("decide", "dict_p50"), "p99": med("decide", "dict_p99")},
        "timer_us": med("decide", "timer_p50"),
        "propagation_ms": {"p50": med("prop", "p50"), "p99": med("prop", "p99"), "max": med("prop", "max")},
        "sidecar_cpu_s_per_1000_windows": med("cpu", "cpu_s_per_1000"),
        "sidecar_wall_s_per_1000_windows": med("cpu", "wall_s_per_1000"),
        "sidecar_windows_per_batch": med("cpu", "windows_per_batch"),
        "store": "sqlite (temporary file)" if db_url is None else db_url.split("://")[0],
        "targets": {"decide_us_p99": DECIDE_TARGET_P99_US, "propagation_ms_p99": PROPAGATION_TARGET_P99_MS},
        "config": dict(cfg.__dict__),
        "repeats_raw": reps,
    }


def report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="controller benchmark (medians over repeats)")
    for c in ("figure", "p50", "p99", "target"):
        t.add_column(c)
    t.add_row("decide() us", f"{res['decide_us']['p50']:.2f}", f"{res['decide_us']['p99']:.2f}",
              f"p99 <= {DECIDE_TARGET_P99_US:g}")
    t.add_row("bare dict lookup us", f"{res['dict_lookup_us']['p50']:.2f}", f"{res['dict_lookup_us']['p99']:.2f}", "")
    t.add_row("propagation ms", f"{res['propagation_ms']['p50']:.2f}", f"{res['propagation_ms']['p99']:.2f}",
              f"p99 <= {PROPAGATION_TARGET_P99_MS:g}")
    t.add_row("sidecar CPU s / 1000 windows", f"{res['sidecar_cpu_s_per_1000_windows']:.2f}", "", "")
    Console().print(t)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    ax = axes[0]
    xs = range(2)
    ax.bar([x - 0.2 for x in xs], [res["decide_us"]["p50"], res["decide_us"]["p99"]], 0.4, label="decide()")
    ax.bar([x + 0.2 for x in xs], [res["dict_lookup_us"]["p50"], res["dict_lookup_us"]["p99"]], 0.4,
           label="bare dict.get")
    ax.axhline(DECIDE_TARGET_P99_US, color="crimson", ls="--", lw=1, label="p99 target")
    ax.set(xticks=list(xs), xticklabels=["p50", "p99"], ylabel="microseconds", title="Engine-side lookup")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.bar(["p50", "p99"], [res["propagation_ms"]["p50"], res["propagation_ms"]["p99"]])
    ax.axhline(PROPAGATION_TARGET_P99_MS, color="crimson", ls="--", lw=1)
    ax.set(ylabel="milliseconds", title="Decision -> engine (Redis)")
    ax = axes[2]
    ax.bar(["CPU", "wall"], [res["sidecar_cpu_s_per_1000_windows"], res["sidecar_wall_s_per_1000_windows"]])
    ax.set(ylabel="seconds per 1000 window batches", title="Sidecar cost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--json", default="bench/results/controller.json", help="where to write the figures")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat (a smoke run)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--db-url", default=None, help="store for the sidecar (default: a temporary SQLite file)")
    args = ap.parse_args(argv)
    cfg = PRESETS["quick" if args.quick else "full"]
    res = run(cfg, args.redis_url, args.db_url)
    res["preset"] = "quick" if args.quick else "full"
    write_results(res, args.json, plot, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
