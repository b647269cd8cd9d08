"""Scale-out under a leader kill: three ``spectune sidecar`` processes share one consumer group, one lease.

:func:`run_scaleout` starts the sidecars on the given Redis and PostgreSQL, feeds seeded synthetic window batches
from one engine id while a monitor polls every sidecar's ``/health`` and the engines' policy key, ``kill -9``\\ s
the leader half way through the feed, keeps feeding, and reports what happened. Used by ``spectune bench faults``
(its ``scaleout`` scenario) and by ``tests/controller/test_lease.py``; it never asserts.

The sidecars run with the product's timing defaults (lease, claim idle time, publish period: no flag) unless a
caller passes ``lease_ms`` / ``claim_idle_ms``; the waits below are derived from what they run with. With the
default claim idle time (``ConsumerConfig.claim_min_idle_ms``, 30 s) the dead leader's pending entries are stored
by a survivor only that long after the kill, so a run takes about that much longer than with a short one.

Figures (a "window" is one engine's window batch, the unit that travels, as in the other fault scenarios):

- ``publishers_at_once``: the most sidecars that said ``leader: true`` in one monitor sweep (target: 1);
  ``versions_by_sidecar`` / ``publisher_switches``: who published which stored version (each version once, and
  the publisher changes only at a failover);
- ``failover_s``: from the kill to the first sweep in which a survivor leads (target: within the lease + 2 s);
- ``table_flips``: stored versions whose table equals the one before it (a publish without a real change), plus
  moves of the engines' key to a lower version;
- ``windows_sent/stored/lost/duplicated``: batches the feeder sent vs batches in the store (and rounds: a
  duplicate would count its rounds twice);
- ``new_leader_rows_observed`` vs ``rows_stored`` and ``new_leader_own_batches``: the new leader's policy learned
  every stored window row, including those other sidecars' consumers stored (``leader_saw_peer_windows``);
- ``sidecar_crashed``: a survivor exited before it was stopped, or not with status 0.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

SIDECARS = 3
READY_TIMEOUT_S = 60.0  # three interpreters importing on a busy 2-core machine
HEALTH_TIMEOUT_S = 0.5
MONITOR_EVERY_S = 0.05
FEED_PHASE_S = 3.0  # each half of the feed (before and after the kill) is spread over this long
ROUNDS_PER_WINDOW = 20
SETTLE_MARGIN_S = 15.0  # after the survivors' re-claim time: every batch stored and learned by the new leader
FIRST_TABLE_PERIODS = 5  # the leader's first table is at the key within this many publish periods
REPO = Path(__file__).resolve().parents[1]


def _defaults() -> tuple[int, int, float, float]:
    """The sidecar's own defaults: (lease ms, claim idle ms, claim interval s, publish period s)."""
    from controller.service.lease import LeaseConfig
    from controller.service.sidecar import SidecarConfig
    from telemetry.ingest import ConsumerConfig

    cc = ConsumerConfig(consumer="defaults")
    return LeaseConfig().lease_ms, cc.claim_min_idle_ms, cc.claim_interval_s, SidecarConfig().publish_every_s


def _claim_interval_s(claim_idle_ms: int) -> float:
    """How often a sidecar started with ``--claim-idle-ms`` looks for stale entries (as ``spectune sidecar``
    derives it)."""
    return min(5.0, claim_idle_ms / 2000)


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    ready: Path
    url: str = ""
    killed: bool = False
    stopped: bool = False


