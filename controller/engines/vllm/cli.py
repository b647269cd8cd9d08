"""``spectune vllm serve [OPTIONS] [-- VLLM FLAGS]``: the command an operator runs in place of ``vllm serve``.

Options this command does not know go to ``vllm serve`` as they are (``--max-num-seqs 64``, ``--enforce-eager``,
...), after the ones it sets, so they win.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from controller.engines.vllm.draft_sync import MODES as DRAFT_SYNC_MODES
from controller.engines.vllm.serve import (
    DEFAULT_K_MAX,
    DEFAULT_KV_CACHE_GIB,
    DEFAULT_MODELS_DIR,
    DEFAULT_PORT,
    DEFAULT_VLLM_VENV,
    VllmError,
    VllmServeConfig,
    parse_extra,
    serve,
)
from engine.profiles import DEFAULT_PROFILE, PROFILE_HELP, PROFILE_NAMES
from telemetry.transport import DEFAULT_PREFIX


def build_parser(redis_default: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spectune vllm", description="vLLM steered by spectune.")
    sub = ap.add_subparsers(dest="cmd", metavar="ACTION")
    sub.required = True
    p = sub.add_parser("serve", help="vllm serve with spectune's exported models, draft and scheduler; unknown "
                                     "flags go to vllm serve")
    p.add_argument("--profile", choices=PROFILE_NAMES, default=DEFAULT_PROFILE, help=PROFILE_HELP)
    p.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR,
                   help="where the exported models live (exported there when missing)")
    p.add_argument("--redis-url", default=redis_default, help="windows out, policy table in")
    p.add_argument("--no-telemetry", action="store_true",
                   help="no Redis: no round records and no table (fail-static at --default-k, or --fixed-k)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis names' prefix; must match the sidecar's")
    p.add_argument("--engine-id", default="vllm-0", help="unique per engine process")
    p.add_argument("--k-max", type=int, default=DEFAULT_K_MAX,
                   help="vLLM's num_speculative_tokens: the largest k (match the sidecar's --k-max)")
    p.add_argument("--default-k", type=int, default=None, help="fail-static k before a table arrives (default k-max)")
    p.add_argument("--fixed-k", type=int, default=None, help="follow no table: draft this k every step")
    p.add_argument("--no-speculation", action="store_true", help="plain vLLM: no draft, no spectune scheduler")
    p.add_argument("--speculative-config", type=Path, default=None, metavar="FILE",
                   help="a start-up table from `spectune export vllm --out FILE`: vLLM's own scheduler follows it "
                        "(no steering, no telemetry); checked by vLLM's rules first")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--draft-sync", choices=DRAFT_SYNC_MODES, default="lazy",
                   help="lazy: at k = 0 the draft does not run, its KV cache catches up when drafting resumes "
                        "(default); eager: vLLM's own, the draft runs over every token even at k = 0")
    p.add_argument("--kv-cache-gib", type=int, default=DEFAULT_KV_CACHE_GIB, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--status-file", type=Path, default=None, help="the scheduler appends JSON status lines here")
    p.add_argument("--trace-file", type=Path, default=None,
                   help="the scheduler appends one JSON line per step here: where the step's wall time went "
                        "(loop gap, schedule, forward, update), its rows, prompt tokens, k and tokens (diagnosis)")
    p.add_argument("--cost-mixed-steps", action="store_true",
                   help="steps that run prompt tokens beside decoding rows teach the cost model too, their prompt "
                        "part estimated (default: only decode-only steps do; every step counts for acceptance)")
    p.add_argument("--vllm-python", type=Path, default=None,
                   help=f"Python of vLLM's environment (default {DEFAULT_VLLM_VENV}/bin/python, built by make vllm)")
    return ap


def main(argv: Sequence[str], redis_default: str, vllm_python: str | None = None) -> int:
    return serve(config_from_argv(argv, redis_default, vllm_python))


def config_from_argv(argv: Sequence[str], redis_default: str, vllm_python: str | None = None) -> VllmServeConfig:
    """What ``spectune vllm serve ARGV`` runs (flags it does not know go to vLLM)."""
    args, extra = build_parser(redis_default).parse_known_args(list(argv))
    py = args.vllm_python or (Path(vllm_python) if vllm_python else DEFAULT_VLLM_VENV / "bin" / "python")
    spec = None if args.speculative_config is None else read_speculative_config(args.speculative_config)
    common: dict[str, Any] = dict(
        profile=args.profile, models_dir=args.models_dir, prefix=args.prefix, engine_id=args.engine_id,
        host=args.host, port=args.port, kv_cache_gib=args.kv_cache_gib, draft_sync=args.draft_sync, vllm_python=py,
        status_path=args.status_file, trace_path=args.trace_file, cost_mixed_steps=args.cost_mixed_steps,
        extra_args=parse_extra(extra))
    if spec is None:
        return VllmServeConfig(
            k_max=args.k_max, redis_url=None if args.no_telemetry else args.redis_url, default_k=args.default_k,
            fixed_k=args.fixed_k, speculate=not args.no_speculation, **common)
    if args.fixed_k is not None or args.default_k is not None or args.no_speculation:
        raise VllmError("--speculative-config is the whole schedule: drop --fixed-k / --default-k / "
                        "--no-speculation")
    # vLLM's own scheduler follows the file: no spectune scheduler, hence no telemetry and no table
    return VllmServeConfig(k_max=int(spec["num_speculative_tokens"]), redis_url=None, steer=False,
                           speculative_config=spec, **common)


def read_speculative_config(path: Path) -> dict[str, Any]:
    """An exported vLLM speculative config, checked by vLLM 0.32's rules (a draft model may be left to us)."""
    from controller.offline.export import ExportError, validate_vllm

    try:
        spec = json.loads(path.read_text())
        validate_vllm(spec, require_model=False)
    except (OSError, ValueError) as e:
        raise VllmError(f"cannot read --speculative-config {path}: {e}") from e
    except ExportError as e:
        raise VllmError(f"--speculative-config {path} is not one vLLM accepts: {e}") from e
    if spec.get("method", "draft_model") != "draft_model":
        raise VllmError(f"--speculative-config {path}: method {spec['method']!r}; spectune's profiles serve a "
                        "draft_model")
    return cast(dict[str, Any], spec)
