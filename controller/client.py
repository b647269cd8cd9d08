"""What an engine embeds: the policy lookup (a local copy of the table, microseconds) and the telemetry hook.

:class:`PolicyClient` answers ``decide(request_type, batch_size, context_len) -> k`` from a dictionary held in
the engine process; no network on the hot path. A background thread keeps that dictionary current:

- it subscribes to ``{prefix}:policy-updates`` (the sidecar PUBLISHes the new version there) and, on a nudge
  carrying a version newer than its own, GETs ``{prefix}:policy`` (the whole table, written atomically);
- it also re-reads ``{prefix}:policy`` every ``refresh_s`` in case a nudge was missed (pub/sub is fire-and-forget);
- a table that fails validation (wrong schema, k outside ``[0, k_max]``, a version older than the one it has) is
  rejected, counted by reason, and the last good table stays in force;
- with no sidecar and no Redis at all it answers ``default_k`` (**fail-static**) and says so in :meth:`status`.

In-process (the embedded demo) the sidecar hands tables to :meth:`PolicyClient.apply` directly.

This module must not import torch: third-party engines embed it as is.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from functools import partial

import redis
from redis.exceptions import RedisError

from telemetry.emitter import Emitter, EmitterConfig
from telemetry.policy_table import MAX_TABLE_BYTES, RowLookup, check_entry_count, lookup, policy_table_from_json
from telemetry.records import (
    DEFAULT_BUCKETS,
    MAX_DRAFT_LEN,
    BucketConfig,
    PolicyTable,
    RecordError,
    RoundRecord,
)
from telemetry.transport import DEFAULT_PREFIX, RedisConfig, RedisKeys, RedisStreamsTransport, Transport
from telemetry.wire import check_label

MIN_REFRESH_S = 0.05  # below this the timer refresh would hammer Redis for nothing
RECONNECT_MAX_S = 5.0  # cap of the wait between attempts to reach an absent Redis
SOCKET_TIMEOUT_S = 2.0  # a stuck Redis must not hold the refresh thread for long


@dataclass(frozen=True)
class ClientConfig:
    """One engine's policy client."""

    target_version: str  # the bucket's versions: a model update changes them (see PolicyClient.set_versions)
    draft_version: str
    default_k: int = 0  # answer before any table arrives and for buckets the table does not cover (fail-static)
    k_max: int = 8  # the largest k this engine can run; a table asking for more is rejected whole
    redis_url: str | None = None  # None: in-process only (tables arrive through apply())
    prefix: str = DEFAULT_PREFIX  # must match the sidecar's
    refresh_s: float = 1.0  # timer refresh, the safety net under the pub/sub nudge
    # When the policy key has held only tables older than ours for this long, the newest is followed back (see
    # PolicyClient.refresh): the sidecar put them there over a table its store never made (a forged version).
    rollback_after_s: float = 10.0
    buckets: BucketConfig = DEFAULT_BUCKETS  # must match the sidecar's

    def __post_init__(self) -> None:
        for name in ("target_version", "draft_version"):
            try:
                check_label(getattr(self, name), f"ClientConfig.{name}")  # part of every bucket key
            except RecordError as e:
                raise ValueError(e.detail) from None
        if not 0 <= self.k_max <= MAX_DRAFT_LEN:
            raise ValueError(f"ClientConfig.k_max must be in [0, {MAX_DRAFT_LEN}], got {self.k_max}")
        if not 0 <= self.default_k <= self.k_max:
            raise ValueError(f"ClientConfig.default_k must be in [0, k_max={self.k_max}], got {self.default_k}")
        if self.refresh_s < MIN_REFRESH_S:
            raise ValueError(f"ClientConfig.refresh_s must be >= {MIN_REFRESH_S}, got {self.refresh_s}")
        if not self.rollback_after_s >= self.refresh_s:
            raise ValueError(f"ClientConfig.rollback_after_s must be >= refresh_s ({self.refresh_s}), got "
                             f"{self.rollback_after_s}")
        RedisKeys(self.prefix)  # raises ValueError for a prefix that is no word


