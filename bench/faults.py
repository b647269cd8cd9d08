"""Fault suite: the sidecar path under outages, kills and hostile input, on its own Redis and PostgreSQL.

Run: ``spectune bench faults [--quick] [--profile small|xl] [--out bench/results]`` (or ``python -m bench.faults``).
Writes ``faults.json`` and ``faults.png`` (a timeline per scenario) under ``--out`` and prints a table.

What runs. The suite starts its **own** ``redis-server`` (no persistence) and its **own** PostgreSQL cluster
(``initdb`` into a temporary folder, ``pg_ctl start`` on a free port; as the ``postgres`` user when run as root),
a ``spectune sidecar`` process between them and, unless ``--no-engine``, one reference engine process
(``spectune engine``, ``--profile``) that decodes and ships windows through every scenario. It kills and restarts
only what it started, by PID or by its own data folder, and removes everything on exit (exceptions, Ctrl-C and
SIGTERM included). The shared servers on 6379 / 5432 are never touched.

Settings. Every sidecar (the suite's, and the scale-out's three) runs with the product's defaults: it is given
only the flags that say where to connect and how to be found (Redis and database URLs, prefix, port, ready file,
consumer name), no timing flag. :class:`SidecarDefaults` reads those defaults from the config classes
(``SidecarConfig.publish_every_s`` / ``publish_every_windows``, ``ConsumerConfig.claim_min_idle_ms`` /
``claim_interval_s``, ``LeaseConfig.lease_ms``, ``HttpConfig``'s timeouts, ``RedisConfig``'s stream lengths);
the waits and the targets that depend on them are derived from them, and all of it is in the JSON's ``config``
block (``sidecar_defaults``, ``derived``; ``sidecar_cli_default_mismatch`` lists a flag whose default differs
from its config class). In particular an entry a killed sidecar or a failed store write left pending is read again
only after ``claim_min_idle_ms`` (30 s), so the suite waits that long plus a margin before it counts a window lost.

Counting. Each scenario runs a **feeder**: a thread that XADDs well-formed window batches of seeded synthetic
rounds, one engine id per scenario and sequence numbers 1, 2, 3, ..., at an engine's pace (one window per
``feed_interval_s``), keeping what Redis refused and sending it again, as the emitter does. ``windows_sent`` counts
the XADDs Redis acknowledged; ``windows_stored`` counts that engine id's distinct ``seq`` in the suite's
PostgreSQL; ``windows_duplicated`` counts stored rows beyond one per ``seq``. The engine's own figures (its
emitter's ``windows_sent`` / ``windows_dropped`` against its rows in PostgreSQL) are in the ``engine`` block.

Scenarios, in this order (one fault at a time; ``--quick`` shrinks durations and counts; ``--scenarios`` picks a
subset; each starts from a running system, what an earlier one left down is started again first):

- ``redis_kill``: SIGKILL the suite's Redis, keep it down ``redis_down_s``, restart it empty on the same port.
  The kill is timed at a moment when the consumer group has no undelivered entry (``XINFO GROUPS`` lag 0, the
  feeder held): without persistence, entries Redis had acknowledged and nobody read yet die with it, which is
  Redis's durability setting, not the sidecar's. ``undelivered_at_kill`` says how many there were (0).
- ``sidecar_kill``: SIGKILL the sidecar, start a new one (same consumer name, so it claims its own pending once
  they have been idle ``claim_min_idle_ms``).
- ``postgres_stop``: ``pg_ctl stop -m immediate``, ``pg_down_s`` of outage, ``pg_ctl start``.
- ``fuzz``: ``fuzz_entries`` hostile stream entries: hypothesis draws valid batches (seeded synthetic rounds) and
  raw wire Structs (``st.from_type`` on :mod:`telemetry.wire`'s Structs), then a seeded mutator changes fields,
  types, bytes, sizes and nesting. Every entry must be dead-lettered, stored or skipped as a duplicate. Redis's
  memory is sampled throughout (below).
- ``http``: ``http_requests`` requests from ``http_clients`` concurrent clients against the operator endpoint,
  hostile bodies included (5000-digit k, 5000-deep JSON, NUL in a bucket), with ``idle_connections`` held open
  (connected, silent). The clients are one selector-driven thread in a process of their own (:func:`http_load`),
  ``http_clients`` connections in flight at all times, each request on a new connection: client threads inside the
  suite's process would wait for its GIL behind the feeders and the observer, and that wait would be counted as the
  endpoint's. Latency is from the connect to the last byte of the answer, as the client sees it.
- ``slow_clients``: while the feeder runs, a process of its own (:func:`bench._faults_probes.slow_clients`)
  holds ``slow_half_sent`` connections that sent a request head without its closing blank line and nothing more,
  and ``slow_tricklers`` that send a request one byte every ``slow_trickle_every_s``; a connection the server
  closes is opened again at once. Meanwhile another process (:func:`bench._faults_probes.health_probe`) times
  ``GET /health``, one at a time on new connections, for ``slow_probe_s``. Figures: ``health_p50/p99/max_ms``,
  ``health_errors`` (no answer, or not 200), and what the endpoint did with the slow connections:
  ``slow_closed_by_server`` per kind, ``slow_held_s`` (how long it held them before closing;
  ``HttpConfig.request_timeout_s`` says 10 s), ``slow_answers`` (status lines it sent on them, e.g. 408; empty
  when it closes without a word), ``requests_timed_out_by_server`` (its own counter).
- ``forged_types``: ``forged_types`` well-formed windows, each with a new request type, in bursts spread over
  ``forged_flood_s``; the cardinality caps must dead-letter the excess (counted per window, as the gate splits a
  batch), and the sidecar's RSS must stay within 2x its idle RSS. It must keep deciding and publishing meanwhile:
  ``/health`` is read every 0.25 s and its ``deciding`` block (``decisions``, ``last_at``, ``p99_s``,
  ``overdue``; None while the sidecar does not report one) gives ``forged_decision_gap_s`` (the largest gap
  between consecutive decisions during the flood, from ``last_at``: an upper bound when two samples straddle
  several decisions; ``baseline_decision_gap_s`` is the same over four periods before the flood) and
  ``forged_decision_p99_s`` (the largest p99 it reported). A third of the way through,
  ``POST /pins`` pins ``PIN_BUCKET`` to a k other than the table's default; ``forged_pin_to_key_s`` is from the
  request to the engines' key holding a newer table with the pin's entry (None: not within ``PIN_WAIT_S``); the
  pin is then deleted (``DELETE /pins/{bucket}``, ``forged_unpin_to_key_s``). After the flood, real traffic:
  ``real_type_windows`` acceptance windows of one new request type (``REAL_TYPE``), then ``model_update_windows``
  windows of a new target version (``MODEL_UPDATE_VERSION``); ``forged_real_type_in_table`` /
  ``forged_model_update_in_table`` say whether the published table came to list them within ``APPEAR_WAIT_S``
  of the last one sent, and ``..._to_table_s`` how long after the first. Redis's memory is sampled throughout.
- ``forged_tables``: forged (version far ahead), stale, oversized, garbage and wrong-Redis-type values written
  to the engines' policy key, and the key deleted; how long each stays before the sidecar puts the store's table
  back, and whether the engine stayed on the forgery (``engine_stuck_on_forged``; the client follows an older table
  back once it has held the key for ``ClientConfig.rollback_after_s``: ``engine_back_on_store_s``).
- ``scaleout``: ``bench._faults_scaleout.run_scaleout`` (three sidecars on the default lease, kill -9 the leader),
  when present.

Redis memory (``fuzz`` and ``forged_types``): every 0.5 s, ``INFO memory`` ``used_memory`` and the windows and
dead-letter streams' ``XLEN`` and ``MEMORY USAGE``: ``redis_used_memory_mb_peak``, ``redis_windows_len_peak``,
``redis_deadletter_len_peak``, ``redis_windows_mb_peak``, ``redis_deadletter_mb_peak`` and
``redis_stream_mb_peak`` (the two streams together while the flood is still unread: the writers' backlog, which
only their XADD MAXLEN bounds); one trim interval after the flood was read, ``redis_stream_mb_settled``, judged
against ``RedisConfig.stream_cap_mb``, the product's stated cap on what its streams keep.

Per scenario: ``windows_sent/stored/lost/duplicated``, ``engine_crashed``, ``sidecar_crashed``, ``recovery_s``
(``first_window_stored_s`` and ``table_present_s`` after the service returns), ``policy_key_absent_s`` (longest
run of 50 ms polls finding no table of the store's at the key while Redis answered), ``http_5xx``, ``http_p99_ms``
(``slow_clients``: the /health probe's), ``max_rss_mb`` (peak sampled VmRSS of the sidecar), ``idle_rss_mb``
(VmRSS before the fault), ``dead_lettered`` and ``dead_letter_reasons`` (the sidecar's ``/health`` ``rejected``
counters over the scenario; decision ticks the policy raised on are counted apart, as ``policy_errors``).
``targets`` judges each.

A benchmark never asserts: it prints, saves JSON and a PNG, and leaves judging to the reader (and ``targets``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import json
import math
import os
import random
import select
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from bench._common import write_results
from bench._faults_probes import (
    HTTP_STATUS_FAILED,
    SLOW_READY,
    HealthSampler,
    RedisMemory,
    decision_figures,
    stream_mb_settled,
)
from controller.client import ClientConfig
from telemetry.aggregate import aggregate
from telemetry.policy_table import MAX_TABLE_BYTES, policy_table_from_json, table_to_json
from telemetry.records import MAX_ENCODED_BYTES, AcceptanceWindow, PolicyTable, RecordError, WindowBatch
from telemetry.synthetic import SyntheticConfig, synthetic_rounds
from telemetry.transport import GROUP, PAYLOAD_FIELD, RedisConfig, RedisKeys
from telemetry.wire import encode_batch

REPO = Path(__file__).resolve().parents[1]
PREFIX = "faults"  # the suite's Redis prefix (its own Redis, so any word does)
POLL_S = 0.05  # the policy key and the sidecar's RSS are sampled this often
STORED_POLL_S = 0.5  # the feeder's stored count is read from PostgreSQL this often (timeline only)
READY_TIMEOUT_S = 120.0  # a sidecar or engine start on a busy 2-core machine (torch import, model load)
SERVICE_TIMEOUT_S = 30.0  # redis-server / PostgreSQL start
SETTLE_MARGIN_S = 25.0  # beyond the sidecar's re-claim time: a busy 2-core machine, a store catching up
PG_SUPERUSER = "postgres"
PG_BINARIES = ("initdb", "pg_ctl")
FORGED_REASON = "forged by the fault suite"
POLICY_ERROR = "policy_error"  # the sidecar's count of decision ticks the policy raised on (controller/service)



@dataclass(frozen=True)
class SidecarDefaults:
    """The settings a ``spectune sidecar`` runs with when given no timing flags, read from the product's own
    config classes. The suite starts every sidecar without timing flags, so it measures these; its waits and
    several targets are derived from them (and recorded in the JSON's ``config`` block)."""

    publish_every_s: float  # SidecarConfig: a decision at least this often
    publish_every_windows: int  # SidecarConfig: ... or after this many new windows
    claim_min_idle_ms: int  # ConsumerConfig: an entry left pending this long is claimed again
    claim_interval_s: float  # ConsumerConfig: how often the consumer looks for such entries
    lease_ms: int  # LeaseConfig: a dead leader is replaced within this long
    http_request_timeout_s: float  # HttpConfig: a request not whole this long after its first byte is cut
    http_idle_timeout_s: float  # HttpConfig: a keep-alive connection with no request this long is closed
    stream_maxlen: int  # RedisConfig: approximate MAXLEN of the windows stream (entries)
    deadletter_maxlen: int  # RedisConfig: approximate MAXLEN of the dead-letter stream (entries)
    trim_every_s: float  # SidecarConfig: how often the windows stream is trimmed below what was acknowledged

    @classmethod
    def from_product(cls) -> SidecarDefaults:
        from controller.service.http import HttpConfig
        from controller.service.lease import LeaseConfig
        from controller.service.sidecar import SidecarConfig
        from telemetry.ingest import ConsumerConfig

        sc, cc, http, rc = SidecarConfig(), ConsumerConfig(consumer="defaults"), HttpConfig(), RedisConfig()
        return cls(publish_every_s=sc.publish_every_s, publish_every_windows=sc.publish_every_windows,
                   claim_min_idle_ms=cc.claim_min_idle_ms, claim_interval_s=cc.claim_interval_s,
                   lease_ms=LeaseConfig().lease_ms, http_request_timeout_s=http.request_timeout_s,
                   http_idle_timeout_s=http.idle_timeout_s, stream_maxlen=rc.maxlen,
                   deadletter_maxlen=rc.deadletter_maxlen, trim_every_s=sc.trim_every_s)

    @property
    def reclaim_s(self) -> float:
        """Longest wait before an entry a killed sidecar (or a failed store write) left pending is read again."""
        return self.claim_min_idle_ms / 1000 + self.claim_interval_s

    @property
    def settle_s(self) -> float:
        """How long the suite waits for every window to be stored after a fault, before counting the rest lost."""
        return self.reclaim_s + SETTLE_MARGIN_S

    def cli_mismatches(self) -> dict[str, tuple[Any, Any]]:
        """Defaults where ``spectune sidecar``'s flags disagree with the config classes (field -> (flag, class)):
        the suite starts the CLI, so its waits would be derived from the wrong figure."""
        from controller.cli import build_parser

        args = build_parser().parse_args(["sidecar"])
        flags = {"publish_every_s": args.publish_every_s, "publish_every_windows": args.publish_every_windows,
                 "claim_min_idle_ms": args.claim_idle_ms, "lease_ms": args.lease_ms}
        return {k: (v, getattr(self, k)) for k, v in flags.items() if v != getattr(self, k)}


DEFAULTS = SidecarDefaults.from_product()
SETTLE_TIMEOUT_S = DEFAULTS.settle_s  # after a scenario: every window the feeder sent stored, or count the rest lost


# Targets; evaluated in the JSON's ``targets`` block.
TARGET_RECOVERY_S = 5.0  # first stored window and a table at the key, after a service returns
TARGET_POLICY_ABSENT_S = 2.0  # the engines' key without the store's table
TARGET_HTTP_P99_MS = 50.0  # operator endpoint at 20 concurrent clients (and /health beside slow clients)
TARGET_RSS_RATIO = 2.0  # sidecar peak RSS over its idle RSS under the cardinality flood
# Under the label flood the sidecar must keep deciding on its own schedule: no gap between decisions past two
# periods, and a pin through the endpoint at the engines' key within two periods.
TARGET_DECISION_GAP_S = 2 * DEFAULTS.publish_every_s
TARGET_PIN_TO_KEY_S = 2 * DEFAULTS.publish_every_s
# A decision must fit within one lease renewal interval (lease_ms / 3): longer, and a leader that decides on its
# loop risks its lease.
TARGET_DECISION_P99_S = DEFAULTS.lease_ms / 3 / 1000
TARGET_STREAM_MB, STREAM_CAP_SOURCE = RedisConfig().stream_cap_mb, "telemetry.transport.RedisConfig.stream_cap_mb"

# The hostile-label and forged-table scenarios run late: what they leave behind (64 tracked types, an engine that
# adopted a forged table) would colour the scenarios after them.
# What every scenario's record holds; scenarios add their own figures beside these.
FIELDS = ("windows_sent", "windows_stored", "windows_lost", "windows_duplicated", "engine_crashed", "sidecar_crashed",
          "recovery_s", "policy_key_absent_s", "http_5xx", "http_p99_ms", "max_rss_mb", "idle_rss_mb", "dead_lettered",
          "dead_letter_reasons")
SCENARIOS = ("redis_kill", "sidecar_kill", "postgres_stop", "fuzz", "http", "slow_clients", "forged_types",
             "forged_tables", "scaleout")


class FaultSuiteError(RuntimeError):
    """The suite could not set itself up (a missing binary, a service that did not start); says what to do."""


@dataclass(frozen=True)
class FaultConfig:
    """Durations and sizes of one run; ``--quick`` picks the small preset."""

    redis_down_s: float  # Redis outage (SIGKILL to restart)
    pg_down_s: float  # PostgreSQL outage (stop -m immediate to start)
    fuzz_entries: int  # hostile stream entries
    fuzz_pool: int  # of which drawn by hypothesis; the rest are seeded mutations of those draws
    forged_types: int  # well-formed windows, each with a new request type
    http_requests: int
    http_clients: int  # concurrent clients
    idle_connections: int  # held open during the HTTP run
    before_s: float  # steady feeding before each fault
    after_s: float  # steady feeding after a service returns
    feed_interval_s: float = 0.25  # one feeder window per this many seconds (an engine's emitter interval)
    rounds_per_window: int = 40
    scaleout_windows: int = 200  # passed to run_scaleout
    forged_flood_s: float = 15.0  # the forged types arrive in bursts spread over this long
    real_type_windows: int = 600  # acceptance windows of one real new request type, sent after the flood
    model_update_windows: int = 2_400  # windows (acceptance and cost) of a real model update, sent after the flood
    slow_half_sent: int = 200  # connections holding a request head without its blank line
    slow_tricklers: int = 4  # connections sending a request one byte every slow_trickle_every_s
    slow_trickle_every_s: float = 5.0
    slow_probe_s: float = 30.0  # /health is timed this long beside the slow clients
    slow_probe_every_s: float = 0.05  # pause between two /health probes (one at a time)
    seed: int = 0

    def __post_init__(self) -> None:
        for name, v in self.__dict__.items():
            if name != "seed" and not v > 0:
                raise ValueError(f"FaultConfig.{name} must be > 0, got {v}")
        if self.fuzz_pool > self.fuzz_entries:
            raise ValueError("FaultConfig.fuzz_pool must be <= fuzz_entries")


PRESETS = {
    "full": FaultConfig(redis_down_s=30, pg_down_s=20, fuzz_entries=100_000, fuzz_pool=5_000, forged_types=1_000,
                        http_requests=2_000, http_clients=20, idle_connections=200, before_s=5, after_s=8,
                        scaleout_windows=400),
    "quick": FaultConfig(redis_down_s=5, pg_down_s=5, fuzz_entries=2_000, fuzz_pool=500, forged_types=1_000,
                         http_requests=400, http_clients=20, idle_connections=200, before_s=2, after_s=4,
                         forged_flood_s=10, slow_probe_s=10),
}


# ------------------------------------------------------------------------------------------------ helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.05) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise FaultSuiteError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def rss_mb(pid: int) -> tuple[float, float] | None:
    """(VmRSS, VmHWM) of a process in MB, from /proc; None once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    kb = {ln.split(":")[0]: float(ln.split()[1]) for ln in lines if ln.startswith(("VmRSS", "VmHWM"))}
    if "VmRSS" not in kb:
        return None
    return kb["VmRSS"] / 1024, kb.get("VmHWM", kb["VmRSS"]) / 1024


# ----------------------------------------------------------------------------------------- own services
class OwnRedis:
    """A ``redis-server`` this suite started (no persistence): killed and restarted by PID, same port."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            raise FaultSuiteError("redis-server is not on PATH; install Redis (apt-get install redis-server)")
        self.port, self.dir = free_port(), workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(self.ping, SERVICE_TIMEOUT_S, f"redis-server on port {self.port}")

    def ping(self) -> bool:
        try:
            r = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
            try:
                return bool(r.ping())
            finally:
                r.close()
        except (redis.RedisError, OSError):
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)  # only the process this suite started
            self.proc.wait(10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class OwnPostgres:
    """A PostgreSQL cluster this suite made with ``initdb`` in a temporary folder, on a free port.

    Run as root, ``initdb`` / ``pg_ctl`` run as the ``postgres`` user (``runuser``) and the folder is given to it.
    Stopped with ``pg_ctl stop -m immediate`` on its own data folder; as a last resort its postmaster's PID (from
    ``postmaster.pid``) is killed.
    """

    def __init__(self) -> None:
        missing = [b for b in PG_BINARIES if shutil.which(b) is None]
        if missing:
            raise FaultSuiteError(f"{', '.join(missing)} not on PATH; install PostgreSQL's server binaries "
                                  "(apt-get install postgresql) or put their bin folder on PATH")
        self.port = free_port()
        # A folder of its own under the system's temporary folder: the postgres user must reach it, and a caller's
        # folder (pytest's tmp_path under /tmp/pytest-of-root, mode 0700) may not let it.
        self.dir = Path(tempfile.mkdtemp(prefix="spectune-faults-pg-"))
        self.data = self.dir / "data"
        self._as_root = os.geteuid() == 0
        if self._as_root:
            import pwd

            pw = pwd.getpwnam(PG_SUPERUSER)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{PG_SUPERUSER}@127.0.0.1:{self.port}/postgres?connect_timeout=2"

    def _run(self, *args: str, timeout_s: float = 60) -> None:
        cmd = [shutil.which(args[0]) or args[0], *args[1:]]
        if self._as_root:
            cmd = ["runuser", "-u", PG_SUPERUSER, "--", *cmd]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=self.dir)
        if res.returncode != 0:
            raise FaultSuiteError(f"{' '.join(args[:2])} failed ({res.returncode}): {res.stderr.strip()[-600:]}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", PG_SUPERUSER, "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "pg.log"), "-w", "-t",
                  str(int(SERVICE_TIMEOUT_S)), "-o", opts, "start")

    def stop_immediate(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        """Stop the cluster (if it runs) and remove its folder."""
        if self.postmaster_pid() is not None:
            try:
                self.stop_immediate()
            except (FaultSuiteError, subprocess.TimeoutExpired):
                pid = self.postmaster_pid()
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)  # our own postmaster, named by our own data folder
                    time.sleep(0.5)
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------------ spectune processes
class SidecarProc:
    """One ``spectune sidecar`` process of the suite."""

    def __init__(self, workdir: Path, redis_url: str, db_url: str, name: str = "faults-sc") -> None:
        self.workdir, self.redis_url, self.db_url, self.name = workdir, redis_url, db_url, name
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.starts = 0
        self.killed_by_us = False

    def start(self) -> None:
        self.starts += 1
        ready = self.workdir / f"{self.name}.{self.starts}.ready"
        log = (self.workdir / f"{self.name}.{self.starts}.log").open("wb")
        # No timing flag: the suite measures the sidecar as it ships (DEFAULTS); the consumer name is fixed so
        # that a restarted sidecar claims back what its killed predecessor left pending.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controller.cli", "sidecar", "--redis-url", self.redis_url, "--db-url",
             self.db_url, "--prefix", PREFIX, "--auto-upgrade", "--http-port", "0", "--ready-file", str(ready),
             "--consumer", self.name],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        proc = self.proc

        def up() -> Any:
            if proc.poll() is not None:
                raise FaultSuiteError(f"the sidecar exited with {proc.returncode} at start; see {log.name}")
            return ready.exists() and ready.read_text() and json.loads(ready.read_text())

        self.url = wait_for(up, READY_TIMEOUT_S, "the sidecar to serve")["url"]
        self.killed_by_us = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.killed_by_us = True
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def health(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                out: dict[str, Any] = json.loads(r.read())
                return out
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class EngineProc:
    """The reference engine (``spectune engine``) decoding through the whole suite, on its own engine id."""

    ENGINE_ID = "faults-engine"

    def __init__(self, workdir: Path, redis_url: str, profile: str, seed: int) -> None:
        self.status = workdir / "engine.jsonl"
        self.log = workdir / "engine.log"
        self.args = ["engine", "--redis-url", redis_url, "--prefix", PREFIX, "--engine-id", self.ENGINE_ID,
                     "--profile", profile, "--device", "cpu", "--workload", "steady", "--duration", "86400",
                     "--load", "4", "--default-k", "2", "--status-file", str(self.status), "--seed", str(seed)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "controller.cli", *self.args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        proc = self.proc

        def decoding() -> bool:
            if proc.poll() is not None:
                raise FaultSuiteError(f"the engine exited with {proc.returncode} at start; see {self.log}")
            return any(x.get("rounds", 0) >= 3 for x in self.lines())

        wait_for(decoding, READY_TIMEOUT_S, "the engine to decode", every_s=0.5)

    def lines(self) -> list[dict[str, Any]]:
        if not self.status.exists():
            return []
        out = []
        for ln in self.status.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(ln))
        return out

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> dict[str, Any]:
        """SIGTERM (the engine flushes its telemetry), then its final status line."""
        if self.proc is None:
            return {}
        crashed = self.proc.poll() is not None
        if not crashed:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        final: dict[str, Any] = next((x for x in reversed(self.lines()) if x.get("final")), {})
        return {"exit_code": self.proc.returncode, "crashed_before_stop": crashed, **final}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


# ---------------------------------------------------------------------------------------------- the feeder
def window_pool(n: int, rounds_per_window: int, seed: int) -> list[WindowBatch]:
    """``n`` distinct well-formed windows of seeded synthetic rounds (engine id and seq are set when sent)."""
    rounds = list(synthetic_rounds(n * rounds_per_window, seed=seed))
    out = []
    for i in range(n):
        agg = aggregate(rounds[i * rounds_per_window:(i + 1) * rounds_per_window])
        out.append(WindowBatch("pool", 0, 0.0, 0.25, agg.acceptance, agg.cost))
    return out


class Feeder:
    """XADDs well-formed windows with known ids at an engine's pace; what Redis refused is sent again later.

    ``sent`` counts XADDs Redis acknowledged (sequence numbers 1..sent, each once, though a pipeline cut by a
    dying server may have added some twice: stored once, as redeliveries are).
    """

    def __init__(self, redis_url: str, engine_id: str, pool: list[WindowBatch], interval_s: float) -> None:
        self.engine_id, self._pool, self._interval = engine_id, pool, interval_s
        self._r = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=0.5)
        self._stream = RedisKeys(PREFIX).windows
        self.lock = threading.Lock()  # held around each XADD: the Redis kill waits for a quiet moment under it
        self._outbox: list[tuple[int, bytes]] = []
        self._next_seq = 1
        self.sent = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"feeder-{engine_id}", daemon=True)

    def start(self) -> Feeder:
        self._thread.start()
        return self

    def _run(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            self.tick()
            nxt += self._interval
            self._stop.wait(max(0.0, nxt - time.monotonic()))

    def tick(self) -> None:
        seq = self._next_seq
        self._next_seq += 1
        now = time.time()
        b = replace(self._pool[seq % len(self._pool)], engine_id=self.engine_id, seq=seq,
                    window_start=now - self._interval, window_end=now)
        self._outbox.append((seq, encode_batch(b)))
        with self.lock:
            try:
                pipe = self._r.pipeline(transaction=False)
                for _, payload in self._outbox:
                    pipe.xadd(self._stream, {PAYLOAD_FIELD: payload})
                pipe.execute()
            except (redis.RedisError, OSError):
                self.failures += 1
                return
            self.sent += len(self._outbox)
            self._outbox.clear()

    def stop(self, retry_s: float = SETTLE_TIMEOUT_S) -> None:
        """Stop feeding, then keep trying what is still waiting for ``retry_s`` (as the emitter's close does)."""
        self._stop.set()
        self._thread.join(10)
        end = time.monotonic() + retry_s
        while self._outbox and time.monotonic() < end:
            with self.lock:
                try:
                    pipe = self._r.pipeline(transaction=False)
                    for _, payload in self._outbox:
                        pipe.xadd(self._stream, {PAYLOAD_FIELD: payload})
                    pipe.execute()
                    self.sent += len(self._outbox)
                    self._outbox.clear()
                except (redis.RedisError, OSError):
                    time.sleep(0.2)
        self._r.close()

    @property
    def unsent(self) -> int:
        return len(self._outbox)


# ----------------------------------------------------------------------------------------------- observer
@dataclass
class Sample:
    t: float  # time.time()
    redis_up: bool
    key_version: int | None  # the table's version at the key; None: absent or not a table
    key_ours: bool  # the key holds a table of the store's (not forged, parses)
    rss_mb: float | None


class Observer:
    """Polls the engines' policy key and the sidecar's RSS every ``POLL_S`` (a thread), and the feeder's stored
    count every ``STORED_POLL_S``, for the figures and the timeline."""

    def __init__(self, redis_url: str, sidecar: SidecarProc) -> None:
        self._r = redis.Redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.2)
        self._key = RedisKeys(PREFIX).policy
        self._sidecar = sidecar
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="observer", daemon=True)

    def start(self) -> Observer:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(POLL_S)

    def sample(self) -> Sample:
        now = time.time()
        pid = self._sidecar.pid if self._sidecar.alive() else None
        mem = rss_mb(pid) if pid is not None else None
        try:
            raw = self._r.get(self._key)
        except redis.ResponseError:  # WRONGTYPE: something that is not a table sits there
            return Sample(now, True, None, False, mem[0] if mem else None)
        except (redis.RedisError, OSError):
            return Sample(now, False, None, False, mem[0] if mem else None)
        version, ours = None, False
        if raw is not None:
            try:
                t = policy_table_from_json(raw)
                version, ours = t.version, not t.reason.startswith(FORGED_REASON)
            except RecordError:
                pass
        return Sample(now, True, version, ours, mem[0] if mem else None)

    def between(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in list(self.samples) if t0 <= s.t <= t1]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._r.close()


