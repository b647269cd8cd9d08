"""How window batches travel from engines to the sidecar: Redis Streams, or an in-process queue.

Both transports have the same small interface (:class:`Transport`): the engine side publishes encoded batches;
the sidecar side reads them through a consumer group, acknowledges them only after the store committed, claims
entries a dead consumer left pending, and moves invalid entries to a dead-letter stream with a reason.

Payloads are opaque bytes here; :mod:`telemetry.wire` encodes and decodes them. Every Redis name spectune uses is
built by :class:`RedisKeys`, and every redis-py error is translated here into
:class:`~telemetry.errors.TransportError`: callers never see the library.
"""

from __future__ import annotations

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import RedisError, ResponseError

from telemetry.errors import TransportError
from telemetry.urls import redact_url

DEFAULT_PREFIX = "spectune"
GROUP = "sidecar"  # the sidecars' consumer group on the windows stream
PAYLOAD_FIELD = "v"  # stream entries carry one field: the encoded batch
DEADLETTER_KEEP_BYTES = 4 << 10  # dead letters keep this much of a payload (and its full size): enough to see what
# was wrong, small enough that deadletter_maxlen of them stay a bounded share of a shared Redis
DEADLETTER_ENTRY_OVERHEAD_BYTES = 512  # reason, source id, size, time and the stream's own bookkeeping, per entry

Entry = tuple[str, bytes]  # (entry id, payload)


@dataclass(frozen=True)
class RedisKeys:
    """Every Redis name spectune uses, built from one prefix (engines and sidecars must share it)."""

    prefix: str = DEFAULT_PREFIX  # lets several deployments share one Redis

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"the Redis prefix must be a non-empty word, got {self.prefix!r}")

    @property
    def windows(self) -> str:
        """Stream of encoded window batches, read by the ``sidecar`` consumer group."""
        return f"{self.prefix}:windows"

    @property
    def deadletter(self) -> str:
        """Stream of entries the sidecar rejected, each with its reason."""
        return f"{self.prefix}:deadletter"

    @property
    def policy(self) -> str:
        """The current policy table's JSON, one value written atomically with its version."""
        return f"{self.prefix}:policy"

    @property
    def policy_updates(self) -> str:
        """Pub/sub channel carrying each new table version (a nudge; the table itself is at :attr:`policy`)."""
        return f"{self.prefix}:policy-updates"

    @property
    def alerts(self) -> str:
        """Stream of raised alerts (model_update, acceptance_drift, cost_drift) for operators."""
        return f"{self.prefix}:alerts"

    @property
    def leader(self) -> str:
        """The sidecars' leader lease: the holder's random token, with a TTL (``SET NX PX``; see
        :mod:`controller.service.lease`). Only the holder decides and publishes the policy table."""
        return f"{self.prefix}:leader"

    @property
    def pattern(self) -> str:
        """A SCAN pattern matching every name of this prefix (housekeeping in tests and benchmarks)."""
        return f"{self.prefix}:*"


@dataclass(frozen=True)
class DeadLetter:
    """An entry the sidecar rejected: the original id, the (possibly truncated) payload and why."""

    source_id: str
    reason: str
    payload: bytes
    size: int  # the payload's original size in bytes
    at: float  # wall-clock seconds when it was rejected