@dataclass
class _Monitor:
    procs: list[_Proc]
    keys_policy: str
    r: redis.Redis
    samples: list[tuple[float, dict[str, bool]]] = field(default_factory=list)
    health: dict[str, dict[str, Any]] = field(default_factory=dict)
    key_seen: list[tuple[float, int, str]] = field(default_factory=list)  # (t, version, content hash) changes
    stop: threading.Event = field(default_factory=threading.Event)

    def sweep(self) -> dict[str, bool]:
        started = time.monotonic()  # a sweep counts from its start: a killed leader's last answer is before it
        leaders: dict[str, bool] = {}
        for p in self.procs:
            if p.killed or p.stopped or not p.url:
                continue
            try:
                with urllib.request.urlopen(f"{p.url}/health", timeout=HEALTH_TIMEOUT_S) as resp:
                    h = json.loads(resp.read())
            except (OSError, ValueError):
                continue  # busy or gone: not counted as a leader in this sweep
            self.health[p.name] = h
            leaders[p.name] = bool(h.get("leader"))
        self.samples.append((started, leaders))
        try:
            raw = self.r.get(self.keys_policy)
        except redis.RedisError:
            raw = None
        if isinstance(raw, bytes):
            try:
                t = json.loads(raw)
                ver, content = int(t["version"]), _content_hash(t)
            except (ValueError, KeyError, TypeError):
                ver, content = -1, "junk"
            if not self.key_seen or self.key_seen[-1][1] != ver:
                self.key_seen.append((time.monotonic(), ver, content))
        return leaders

    def run(self) -> None:
        while not self.stop.is_set():
            self.sweep()
            self.stop.wait(MONITOR_EVERY_S)

    def leaders_now(self, since: float = 0.0) -> list[str]:
        """Who led in the newest sweep that started after ``since`` (monotonic seconds)."""
        last = self.samples[-1] if self.samples else (0.0, {})
        return [n for n, lead in last[1].items() if lead] if last[0] > since else []


def _content_hash(t: dict[str, Any]) -> str:
    body = json.dumps({"entries": t.get("entries"), "default_k": t.get("default_k")}, sort_keys=True)
    return hashlib.sha1(body.encode()).hexdigest()[:12]