def longest_absence(samples: Sequence[Sample], after: float = 0.0) -> float:
    """Longest run of samples (from ``after`` on) that found Redis up and no table of the store's at the key."""
    best, start = 0.0, None
    for s in samples:
        if s.t < after:
            continue
        bad = s.redis_up and not s.key_ours
        if bad and start is None:
            start = s.t
        elif not bad and start is not None:
            best, start = max(best, s.t - start), None
    if start is not None and samples:
        best = max(best, samples[-1].t - start)
    return round(best, 3)


def key_state_changes(samples: Sequence[Sample]) -> list[tuple[float, bool, bool]]:
    """The samples where (Redis up, a table of the store's at the key) changed: the timeline, without 20 rows a
    second of the same state."""
    out: list[tuple[float, bool, bool]] = []
    for s in samples:
        if not out or (out[-1][1], out[-1][2]) != (s.redis_up, s.key_ours):
            out.append((round(s.t, 3), s.redis_up, s.key_ours))
    return out


# -------------------------------------------------------------------------------------------------- store
class Counts:
    """Counts in the suite's PostgreSQL (a short-lived connection per query: the server may be down)."""

    def __init__(self, db_url: str) -> None:
        self._url = db_url
        self._engine: Engine | None = None

    def _eng(self) -> Engine:
        if self._engine is None:
            self._engine = create_engine(self._url, pool_pre_ping=True, pool_size=2)
        return self._engine

    def stored(self, engine_id: str) -> tuple[int, int]:
        """(distinct seq, rows) stored for ``engine_id``."""
        with self._eng().connect() as c:
            row = c.execute(text("SELECT count(DISTINCT seq), count(*) FROM ingested_batches WHERE engine_id = :e"),
                            {"e": engine_id}).one()
        return int(row[0]), int(row[1])

    def stored_or_none(self, engine_id: str) -> int | None:
        try:
            return self.stored(engine_id)[0]
        except Exception:  # PostgreSQL is down (that is a scenario): no reading this time
            return None

    def first_stored_after(self, engine_id: str, t: float) -> float | None:
        with self._eng().connect() as c:
            v = c.execute(text("SELECT min(ingested_at) FROM ingested_batches WHERE engine_id = :e AND "
                               "ingested_at >= :t"), {"e": engine_id, "t": t}).scalar()
        return None if v is None else float(v)

    def latest_policy_version(self) -> int | None:
        with self._eng().connect() as c:
            v = c.execute(text("SELECT max(version) FROM policy_versions")).scalar()
        return None if v is None else int(v)

    def foreign_batches(self) -> int:
        """Batches stored from senders other than the feeders and the reference engine (fuzz, forgers)."""
        with self._eng().connect() as c:
            return int(c.execute(text("SELECT count(*) FROM ingested_batches WHERE engine_id NOT LIKE 'feed-%' "
                                      "AND engine_id != :e"), {"e": EngineProc.ENGINE_ID}).scalar() or 0)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()


