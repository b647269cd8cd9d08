"""Clients and samplers of the fault suite's hostile scenarios (``bench/faults.py``), apart from its services.

- :func:`slow_clients`: connections that hold a request head without its closing blank line, and connections
  that send a request a byte at a time (a slow-loris client); what the server does with them.
- :func:`health_probe`: ``GET /health`` one at a time, timed from the connect to the last byte.
- :class:`HealthSampler`: the sidecar's ``/health`` ``deciding`` block over time; :func:`decision_figures` turns
  it into the largest gap between decisions.
- :class:`RedisMemory`: Redis's ``used_memory`` and the telemetry streams' length and size over time.

The two clients run in processes of their own (``_slow_clients_child`` / ``_health_probe_child``: a JSON job on
stdin, a JSON answer on stdout), so that the suite's threads do not hold their GIL and their waits are the
server's. Nothing here asserts.
"""

from __future__ import annotations

import contextlib
import json
import math
import selectors
import socket
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, cast

import redis

HTTP_STATUS_FAILED = -1  # no answer at all (connection refused, reset, timeout, not HTTP)

HEALTH_EVERY_S = 0.25  # the sidecar's /health is read this often while a flood runs
HEALTH_TIMEOUT_S = 2.0  # a /health read slower than this counts as a failure of that sample
REDIS_MEM_EVERY_S = 0.5  # Redis's memory and the streams' length and size are read this often
MB = 1 << 20


class _Sampler:
    """A daemon thread that calls ``_sample`` every ``every_s`` until stopped (``with`` starts and stops it)."""

    def __init__(self, every_s: float, name: str) -> None:
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(HEALTH_TIMEOUT_S + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._every)

    def _sample(self) -> None:
        raise NotImplementedError


class HealthSampler(_Sampler):
    """Reads ``/health`` every ``HEALTH_EVERY_S``: its ``deciding`` block (decisions so far, when the last one was,
    the decision time's p99, whether one is overdue), or None when the sidecar does not report one.

    Args:
        base_url: the sidecar's endpoint as of now (a restarted sidecar serves on a new port).
    """

    def __init__(self, base_url: Callable[[], str]) -> None:
        super().__init__(HEALTH_EVERY_S, "health-sampler")
        self._url = base_url
        self.samples: list[tuple[float, dict[str, Any] | None]] = []  # (time.time(), deciding)
        self.failures = 0  # reads that got no answer within HEALTH_TIMEOUT_S

    def _sample(self) -> None:
        try:
            with urllib.request.urlopen(self._url() + "/health", timeout=HEALTH_TIMEOUT_S) as r:
                h = json.loads(r.read())
        except (OSError, ValueError):
            self.failures += 1
            return
        d = h.get("deciding") if isinstance(h, dict) else None
        self.samples.append((time.time(), d if isinstance(d, dict) else None))


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def decision_figures(samples: Sequence[tuple[float, dict[str, Any] | None]]) -> dict[str, Any]:
    """From ``/health``'s ``deciding`` samples: the largest gap between consecutive decisions, the largest
    decision-time p99 the sidecar reported, and how often it said a decision was overdue.

    The gap is measured on the sidecar's own clock (``last_at``; the sample's time when it gives none). When
    several decisions fall between two samples the gap counted is the whole span between their ``last_at``
    values: an upper bound. The span from the last decision to the last sample counts too (a sidecar that
    stopped deciding shows a growing gap). All None when the sidecar reports no ``deciding`` block.
    """
    pts = [(t, d) for t, d in samples if d is not None and isinstance(d.get("decisions"), int)]
    if not pts:
        return {"decision_gap_s": None, "decision_p99_s": None, "decisions": None, "overdue_samples": None}
    gap, last_at, count = 0.0, None, None
    for t, d in pts:
        n, at = int(d["decisions"]), _num(d.get("last_at"))
        when = at if at is not None else t
        if count is None or n < count:  # the first sample, or a restarted sidecar counting from zero again
            count, last_at = n, (at if n > 0 else None)
            continue
        if n > count:
            if last_at is not None:
                gap = max(gap, when - last_at)
            count, last_at = n, when
    if last_at is not None:
        gap = max(gap, pts[-1][0] - last_at)
    p99s = [v for _, d in pts if (v := _num(d.get("p99_s"))) is not None]
    return {"decision_gap_s": round(gap, 3) if last_at is not None else None,
            "decision_p99_s": round(max(p99s), 4) if p99s else None,
            "decisions": max(0, int(pts[-1][1]["decisions"]) - int(pts[0][1]["decisions"])),
            "overdue_samples": sum(1 for _, d in pts if d.get("overdue") is True)}