def _start(i: int, redis_url: str, db_url: str, prefix: str, seed: int, tmp: Path,
           timing: list[str]) -> _Proc:
    name = f"scaleout-{i}"
    log, ready = tmp / f"{name}.log", tmp / f"{name}.ready"
    cmd = [sys.executable, "-m", "controller.cli", "sidecar", "--redis-url", redis_url, "--db-url", db_url,
           "--prefix", prefix, "--http-port", "0", "--ready-file", str(ready), "--consumer", name, "--no-alerts",
           "--seed", str(seed), *timing]
    with log.open("wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    return _Proc(name, popen, log, ready)


def _feed(transport: Any, emitter: Any, rounds: Any, n: int, duration_s: float) -> None:
    """Send ``n`` window batches of ``ROUNDS_PER_WINDOW`` rounds, spread over ``duration_s``."""
    t0 = time.monotonic()
    for i in range(n):
        for _ in range(ROUNDS_PER_WINDOW):
            emitter.record(next(rounds))
        emitter.flush()
        wait = t0 + (i + 1) * duration_s / n - time.monotonic()
        if wait > 0:
            time.sleep(wait)


def _published(log: Path) -> list[int]:
    """Versions a sidecar printed as published (``published vN: ...`` lines)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("published v"):
            out.append(int(line[len("published v"):].split(":", 1)[0]))
    return out


def run_scaleout(redis_url: str, db_url: str, *, lease_ms: int | None = None, claim_idle_ms: int | None = None,
                 windows: int = 200, seed: int = 0) -> dict[str, Any]:
    """Three sidecars, one lease, a feed of ``windows`` batches, and a ``kill -9`` of the leader half way.

    Args:
        redis_url: a Redis the sidecars share (a fresh key prefix is used and removed afterwards).
        db_url: a PostgreSQL (or SQLite file) database of its own; migrated to head here.
        lease_ms: the sidecars' ``--lease-ms``; None: no flag, the product's default (``LeaseConfig``).
        claim_idle_ms: the sidecars' ``--claim-idle-ms``; None: no flag, the product's default
            (``ConsumerConfig``). The run waits that long for the dead leader's pending entries.
        windows: window batches the feeder sends (half before the kill, half after).
        seed: seed of the synthetic rounds and of the sidecars' policies.

    Returns:
        The figures listed in the module docstring, JSON-safe.
    """
    from telemetry import migrate
    from telemetry.emitter import Emitter, EmitterConfig
    from telemetry.store import Store
    from telemetry.synthetic import synthetic_rounds
    from telemetry.transport import RedisConfig, RedisKeys, RedisStreamsTransport

    if windows < 2:
        raise ValueError(f"windows must be >= 2 (half are sent before the kill), got {windows}")
    t_start = time.monotonic()
    d_lease, d_claim, d_interval, publish_s = _defaults()
    timing = ([] if lease_ms is None else ["--lease-ms", str(lease_ms)]) + (
        [] if claim_idle_ms is None else ["--claim-idle-ms", str(claim_idle_ms)])
    lease_ms = d_lease if lease_ms is None else lease_ms
    claim_interval_s = d_interval if claim_idle_ms is None else _claim_interval_s(claim_idle_ms)
    claim_idle_ms = d_claim if claim_idle_ms is None else claim_idle_ms
    settle_s = claim_idle_ms / 1000 + claim_interval_s + SETTLE_MARGIN_S
    prefix = f"spectune-scaleout-{uuid.uuid4().hex[:10]}"
    keys = RedisKeys(prefix)
    migrate.upgrade(db_url)
    r = redis.Redis.from_url(redis_url)
    procs: list[_Proc] = []
    res: dict[str, Any] = {"lease_ms": lease_ms, "claim_idle_ms": claim_idle_ms, "publish_every_s": publish_s,
                           "timing_flags": timing, "settle_timeout_s": settle_s, "sidecars": SIDECARS, "seed": seed}
    with tempfile.TemporaryDirectory(prefix="spectune-scaleout-") as td:
        tmp = Path(td)
        monitor = _Monitor(procs, keys.policy, r)
        mon_thread = threading.Thread(target=monitor.run, name="scaleout-monitor", daemon=True)
        transport = RedisStreamsTransport(redis_url, RedisConfig(prefix=prefix))
        emitter = Emitter(transport, EmitterConfig("scaleout-engine"), start=False)
        rounds = iter(synthetic_rounds(windows * ROUNDS_PER_WINDOW + ROUNDS_PER_WINDOW, seed=seed))
        try:
            procs += [_start(i, redis_url, db_url, prefix, seed, tmp, timing) for i in range(SIDECARS)]
            deadline = time.monotonic() + READY_TIMEOUT_S
            for p in procs:
                while not p.ready.exists():
                    if p.popen.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"sidecar {p.name} did not start: {p.log.read_text(errors='replace')}")
                    time.sleep(0.05)
                time.sleep(0.05)  # the file is written in one call; give it a moment to be complete
                p.url = json.loads(p.ready.read_text())["url"]
            mon_thread.start()
            res["startup_s"] = round(time.monotonic() - t_start, 2)
            _wait(lambda: bool(monitor.leaders_now()), lease_ms / 1000 + 5)

            first = windows // 2
            _feed(transport, emitter, rounds, first, FEED_PHASE_S)
            _wait(lambda: any(v > 0 for _, v, _ in monitor.key_seen),  # the leader published something
                  max(5.0, FIRST_TABLE_PERIODS * publish_s))
            leaders = monitor.leaders_now()
            victim = next((p for p in procs if leaders and p.name == leaders[0]), None)
            res["leader_killed"] = victim.name if victim else None
            t_kill, t_kill_wall = time.monotonic(), time.time()
            if victim is not None:
                victim.killed = True
                os.kill(victim.popen.pid, signal.SIGKILL)
                victim.popen.wait()
            feeder = threading.Thread(target=_feed, args=(transport, emitter, rounds, windows - first, FEED_PHASE_S),
                                      daemon=True)
            feeder.start()
            _wait(lambda: bool(monitor.leaders_now(since=t_kill)), lease_ms / 1000 + 10)
            after = [(t, ls) for t, ls in monitor.samples if t > t_kill and any(ls.values())]
            new = [n for n, lead in after[0][1].items() if lead] if after else []
            res["new_leader"] = new[0] if new else None
            # the new leader says when it took over (same machine, same clock): the monitor's sweep only bounds it
            since = ((monitor.health.get(new[0], {}).get("lease") or {}).get("leader_since") if new else None)
            res["failover_s"] = (round(since - t_kill_wall, 3) if isinstance(since, float)
                                 else round(after[0][0] - t_kill, 3) if after else None)
            res["failover_seen_s"] = round(after[0][0] - t_kill, 3) if after else None
            feeder.join()
            sent = emitter.stats().windows_sent
            store = Store(db_url)
            try:
                rows_total = [0]

                def settled() -> bool:
                    if store.batch_count() < sent or not new:
                        return False
                    rows_total[0] = len(store.acceptance_windows()) + len(store.cost_windows())
                    h = monitor.health.get(new[0], {})
                    return int(h.get("windows_observed", -1)) >= rows_total[0]

                res["settled"] = _wait(settled, settle_s)
                time.sleep(2 * MONITOR_EVERY_S)
                stored = store.batch_count()
                rounds_stored = sum(w.window.rounds for w in store.cost_windows())
                tables = list(reversed(store.policy_versions(limit=100_000)))
            finally:
                store.close()
            res.update(_windows_figures(sent, stored, sent * ROUNDS_PER_WINDOW, rounds_stored))
            h_new = monitor.health.get(new[0], {}) if new else {}
            res["rows_stored"] = rows_total[0]
            res["new_leader_rows_observed"] = h_new.get("windows_observed")
            res["new_leader_own_batches"] = h_new.get("windows_ingested")
            res["leader_saw_peer_windows"] = bool(
                h_new and h_new.get("windows_observed") == rows_total[0] and rows_total[0] > 0
                and int(h_new.get("windows_ingested", 0)) < stored)
        finally:
            monitor.stop.set()
            if mon_thread.is_alive():
                mon_thread.join(2)
            crashed = _stop_all(procs)
            transport.close()
            leftover = list(r.scan_iter(keys.pattern))
            if leftover:
                r.delete(*leftover)
            r.close()
        res["sidecar_crashed"] = crashed
        res["publishers_at_once"] = max((sum(ls.values()) for _, ls in monitor.samples), default=0)
        by = {p.name: _published(p.log) for p in procs}
        res["versions_by_sidecar"] = by
        owner = sorted((v, n) for n, vs in by.items() for v in vs)
        res["versions_published_twice"] = len(owner) - len({v for v, _ in owner})
        res["publisher_switches"] = sum(1 for a, b in itertools.pairwise(owner) if a[1] != b[1])
        res["table_flips"] = _flips(tables, monitor.key_seen)
        res["versions_stored"] = len(tables)
    res["wall_s"] = round(time.monotonic() - t_start, 2)
    return res


def _wait(cond: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(MONITOR_EVERY_S)
    return bool(cond())


def _windows_figures(sent: int, stored: int, rounds_sent: int, rounds_stored: int) -> dict[str, int]:
    return {"windows_sent": sent, "windows_stored": stored, "windows_lost": max(0, sent - stored),
            "windows_duplicated": max(0, stored - sent), "rounds_sent": rounds_sent, "rounds_stored": rounds_stored}


def _flips(tables: list[Any], key_seen: list[tuple[float, int, str]]) -> int:
    """Publishes without a real change (a stored table equal to the one before it), plus moves of the engines'
    key to a lower version."""
    same = sum(1 for a, b in itertools.pairwise(tables)
               if a.entries == b.entries and a.default_k == b.default_k)
    backwards = sum(1 for a, b in itertools.pairwise(key_seen) if b[1] < a[1])
    return same + backwards


def _stop_all(procs: list[_Proc]) -> bool:
    """SIGTERM every survivor, wait, kill what hangs. Returns whether one had died before or exited non-zero."""
    crashed = False
    for p in procs:
        if p.killed:
            continue
        if p.popen.poll() is not None:
            crashed = True  # died on its own
            continue
        p.popen.send_signal(signal.SIGTERM)
    for p in procs:
        if p.killed:
            continue
        try:
            rc = p.popen.wait(15)
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
            rc = -9
        p.stopped = True
        crashed = crashed or rc != 0
    return crashed