# ------------------------------------------------------------------------------------------- the suite
@dataclass
class Timeline:
    """What the PNG draws for one scenario: feeder sent / stored over time, the fault's span, the key's state."""

    t0: float
    sent: list[tuple[float, int]] = field(default_factory=list)
    stored: list[tuple[float, int]] = field(default_factory=list)
    fault: tuple[float, float] | None = None


class Suite:
    """The services, the processes and the counters the scenarios share."""

    def __init__(self, cfg: FaultConfig, workdir: Path, *, engine: bool, profile: str) -> None:
        self.cfg, self.workdir = cfg, workdir
        self.redis = OwnRedis(workdir)
        self.pg = OwnPostgres()
        self._want_engine, self._profile = engine, profile
        self.sidecar: SidecarProc | None = None
        self.engine: EngineProc | None = None
        self.observer: Observer | None = None
        self.counts: Counts | None = None
        self.pool = window_pool(16, cfg.rounds_per_window, cfg.seed)
        self.timelines: dict[str, Timeline] = {}
        self.t_start = time.time()

    def __enter__(self) -> Suite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.redis.start()
        self.pg.init()
        self.pg.start()
        self.counts = Counts(self.pg.url)
        self.sidecar = SidecarProc(self.workdir, self.redis.url, self.pg.url)
        self.sidecar.start()
        self.observer = Observer(self.redis.url, self.sidecar).start()
        if self._want_engine:
            self.engine = EngineProc(self.workdir, self.redis.url, self._profile, self.cfg.seed)
            self.engine.start()

    def close(self) -> None:
        """Stop everything this suite started, newest first; each step runs even if an earlier one failed."""
        steps: list[Callable[[], None] | None] = [
            self.engine.close if self.engine else None, self.observer.close if self.observer else None,
            self.sidecar.close if self.sidecar else None, self.counts.close if self.counts else None,
            self.redis.kill, self.pg.close]
        for step in steps:
            if step is not None:
                with contextlib.suppress(Exception):
                    step()

    # -- pieces the scenarios share
    @property
    def sc(self) -> SidecarProc:
        assert self.sidecar is not None
        return self.sidecar

    @property
    def db(self) -> Counts:
        assert self.counts is not None
        return self.counts

    @property
    def obs(self) -> Observer:
        assert self.observer is not None
        return self.observer

    def warm_up(self, timeout_s: float = 60.0) -> None:
        """Feed (engine id ``feed-warmup``) until the sidecar has published its first table."""
        feeder = Feeder(self.redis.url, "feed-warmup", self.pool, self.cfg.feed_interval_s).start()
        try:
            self.wait_for_table(timeout_s)
        finally:
            feeder.stop()

    def wait_for_table(self, timeout_s: float = 30.0) -> None:
        wait_for(lambda: self.obs.sample().key_ours, timeout_s, "the sidecar's first table at the key")

    def group_backlog(self) -> tuple[int, int] | None:
        """(undelivered, pending) entries of the windows stream's consumer group; None when Redis is down."""
        r = redis.Redis.from_url(self.redis.url, socket_timeout=1.0, socket_connect_timeout=0.5)
        try:
            for g in r.xinfo_groups(RedisKeys(PREFIX).windows):
                if g["name"] in (GROUP, GROUP.encode()):
                    return int(g.get("lag") or 0), int(g["pending"])
            return None
        except (redis.RedisError, OSError):
            return None
        finally:
            r.close()

    def wait_drained(self, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
        """True once the group has nothing undelivered and nothing pending."""
        try:
            wait_for(lambda: self.group_backlog() == (0, 0), timeout_s, "the sidecar to drain", every_s=0.1)
            return True
        except FaultSuiteError:
            return False

    def rejected(self) -> dict[str, int]:
        h = self.sc.health() or {}
        return dict(h.get("rejected") or {})

    # -- one scenario's frame
    @contextlib.contextmanager
    def scenario(self, name: str, *, feed: bool = True) -> Iterator[dict[str, Any]]:
        """Feeds (unless ``feed`` is False), lets the body inject its fault, then settles and counts.

        The body fills ``rec`` with ``fault_at`` / ``returned_at`` (time.time()) and any extra figures.
        """
        print(f"[faults] {name} ...", flush=True)
        repaired = self.ensure_services()
        tl = Timeline(time.time())
        self.timelines[name] = tl
        engine_alive_before = self.engine.alive() if self.engine else None
        sidecar_starts = self.sc.starts
        rej0 = self.rejected()
        mem0 = rss_mb(self.sc.pid) if self.sc.pid else None
        feeder = Feeder(self.redis.url, f"feed-{name}", self.pool, self.cfg.feed_interval_s) if feed else None
        rec: dict[str, Any] = {"idle_rss_mb": round(mem0[0], 1) if mem0 else None, "restarted_before": repaired}
        stop_tl = threading.Event()

        def track() -> None:
            while not stop_tl.wait(STORED_POLL_S):
                if feeder is not None:
                    tl.sent.append((time.time(), feeder.sent))
                    got = self.db.stored_or_none(feeder.engine_id)
                    if got is not None:
                        tl.stored.append((time.time(), got))

        tracker = threading.Thread(target=track, daemon=True)
        tracker.start()
        if feeder is not None:
            rec["_feeder"] = feeder
            feeder.start()
            time.sleep(self.cfg.before_s)
        try:
            yield rec
        except BaseException:  # Ctrl-C, SIGTERM or a failed step: stop at once, the suite's cleanup follows
            if feeder is not None:
                feeder.stop(retry_s=0.0)
            stop_tl.set()
            raise
        rec.pop("_feeder", None)
        if feeder is not None:
            time.sleep(self.cfg.after_s)
            feeder.stop()
            self.wait_drained()
        stop_tl.set()
        tracker.join(5)
        t_end = time.time()
        samples = self.obs.between(tl.t0, t_end)
        if "fault_at" in rec:
            tl.fault = (rec["fault_at"], rec.get("returned_at", rec["fault_at"]))
        # figures
        if feeder is not None:
            try:
                distinct, rows = wait_for(lambda: self._all_stored(feeder), SETTLE_TIMEOUT_S, "every window stored")
            except FaultSuiteError:
                distinct, rows = self.db.stored(feeder.engine_id)
            tl.stored.append((time.time(), distinct))
            tl.sent.append((time.time(), feeder.sent))
            rec.update(windows_sent=feeder.sent, windows_stored=distinct, windows_lost=feeder.sent - distinct,
                       windows_duplicated=rows - distinct, feeder_unsent=feeder.unsent,
                       feeder_failures=feeder.failures)
        else:
            rec.update(windows_sent=0, windows_stored=0, windows_lost=0, windows_duplicated=0)
        rec["engine_crashed"] = (engine_alive_before and not self.engine.alive()) if self.engine else None
        restarted = self.sc.starts != sidecar_starts
        rec["sidecar_crashed"] = not self.sc.alive() or (restarted and not rec.get("sidecar_killed_by_suite"))
        rec.setdefault("sidecar_killed_by_suite", False)
        rec.setdefault("recovery_s", None)
        rec["policy_key_absent_s"] = max(rec.get("policy_key_absent_s", 0.0),
                                         longest_absence(samples, after=tl.t0))
        rec.setdefault("http_5xx", None)
        rec.setdefault("http_p99_ms", None)
        rss = [s.rss_mb for s in samples if s.rss_mb is not None]
        mem1 = rss_mb(self.sc.pid) if self.sc.pid else None
        rec["max_rss_mb"] = round(max(rss), 1) if rss else None
        rec["hwm_rss_mb"] = round(mem1[1], 1) if mem1 else None
        h1 = self.sc.health() or {}
        rej1 = dict(h1.get("rejected") or {})
        rec["sidecar_errors"] = h1.get("errors")
        rec["sidecar_lease"] = h1.get("lease")
        rec["sidecar_last_error"] = (h1.get("last_error") or None) and str(h1["last_error"])[:500]
        base = {} if restarted else rej0
        reasons = {k: v - base.get(k, 0) for k, v in rej1.items() if v - base.get(k, 0) > 0}
        # /health's "rejected" also counts decision ticks the policy failed: not entries, so not dead letters.
        rec["policy_errors"] = reasons.pop(POLICY_ERROR, 0)
        rec["dead_letter_reasons"] = dict(sorted(reasons.items()))
        rec["dead_lettered"] = sum(reasons.values())
        rec["duration_s"] = round(t_end - tl.t0, 2)

    def ensure_services(self) -> list[str]:
        """Start again what an earlier scenario left down (a crash, or a scenario that failed half-way), so each
        scenario begins from a running system. Returns what had to be started."""
        out = []
        if not self.redis.alive():
            self.redis.start()
            out.append("redis")
        if self.pg.postmaster_pid() is None:
            self.pg.start()
            out.append("postgres")
        if not self.sc.alive():
            self.sc.start()
            out.append("sidecar")
        return out

    def _all_stored(self, feeder: Feeder) -> tuple[int, int] | None:
        distinct, rows = self.db.stored(feeder.engine_id)
        return (distinct, rows) if distinct >= feeder.sent else None

    def recovery(self, engine_id: str, returned_at: float) -> dict[str, float | None]:
        """Seconds from a service's return to the first window stored and to a table of the store's at the key."""
        first = wait_for(lambda: self.db.first_stored_after(engine_id, returned_at), SETTLE_TIMEOUT_S,
                         "a window stored after the service returned", every_s=0.1)
        table_at = None
        with contextlib.suppress(FaultSuiteError):
            table_at = wait_for(lambda: next((s.t for s in self.obs.between(returned_at, time.time())
                                              if s.key_ours), None), SETTLE_TIMEOUT_S, "a table at the key")
        return {"first_window_stored_s": round(first - returned_at, 3),
                "table_present_s": None if table_at is None else round(max(0.0, table_at - returned_at), 3)}


# ----------------------------------------------------------------------------------------------- scenarios
def scenario_redis_kill(s: Suite) -> dict[str, Any]:
    with s.scenario("redis_kill") as rec:
        feeder: Feeder = rec["_feeder"]
        # Kill at a quiet moment: the feeder held, nothing undelivered in the group (see the module docstring).
        deadline = time.monotonic() + 10
        while True:
            feeder.lock.acquire()
            backlog = s.group_backlog()
            if (backlog is not None and backlog[0] == 0) or time.monotonic() > deadline:
                break
            feeder.lock.release()
            time.sleep(0.01)
        try:
            rec["undelivered_at_kill"] = backlog[0] if backlog else None
            rec["fault_at"] = time.time()
            s.redis.kill()
        finally:
            feeder.lock.release()
        time.sleep(s.cfg.redis_down_s)
        s.redis.start()
        rec["returned_at"] = time.time()
        rec["recovery_s"] = s.recovery(feeder.engine_id, rec["returned_at"])
        # The key is empty until the sidecar puts the table back: that gap is what the engines see.
        rec["policy_key_absent_s"] = longest_absence(s.obs.between(rec["returned_at"], time.time()))
    return rec


def scenario_sidecar_kill(s: Suite) -> dict[str, Any]:
    with s.scenario("sidecar_kill") as rec:
        feeder: Feeder = rec["_feeder"]
        rec["fault_at"] = time.time()
        s.sc.kill9()
        rec["sidecar_killed_by_suite"] = True
        s.sc.start()
        rec["returned_at"] = time.time()
        rec["restart_s"] = round(rec["returned_at"] - rec["fault_at"], 3)
        rec["recovery_s"] = s.recovery(feeder.engine_id, rec["returned_at"])
    return rec


def scenario_postgres_stop(s: Suite) -> dict[str, Any]:
    with s.scenario("postgres_stop") as rec:
        feeder: Feeder = rec["_feeder"]
        rec["fault_at"] = time.time()
        s.pg.stop_immediate()
        time.sleep(s.cfg.pg_down_s)
        s.pg.start()
        rec["returned_at"] = time.time()
        rec["recovery_s"] = s.recovery(feeder.engine_id, rec["returned_at"])
        h = s.sc.health() or {}
        rec["store_failures"] = h.get("store_failures")
    return rec


# ---- fuzz
def _redis_memory(s: Suite) -> RedisMemory:
    keys = RedisKeys(PREFIX)
    return RedisMemory(s.redis.url, keys.windows, keys.deadletter)


def _settled(s: Suite) -> dict[str, Any]:
    """The streams' size one trim interval (and a second) after a flood was read."""
    keys = RedisKeys(PREFIX)
    return stream_mb_settled(s.redis.url, keys.windows, keys.deadletter, DEFAULTS.trim_every_s + 1.0)


def fuzz_payloads(n: int, pool_n: int, seed: int) -> list[dict[bytes, bytes]]:
    """``n`` hostile stream entries (field -> value): hypothesis draws ``pool_n`` bases and mutations, a seeded
    mutator derives the rest from those draws."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from telemetry import wire

    valid = window_pool(8, 20, seed + 1)
    structs: list[type[Any]] = [wire._Batch, wire._Acceptance, wire._Cost, wire._Round, wire._Stat]
    base = st.one_of(
        st.builds(lambda i, e, q: _plain(replace(valid[i], engine_id=e, seq=q)),
                  st.integers(0, len(valid) - 1), st.sampled_from(["fuzz", "fuzz-2"]), st.integers(1, 2**40)),
        st.sampled_from(structs).flatmap(lambda t: st.from_type(t)).map(_struct_plain),
    )
    drawn: list[tuple[Any, int]] = []

    @settings(max_examples=pool_n, database=None, derandomize=True, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(base, st.integers(0, 2**32 - 1))
    def draw(doc: Any, salt: int) -> None:
        drawn.append((doc, salt))

    draw()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        doc, salt = drawn[i % len(drawn)] if drawn else ({}, 0)
        out.append(_mutate(doc, random.Random(rng.random() + salt)))
    return out


def _plain(b: WindowBatch) -> dict[str, Any]:
    from telemetry.wire import window_batch_to_dict

    return window_batch_to_dict(b)


def _struct_plain(s: Any) -> Any:
    import msgspec

    try:
        return msgspec.to_builtins(s)
    except (TypeError, ValueError, OverflowError):
        return {"unencodable": repr(s)[:200]}


_HOSTILE: list[Any] = [None, True, -1, 0, 2**63, 2**64 + 1, -0.0, 1e308, "", "x" * 70, "co\x00de", "a|b", "\u00b2",
                       [], {}, [[[]]], "NaN", 3.5]


FUZZ_MIN_RATE = 50  # hostile entries/s the sidecar is given to drain them before the suite stops waiting
FUZZ_NESTING = 5_000  # levels of JSON nesting in a hostile entry: past Python's and msgspec's recursion limits
FUZZ_OVERSIZED_SHARE = 0.0005  # entries past MAX_ENCODED_BYTES (1 MiB each: ~50 of the full suite's 10^5)


def _mutate(doc: Any, rng: random.Random) -> dict[bytes, bytes]:
    """One hostile entry from a drawn document: a field changed, a type swapped, bytes flipped, ..."""
    op = rng.randrange(10)
    d = json.loads(json.dumps(doc, default=str)) if isinstance(doc, dict | list) else doc
    if op <= 3 and isinstance(d, dict) and d:  # one field's value replaced by a hostile one (maybe deep)
        target = d
        for _ in range(rng.randrange(3)):
            kids = [v for v in target.values() if isinstance(v, dict)] + [
                x for v in target.values() if isinstance(v, list) for x in v if isinstance(x, dict)]
            if not kids:
                break
            target = rng.choice(kids)
        if target:
            target[rng.choice(list(target))] = rng.choice(_HOSTILE)
    elif op == 4 and isinstance(d, dict) and d:  # a field dropped
        d.pop(rng.choice(list(d)))
    elif op == 5:  # nesting past any recursion limit
        return {PAYLOAD_FIELD.encode(): b'{"engine_id": ' + b"[" * FUZZ_NESTING + b"]" * FUZZ_NESTING + b"}"}
    elif op == 6:  # bytes flipped in the encoding
        raw = bytearray(json.dumps(d, default=str).encode())
        for _ in range(rng.randrange(1, 8)):
            if raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        return {PAYLOAD_FIELD.encode(): bytes(raw)}
    elif op == 7:  # msgpack of the document, or truncated JSON
        import msgpack

        try:
            return {PAYLOAD_FIELD.encode(): msgpack.packb(d)}
        except (TypeError, ValueError, OverflowError):
            return {PAYLOAD_FIELD.encode(): json.dumps(d, default=str).encode()[: rng.randrange(1, 40)]}
    elif op == 8:  # no payload field, or (rarely: each is a megabyte in Redis) one past the size cap
        if rng.random() >= FUZZ_OVERSIZED_SHARE * 10:
            return {b"x": b"no payload field"}
        return {PAYLOAD_FIELD.encode(): b"{" + b" " * (MAX_ENCODED_BYTES + 10) + b"}"}
    else:  # the document as drawn (from_type draws break the rules between fields already)
        pass
    try:
        payload = json.dumps(d, allow_nan=True).encode()
    except (TypeError, ValueError):
        payload = repr(d).encode()
    return {PAYLOAD_FIELD.encode(): payload}


def scenario_fuzz(s: Suite) -> dict[str, Any]:
    entries = fuzz_payloads(s.cfg.fuzz_entries, s.cfg.fuzz_pool, s.cfg.seed)
    with s.scenario("fuzz") as rec, _redis_memory(s) as mem:
        h0 = s.sc.health() or {}
        batches0 = s.db.foreign_batches()
        r = redis.Redis.from_url(s.redis.url)
        rec["fault_at"] = time.time()
        for i in range(0, len(entries), 500):
            pipe = r.pipeline(transaction=False)
            for fields in entries[i:i + 500]:
                pipe.xadd(RedisKeys(PREFIX).windows, fields)  # type: ignore[arg-type]
            pipe.execute()
        r.close()
        rec["fuzz_entries"] = len(entries)
        rec["drained"] = s.wait_drained(max(SETTLE_TIMEOUT_S, len(entries) / FUZZ_MIN_RATE))
        rec["returned_at"] = time.time()
        mem.stop()
        rec.update(mem.summary())
        rec.update(_settled(s))
        rec["drain_s"] = round(rec["returned_at"] - rec["fault_at"], 2)
        rec["drain_entries_per_s"] = round(len(entries) / max(1e-9, rec["drain_s"]), 1)
        h1 = s.sc.health() or {}
        rec["fuzz_stored"] = s.db.foreign_batches() - batches0  # valid after all (a mutation that kept the rules)
        rec["fuzz_duplicates"] = int(h1.get("duplicates_skipped", 0)) - int(h0.get("duplicates_skipped", 0))
        # Entries, not windows: "dead_lettered" counts windows of excess labels one by one, and an entry stored with
        # some windows dead-lettered apart as excess is in fuzz_stored.
        rec["fuzz_dead_lettered_entries"] = (int(h1.get("dead_lettered_entries", 0))
                                             - int(h0.get("dead_lettered_entries", 0)))
    rec["fuzz_unaccounted"] = (rec["fuzz_entries"] - rec["fuzz_dead_lettered_entries"] - rec["fuzz_stored"]
                               - rec["fuzz_duplicates"])
    return rec


# ---- cardinality
def forged_type_batches(n: int, seed: int) -> list[bytes]:
    """``n`` well-formed windows, each naming a request type never seen before."""
    pool = window_pool(4, 20, seed + 2)
    out = []
    for i in range(n):
        b = pool[i % len(pool)]
        acc = tuple(AcceptanceWindow(**{**a.__dict__, "request_type": f"forged-{i:05d}"}) for a in b.acceptance)
        out.append(encode_batch(replace(b, engine_id="forger", seq=i + 1, acceptance=acc)))
    return out


FORGED_BURSTS = 40  # the forged windows arrive in this many bursts over forged_flood_s
PIN_AT = 1 / 3  # share of the flood's time that passes before the pin is posted
PIN_K = 7  # the pinned k (one below when the table's default is 7 already): within the CLI's default k_max of 8
PIN_REASON = "fault suite"
# The pool's windows are of SyntheticConfig's versions: the pin covers every bucket of that pair.
PIN_BUCKET = f"{SyntheticConfig().target_version}|{SyntheticConfig().draft_version}|*|*|*"
REAL_TYPE = "real-new-type"  # a request type a real workload adds after the flood
REAL_TYPE_ALPHA = 0.7  # its draft agreement (between the synthetic prose and code types)
MODEL_UPDATE_VERSION = "target-v2"  # a real model update after the flood: the same draft, a new target
REAL_SEND_S = 3.0  # the real type's windows are spread over this long ...
MODEL_SEND_S = 4.0  # ... then the model update's over this long
KEY_POLL_S = 0.05  # the engines' key is read this often while the suite waits for a table to change
PIN_WAIT_S = max(10.0, 10 * DEFAULTS.publish_every_s)  # a pin not at the key by then is counted as never
APPEAR_WAIT_S = max(15.0, 15 * DEFAULTS.publish_every_s)  # after the last real window, for the table to list it
HTTP_CALL_TIMEOUT_S = 30.0  # a pin request under the flood
BASELINE_PERIODS = 4  # decision periods sampled before the flood, for the gap without one


def real_batches(engine_id: str, windows: int, config: SyntheticConfig, seed: int, *, count_cost: bool,
                 rounds_per_window: int = 40) -> tuple[list[WindowBatch], int]:
    """Window batches of seeded synthetic rounds of ``config`` (a new request type, a new model version) until they
    hold ``windows`` windows: acceptance windows only, or acceptance and cost windows when ``count_cost``.
    Returns the batches (``engine_id``, seq 1, 2, ...) and the windows they hold."""
    rounds = synthetic_rounds(max(1, windows) * rounds_per_window, seed=seed, config=config)
    out: list[WindowBatch] = []
    got = 0
    while got < windows:
        chunk = list(itertools.islice(rounds, rounds_per_window))
        if not chunk:
            break
        agg = aggregate(chunk)
        out.append(WindowBatch(engine_id, len(out) + 1, 0.0, 0.25, agg.acceptance, agg.cost))
        got += len(agg.acceptance) + (len(agg.cost) if count_cost else 0)
    return out, got


class _Sender(threading.Thread):
    """XADDs phases of stream entries from a thread, each phase's entries in ``bursts`` spread over ``over_s``.
    A :class:`WindowBatch` is encoded when it is sent, with that moment as its window's end."""

    def __init__(self, redis_url: str, phases: Sequence[tuple[Sequence[bytes | WindowBatch], int, float]]) -> None:
        super().__init__(name="forged-sender", daemon=True)
        self._url, self._phases = redis_url, phases
        self.began: list[float | None] = [None] * len(phases)  # time.time() of each phase's first XADD
        self.sent = 0
        self.error: str | None = None

    def run(self) -> None:
        r = redis.Redis.from_url(self._url, socket_timeout=5.0)
        stream = RedisKeys(PREFIX).windows
        try:
            for i, (items, bursts, over_s) in enumerate(self._phases):
                per = max(1, math.ceil(len(items) / max(1, bursts)))
                t0 = time.monotonic()
                self.began[i] = time.time()
                for j, at in enumerate(range(0, len(items), per)):
                    pipe = r.pipeline(transaction=False)
                    for item in items[at:at + per]:
                        if isinstance(item, WindowBatch):
                            now = time.time()
                            item = encode_batch(replace(item, window_start=now - 0.25, window_end=now))
                        pipe.xadd(stream, {PAYLOAD_FIELD: item})
                    pipe.execute()
                    self.sent += len(items[at:at + per])
                    time.sleep(max(0.0, t0 + (j + 1) * over_s / max(1, bursts) - time.monotonic()))
        except (redis.RedisError, OSError) as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            r.close()


def table_at(r: redis.Redis) -> PolicyTable | None:
    """The table at the engines' key, or None (absent, not a table, Redis unreachable)."""
    try:
        raw = r.get(RedisKeys(PREFIX).policy)
    except (redis.RedisError, OSError):
        return None
    if not isinstance(raw, bytes | str):
        return None
    try:
        return policy_table_from_json(raw)
    except RecordError:
        return None


def watch_key(r: redis.Redis, conds: dict[str, Callable[[PolicyTable], bool]],
              timeout_s: float) -> dict[str, float | None]:
    """Reads the engines' key every ``KEY_POLL_S`` until every condition has held once, or ``timeout_s``. Returns
    when each first held (time.time()), None for those that never did."""
    seen: dict[str, float | None] = dict.fromkeys(conds)
    end = time.monotonic() + timeout_s
    while True:
        t, now = table_at(r), time.time()
        if t is not None:
            for name, cond in conds.items():
                if seen[name] is None and cond(t):
                    seen[name] = now
        if all(v is not None for v in seen.values()) or time.monotonic() > end:
            return seen
        time.sleep(KEY_POLL_S)


def _http_json(method: str, url: str, body: Any = None) -> int:
    """The status of one request to the operator endpoint (-1: no answer)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_CALL_TIMEOUT_S) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return HTTP_STATUS_FAILED


def _parts(key: str) -> list[str]:
    return key.split("|")


def pin_round_trip(sc: SidecarProc, r: redis.Redis) -> dict[str, Any]:
    """POST a pin on :data:`PIN_BUCKET`, time it to the engines' key, DELETE it and time that too."""
    before = table_at(r)
    v0 = before.version if before else 0
    k = PIN_K if before is None or before.default_k != PIN_K else PIN_K - 1
    t0 = time.time()
    status = _http_json("POST", sc.url + "/pins", {"bucket": PIN_BUCKET, "k": k, "reason": PIN_REASON})
    answered = time.time()
    at = watch_key(r, {"pin": lambda t: t.version > v0 and t.entries.get(PIN_BUCKET) == k}, PIN_WAIT_S)["pin"]
    pinned = table_at(r)
    v1 = pinned.version if pinned else v0
    t1 = time.time()
    unpin = _http_json("DELETE", sc.url + "/pins/" + urllib.parse.quote(PIN_BUCKET, safe=""))
    gone = watch_key(r, {"unpin": lambda t: t.version > v1 and PIN_BUCKET not in t.entries}, PIN_WAIT_S)["unpin"]
    return {"forged_pin_k": k, "forged_pin_status": status, "forged_pin_answer_s": round(answered - t0, 3),
            "forged_pin_to_key_s": None if at is None else round(at - t0, 3),
            "forged_unpin_status": unpin, "forged_unpin_to_key_s": None if gone is None else round(gone - t1, 3)}


def scenario_forged_types(s: Suite) -> dict[str, Any]:
    """A flood of forged request types, and whether the sidecar keeps deciding, publishing and learning."""
    cfg = s.cfg
    payloads = forged_type_batches(cfg.forged_types, cfg.seed)
    new_type, type_windows = real_batches("real-new-type", cfg.real_type_windows,
                                          SyntheticConfig(alpha={REAL_TYPE: REAL_TYPE_ALPHA}), cfg.seed + 3,
                                          count_cost=False)
    update, update_windows = real_batches("model-update", cfg.model_update_windows,
                                          SyntheticConfig(target_version=MODEL_UPDATE_VERSION), cfg.seed + 4,
                                          count_cost=True)
    with (s.scenario("forged_types") as rec, HealthSampler(lambda: s.sc.url) as health, _redis_memory(s) as mem,
          contextlib.closing(redis.Redis.from_url(s.redis.url, socket_timeout=2.0)) as r):
        time.sleep(BASELINE_PERIODS * DEFAULTS.publish_every_s)  # the decisions' rhythm before the flood
        rec["fault_at"] = time.time()
        flood = _Sender(s.redis.url, [(payloads, FORGED_BURSTS, cfg.forged_flood_s)])
        flood.start()
        time.sleep(cfg.forged_flood_s * PIN_AT)
        rec.update(pin_round_trip(s.sc, r))
        flood.join()
        t_flood = time.time()
        rec["flood_s"] = round(t_flood - rec["fault_at"], 2)
        rec["forged_windows"] = flood.sent
        rec["flood_error"] = flood.error
        # After the flood, real traffic: one new request type, then a model update.
        real = _Sender(s.redis.url, [(new_type, len(new_type), REAL_SEND_S), (update, len(update), MODEL_SEND_S)])
        real.start()
        seen = watch_key(r, {
            "type": lambda t: any(_parts(key)[2:3] == [REAL_TYPE] for key in t.entries),
            "update": lambda t: any(_parts(key)[0] == MODEL_UPDATE_VERSION for key in t.entries),
        }, REAL_SEND_S + MODEL_SEND_S + APPEAR_WAIT_S)
        real.join()
        rec["real_type_windows"], rec["model_update_windows"] = type_windows, update_windows
        rec["real_send_error"] = real.error
        for name, key, began in (("real_type", "type", real.began[0]), ("model_update", "update", real.began[1])):
            at = seen[key]
            rec[f"forged_{name}_in_table"] = at is not None
            rec[f"forged_{name}_to_table_s"] = None if at is None or began is None else round(at - began, 3)
        t_real = time.time()
        rec["drained"] = s.wait_drained()
        rec["returned_at"] = time.time()
        rec["drain_s"] = round(rec["returned_at"] - rec["fault_at"], 2)
        health.stop()
        mem.stop()
        before = decision_figures([x for x in health.samples if x[0] <= rec["fault_at"]])
        during = decision_figures([x for x in health.samples if rec["fault_at"] <= x[0] <= t_flood])
        after = decision_figures([x for x in health.samples if t_flood <= x[0] <= t_real])
        rec["baseline_decision_gap_s"] = before["decision_gap_s"]
        rec["forged_decision_gap_s"] = during["decision_gap_s"]
        rec["forged_decision_p99_s"] = during["decision_p99_s"]
        rec["forged_decisions"] = during["decisions"]
        rec["forged_overdue_samples"] = during["overdue_samples"]
        rec["after_flood_decision_gap_s"] = after["decision_gap_s"]
        rec["after_flood_decision_p99_s"] = after["decision_p99_s"]
        rec["deciding_reported"] = any(d is not None for _, d in health.samples)
        rec["health_samples"], rec["health_failures"] = len(health.samples), health.failures
        rec.update(mem.summary())
        rec.update(_settled(s))
        rec["forged_batches_stored"] = s.db.stored("forger")[0]  # their other windows are stored as usual
        h = s.sc.health() or {}
        rec["tracked"] = h.get("tracked")
    # The caps split a batch: the excess acceptance windows are dead-lettered one by one (counted per window).
    rec["excess_windows_dead_lettered"] = sum(v for k, v in rec["dead_letter_reasons"].items()
                                              if k.startswith("too_many"))
    return rec


# ---- forged tables
# A forged table is replaced on one of the sidecar's decision ticks; ten of them is the most the suite waits.
FORGED_REPLACE_TIMEOUT_S = max(10.0, 10 * DEFAULTS.publish_every_s)


def scenario_forged_tables(s: Suite) -> dict[str, Any]:
    key = RedisKeys(PREFIX).policy
    with s.scenario("forged_tables") as rec:
        s.wait_for_table()
        r = redis.Redis.from_url(s.redis.url)
        rec["fault_at"] = time.time()
        held: dict[str, float | None] = {}
        latest = s.db.latest_policy_version() or 1
        forged = PolicyTable(version=2**40, default_k=7, k_max=8, entries={"*|*|*|*|*": 7}, reason=FORGED_REASON)
        big = json.loads(table_to_json(replace(forged, version=latest + 1000)))
        big["reason"] = FORGED_REASON + " " * MAX_TABLE_BYTES
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("ahead", lambda: r.set(key, table_to_json(forged))),
            ("stale", lambda: r.set(key, table_to_json(replace(forged, version=0, default_k=1,
                                                                entries={"*|*|*|*|*": 1})))),
            ("oversized", lambda: r.set(key, json.dumps(big))),
            ("garbage", lambda: r.set(key, b"{garbage \x00\xff")),
            ("wrong_redis_type", lambda: (r.delete(key), r.hset(key, "version", str(2**40)))),
            ("deleted", lambda: r.delete(key)),
        ]
        for name, write in cases:
            s.wait_for_table(FORGED_REPLACE_TIMEOUT_S)
            t0 = time.time()
            write()
            r.publish(RedisKeys(PREFIX).policy_updates, str(2**40))
            try:
                wait_for(lambda: s.obs.sample().key_ours, FORGED_REPLACE_TIMEOUT_S,
                         f"the sidecar to replace the {name} table")
                held[name] = round(time.time() - t0, 3)
            except FaultSuiteError:
                held[name] = None  # not replaced within FORGED_REPLACE_TIMEOUT_S
                with contextlib.suppress(redis.RedisError):
                    r.delete(key)  # let the next case start clean
        r.close()
        rec["returned_at"] = time.time()
        rec["forged_held_s"] = held  # None: still there after the timeout (the timeline's absence covers it)
        h = s.sc.health() or {}
        rec["policy_version_ahead"] = h.get("policy_version_ahead")
        if s.engine is not None:
            # A forged table ahead of the store, once adopted, makes the engine refuse the store's (older) one at
            # first; the client follows an older table back once it has held the key for its rollback_after_s.
            wait_s = ClientConfig("t", "d").rollback_after_s + 5.0
            t_back = time.time()

            def engine_on_store() -> bool:
                v = ((s.engine.lines() if s.engine else None) or [{}])[-1].get("version") or 0
                return 0 < v <= (s.db.latest_policy_version() or 0)

            with contextlib.suppress(FaultSuiteError):
                wait_for(engine_on_store, wait_s, "the engine to follow the store's table back", every_s=0.25)
            last = (s.engine.lines() or [{}])[-1]
            rec["engine_policy_version"] = last.get("version")
            rec["store_policy_version"] = s.db.latest_policy_version()
            rec["engine_rejected"] = last.get("rejected")
            rec["engine_stuck_on_forged"] = (last.get("version") or 0) > (rec["store_policy_version"] or 0)
            rec["engine_back_on_store_s"] = None if rec["engine_stuck_on_forged"] else round(time.time() - t_back, 2)
    return rec