class RedisMemory(_Sampler):
    """Reads Redis's ``used_memory`` and the windows and dead-letter streams' length (``XLEN``) and size
    (``MEMORY USAGE``) every ``REDIS_MEM_EVERY_S``.

    Args:
        redis_url: the Redis to read.
        windows: the windows stream's key.
        deadletter: the dead-letter stream's key.
    """

    def __init__(self, redis_url: str, windows: str, deadletter: str) -> None:
        super().__init__(REDIS_MEM_EVERY_S, "redis-memory")
        self._r = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=0.5)
        self._streams = {"windows": windows, "deadletter": deadletter}
        self.samples: list[dict[str, float]] = []

    def _sample(self) -> None:
        try:
            row = {"t": time.time(), "used_mb": int(self._r.info("memory")["used_memory"]) / MB}
            for name, key in self._streams.items():
                row[f"{name}_len"] = int(self._r.xlen(key))
                row[f"{name}_mb"] = int(self._r.memory_usage(key) or 0) / MB
        except (redis.RedisError, OSError, KeyError, ValueError):
            return  # Redis busy or down: no sample this time
        self.samples.append(row)

    def stop(self) -> None:
        super().stop()
        self._r.close()

    def summary(self) -> dict[str, Any]:
        """Peaks over the samples (None without any), and the stream total the cap is judged on."""
        if not self.samples:
            return {"redis_used_memory_mb_peak": None, "redis_stream_mb_peak": None, "redis_memory_samples": 0}

        def peak(k: str) -> float:
            return max(x[k] for x in self.samples)

        return {"redis_used_memory_mb_start": round(self.samples[0]["used_mb"], 2),
                "redis_used_memory_mb_peak": round(peak("used_mb"), 2),
                "redis_windows_len_peak": int(peak("windows_len")),
                "redis_deadletter_len_peak": int(peak("deadletter_len")),
                "redis_windows_mb_peak": round(peak("windows_mb"), 2),
                "redis_deadletter_mb_peak": round(peak("deadletter_mb"), 2),
                "redis_stream_mb_peak": round(max(x["windows_mb"] + x["deadletter_mb"] for x in self.samples), 2),
                "redis_memory_samples": len(self.samples)}


def stream_mb_settled(redis_url: str, windows: str, deadletter: str, after_s: float) -> dict[str, Any]:
    """The two streams' size ``after_s`` seconds from now (once the sidecar has trimmed what it stored): what stays
    in Redis after a flood, judged against the product's stated cap."""
    time.sleep(after_s)
    r = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=1.0)
    try:
        out: dict[str, Any] = {"redis_windows_len_settled": int(r.xlen(windows)),
               "redis_deadletter_len_settled": int(r.xlen(deadletter))}
        out["redis_stream_mb_settled"] = round(sum(int(r.memory_usage(k) or 0) for k in (windows, deadletter)) / MB,
                                               2)
        return out
    except (redis.RedisError, OSError):
        return {"redis_stream_mb_settled": None}
    finally:
        r.close()


# A request head without the blank line that ends it: never whole, the server must not wait on it for ever.
SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"
TRICKLE_REQUEST = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"  # sent a byte at a time
SLOW_CONNECT_TIMEOUT_S = 2.0
SLOW_READY = b"ready\n"  # what the slow-clients process prints once its connections are open


@dataclass
class _Slow:
    """One connection of :func:`slow_clients`."""

    kind: str  # "half_sent" or "trickle"
    t_open: float  # monotonic, when its first byte went out
    sent: int  # bytes of its request sent so far
    next_at: float = 0.0  # monotonic, when a trickler sends its next byte
    answered: bool = False  # the server sent something (a status line) on it