@dataclass(frozen=True)
class ClientStatus:
    """What the client runs on, for operators (``fail_static`` True means: no table yet, ``default_k`` in force)."""

    fail_static: bool
    mode: str  # "fail-static", "following" (Redis) or "embedded" (apply())
    version: int | None  # version of the table in force
    connected: bool  # Redis answered on the last attempt (always False in embedded mode)
    tables_applied: int
    rejected: dict[str, int]  # tables refused, by reason
    rollbacks: int  # times the key held only older tables for rollback_after_s and the client followed them back
    last_error: str | None  # the latest rejection or connection error, verbatim
    last_update_at: float | None  # wall-clock seconds when the table in force was applied
    detail: str  # one sentence saying what is happening
    versions: tuple[str, str] = field(default=("", ""))  # (target, draft) the lookups are made for


def validate_table(table: PolicyTable, k_max: int, current: int | None) -> None:
    """Refuse a table this engine must not run.

    Raises:
        RecordError: ``table_too_large`` past ``MAX_TABLE_ENTRIES``; ``k_above_engine_max`` when it asks for
            more than ``k_max``; ``stale_version`` when its version is older than ``current``.
    """
    check_entry_count(table)  # the JSON path checks bytes too, before parsing
    worst = max([table.default_k, *table.entries.values()])
    if worst > k_max:
        raise RecordError("k_above_engine_max", f"table v{table.version} asks for k={worst} > engine k_max={k_max}")
    if current is not None and table.version < current:
        raise RecordError("stale_version", f"table v{table.version} is older than v{current} in force")