# ---- HTTP


@dataclass
class _InFlight:
    """One request of :func:`http_load` on its own non-blocking connection."""

    i: int  # its index in the request list
    t0: float  # perf_counter() before the connect
    out: memoryview  # what is still to send
    got: bytearray = field(default_factory=bytearray)
    connected: bool = False


def http_load(port: int, reqs: Sequence[tuple[str, str, bytes]], clients: int,
              timeout_s: float = 10.0) -> list[tuple[int, float]]:
    """Send ``reqs`` to 127.0.0.1:``port``, ``clients`` at a time, each on a new connection (``Connection: close``),
    from one thread driving non-blocking sockets with a selector. Returns (status, ms) per request, in order;
    status -1 when no HTTP answer came within ``timeout_s``."""
    sel = selectors.DefaultSelector()
    out: list[tuple[int, float] | None] = [None] * len(reqs)
    nxt = 0

    def finish(f: _InFlight, sock: socket.socket, code: int) -> None:
        out[f.i] = (code, (time.perf_counter() - f.t0) * 1e3)
        sel.unregister(sock)
        sock.close()

    while True:
        while len(sel.get_map()) < clients and nxt < len(reqs):
            method, path, body = reqs[nxt]
            head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            f = _InFlight(nxt, time.perf_counter(), memoryview(head.encode() + body))
            nxt += 1
            sock = socket.socket()
            sock.setblocking(False)
            if sock.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
                out[f.i] = (HTTP_STATUS_FAILED, (time.perf_counter() - f.t0) * 1e3)
                sock.close()
                continue
            sel.register(sock, selectors.EVENT_WRITE, f)
        if not sel.get_map():
            break
        for key, _ in sel.select(0.1):
            f, sock = key.data, cast(socket.socket, key.fileobj)
            try:
                if f.out:
                    if not f.connected:
                        if err := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                            raise OSError(err, os.strerror(err))
                        f.connected = True
                    f.out = f.out[sock.send(f.out):]
                    if not f.out:
                        sel.modify(sock, selectors.EVENT_READ, f)
                elif chunk := sock.recv(65536):
                    f.got += chunk
                else:  # the server closed: the whole answer is in
                    parts = bytes(f.got[:16]).split(b" ", 2)
                    ok = len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit()
                    finish(f, sock, int(parts[1]) if ok else HTTP_STATUS_FAILED)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                finish(f, sock, HTTP_STATUS_FAILED)
        now = time.perf_counter()
        for key in list(sel.get_map().values()):
            if now - key.data.t0 > timeout_s:
                finish(key.data, cast(socket.socket, key.fileobj), HTTP_STATUS_FAILED)
    sel.close()
    return [r if r is not None else (HTTP_STATUS_FAILED, 0.0) for r in out]