def slow_clients(port: int, half_sent: int, tricklers: int, every_s: float, duration_s: float,
                 ready: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Hold ``half_sent`` connections that sent :data:`SLOW_HEAD` and nothing more, and ``tricklers`` that send
    :data:`TRICKLE_REQUEST` one byte every ``every_s``, for ``duration_s`` (one thread, a selector). A
    connection the server closes is opened again at once, as a slow-loris client would. Returns what the server
    did with them: closes per kind, how long it held each, the status lines it sent (a 408, say)."""
    sel = selectors.DefaultSelector()
    closed = {"half_sent": 0, "trickle": 0}
    held: dict[str, list[float]] = {"half_sent": [], "trickle": []}
    answers: dict[str, int] = {}
    counts = {"opened": 0, "connect_failures": 0, "bytes_trickled": 0}

    def open_one(kind: str) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=SLOW_CONNECT_TIMEOUT_S)
            first = SLOW_HEAD if kind == "half_sent" else TRICKLE_REQUEST[:1]
            sock.sendall(first)
        except OSError:
            counts["connect_failures"] += 1
            return
        now = time.monotonic()
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, _Slow(kind, now, len(first), now + every_s))
        counts["opened"] += 1

    for _ in range(half_sent):
        open_one("half_sent")
    for _ in range(tricklers):
        open_one("trickle")
    ready()
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        for key, _ in sel.select(0.1):
            c, sock = cast(_Slow, key.data), cast(socket.socket, key.fileobj)
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data:
                if not c.answered:  # the start of an answer: its status
                    c.answered = True
                    parts = data[:16].split(b" ", 2)
                    code = parts[1].decode() if len(parts) > 1 and parts[1].isdigit() else "not_http"
                    answers[code] = answers.get(code, 0) + 1
                continue
            sel.unregister(sock)
            sock.close()
            closed[c.kind] += 1
            held[c.kind].append(time.monotonic() - c.t_open)
            open_one(c.kind)
        now = time.monotonic()
        for key in list(sel.get_map().values()):
            c, sock = cast(_Slow, key.data), cast(socket.socket, key.fileobj)
            if c.kind == "trickle" and now >= c.next_at and c.sent < len(TRICKLE_REQUEST):
                with contextlib.suppress(OSError):  # a connection the server cut: its read says so
                    c.sent += sock.send(TRICKLE_REQUEST[c.sent:c.sent + 1])
                    counts["bytes_trickled"] += 1
                c.next_at = now + every_s
    still_open = len(sel.get_map())
    for key in list(sel.get_map().values()):
        cast(socket.socket, key.fileobj).close()
    sel.close()

    def summary(xs: list[float]) -> dict[str, float | None]:
        return {"median": round(statistics.median(xs), 2) if xs else None,
                "max": round(max(xs), 2) if xs else None}

    return {"slow_opened": counts["opened"], "slow_connect_failures": counts["connect_failures"],
            "slow_closed_by_server": closed, "slow_held_s": {k: summary(v) for k, v in held.items()},
            "slow_answers": dict(sorted(answers.items())), "slow_bytes_trickled": counts["bytes_trickled"],
            "slow_open_at_end": still_open}


def _slow_clients_child() -> None:
    """:func:`slow_clients` in a process of its own: a JSON job on stdin, :data:`SLOW_READY` on stdout once its
    connections are open, then its JSON answer."""
    job = json.load(sys.stdin)

    def ready() -> None:
        sys.stdout.buffer.write(SLOW_READY)
        sys.stdout.flush()

    out = slow_clients(job["port"], job["half_sent"], job["tricklers"], job["every_s"], job["duration_s"], ready)
    sys.stdout.write(json.dumps(out) + "\n")


def health_probe(port: int, duration_s: float, every_s: float, timeout_s: float = 5.0) -> list[tuple[int, float]]:
    """``GET /health`` one at a time for ``duration_s``, each on a new connection, ``every_s`` apart. Returns
    (status, ms) per probe, from the connect to the last byte of the answer; status -1 when none came within
    ``timeout_s``."""
    out: list[tuple[int, float]] = []
    req = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        t0 = time.perf_counter()
        got = bytearray()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
                sock.sendall(req)
                while chunk := sock.recv(65536):
                    got += chunk
                    if time.perf_counter() - t0 > timeout_s:
                        raise TimeoutError
            parts = bytes(got[:16]).split(b" ", 2)
            ok = len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit()
            code = int(parts[1]) if ok else HTTP_STATUS_FAILED
        except OSError:
            code = HTTP_STATUS_FAILED
        out.append((code, (time.perf_counter() - t0) * 1e3))
        time.sleep(every_s)
    return out


def _health_probe_child() -> None:
    """:func:`health_probe` in a process of its own (the suite's threads would hold its GIL): a JSON job on stdin,
    a JSON answer on stdout (``results``, ``began`` / ``ended`` in wall-clock time)."""
    job = json.load(sys.stdin)
    began = time.time()
    results = health_probe(job["port"], job["duration_s"], job["every_s"])
    json.dump({"results": results, "began": began, "ended": time.time()}, sys.stdout)
