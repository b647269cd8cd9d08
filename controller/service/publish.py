"""Where the sidecar's policy tables go: Redis (production) or a callback (the embedded demo and tests).

Redis: the whole table JSON (with its version) is one value at ``{prefix}:policy``; the version is PUBLISHed on
``{prefix}:policy-updates``. Both happen in one Lua script, so they are atomic together, and the script writes
only when the new version is higher than the stored one: two sidecars sharing the consumer group can never move
the engines' table backwards.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import RedisError, ResponseError

from telemetry.errors import TransportError
from telemetry.policy_table import policy_table_from_json, table_to_json
from telemetry.records import PolicyTable, RecordError
from telemetry.transport import DEFAULT_PREFIX, RedisKeys
from telemetry.urls import redact_url

# Fencing (scale-out): with KEYS[3] = the leader lease's key and ARGV[3] = this sidecar's lease token, nothing is
# written unless the lease key holds that token at the moment of writing (-1), in the same atomic script: a leader
# paused between its lease check and its publish cannot overwrite its successor's table.
_FENCE = """
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[3] then
  return -1
end
"""
# KEYS[1] = table key, KEYS[2] = channel, KEYS[3] = lease key (or the table key, unused); ARGV[1] = table JSON,
# ARGV[2] = its version, ARGV[3] = lease token ('' without a lease).
# Returns 1 when written and published, 0 when the stored version is already >= ARGV[2], -1 when fenced.
_CAS_SCRIPT = _FENCE + """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'string' and kind ~= 'none' then
  redis.call('DEL', KEYS[1])  -- a hash, list, ... is no table of ours: replaced like junk (GET would refuse it)
end
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, t = pcall(cjson.decode, cur)
  if ok and type(t) == 'table' and tonumber(t['version']) and tonumber(t['version']) >= tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[2], ARGV[2])
return 1
"""
# The same keys and arguments; writes whatever is there (not a table of ours): 1, or -1 when fenced.
_FORCE_SCRIPT = _FENCE + """
redis.call('SET', KEYS[1], ARGV[1])  -- SET replaces a value of any type
redis.call('PUBLISH', KEYS[2], ARGV[2])
return 1
"""
# KEYS[1] = table key. Returns the stored table's version as a string, or false when absent or not a table
# (decoded inside Redis: the sidecar checks this every tick without fetching the whole table).
_VERSION_SCRIPT = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then return false end
local cur = redis.call('GET', KEYS[1])
if not cur then return false end
local ok, t = pcall(cjson.decode, cur)
if ok and type(t) == 'table' and tonumber(t['version']) then return string.format('%.0f', t['version']) end
return false
"""
SOCKET_TIMEOUT_S = 2.0


class FencedError(TransportError):
    """The leader lease named in :meth:`RedisPublisher.fence` is not this sidecar's any more: nothing was written."""


class Publisher(ABC):
    """Delivers policy tables to the engines."""

    @abstractmethod
    def publish(self, table: PolicyTable, force: bool = False) -> bool:
        """Deliver ``table``. Returns False when a table of the same or a newer version is already there.

        ``force`` overwrites whatever is there (used when what is there is not a valid table at all).

        Raises:
            TransportError: the table could not be delivered (retry later).
        """

    @abstractmethod
    def current(self) -> PolicyTable | None:
        """The table engines see now (None when there is none, or it cannot be read as a table)."""

    def current_version(self) -> int | None:
        """The version of the table engines see now (None: none, or not a table); cheaper than :meth:`current`.

        Raises:
            TransportError: the publisher cannot be reached.
        """
        t = self.current()
        return t.version if t is not None else None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class CallbackPublisher(Publisher):
    """Hands each table to ``callback`` in-process (e.g. ``PolicyClient.apply``); keeps the newest."""

    def __init__(self, callback: Callable[[PolicyTable], object] | None = None) -> None:
        self._callbacks: list[Callable[[PolicyTable], object]] = [callback] if callback else []
        self._current: PolicyTable | None = None
        self._lock = threading.Lock()

    def subscribe(self, callback: Callable[[PolicyTable], object]) -> None:
        """Add a receiver (another embedded engine); it gets the current table at once."""
        with self._lock:
            self._callbacks.append(callback)
            cur = self._current
        if cur is not None:
            callback(cur)

    def publish(self, table: PolicyTable, force: bool = False) -> bool:
        with self._lock:
            if not force and self._current is not None and self._current.version >= table.version:
                return False
            self._current = table
            callbacks = list(self._callbacks)
        for cb in callbacks:
            cb(table)
        return True

    def current(self) -> PolicyTable | None:
        return self._current


class RedisPublisher(Publisher):
    """Writes ``{prefix}:policy`` and PUBLISHes on ``{prefix}:policy-updates``, atomically, version-monotonic."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX) -> None:
        self._shown = redact_url(url)
        try:
            self._r = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S,
                                           socket_connect_timeout=SOCKET_TIMEOUT_S / 2)
        except ValueError as e:
            raise TransportError(f"bad Redis URL {self._shown}: {e}") from e
        keys = RedisKeys(prefix)
        self.key, self.channel = keys.policy, keys.policy_updates
        self._script = self._r.register_script(_CAS_SCRIPT)
        self._force_script = self._r.register_script(_FORCE_SCRIPT)
        self._version_script = self._r.register_script(_VERSION_SCRIPT)
        self._fence: tuple[str, str] | None = None

    def fence(self, lease_key: str, token: str) -> None:
        """Write only while ``lease_key`` holds ``token`` (this sidecar's leader lease), checked inside the write."""
        self._fence = (lease_key, token)

    def publish(self, table: PolicyTable, force: bool = False) -> bool:
        lease_key, token = self._fence or (self.key, "")
        script = self._force_script if force else self._script
        try:
            done = int(script(keys=[self.key, self.channel, lease_key], args=[table_to_json(table), table.version,
                                                                             token]))
        except (RedisError, OSError) as e:
            raise TransportError(
                f"publishing policy v{table.version} to Redis at {self._shown} failed: {e}; "
                "check that Redis is running; the sidecar retries on its next tick"
            ) from e
        if done < 0:
            raise FencedError(f"policy v{table.version} not published: the leader lease {lease_key} is not this "
                              "sidecar's any more (another sidecar leads)")
        return done == 1

    def _read(self, read: Callable[[], Any]) -> Any:
        """One read of the policy key, Redis errors translated; the raw value, None when the key is absent."""
        try:
            return read()
        except ResponseError as e:
            if str(e).startswith("WRONGTYPE"):
                return None  # a hash, list, ... at the key: no table of ours (the next publish replaces it)
            raise TransportError(f"reading {self.key} from Redis at {self._shown} failed: {e}") from e
        except (RedisError, OSError) as e:
            raise TransportError(f"reading {self.key} from Redis at {self._shown} failed: {e}") from e

    def current(self) -> PolicyTable | None:
        raw = self._read(lambda: self._r.get(self.key))
        if raw is None:
            return None
        try:
            return policy_table_from_json(raw)
        except RecordError:
            return None  # garbage there: our next publish overwrites it

    def current_version(self) -> int | None:
        raw = self._read(lambda: self._version_script(keys=[self.key]))
        if raw is None:
            return None
        try:
            return int(raw)
        except (TypeError, ValueError):
            return None  # not an integer (inf, nan): not a table of ours; treated as junk

    def close(self) -> None:
        self._r.close()