def _http_load_child() -> None:
    """``http_load`` in a process of its own: a JSON job on stdin (``port``, ``clients``, ``requests`` as indices
    into ``HTTP_REQUESTS``), a JSON answer on stdout (``results``, and ``began`` / ``ended`` in wall-clock time)."""
    job = json.load(sys.stdin)
    reqs = [HTTP_REQUESTS[i] for i in job["requests"]]
    began = time.time()
    results = http_load(job["port"], reqs, job["clients"])
    json.dump({"results": results, "began": began, "ended": time.time()}, sys.stdout)


HOSTILE_REQUESTS: list[tuple[str, str, bytes]] = [
    ("POST", "/pins", b'{"bucket": "*|*|*|*|*", "k": ' + b"7" * 5000 + b"}"),
    ("POST", "/pins", b"[" * 5000 + b"]" * 5000),
    ("POST", "/pins", b'{"bucket": "' + b"{" * 3000 + b'", "k": 1}'),
    ("POST", "/pins", json.dumps({"bucket": "t|d|co\x00de|8|*", "k": 1}).encode()),
    ("POST", "/pins", json.dumps({"bucket": "*|*|*|\u00b2|*", "k": 1}).encode()),
    ("POST", "/pins", json.dumps({"bucket": "*|*|*|*|*", "k": -1}).encode()),
    ("POST", "/pins", json.dumps({"bucket": "*|*|*|*|*", "k": True}).encode()),
    ("POST", "/pins", b"\xff\xfe not utf-8"),
    ("POST", "/pins", b"[1, 2, 3]"),
    ("DELETE", "/pins/t%7Cd%7Cx%00%7C8%7C*", b""),
    ("GET", "/deadletter?limit=" + "9" * 5000, b""),
    ("GET", "/alerts?unacked=2", b""),
    ("GET", "/nowhere", b""),
]
PLAIN_REQUESTS: list[tuple[str, str, bytes]] = [
    ("GET", "/health", b""), ("GET", "/policy", b""), ("GET", "/pins", b""), ("GET", "/metrics", b""),
    ("GET", "/deadletter?limit=5", b""), ("GET", "/policy/history?limit=3", b""), ("GET", "/alerts?limit=5", b""),
]
HTTP_REQUESTS = HOSTILE_REQUESTS + PLAIN_REQUESTS  # what the load process is told to send, by index
HTTP_LOAD_TIMEOUT_S = 300.0  # the load process as a whole (2,000 requests take a few seconds)