# -------------------------------------------------------------------------------------------- interface
class Transport(ABC):
    """Moves encoded window batches from engines to sidecars (at-least-once; stores deduplicate)."""

    @abstractmethod
    def publish(self, payloads: bytes | Sequence[bytes]) -> None:
        """Append one or more encoded batches. Raises :class:`TransportError` when they were not accepted."""

    @abstractmethod
    def read(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        """Deliver up to ``count`` new entries to ``consumer`` of the group, waiting up to ``block_ms``."""

    @abstractmethod
    def ack(self, ids: Sequence[str]) -> None:
        """Acknowledge delivered entries (call only after the store committed them)."""

    @abstractmethod
    def claim_stale(self, consumer: str, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over up to ``count`` entries delivered but not acknowledged for ``min_idle_ms`` or longer."""

    @abstractmethod
    def deadletter(self, entry_id: str, payload: bytes, reason: str) -> None:
        """Move a delivered entry to the dead-letter stream with ``reason`` and acknowledge it."""

    @abstractmethod
    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The oldest ``count`` dead letters, for operators and tests."""

    @abstractmethod
    def recent_dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The newest ``count`` dead letters, newest first (what an operator looks at)."""

    def trim_acknowledged(self) -> int:
        """Drop entries every consumer group has acknowledged (their windows are in the store); returns how many
        were dropped. Default: nothing kept that needs trimming."""
        return 0

    def stream_lengths(self) -> dict[str, int]:
        """Entries held per stream (``windows``, ``deadletter``) and the windows not yet delivered to the sidecars
        (``unread``), for health and metrics. Default: none."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections."""


# ---------------------------------------------------------------------------------------- in-process
class InProcessTransport(Transport):
    """A thread-safe in-process stream with consumer-group semantics, for the embedded default.

    Entries beyond ``max_entries`` that no consumer has read yet are trimmed oldest first (as Redis's MAXLEN
    would) and counted in :attr:`trimmed`.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._max = max_entries
        self._cond = threading.Condition()
        self._new: deque[Entry] = deque()
        # entry id -> (payload, consumer, delivered at monotonic seconds)
        self._pending: OrderedDict[str, tuple[bytes, str, float]] = OrderedDict()
        self._dead: list[DeadLetter] = []
        self._ids = itertools.count(1)
        self.trimmed = 0

    def publish(self, payloads: bytes | Sequence[bytes]) -> None:
        items = [payloads] if isinstance(payloads, bytes | bytearray) else list(payloads)
        with self._cond:
            for p in items:
                self._new.append((f"{next(self._ids)}-0", bytes(p)))
            while len(self._new) > self._max:
                self._new.popleft()
                self.trimmed += 1
            self._cond.notify_all()

    def read(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        deadline = time.monotonic() + block_ms / 1000
        with self._cond:
            while not self._new:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            now = time.monotonic()
            out: list[Entry] = []
            while self._new and len(out) < count:
                eid, payload = self._new.popleft()
                self._pending[eid] = (payload, consumer, now)
                out.append((eid, payload))
            return out

    def ack(self, ids: Sequence[str]) -> None:
        with self._cond:
            for eid in ids:
                self._pending.pop(eid, None)

    def claim_stale(self, consumer: str, min_idle_ms: int, count: int) -> list[Entry]:
        now = time.monotonic()
        out: list[Entry] = []
        with self._cond:
            for eid, (payload, _, at) in list(self._pending.items()):
                if len(out) >= count:
                    break
                if (now - at) * 1000 >= min_idle_ms:
                    self._pending[eid] = (payload, consumer, now)
                    out.append((eid, payload))
        return out

    def deadletter(self, entry_id: str, payload: bytes, reason: str) -> None:
        with self._cond:
            self._dead.append(_dead_letter(entry_id, payload, reason))
            self._pending.pop(entry_id, None)

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        with self._cond:
            return self._dead[:count]

    def recent_dead_letters(self, count: int = 100) -> list[DeadLetter]:
        with self._cond:
            return self._dead[::-1][:count]

    @property
    def pending(self) -> int:
        """Entries delivered and not yet acknowledged."""
        with self._cond:
            return len(self._pending)


def _dead_letter(entry_id: str, payload: bytes, reason: str) -> DeadLetter:
    raw = bytes(payload) if isinstance(payload, bytes | bytearray | memoryview) else repr(payload).encode()
    return DeadLetter(entry_id, reason, raw[:DEADLETTER_KEEP_BYTES], len(raw), time.time())


# --------------------------------------------------------------------------------------------- Redis
@dataclass(frozen=True)
class RedisConfig:
    """How to talk to Redis. The URL carries host, port, database, AUTH (``redis://user:pass@host``) and TLS
    (``rediss://``)."""

    prefix: str = DEFAULT_PREFIX  # the names' prefix (see RedisKeys); engines and sidecars must share it
    maxlen: int = 1_000_000  # approximate MAXLEN of the windows stream: ~minutes of a large fleet's windows
    # Dead letters are for inspection, not for ever: the newest this many are kept (each up to MAX_ENCODED_BYTES;
    # hostile entries are usually small). Every one is counted per reason in the sidecar's metrics before it goes.
    deadletter_maxlen: int = 10_000
    socket_timeout_s: float = 2.0  # a stuck Redis must not hold an engine's flush thread for long
    connect_timeout_s: float = 1.0
    backoff_initial_s: float = 0.05  # first wait after a failure before trying Redis again
    backoff_max_s: float = 5.0  # cap of the exponential backoff

    @property
    def stream_cap_mb(self) -> float:
        """What a sidecar's streams hold at most once it has read what was sent: the dead letters it keeps (the
        windows stream is trimmed below what every consumer group acknowledged). Entries nobody has read yet are
        the writers' backlog, bounded only by ``maxlen`` on their XADD."""
        return self.deadletter_maxlen * (DEADLETTER_KEEP_BYTES + DEADLETTER_ENTRY_OVERHEAD_BYTES) / (1 << 20)

    def __post_init__(self) -> None:
        RedisKeys(self.prefix)  # raises ValueError for a prefix that is no word
        if self.maxlen < 1 or self.deadletter_maxlen < 1:
            raise ValueError("RedisConfig.maxlen and deadletter_maxlen must be >= 1")
        if self.connect_timeout_s <= 0 or self.socket_timeout_s <= 0:
            raise ValueError("RedisConfig timeouts must be positive")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("RedisConfig needs 0 < backoff_initial_s <= backoff_max_s")


class RedisStreamsTransport(Transport):
    """Redis Streams: ``{prefix}:windows`` with consumer group ``sidecar``, and ``{prefix}:deadletter``.

    After a failure the transport waits (exponential backoff, capped) before touching Redis again; calls in
    that time fail at once with :class:`TransportError`, so an engine's flush thread never queues up behind a
    dead server. redis-py reconnects on the next call after the wait.
    """

    def __init__(self, url: str, config: RedisConfig | None = None) -> None:
        self.config = config or RedisConfig()
        self._url_shown = redact_url(url)
        try:
            self._r = redis.Redis.from_url(
                url,
                socket_timeout=self.config.socket_timeout_s,
                socket_connect_timeout=self.config.connect_timeout_s,
                health_check_interval=30,
            )
        except (ValueError, RedisError) as e:
            raise TransportError(f"bad Redis URL {self._url_shown}: {e}") from e
        keys = RedisKeys(self.config.prefix)
        self.stream = keys.windows
        self.deadletter_stream = keys.deadletter
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._retry_at = 0.0
        self._group_ready = False

    # -- failure handling
    def _call(self, what: str, fn: Any) -> Any:
        now = time.monotonic()
        if now < self._retry_at:
            raise TransportError(
                f"Redis at {self._url_shown} failed recently; retrying in {self._retry_at - now:.2f}s ({what})"
            )
        try:
            out = fn()
        except (RedisError, OSError) as e:  # connection, timeout, AUTH and server errors alike
            with self._lock:
                self._backoff = min(self.config.backoff_max_s, max(self.config.backoff_initial_s, self._backoff * 2))
                self._retry_at = time.monotonic() + self._backoff
            raise TransportError(
                f"Redis at {self._url_shown} failed during {what}: {e}; check that it is running and reachable"
            ) from e
        if self._backoff:
            with self._lock:
                self._backoff, self._retry_at = 0.0, 0.0
        return out

    def _ensure_group(self) -> None:
        if self._group_ready:
            return

        def create() -> None:
            try:
                # From id 0: batches engines published before the first sidecar started are still consumed.
                self._r.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

        self._call("XGROUP CREATE", create)
        self._group_ready = True

    # -- engine side
    def publish(self, payloads: bytes | Sequence[bytes]) -> None:
        items = [payloads] if isinstance(payloads, bytes | bytearray) else list(payloads)
        if not items:
            return

        def run() -> None:
            pipe = self._r.pipeline(transaction=False)
            for p in items:
                pipe.xadd(self.stream, {PAYLOAD_FIELD: p}, maxlen=self.config.maxlen, approximate=True)
            pipe.execute()

        self._call("XADD", run)

    # -- sidecar side
    def read(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        self._ensure_group()
        # A blocking read must return before the socket timeout fires.
        block = max(1, min(block_ms, int(self.config.socket_timeout_s * 1000) // 2))

        def run() -> Any:
            try:
                return self._r.xreadgroup(GROUP, consumer, {self.stream: ">"}, count=count, block=block)
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                self._group_ready = False  # the stream was deleted under us; recreate and report nothing now
                return []

        resp = self._call("XREADGROUP", run)
        out: list[Entry] = []
        for _stream, entries in resp or []:
            out.extend(_entries(entries))
        return out

    def ack(self, ids: Sequence[str]) -> None:
        if ids:
            self._call("XACK", lambda: self._r.xack(self.stream, GROUP, *ids))

    def claim_stale(self, consumer: str, min_idle_ms: int, count: int) -> list[Entry]:
        self._ensure_group()
        out: list[Entry] = []
        start = "0-0"
        while len(out) < count:

            def run(s: str = start) -> Any:
                try:
                    return self._r.xautoclaim(
                        self.stream, GROUP, consumer, min_idle_time=min_idle_ms, start_id=s, count=count - len(out)
                    )
                except ResponseError as e:
                    if "NOGROUP" not in str(e):
                        raise
                    self._group_ready = False  # Redis restarted empty: recreate the group, nothing to claim
                    return None

            resp = self._call("XAUTOCLAIM", run)
            if resp is None:
                break
            nxt, entries = resp[0], resp[1]
            out.extend(_entries(entries))
            start = nxt.decode() if isinstance(nxt, bytes) else str(nxt)
            if start == "0-0":
                break
        return out

    def deadletter(self, entry_id: str, payload: bytes, reason: str) -> None:
        dl = _dead_letter(entry_id, payload, reason)

        def run() -> None:
            pipe = self._r.pipeline(transaction=True)  # MULTI: the entry is either moved and acked, or neither
            pipe.xadd(
                self.deadletter_stream,
                {PAYLOAD_FIELD: dl.payload, "reason": reason, "source_id": entry_id, "size": dl.size, "at": dl.at},
                maxlen=self.config.deadletter_maxlen,
                approximate=True,
            )
            pipe.xack(self.stream, GROUP, entry_id)
            pipe.execute()

        self._call("dead-letter", run)

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        resp = self._call("XRANGE", lambda: self._r.xrange(self.deadletter_stream, count=count))
        return [_read_dead_letter(fields) for _eid, fields in resp or []]

    def recent_dead_letters(self, count: int = 100) -> list[DeadLetter]:
        resp = self._call("XREVRANGE", lambda: self._r.xrevrange(self.deadletter_stream, count=count))
        return [_read_dead_letter(fields) for _eid, fields in resp or []]

    def trim_acknowledged(self) -> int:
        """``XTRIM MINID`` the windows stream below the oldest entry any consumer group still needs: the oldest
        pending (delivered, not acknowledged) entry, else the group's last-delivered id. Everything below was
        acknowledged, which a consumer does only after the store committed it, so nothing unstored is dropped.
        Without a group nothing is trimmed (entries wait for the first sidecar; MAXLEN still caps them)."""

        def run() -> int:
            try:
                groups = self._r.xinfo_groups(self.stream)
            except ResponseError:  # no stream yet
                return 0
            if not groups:
                return 0
            floor: tuple[int, int] | None = None
            for g in groups:
                name = g["name"]
                pending = self._r.xpending(self.stream, name)
                oldest = pending.get("min") if pending and pending.get("pending") else None
                need = _stream_id(oldest if oldest is not None else g["last-delivered-id"])
                if oldest is None:
                    need = (need[0], need[1] + 1)  # the last delivered entry is acknowledged too
                floor = need if floor is None else min(floor, need)
            if floor is None or floor == (0, 1):
                return 0
            return int(self._r.xtrim(self.stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))

        out: int = self._call("XTRIM", run)
        return out

    def stream_lengths(self) -> dict[str, int]:
        def run() -> list[Any]:
            pipe = self._r.pipeline(transaction=False)
            pipe.xlen(self.stream)
            pipe.xlen(self.deadletter_stream)
            pipe.xinfo_groups(self.stream)
            return list(pipe.execute(raise_on_error=False))

        windows, dead, groups = self._call("XLEN", run)
        # unread: entries the sidecars' group has not been delivered yet (Redis >= 7 reports the lag; None when it
        # cannot tell, e.g. after an XDEL, and then every entry held counts)
        lag = next((g.get("lag") for g in groups if g.get("name") in (GROUP, GROUP.encode())), None) \
            if isinstance(groups, list) else 0
        return {"windows": int(windows), "deadletter": int(dead), "unread": int(windows if lag is None else lag)}

    def ping(self) -> bool:
        """True when Redis answers (no backoff gate: an operator's explicit check)."""
        try:
            return bool(self._r.ping())
        except (RedisError, OSError):
            return False

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (for stream housekeeping in tests and tools)."""
        return self._r

    def close(self) -> None:
        self._r.close()


def _read_dead_letter(f: dict[bytes, bytes]) -> DeadLetter:
    """A dead-letter stream entry as written by :meth:`RedisStreamsTransport.deadletter`. Entries are written by
    sidecars only, yet read defensively: a field written by hand reads as empty or zero, never raises."""

    def number(name: bytes, kind: type[int] | type[float]) -> Any:
        try:
            return kind(f.get(name, b"0"))
        except ValueError:
            return kind(0)

    return DeadLetter(
        source_id=f.get(b"source_id", b"").decode(errors="replace"),
        reason=f.get(b"reason", b"").decode(errors="replace"),
        payload=f.get(PAYLOAD_FIELD.encode(), b""),
        size=number(b"size", int),
        at=number(b"at", float),
    )


def _stream_id(raw: Any) -> tuple[int, int]:
    """``b"1700000000000-3"`` -> ``(1700000000000, 3)``."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _entries(raw: Any) -> list[Entry]:
    out: list[Entry] = []
    for eid, fields in raw or []:
        sid = eid.decode() if isinstance(eid, bytes) else str(eid)
        # A deleted-but-pending entry comes back with no fields; it gets an empty payload and is dead-lettered.
        payload = (fields or {}).get(PAYLOAD_FIELD.encode(), b"")
        out.append((sid, payload))
    return out