class PolicyClient:
    """The engine's local copy of the policy table.

    Args:
        config: client settings.
        start: start the Redis refresh thread now (only with ``config.redis_url``).
    """

    def __init__(self, config: ClientConfig, start: bool = True) -> None:
        self._cfg = config
        self._keys = RedisKeys(config.prefix)
        self._table: PolicyTable | None = None
        # The one row -> k lookup, replaced whole on a new table or new versions (its cache belongs to them).
        self._lookup = self._new_lookup(None, config.target_version, config.draft_version)
        self._lock = threading.Lock()  # serialises table swaps (lookups never take it)
        self._applied = 0
        self._rejected: dict[str, int] = {}
        self._last_error: str | None = None
        self._last_update: float | None = None
        self._connected = False
        self._last_raw: bytes | None = None  # the value of {prefix}:policy last processed
        self._older_since: float | None = None  # since when the key has held only tables older than ours
        self._rollbacks = 0
        self._oversize_len: int | None = None  # length of the oversized value last refused unread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._redis: redis.Redis | None = None
        if config.redis_url is not None:
            try:
                self._redis = redis.Redis.from_url(config.redis_url, socket_timeout=SOCKET_TIMEOUT_S,
                                                   socket_connect_timeout=SOCKET_TIMEOUT_S / 2)
            except ValueError as e:
                raise ValueError(f"ClientConfig.redis_url is not a Redis URL: {e}") from e
            if start:
                self._thread = threading.Thread(target=self._follow, name="spectune-policy-client", daemon=True)
                self._thread.start()

    @property
    def config(self) -> ClientConfig:
        return self._cfg

    # ------------------------------------------------------------------------------------------ hot path
    def decide(self, request_type: str, batch_size: int, context_len: int) -> int:
        """k for a row (0 = speculation off): a dictionary lookup, computed once per bucket and table."""
        return self._lookup(request_type, batch_size, context_len)  # one read: a swap replaces the whole lookup

    def _new_lookup(self, table: PolicyTable | None, target_version: str, draft_version: str) -> RowLookup:
        default_k = self._cfg.default_k
        resolve = partial(lookup, table) if table is not None else lambda _bucket: default_k  # fail-static
        return RowLookup(resolve, target_version, draft_version, self._cfg.buckets)

    # ---------------------------------------------------------------------------------------- updates
    def set_versions(self, target_version: str, draft_version: str) -> None:
        """The engine swapped a model: look buckets up under the new versions from now on."""
        with self._lock:
            self._lookup = self._new_lookup(self._table, target_version, draft_version)

    def apply(self, table: PolicyTable, *, allow_older: bool = False) -> bool:
        """Install ``table`` if it is valid and not older than the one in force (``allow_older``: older too).

        Returns:
            True when installed (or already in force); False when rejected (counted, the last good one stays).
        """
        return self._install(table, allow_older) is None

    def apply_json(self, text: str | bytes, *, allow_older: bool = False) -> bool:
        """Parse, validate and install a table as it travels (JSON with its version)."""
        return self._install_json(text, allow_older) is None

    def _install(self, table: PolicyTable, allow_older: bool) -> str | None:
        """:meth:`apply`; returns the reason it was rejected, None when installed (or already in force)."""
        with self._lock:
            try:
                current = self._table.version if self._table and not allow_older else None
                validate_table(table, self._cfg.k_max, current)
            except RecordError as e:
                self._reject(e.reason, str(e))
                return e.reason
            if self._table is not None and table.version == self._table.version:
                return None
            self._table = table
            self._lookup = self._new_lookup(table, *self._lookup.versions)
            self._applied += 1
            self._last_update = time.time()
            return None

    def _install_json(self, text: str | bytes, allow_older: bool) -> str | None:
        """:meth:`apply_json`; returns the reason it was rejected, None when installed."""
        try:
            table = policy_table_from_json(text)
        except RecordError as e:
            with self._lock:
                self._reject(e.reason, str(e))
            return e.reason
        except Exception as e:  # a parser gap must not kill the refresh thread: reject, count, keep the last table
            with self._lock:
                self._reject("malformed", f"policy table rejected: {type(e).__name__}: {e}")
            return "malformed"
        return self._install(table, allow_older)

    def _reject(self, reason: str, detail: str) -> None:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        self._last_error = detail

    @property
    def version(self) -> int | None:
        t = self._table
        return t.version if t is not None else None

    @property
    def table(self) -> PolicyTable | None:
        return self._table

    # ------------------------------------------------------------------------------------- Redis thread
    def refresh(self) -> bool:
        """Read ``{prefix}:policy`` once and apply it. Returns False when Redis could not be read."""
        if self._redis is None:
            return False
        key = self._keys.policy
        try:
            size = int(self._redis.strlen(key))  # type: ignore[arg-type]
            if size > MAX_TABLE_BYTES:  # refused unread: fetching it is the cost the cap exists to avoid
                self._connected = True
                if size != self._oversize_len:  # count it once, not once per refresh
                    self._oversize_len = size
                    with self._lock:
                        self._reject("table_too_large", f"policy table of {size} bytes > cap {MAX_TABLE_BYTES}")
                return True
            self._oversize_len = None
            raw = self._redis.get(key)
        except (RedisError, OSError) as e:
            self._connected = False
            self._last_error = f"Redis unreachable: {e}"
            return False
        self._connected = True
        if raw is not None and raw != self._last_raw:  # the same bytes again: already applied or rejected once
            self._last_raw = raw  # type: ignore[assignment]
            older = self._install_json(raw, allow_older=False) == "stale_version"  # type: ignore[arg-type]
            if not older:
                self._older_since = None
            elif self._older_since is None:  # the sidecar's newer tables stay older than ours: one stretch
                self._older_since = time.monotonic()
        if raw is not None and self._older_since is not None and (
                time.monotonic() - self._older_since >= self._cfg.rollback_after_s):
            # Versions only go up while the sidecar publishes (its write is compare-and-set), so tables older than
            # ours that keep coming are the sidecar's own store-backed ones, put back over one it never made (a
            # forged or foreign version ahead of its store). An older table pushed by hand is soon replaced by the
            # sidecar's, which ours is not newer than, and ends the stretch.
            self._older_since = None
            was = self.version
            if self.apply_json(raw, allow_older=True):  # type: ignore[arg-type]
                self._rollbacks += 1
                self._last_error = (f"followed the policy key back from v{was} to v{self.version}: it held only "
                                    f"older tables for {self._cfg.rollback_after_s:g} s (the sidecar replaced a "
                                    "table its store never made)")
        return True

    def _follow(self) -> None:
        """Subscribe to the nudge channel and refresh on every newer version, or every ``refresh_s``."""
        assert self._redis is not None
        wait = MIN_REFRESH_S
        while not self._stop.is_set():
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._keys.policy_updates)
                self.refresh()  # after subscribing: a version published meanwhile is either read now or nudged
                wait = MIN_REFRESH_S
                next_timer = time.monotonic() + self._cfg.refresh_s
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=min(self._cfg.refresh_s, 0.5))
                    nudged = msg is not None and msg.get("type") == "message" and self._newer(msg.get("data"))
                    if nudged or time.monotonic() >= next_timer:
                        self.refresh()
                        next_timer = time.monotonic() + self._cfg.refresh_s
            except (RedisError, OSError) as e:
                self._connected = False
                self._last_error = f"Redis unreachable: {e}"
                self._stop.wait(wait)
                wait = min(RECONNECT_MAX_S, wait * 2)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    pubsub.close()

    def _newer(self, data: object) -> bool:
        try:
            v = int(data)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return True  # an unreadable nudge still means "something changed": read the table and validate it
        cur = self.version
        return cur is None or v > cur

    def close(self) -> None:
        """Stop the refresh thread and release the connection (the table in force stays usable)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(SOCKET_TIMEOUT_S * 2)
        if self._redis is not None:
            self._redis.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- status
    def status(self) -> ClientStatus:
        t = self._table
        embedded = self._cfg.redis_url is None
        if t is None:
            mode = "fail-static"
            where = "no sidecar configured" if embedded else (
                "Redis unreachable" if not self._connected else "no policy published yet")
            detail = f"fail-static: {where}; every decision is default_k={self._cfg.default_k}"
        else:
            mode = "embedded" if embedded else "following"
            detail = f"policy v{t.version} in force ({len(t.entries)} buckets, default_k={t.default_k})"
            if not embedded and not self._connected:
                detail += "; Redis unreachable, keeping the last good table"
        return ClientStatus(
            fail_static=t is None, mode=mode, version=t.version if t else None, connected=self._connected,
            tables_applied=self._applied, rejected=dict(self._rejected), rollbacks=self._rollbacks,
            last_error=self._last_error,
            last_update_at=self._last_update, detail=detail, versions=self._lookup.versions,
        )


class EngineHooks:
    """The two calls an engine makes: ``decide`` before a round, ``record`` after it.

    Build them with :func:`build_engine_hooks`.

    Args:
        client: the policy client (decisions).
        emitter: the telemetry emitter (round records -> windows); None to decide without reporting.
        transport: the emitter's transport when the hooks own it (closed after the emitter's last flush); None
            when it belongs to someone else (an embedded sidecar reading the same in-process queue).
    """

    def __init__(self, client: PolicyClient, emitter: Emitter | None, transport: Transport | None = None) -> None:
        self.client = client
        self.emitter = emitter
        self.decide = client.decide  # bound once: the engine's hot path calls it per row per round
        self._transport = transport
        self._versions = client.status().versions

    def set_versions(self, target_version: str, draft_version: str) -> None:
        """The engine swapped a model: decide under the new versions from its next round on."""
        self._versions = (target_version, draft_version)
        self.client.set_versions(target_version, draft_version)

    def record(self, round_: RoundRecord) -> None:
        """Ship a round; a round under new model versions switches the lookups to them."""
        if (round_.target_version, round_.draft_version) != self._versions:
            self.set_versions(round_.target_version, round_.draft_version)
        if self.emitter is not None:
            self.emitter.record(round_)

    def close(self) -> None:
        """Flush telemetry, release an owned transport, then stop following the policy."""
        if self.emitter is not None:
            self.emitter.close()
        if self._transport is not None:
            self._transport.close()
        self.client.close()


def build_engine_hooks(client_config: ClientConfig, emitter_config: EmitterConfig,
                       transport: Transport | None = None) -> EngineHooks:
    """What an engine embeds, wired in one place: the policy client, the telemetry emitter and its transport.

    Args:
        client_config: the policy client; with ``redis_url`` None, tables arrive through ``hooks.client.apply``.
        emitter_config: the emitter (engine id, window length).
        transport: where windows go. None: Redis Streams at ``client_config.redis_url`` under the same prefix,
            owned and closed by the hooks. Given: shared with its owner (the embedded sidecar's in-process queue)
            and left open.

    Raises:
        ValueError: neither a transport nor ``client_config.redis_url`` to build one from.
        TransportError: Redis cannot be reached.
    """
    owned: Transport | None = None
    if transport is None:
        if client_config.redis_url is None:
            raise ValueError("build_engine_hooks needs a transport or ClientConfig.redis_url")
        transport = owned = RedisStreamsTransport(client_config.redis_url, RedisConfig(prefix=client_config.prefix))
    return EngineHooks(PolicyClient(client_config), Emitter(transport, emitter_config), owned)