def scenario_http(s: Suite) -> dict[str, Any]:
    port = int(s.sc.url.rsplit(":", 1)[1])
    rng = random.Random(s.cfg.seed)
    reqs = [rng.choice(HOSTILE_REQUESTS if i % 2 else PLAIN_REQUESTS) for i in range(s.cfg.http_requests)]
    with s.scenario("http") as rec:
        idle = []
        for _ in range(s.cfg.idle_connections):
            with contextlib.suppress(OSError):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        rec["idle_connections_open"] = len(idle)
        job = {"port": port, "clients": s.cfg.http_clients, "requests": [HTTP_REQUESTS.index(r) for r in reqs]}
        try:
            done = subprocess.run([sys.executable, "-c", "from bench.faults import _http_load_child as m; m()"],
                                  input=json.dumps(job).encode(), capture_output=True, cwd=REPO, check=True,
                                  timeout=HTTP_LOAD_TIMEOUT_S)
            answer = json.loads(done.stdout)
        except (subprocess.SubprocessError, ValueError) as e:
            err = getattr(e, "stderr", b"") or b""
            raise FaultSuiteError(f"the HTTP load process failed: {e}; {err.decode(errors='replace')[-2000:]}") from e
        rec["fault_at"], rec["returned_at"] = answer["began"], answer["ended"]
        results = [(int(code), float(ms)) for code, ms in answer["results"]]
        for c in idle:
            c.close()
        codes: dict[str, int] = {}
        for code, _ in results:
            codes[str(code)] = codes.get(str(code), 0) + 1
        lat = [ms for _, ms in results]
        rec["http_requests"] = len(results)
        rec["http_codes"] = dict(sorted(codes.items()))
        rec["http_5xx"] = sum(n for c, n in codes.items() if c.startswith("5"))
        rec["http_no_answer"] = codes.get("-1", 0)
        rec["http_p50_ms"] = round(statistics.median(lat), 2)
        rec["http_p99_ms"] = round(pct(lat, 99) or 0.0, 2)
        rec["http_max_ms"] = round(max(lat), 2)
        rec["http_bad_input_5xx"] = sum(1 for req, (code, _) in zip(reqs, results, strict=True)
                                        if req in HOSTILE_REQUESTS and code >= 500)
    return rec


