"""``spectune``: the one entry point. Subcommands: train, export-model, engine, sidecar, vllm, demo, bench, db,
policy, report.

This is the only module that reads the environment (``SPECTUNE_REDIS_URL``, ``SPECTUNE_DB_URL``,
``SPECTUNE_SIDECAR_URL`` as defaults for the matching options). Torch is imported only inside the subcommands
that run models (``train``, ``engine``, ``demo``, some benchmarks): ``spectune sidecar`` never loads it.

Expected failures (bad arguments, an unreachable Redis or database, a schema to upgrade, missing checkpoints)
print one ``error:`` line saying what to do next and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from engine.profiles import DEFAULT_PROFILE, PROFILE_HELP, PROFILE_NAMES
from telemetry.urls import redact_url

EXIT_USAGE = 2  # bad arguments and expected failures, as argparse uses
REPORT_VIEWS = ("k", "position", "cost")  # spectune report --by (controller/report.py)
BENCHES = ("engine", "telemetry", "policies", "controller", "tuning", "drift", "faults", "vllm")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_DB_URL = "sqlite:///spectune.sqlite"
DEFAULT_HTTP_PORT = 8742
HTTP_TIMEOUT_S = 5.0
DEFAULT_LEASE_MS = 5000  # a crashed leader is replaced within ~5 s; a Redis hiccup under ~3 s keeps the leader


class CLIError(Exception):
    """An expected failure: the message is printed as ``error: ...`` and the exit status is 2."""


def _env(name: str, fallback: str) -> str:
    return os.environ.get(name, fallback)


# ------------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spectune", description="Learns, live, how far to speculate.")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True
    redis_default = _env("SPECTUNE_REDIS_URL", DEFAULT_REDIS_URL)
    db_default = _env("SPECTUNE_DB_URL", DEFAULT_DB_URL)
    sidecar_default = _env("SPECTUNE_SIDECAR_URL", f"http://127.0.0.1:{DEFAULT_HTTP_PORT}")

    p = sub.add_parser("train", help="train the target, draft and updated target checkpoints")
    p.add_argument("--work-dir", type=Path, default=Path("train_work"), help="resumable training state")
    p.add_argument("--out", type=Path, default=None, help="checkpoint folder (default: the shipped checkpoints/)")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the training steps (smoke runs: 0.01)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")

    p = sub.add_parser("engine", help="run the reference engine on a workload, following the policy via Redis")
    p.add_argument("--redis-url", default=redis_default)
    p.add_argument("--prefix", default="spectune")
    p.add_argument("--engine-id", default=f"engine-{os.getpid()}")
    p.add_argument("--checkpoints", type=Path, default=None, help="checkpoint folder (default: shipped)")
    p.add_argument("--profile", choices=PROFILE_NAMES, default=DEFAULT_PROFILE, help=PROFILE_HELP)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--workload", default="steady", help="demo or steady")
    p.add_argument("--duration", type=float, default=None, help="seconds to run (default: the workload's length)")
    p.add_argument("--load", type=int, default=None, help="requests kept in flight (overrides the workload)")
    p.add_argument("--default-k", type=int, default=2, help="k until a policy arrives (fail-static)")
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--window", type=float, default=0.25, help="telemetry window in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--status-file", type=Path, default=None, help="append JSON status lines here")
    p.add_argument("--prompt-cache", type=Path, default=Path(".spectune_cache"))

    p = sub.add_parser("sidecar", help="consume windows, learn, publish the policy; operator HTTP endpoint")
    p.add_argument("--redis-url", default=redis_default)
    p.add_argument("--db-url", default=db_default)
    p.add_argument("--prefix", default="spectune")
    p.add_argument("--policy", default="goodput", help="policy name (see policies.REGISTRY)")
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--one-k-per-batch", action="store_true",
                   help="the engines run one k per step for the whole batch (vLLM): give every request type of a "
                        "cell the same k, except at batch 1 where a step runs its one row's k, and never a larger "
                        "batch a deeper k than a settled smaller one (goodput policy)")
    p.add_argument("--tail-weight", type=float, default=None,
                   help="goodput policy: weigh a choice's throughput by its slowest request type's token rate (the "
                        "TPOT tail) to this power; 0 is throughput alone (default: 1 with --one-k-per-batch, else 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="0 picks a free port")
    p.add_argument("--publish-every-windows", type=int, default=16)
    p.add_argument("--publish-every-s", type=float, default=1.0)
    p.add_argument("--warm-start-windows", type=int, default=20_000)
    p.add_argument("--consumer", default=None, help="name in the consumer group (default host-pid)")
    p.add_argument("--claim-idle-ms", type=int, default=30_000,
                   help="take over entries a dead sidecar left pending this long")
    p.add_argument("--auto-upgrade", action="store_true", help="migrate the database to head at start-up")
    p.add_argument("--duration", type=float, default=None, help="exit after this many seconds")
    p.add_argument("--ready-file", type=Path, default=None, help="write {url, pid} here once serving")
    p.add_argument("--alerts", action=argparse.BooleanOptionalAction, default=True,
                   help="raise drift alerts and model updates (alerts table, {prefix}:alerts stream, log line, "
                        "spectune_alerts_total, GET /alerts); an acceptance drift re-opens its bucket's exploration")
    p.add_argument("--alert-webhook", default=None, metavar="URL",
                   help="also POST each alert's JSON here (bounded retries, off the sidecar's loop)")
    p.add_argument("--lease-ms", type=int, default=DEFAULT_LEASE_MS,
                   help="leader lease ({prefix}:leader): one sidecar of those sharing the prefix decides and "
                        "publishes, the others ingest; a dead leader is replaced after at most this long")
    p.add_argument("--no-lease", action="store_true",
                   help="no leader lease: this sidecar always decides and publishes (only for a single sidecar)")

    sub.add_parser("alerts", help="list drift alerts and model updates, ack one by id", add_help=False)
    sub.add_parser("demo", help="the embedded demo (spectune demo --help for its options)", add_help=False)
    sub.add_parser("ingest", help="store vLLM / SGLang / TensorRT-LLM telemetry as windows", add_help=False)
    sub.add_parser("export", help="the policy table as a vLLM / TensorRT-LLM / SGLang / HF config", add_help=False)
    sub.add_parser("tune", help="tune a static table or the goodput policy with optuna on stored telemetry",
                   add_help=False)
    sub.add_parser("vllm", help="vllm serve with spectune's models, draft and scheduler (spectune vllm serve --help)",
                   add_help=False)

    p = sub.add_parser("export-model", help="write a profile's target, model update and draft as HuggingFace "
                                            "LlamaForCausalLM directories (for vLLM, SGLang, transformers)")
    p.add_argument("out", type=Path, help="directory; one subdirectory per model, named by its version id")
    p.add_argument("--profile", choices=PROFILE_NAMES, default=DEFAULT_PROFILE, help=PROFILE_HELP)
    p.add_argument("--no-update", action="store_true", help="leave out the model update (target-v2)")

    p = sub.add_parser("bench", help=f"run a benchmark: {', '.join(BENCHES)} (args after NAME go to it)",
                       add_help=False)
    p.add_argument("name", nargs="?")

    p = sub.add_parser("db", help="database schema: upgrade, current, check, check-migrations")
    dsub = p.add_subparsers(dest="db_cmd", metavar="ACTION")
    dsub.required = True
    for name, hlp in (("upgrade", "migrate the database to the newest schema"),
                      ("current", "print the database's schema revision and the one this build needs"),
                      ("check", "fail unless the database is at the schema this build needs")):
        q = dsub.add_parser(name, help=hlp)
        q.add_argument("--db-url", default=db_default)
    dsub.add_parser("check-migrations", help="fail when the models and migrations/ disagree")

    p = sub.add_parser("policy", help="show the policy table, pin or unpin a bucket's k")
    psub = p.add_subparsers(dest="policy_cmd", metavar="ACTION")
    psub.required = True
    for name, hlp in (("show", "the table in force"), ("pin", "pin k for a bucket key"),
                      ("unpin", "remove a pin")):
        q = psub.add_parser(name, help=hlp)
        if name != "show":
            q.add_argument("bucket", help="target|draft|request type|batch bucket|context bucket, '*' allowed")
        if name == "pin":
            q.add_argument("k", type=int)
            q.add_argument("--reason", default="")
        q.add_argument("--sidecar-url", default=sidecar_default, help="the sidecar's HTTP endpoint")
        q.add_argument("--db-url", default=None, help="talk to the database directly instead")
        if name == "show":
            q.add_argument("--redis-url", default=None, help="read the table engines see from Redis instead")
            q.add_argument("--prefix", default="spectune")

    p = sub.add_parser("report", help="summarise stored windows and policy versions")
    p.add_argument("--db-url", default=db_default)
    p.add_argument("--by", choices=REPORT_VIEWS, default=None,
                   help="k: acceptance length per draft length; position: P(accepted >= i | k) per position; "
                        "cost: round seconds, tokens verified and goodput per batch bucket (default: the summary)")
    return ap


# ------------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand; returns the exit status."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_in and args_in[0] in ("ingest", "export"):  # other engines' telemetry and configs
            from controller.offline import cli as offline

            return int(offline.main(args_in))
        if args_in and args_in[0] == "tune":  # optuna studies replaying stored telemetry
            from controller.offline import tune

            return int(tune.main(args_in[1:]))
        if args_in and args_in[0] == "alerts":  # drift alerts and model updates (controller/service/alerts)
            from controller.service.alerts import cli as alerts_cli

            return int(alerts_cli.main(args_in[1:], _env("SPECTUNE_DB_URL", DEFAULT_DB_URL)))
        if args_in and args_in[0] == "demo":
            from controller.reference import demo

            return int(demo.main(args_in[1:]))
        if args_in and args_in[0] == "bench":
            return _bench(args_in[1:])
        if args_in and args_in[0] == "vllm":  # vLLM steered by spectune (controller/engines/vllm)
            from controller.engines.vllm import cli as vllm_cli

            return int(vllm_cli.main(args_in[1:], redis_default=_env("SPECTUNE_REDIS_URL", DEFAULT_REDIS_URL),
                                     vllm_python=os.environ.get("SPECTUNE_VLLM_PYTHON")))
        args = build_parser().parse_args(args_in)
        handler = {"train": _train, "export-model": _export_model, "engine": _engine, "sidecar": _sidecar, "db": _db,
                   "policy": _policy,
                   "report": _report}[args.cmd]
        return int(handler(args))
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from telemetry.errors import SpectuneError

        if isinstance(e, SpectuneError | FileNotFoundError | ValueError):
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise


def _bench(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        print(f"usage: spectune bench NAME [ARGS...]   NAME: {', '.join(BENCHES)}")
        return 0 if rest else EXIT_USAGE
    name = rest[0]
    if name not in BENCHES:
        raise CLIError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHES)}")
    # bench/ is not packaged: it lies beside controller/ in a source checkout (an editable install maps only the
    # packaged folders, so the checkout's root goes on the path for the import).
    root = str(Path(__file__).resolve().parent.parent)
    if (Path(root) / "bench" / "__init__.py").is_file() and root not in sys.path:
        sys.path.append(root)
    try:
        mod = importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        raise CLIError(f"benchmark {name!r} is not in this checkout ({e}); benchmarks run from a source checkout "
                       "(git clone, then `pip install -e .`)") from e
    return int(mod.main(rest[1:]))


# --------------------------------------------------------------------------------------------- commands
def _train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from engine.checkpoint import CHECKPOINT_DIR
    from engine.train import train_all

    if args.scale <= 0:
        raise CLIError("--scale must be > 0 (1.0 reproduces the shipped checkpoints)")
    console = Console(stderr=True)
    out = args.out or CHECKPOINT_DIR
    with console.status(f"training into {out} (resumable state in {args.work_dir})"):
        train_all(args.work_dir, out_dir=out, scale=args.scale, threads=args.threads, log=console.print)
    console.print(f"checkpoints in {out}")
    return 0


def _export_model(args: argparse.Namespace) -> int:
    from engine.hf_export import export_profile

    for m in export_profile(args.profile, args.out, with_update=not args.no_update):
        print(f"{m.path}: {m.what_it_is}")
    return 0


def _engine(args: argparse.Namespace) -> int:
    from controller.reference.engine_proc import EngineProcConfig, run_engine
    from controller.signals import install_stop_signals
    from telemetry.transport import RedisKeys

    _check_redis(args.redis_url)
    cfg = EngineProcConfig(
        redis_url=args.redis_url, engine_id=args.engine_id, checkpoints=args.checkpoints, profile=args.profile,
        device=args.device,
        prefix=args.prefix, workload=args.workload, duration_s=args.duration, load=args.load,
        default_k=args.default_k, k_max=args.k_max, window_s=args.window, seed=args.seed,
        status_path=args.status_file, prompt_cache=args.prompt_cache,
    )
    stop = threading.Event()
    install_stop_signals(stop)
    keys = RedisKeys(cfg.prefix)
    print(f"engine {cfg.engine_id}: loading models, then decoding workload {cfg.workload!r} "
          f"(windows -> {keys.windows}, policy <- {keys.policy})", flush=True)
    res = run_engine(cfg, stop, say=lambda line: print(f"engine {cfg.engine_id}: {line}", flush=True))
    print(f"engine {cfg.engine_id}: {res['rounds']} rounds, {res['tokens']} tokens in {res['wall_s']:.1f}s, "
          f"{res['windows_sent']} windows sent; policy: {res['client']['detail']}", flush=True)
    return 0


def _sidecar(args: argparse.Namespace) -> int:
    from controller.service.alerts import AlertConfig, WebhookConfig
    from controller.service.build import SidecarSettings, build_sidecar
    from controller.service.lease import LeaseConfig
    from controller.service.sidecar import SidecarConfig
    from controller.signals import install_stop_signals
    from policies import REGISTRY
    from telemetry.ingest import ConsumerConfig, default_consumer_name
    from telemetry.transport import RedisKeys

    if args.policy not in REGISTRY:
        raise CLIError(f"unknown policy {args.policy!r}; choose one of: {', '.join(sorted(REGISTRY))}")
    if args.one_k_per_batch and args.policy != "goodput":
        raise CLIError(f"--one-k-per-batch is a setting of the goodput policy, not of {args.policy!r}")
    if args.alert_webhook is not None and not args.alerts:
        raise CLIError("--alert-webhook needs alerts on; drop --no-alerts")
    webhook = WebhookConfig(args.alert_webhook) if args.alert_webhook else None  # ValueError: a bad URL, said early
    lease_cfg = None if args.no_lease else LeaseConfig(args.lease_ms)  # ValueError: a lease too short, said early
    consumer = ConsumerConfig(consumer=args.consumer or default_consumer_name(), claim_min_idle_ms=args.claim_idle_ms,
                              claim_interval_s=min(5.0, args.claim_idle_ms / 2000))
    settings = SidecarSettings(
        db_url=args.db_url, redis_url=args.redis_url, prefix=args.prefix, auto_upgrade=args.auto_upgrade,
        policy=args.policy, k_max=args.k_max, seed=args.seed, one_k_per_batch=args.one_k_per_batch,
        tail_weight=args.tail_weight,
        sidecar=SidecarConfig(publish_every_windows=args.publish_every_windows, publish_every_s=args.publish_every_s,
                              warm_start_windows=args.warm_start_windows, consumer=consumer),
        lease=lease_cfg, alerts=AlertConfig() if args.alerts else None,
        alert_sinks=("stream", "log", "prometheus") if args.alerts else (), alert_webhook=webhook,
        http_host=args.http_host, http_port=args.http_port)
    _check_redis(args.redis_url)
    service = build_sidecar(settings)
    sidecar, server = service.sidecar, service.server
    assert server is not None
    stop = threading.Event()
    install_stop_signals(stop)
    print(f"sidecar {consumer.consumer}: policy {args.policy}, resuming at v{sidecar.version}; "
          f"operator endpoint {server.url}; consuming {RedisKeys(args.prefix).windows} (group sidecar); alerts "
          f"{'on' if sidecar.alerts else 'off'}{' + webhook' if webhook else ''}; "
          + (f"leader lease {sidecar.lease_key} ({lease_cfg.lease_ms} ms)" if sidecar.lease and lease_cfg
             else "no lease (always the leader)"), flush=True)
    if args.ready_file is not None:
        args.ready_file.write_text(json.dumps({"url": server.url, "pid": os.getpid()}))
    try:
        sidecar.run(stop, duration_s=args.duration or None,
                    on_publish=lambda pv: print(f"published v{pv.table.version}: {pv.table.reason}", flush=True))
    finally:
        service.close()
    h = sidecar.health()
    print(f"sidecar stopped: {h['windows_ingested']} batches ingested, policy v{h['policy_version']}", flush=True)
    return 0


def _db(args: argparse.Namespace) -> int:
    from telemetry import migrate

    if args.db_cmd == "upgrade":
        migrate.upgrade(args.db_url)
        print(f"database at revision {migrate.current_revision(args.db_url)}")
    elif args.db_cmd == "current":
        print(f"database at revision {migrate.current_revision(args.db_url) or '(empty)'}; "
              f"this build needs {migrate.head_revision()}")
    elif args.db_cmd == "check":
        migrate.check(args.db_url)  # SchemaOutOfDateError (exit 2) names the upgrade command
        print(f"database at the head revision {migrate.head_revision()}")
    else:
        migrate.check_migrations()
        print("models and migrations agree")
    return 0


def _http(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read()).get("error", e.reason)
        except (ValueError, AttributeError):
            detail = e.reason
        raise CLIError(f"the sidecar refused {method} {url}: {detail}") from e
    except (urllib.error.URLError, OSError) as e:
        raise CLIError(f"no sidecar answers at {url} ({e}); start one with `spectune sidecar`, pass "
                       "--sidecar-url, or use --db-url to talk to the database directly") from e


def _policy(args: argparse.Namespace) -> int:
    base = args.sidecar_url.rstrip("/")
    if args.policy_cmd == "show":
        if args.db_url:
            from telemetry.policy_table import table_to_json
            from telemetry.store import Store

            with Store(args.db_url) as store:
                t = store.latest_policy_version()
            table = json.loads(table_to_json(t)) if t else None
        elif args.redis_url:
            table = _redis_table(args.redis_url, args.prefix)
        else:
            table = _http("GET", f"{base}/policy")
        if table is None:
            raise CLIError("no policy table yet; the sidecar publishes one after it has seen windows")
        _print_table(table)
        return 0
    if args.db_url:
        from telemetry.store import Store

        with Store(args.db_url) as store:
            if args.policy_cmd == "pin":
                store.pin(args.bucket, args.k, args.reason, who="cli")
                print(f"pinned {args.bucket} = {args.k}; a running sidecar applies it within its publish interval")
            elif not store.unpin(args.bucket, who="cli"):
                raise CLIError(f"no active pin on {args.bucket!r}")
            else:
                print(f"unpinned {args.bucket}")
        return 0
    if args.policy_cmd == "pin":
        res = _http("POST", f"{base}/pins", {"bucket": args.bucket, "k": args.k, "reason": args.reason})
        print(f"pinned {args.bucket} = {args.k}; policy v{res['policy_version']}")
    else:
        res = _http("DELETE", f"{base}/pins/{quote(args.bucket, safe='')}")
        print(f"unpinned {args.bucket}; policy v{res['policy_version']}")
    return 0


def _redis_table(url: str, prefix: str) -> Any:
    import redis

    from telemetry.transport import RedisKeys

    key = RedisKeys(prefix).policy
    try:
        raw = redis.Redis.from_url(url, socket_connect_timeout=2).get(key)
    except (redis.RedisError, ValueError) as e:
        raise CLIError(
            f"cannot read {key} from Redis at {redact_url(url)} ({e}); is Redis running?"
        ) from e
    if not raw:
        return None
    from telemetry.policy_table import policy_table_from_json, table_to_json
    from telemetry.records import RecordError

    try:  # what is in Redis is input like any other: the same rules as the engines' clients apply to it
        table = policy_table_from_json(raw)
    except (RecordError, ValueError, UnicodeDecodeError) as e:
        raise CLIError(f"{key} in Redis at {redact_url(url)} is not a policy table spectune reads ({e}); the "
                       "engines keep their last good table; the sidecar replaces this value when it next "
                       "publishes") from e
    return json.loads(table_to_json(table))


def _print_table(table: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from telemetry.records import WILDCARD
    from telemetry.wire import parse_bucket_key

    t = Table(title=f"policy v{table['version']} (default k={table['default_k']}): {table.get('reason', '')}")
    for col in ("target", "draft", "request type", "batch", "context", "k"):
        t.add_column(col)
    for key, k in sorted(table["entries"].items()):
        t.add_row(*(WILDCARD if p is None else str(p) for p in parse_bucket_key(key)), str(k))
    Console().print(t)


def _report(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from telemetry.store import Store

    console = Console()
    if args.by is not None:
        from controller.report import report_by

        with Store(args.db_url) as store:
            acc_w, cost_w = store.acceptance_windows(), store.cost_windows()
        title, columns, lines = report_by(args.by, [w.window for w in acc_w], [w.window for w in cost_w])
        view = Table(title=title)
        for col in columns:
            view.add_column(col)
        for line in lines:
            view.add_row(*line)
        console.print(view)
        return 0
    with Store(args.db_url) as store:
        acc = store.acceptance_windows()
        versions = store.policy_versions(limit=10)
        batches = store.batch_count()
    totals: dict[tuple[str, str, str], list[int]] = {}
    for w in acc:
        a = w.window
        t = totals.setdefault((a.target_version, a.draft_version, a.request_type), [0, 0, 0, 0])
        if a.k > 0:
            t[0] += a.rows
            t[1] += a.drafted
            t[2] += a.accepted
            t[3] += a.emitted
    tab = Table(title=f"acceptance ({batches} window batches stored)")
    for col in ("target", "draft", "request type", "drafting rows", "acceptance rate", "mean acceptance length"):
        tab.add_column(col)
    for (tv, dv, rt), (rows, drafted, accepted, emitted) in sorted(totals.items()):
        rate = f"{accepted / drafted:.3f}" if drafted else "-"
        mal = f"{emitted / rows:.2f}" if rows else "-"
        tab.add_row(tv, dv, rt, str(rows), rate, mal)
    console.print(tab)
    vt = Table(title="newest policy versions")
    for col in ("version", "created", "buckets", "default k", "reason"):
        vt.add_column(col)
    for pt in versions:
        vt.add_row(str(pt.version), time.strftime("%H:%M:%S", time.localtime(pt.created_at)),
                   str(len(pt.entries)), str(pt.default_k), pt.reason)
    console.print(vt)
    return 0


def _check_redis(url: str) -> None:
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping()
    except (redis.RedisError, ValueError, OSError) as e:
        raise CLIError(
            f"Redis at {redact_url(url)} does not answer ({e}); start redis-server or pass --redis-url"
        ) from e




if __name__ == "__main__":
    raise SystemExit(main())