# ---- slow clients
SLOW_SETTLE_S = 1.0  # the slow connections are open this long before /health is timed


def _metric(url: str, name: str) -> float | None:
    """One unlabelled counter from the sidecar's ``/metrics`` (None when it is not there)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text_ = r.read().decode(errors="replace")
    except OSError:
        return None
    for line in text_.splitlines():
        if line.startswith(name + " "):
            with contextlib.suppress(ValueError, IndexError):
                return float(line.rsplit(" ", 1)[1])
    return None


def _child(fn: str) -> list[str]:
    """The command line of one of :mod:`bench._faults_probes`' client processes."""
    return [sys.executable, "-c", f"from bench._faults_probes import {fn} as m; m()"]


def scenario_slow_clients(s: Suite) -> dict[str, Any]:
    """/health timed from a process of its own while slow clients hold the operator endpoint's connections."""
    cfg = s.cfg
    port = int(s.sc.url.rsplit(":", 1)[1])
    timed_out = "spectune_http_requests_timed_out_total"
    with s.scenario("slow_clients") as rec:
        cut0 = _metric(s.sc.url, timed_out)
        slow_job = {"port": port, "half_sent": cfg.slow_half_sent, "tricklers": cfg.slow_tricklers,
                    "every_s": cfg.slow_trickle_every_s, "duration_s": cfg.slow_probe_s + 2 * SLOW_SETTLE_S}
        err_log = s.workdir / "slow_clients.err"
        with err_log.open("wb") as err_out:
            slow = subprocess.Popen(_child("_slow_clients_child"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err_out, cwd=REPO)
        try:
            assert slow.stdin is not None and slow.stdout is not None
            slow.stdin.write(json.dumps(slow_job).encode())
            slow.stdin.close()
            ready, _, _ = select.select([slow.stdout], [], [], READY_TIMEOUT_S)
            if not ready or slow.stdout.readline() != SLOW_READY:
                raise FaultSuiteError("the slow-clients process did not open its connections: "
                                      f"{err_log.read_text(errors='replace')[-2000:]}")
            time.sleep(SLOW_SETTLE_S)
            rec["fault_at"] = time.time()
            probe_job = {"port": port, "duration_s": cfg.slow_probe_s, "every_s": cfg.slow_probe_every_s}
            try:
                done = subprocess.run(_child("_health_probe_child"), input=json.dumps(probe_job).encode(),
                                      capture_output=True, cwd=REPO, check=True,
                                      timeout=cfg.slow_probe_s + HTTP_LOAD_TIMEOUT_S)
                probe = json.loads(done.stdout)
            except (subprocess.SubprocessError, ValueError) as e:
                err = getattr(e, "stderr", b"") or b""
                raise FaultSuiteError(f"the /health probe failed: {e}; {err.decode(errors='replace')[-2000:]}") from e
            rec["returned_at"] = time.time()
            try:
                slow.wait(slow_job["duration_s"] + 30)  # its answer (a line) fits in the pipe meanwhile
                rec.update(json.loads(slow.stdout.read()))
            except (subprocess.TimeoutExpired, ValueError) as e:
                raise FaultSuiteError(f"the slow-clients process gave no answer: {e}; "
                                      f"{err_log.read_text(errors='replace')[-2000:]}") from e
        finally:
            if slow.poll() is None:
                slow.kill()  # only the process this scenario started
                slow.wait(10)
            if slow.stdout is not None:
                slow.stdout.close()
        results = [(int(code), float(ms)) for code, ms in probe["results"]]
        lat = [ms for _, ms in results]
        codes: dict[str, int] = {}
        for code, _ in results:
            codes[str(code)] = codes.get(str(code), 0) + 1
        cut1 = _metric(s.sc.url, timed_out)
        rec["health_probes"] = len(results)
        rec["health_codes"] = dict(sorted(codes.items()))
        rec["health_errors"] = sum(n for c, n in codes.items() if c != "200")
        rec["health_p50_ms"] = round(statistics.median(lat), 2) if lat else None
        rec["health_p99_ms"] = round(pct(lat, 99) or 0.0, 2) if lat else None
        rec["health_max_ms"] = round(max(lat), 2) if lat else None
        # the endpoint's own count of requests it cut for not being whole in time (None: no such metric)
        rec["requests_timed_out_by_server"] = None if cut0 is None or cut1 is None else int(cut1 - cut0)
        rec["http_5xx"] = sum(n for c, n in codes.items() if c.startswith("5"))
        rec["http_p99_ms"] = rec["health_p99_ms"]
    return rec


# ---- scale-out (another engineer's module)
def scenario_scaleout(s: Suite) -> dict[str, Any]:
    try:
        from bench._faults_scaleout import run_scaleout  # type: ignore[import-not-found,unused-ignore]
    except Exception as e:  # not written yet, or broken: recorded, never fatal
        return {"skipped": f"bench._faults_scaleout not importable: {type(e).__name__}: {e}"}
    db = "scaleout"
    eng = create_engine(s.pg.url, isolation_level="AUTOCOMMIT")
    try:
        with eng.connect() as c:
            c.execute(text(f"DROP DATABASE IF EXISTS {db}"))
            c.execute(text(f"CREATE DATABASE {db}"))
    finally:
        eng.dispose()
    url = s.pg.url.replace("/postgres?", f"/{db}?")
    try:
        out = run_scaleout(s.redis.url, url, windows=s.cfg.scaleout_windows, seed=s.cfg.seed)
    except Exception as e:
        return {"skipped": f"run_scaleout failed: {type(e).__name__}: {e}"}
    return dict(out)


RUNNERS: dict[str, Callable[[Suite], dict[str, Any]]] = {
    "redis_kill": scenario_redis_kill, "sidecar_kill": scenario_sidecar_kill,
    "postgres_stop": scenario_postgres_stop, "fuzz": scenario_fuzz, "forged_types": scenario_forged_types,
    "forged_tables": scenario_forged_tables, "http": scenario_http, "slow_clients": scenario_slow_clients,
    "scaleout": scenario_scaleout,
}


# ------------------------------------------------------------------------------------------------ targets
def evaluate(scenarios: dict[str, dict[str, Any]], engine: dict[str, Any] | None) -> dict[str, Any]:
    """Each target with its measured value and whether it was met (None: not measured in this run)."""
    ran = {k: v for k, v in scenarios.items() if "skipped" not in v and "error" not in v}

    def worst(field_: str, fn: Callable[[Any], float | None] = lambda v: v) -> float | None:
        vals = [fn(r.get(field_)) for r in ran.values() if r.get(field_) is not None]
        got = [v for v in vals if v is not None]
        return max(got) if got else None

    def rec_max(r: Any) -> float | None:  # a figure that never came counts as the whole settle timeout
        vals = [SETTLE_TIMEOUT_S if v is None else v for v in (r or {}).values()]
        return max(vals) if vals else None

    lost = sum(r.get("windows_lost", 0) for r in ran.values()) + (engine or {}).get("windows_lost", 0)
    dup = sum(r.get("windows_duplicated", 0) for r in ran.values()) + (engine or {}).get("windows_duplicated", 0)
    crashes = sum(bool(r.get("engine_crashed")) + bool(r.get("sidecar_crashed")) for r in ran.values())
    crashes += bool((engine or {}).get("crashed"))
    policy_errors = sum(r.get("policy_errors", 0) for r in ran.values())
    ft = ran.get("forged_types", {})
    ratio = (ft["max_rss_mb"] / ft["idle_rss_mb"]) if ft.get("max_rss_mb") and ft.get("idle_rss_mb") else None
    http = ran.get("http", {})
    recovery = worst("recovery_s", rec_max)
    absent = worst("policy_key_absent_s")
    fuzz_left = ran.get("fuzz", {}).get("fuzz_unaccounted")

    def t(value: Any, limit: Any, ok: bool | None) -> dict[str, Any]:
        return {"value": value, "target": limit, "met": ok}

    def at_most(rec: dict[str, Any], key: str, limit: float, *, strict: bool = False,
                missing_fails: bool = False) -> dict[str, Any]:
        """``rec[key]`` against ``limit``: not measured when the scenario did not run (or the sidecar does not
        report the figure); with ``missing_fails``, a None the scenario did record is a failure (never happened)."""
        if key not in rec:
            return t(None, limit, None)
        v = rec[key]
        if v is None:
            return t(None, limit, False if missing_fails else None)
        return t(v, limit, v < limit if strict else v <= limit)

    def is_true(rec: dict[str, Any], key: str) -> dict[str, Any]:
        return t(rec.get(key), True, None if key not in rec else rec[key] is True)

    slow = ran.get("slow_clients", {})
    settled = [r["redis_stream_mb_settled"] for r in ran.values() if r.get("redis_stream_mb_settled") is not None]
    stream_settled = {"redis_stream_mb_settled": max(settled)} if settled else {}

    return {
        "windows_lost": t(lost, 0, lost == 0),
        "windows_duplicated": t(dup, 0, dup == 0),
        "crashes": t(crashes, 0, crashes == 0),
        "recovery_s": t(recovery, TARGET_RECOVERY_S, None if recovery is None else recovery <= TARGET_RECOVERY_S),
        "policy_key_absent_s": t(absent, TARGET_POLICY_ABSENT_S,
                                 None if absent is None else absent <= TARGET_POLICY_ABSENT_S),
        "http_5xx_on_bad_input": t(http.get("http_bad_input_5xx"), 0,
                                   None if "http_bad_input_5xx" not in http else http["http_bad_input_5xx"] == 0),
        "http_p99_ms": t(http.get("http_p99_ms"), TARGET_HTTP_P99_MS,
                         None if http.get("http_p99_ms") is None else http["http_p99_ms"] <= TARGET_HTTP_P99_MS),
        "rss_ratio_under_flood": t(None if ratio is None else round(ratio, 2), TARGET_RSS_RATIO,
                                   None if ratio is None else ratio <= TARGET_RSS_RATIO),
        "fuzz_unaccounted": t(fuzz_left, 0, None if fuzz_left is None else fuzz_left == 0),
        "policy_errors": t(policy_errors, 0, policy_errors == 0),  # decision ticks lost to a policy exception
        "engine_stuck_on_forged": t(ran.get("forged_tables", {}).get("engine_stuck_on_forged"), False,
                                    None if "engine_stuck_on_forged" not in ran.get("forged_tables", {})
                                    else not ran["forged_tables"]["engine_stuck_on_forged"]),
        "slow_clients_health_p99_ms": at_most(slow, "health_p99_ms", TARGET_HTTP_P99_MS),
        "slow_clients_health_errors": at_most(slow, "health_errors", 0),
        "forged_decision_gap_s": at_most(ft, "forged_decision_gap_s", TARGET_DECISION_GAP_S),
        "forged_decision_p99_s": at_most(ft, "forged_decision_p99_s", TARGET_DECISION_P99_S, strict=True),
        "forged_pin_to_key_s": at_most(ft, "forged_pin_to_key_s", TARGET_PIN_TO_KEY_S, missing_fails=True),
        "forged_real_type_in_table": is_true(ft, "forged_real_type_in_table"),
        "forged_model_update_in_table": is_true(ft, "forged_model_update_in_table"),
        # What stays in Redis once the flood was read; the peak during a flood (reported per scenario) is the
        # writers' unread backlog, which only their MAXLEN bounds.
        "redis_stream_mb_settled": at_most(stream_settled, "redis_stream_mb_settled", TARGET_STREAM_MB),
        **_scaleout_targets(ran.get("scaleout")),
    }


def _scaleout_targets(so: dict[str, Any] | None) -> dict[str, Any]:
    """Several sidecars: one publisher at a time, failover within the lease + 2 s, no flips without a change."""
    if not so:
        return {}
    limit = so.get("lease_ms", DEFAULTS.lease_ms) / 1000.0 + 2.0
    fo, pub, flips = so.get("failover_s"), so.get("publishers_at_once"), so.get("table_flips")
    return {
        "scaleout_publishers_at_once": {"value": pub, "target": 1, "met": None if pub is None else pub == 1},
        "scaleout_failover_s": {"value": fo, "target": limit, "met": None if fo is None else fo <= limit},
        "scaleout_table_flips": {"value": flips, "target": 0, "met": None if flips is None else flips == 0},
    }


# ------------------------------------------------------------------------------------------------ the run
def run_config(cfg: FaultConfig) -> dict[str, Any]:
    """The JSON's ``config`` block: the preset, the sidecar defaults every scenario ran with, and the limits and
    waits derived from them."""
    return {
        **cfg.__dict__,
        "sidecar_defaults": {**DEFAULTS.__dict__, "timing_flags_passed": False},
        "sidecar_cli_default_mismatch": {k: {"cli": a, "config": b} for k, (a, b) in DEFAULTS.cli_mismatches().items()},
        "derived": {
            "settle_timeout_s": SETTLE_TIMEOUT_S,  # claim_min_idle_ms + claim_interval_s + margin
            "decision_gap_target_s": TARGET_DECISION_GAP_S,  # 2 x publish_every_s
            "pin_to_key_target_s": TARGET_PIN_TO_KEY_S,  # 2 x publish_every_s
            "decision_p99_target_s": round(TARGET_DECISION_P99_S, 4),  # lease_ms / 3
            "scaleout_failover_target_s": DEFAULTS.lease_ms / 1000 + 2.0,  # lease + 2 s
            "forged_table_replace_timeout_s": FORGED_REPLACE_TIMEOUT_S,
            "pin_wait_s": PIN_WAIT_S,
            "real_traffic_appear_wait_s": APPEAR_WAIT_S,
            "stream_cap_mb": TARGET_STREAM_MB,
            "stream_cap_source": STREAM_CAP_SOURCE,
        },
    }


def run(cfg: FaultConfig, *, scenarios: Sequence[str] = SCENARIOS, engine: bool = True, profile: str = "small",
        workdir: Path | None = None) -> dict[str, Any]:
    """Start the services, run ``scenarios`` in order, stop everything. Returns the JSON document."""
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        tmp = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spectune-faults-")))
        suite = stack.enter_context(Suite(cfg, tmp, engine=engine, profile=profile))
        suite.start()
        suite.warm_up()
        for name in scenarios:
            if name == "scaleout":
                continue  # last, after the suite's own sidecar and engine are stopped (it runs its own)
            try:
                results[name] = RUNNERS[name](suite)
            except FaultSuiteError as e:
                results[name] = {"error": str(e)}
                print(f"[faults] {name}: {e}", flush=True)
        eng = None
        if suite.engine is not None:
            final = suite.engine.stop()
            suite.wait_drained()
            distinct, rows = suite.db.stored(EngineProc.ENGINE_ID)
            sent = int(final.get("windows_sent", 0))
            eng = {"profile": profile, "windows_sent": sent, "windows_stored": distinct,
                   "windows_lost": sent - distinct, "windows_duplicated": rows - distinct,
                   "windows_dropped_by_emitter": final.get("windows_dropped"), "exit_code": final.get("exit_code"),
                   "crashed": bool(final.get("crashed_before_stop")), "rounds": final.get("rounds_recorded")}
        sidecar_alive = suite.sc.alive()
        suite.sc.close()
        if "scaleout" in scenarios:
            results["scaleout"] = scenario_scaleout(suite)
        timelines = {k: {"t0": v.t0, "sent": v.sent, "stored": v.stored, "fault": v.fault}
                     for k, v in suite.timelines.items()}
        samples = key_state_changes(suite.obs.samples)
    return {
        "scenarios": results,
        "engine": eng,
        "sidecar_alive_at_end": sidecar_alive,
        "targets": evaluate(results, eng),
        "config": run_config(cfg),
        "timelines": timelines,
        "key_state_changes": samples,
    }


# ------------------------------------------------------------------------------------------------ output
def report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"fault suite ({res.get('preset', '?')}, machine shared: figures are indicative)")
    cols = ("scenario", "sent", "stored", "lost", "dup", "crash", "recovery s", "key absent s", "dead-lettered",
            "5xx", "p99 ms", "RSS idle/max MB")
    for c in cols:
        t.add_column(c)
    for name, r in res["scenarios"].items():
        if "skipped" in r or "error" in r:
            t.add_row(name, *[""] * 10, f"[yellow]{r.get('skipped') or r.get('error')}"[:80])
            continue
        if "policy_key_absent_s" not in r:  # the scale-out run's own figures
            t.add_row(name, str(r.get("windows_sent", "")), str(r.get("windows_stored", "")),
                      str(r.get("windows_lost", "")), str(r.get("windows_duplicated", "")),
                      "sidecar" if r.get("sidecar_crashed") else "0", f"failover {r.get('failover_s')}", "", "", "",
                      "", f"publishers at once {r.get('publishers_at_once')}")
            continue
        rec = r.get("recovery_s") or {}
        rec_s = "/".join("-" if v is None else f"{v:.2f}" for v in rec.values()) if rec else ""
        crash = "engine" if r.get("engine_crashed") else ("sidecar" if r.get("sidecar_crashed") else "0")
        t.add_row(name, str(r["windows_sent"]), str(r["windows_stored"]), str(r["windows_lost"]),
                  str(r["windows_duplicated"]), crash, rec_s, f"{r['policy_key_absent_s']:.2f}",
                  str(r["dead_lettered"]), "" if r["http_5xx"] is None else str(r["http_5xx"]),
                  "" if r["http_p99_ms"] is None else f"{r['http_p99_ms']:.1f}",
                  f"{r.get('idle_rss_mb')}/{r.get('max_rss_mb')}")
    console = Console(width=max(Console().width, 150))  # the table is wide; a pipe's default 80 columns crush it
    console.print(t)
    tt = Table(title="targets")
    for c in ("target", "value", "limit", "met"):
        tt.add_column(c)
    for k, v in res["targets"].items():
        met = {True: "[green]yes", False: "[red]NO", None: "not measured"}[v["met"]]
        tt.add_row(k, str(v["value"]), str(v["target"]), met)
    console.print(tt)
    if res.get("engine"):
        print(f"engine: {res['engine']}")


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tls = res["timelines"]
    n = max(1, len(tls))
    fig, axes = plt.subplots(n, 1, figsize=(10, 1.9 * n + 0.6), squeeze=False)
    order = [n for n in SCENARIOS if n in tls] + [n for n in tls if n not in SCENARIOS]  # the JSON sorts keys
    for ax, name in zip(axes[:, 0], order, strict=False):
        tl = tls[name]
        t0 = tl["t0"]
        if tl["sent"]:
            ax.step([t - t0 for t, _ in tl["sent"]], [v for _, v in tl["sent"]], where="post", label="sent")
        if tl["stored"]:
            ax.step([t - t0 for t, _ in tl["stored"]], [v for _, v in tl["stored"]], where="post", label="stored")
        if tl["fault"]:
            a, b = tl["fault"]
            ax.axvspan(a - t0, max(b, a + 0.05) - t0, color="crimson", alpha=0.2, label="fault")
        end = max([t for t, _ in tl["sent"]] + [t0 + 1])
        changes = res.get("key_state_changes") or []
        label = "Redis down / no table of the store's at the key"
        for (t, up, ours), nxt in zip(changes, [*changes[1:], [math.inf, True, True]], strict=True):
            a, b = max(t, t0), min(nxt[0], end)
            if b > a and not (up and ours):
                ax.axvspan(a - t0, b - t0, ymin=0.93, ymax=1.0, color="black", label=label)
                label = "_"
        ax.set_ylabel("windows")
        ax.set_title(name, fontsize=9, loc="left")
        ax.legend(fontsize=6, loc="upper left")
    axes[-1, 0].set_xlabel("seconds since the scenario began")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="spectune bench faults",
                                 description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="short outages, small counts (a smoke run)")
    ap.add_argument("--profile", choices=("small", "xl"), default="small", help="the reference engine's models")
    ap.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for faults.json / faults.png")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset, in order")
    ap.add_argument("--no-engine", action="store_true", help="feeders only, no reference engine process")
    args = ap.parse_args(argv)
    cfg = PRESETS["quick" if args.quick else "full"]

    def on_term(*_: object) -> None:
        raise KeyboardInterrupt  # unwinds through the suite's cleanup, as Ctrl-C does

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        res = run(cfg, scenarios=[s for s in args.scenarios.split(",") if s], engine=not args.no_engine,
                  profile=args.profile)
    except FaultSuiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the suite's Redis, PostgreSQL and processes are stopped, its folders removed",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    res["preset"] = "quick" if args.quick else "full"
    write_results(res, args.out / "faults.json", plot, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
