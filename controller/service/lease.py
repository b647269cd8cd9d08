"""The leader lease: which one of several sidecars decides and publishes the policy table.

Sidecars scale out their ingestion through the Redis consumer group, but one table must come from one learner:
two publishers would flip the engines' table between their views. So exactly one sidecar at a time holds the
lease at :attr:`telemetry.transport.RedisKeys.leader`:

- **acquire**: ``SET key token NX PX lease_ms`` (the token is random per :class:`Lease`, so a restarted process
  is a new contender, never the old holder);
- **renew**: every ``lease_ms / 3`` the holder extends the TTL only while the key still holds its token (a Lua
  compare-and-extend, atomic in Redis);
- **release**: on a clean stop the holder deletes the key only while it holds its token (compare-and-delete),
  so a peer takes over at once instead of after the TTL;
- **crash**: nothing renews, the key expires after at most ``lease_ms``, and a peer's next attempt takes it.

A holder counts itself leader only until its *local* deadline: the monotonic time at which its last successful
acquire or renew was *sent*, plus ``lease_ms`` less a clock-drift margin. Redis starts the TTL after it received
the command, so the local deadline passes before the key can expire: a holder cut off from Redis (or paused)
steps down before a peer can take the lease. The sidecar checks :meth:`Lease.held` right before it stores a new
table version, and the store's unique version numbers fence what slips through (a version a peer already took
is refused; the loser steps down instead of retrying).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import RedisError

from telemetry.errors import TransportError
from telemetry.urls import redact_url

MIN_LEASE_MS = 100  # below this a renew's round trip is a visible share of the lease
RENEWS_PER_LEASE = 3  # renew every lease/3: two renewals may fail before the lease lapses
CLOCK_DRIFT = 0.01  # a holder trusts its lease 1% less than lease_ms (as Redlock), for clock rate differences
CLOCK_DRIFT_MS = 2  # ... and 2 ms less again
MAX_SOCKET_TIMEOUT_S = 2.0  # a renew stuck longer than this is a failed renew
EXPIRY_SLACK_S = 0.005  # a contender tries again this long after the holder's TTL says the lease runs out

# KEYS[1] = lease key; ARGV[1] = token, ARGV[2] = lease ms. Extends the TTL only while the key holds the token.
_RENEW_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# KEYS[1] = lease key; ARGV[1] = token. Deletes the key only while it holds the token.
_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True)
class LeaseConfig:
    """How long a leader's lease lasts; the holder renews it every ``lease_ms / 3``."""

    # A crashed leader's peers take over after at most this long (plus one attempt interval); shorter leases
    # fail over faster but step a leader down on a shorter Redis hiccup.
    lease_ms: int = 5000

    def __post_init__(self) -> None:
        if isinstance(self.lease_ms, bool) or not isinstance(self.lease_ms, int) or self.lease_ms < MIN_LEASE_MS:
            raise ValueError(f"LeaseConfig.lease_ms must be an int >= {MIN_LEASE_MS}, got {self.lease_ms!r}")

    @property
    def renew_every_s(self) -> float:
        """Seconds between renewals by the holder (and between acquire attempts by the others)."""
        return self.lease_ms / RENEWS_PER_LEASE / 1000

    @property
    def trusted_s(self) -> float:
        """Seconds after sending a successful acquire or renew during which the holder counts itself leader."""
        return (self.lease_ms * (1 - CLOCK_DRIFT) - CLOCK_DRIFT_MS) / 1000


@dataclass(frozen=True)
class LeaseStats:
    """What the lease did so far (a snapshot, for ``/health`` and the metrics)."""

    leader: bool  # held now, by the local deadline
    acquisitions: int  # times this contender became leader
    losses: int  # times it stopped being leader without releasing (lapsed, taken over, Redis unreachable)
    failures: int  # Redis calls that failed
    last_error: str | None


class Lease:
    """One contender for the leader lease at ``key``.

    Args:
        url: Redis URL (the same server as the windows stream).
        key: the lease's key (:attr:`telemetry.transport.RedisKeys.leader`).
        config: lease length.
        token: this contender's value in the key (default: random; a test may name one).

    Call :meth:`tick` often (every loop step): it renews or tries to acquire when one is due and returns whether
    this contender leads now. Redis errors never leave :meth:`tick`; they are counted and the holder steps down
    once its local deadline passes.
    """

    def __init__(self, url: str, key: str, config: LeaseConfig | None = None, *, token: str | None = None) -> None:
        self.config = config or LeaseConfig()
        self.key = key
        self.token = token or secrets.token_hex(16)
        self._shown = redact_url(url)
        timeout = min(MAX_SOCKET_TIMEOUT_S, self.config.renew_every_s)
        try:
            self._r = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        except ValueError as e:
            raise TransportError(f"bad Redis URL {self._shown}: {e}") from e
        self._renew = self._r.register_script(_RENEW_SCRIPT)
        self._release = self._r.register_script(_RELEASE_SCRIPT)
        self._holder = False  # the last acquire / renew succeeded (see _valid_until for how long it counts)
        self._valid_until = 0.0  # monotonic deadline of the lease as this contender may trust it
        self._next_attempt = 0.0
        self._acquisitions = self._losses = self._failures = 0
        self._last_error: str | None = None
        self._lock = threading.RLock()  # the loop thread ticks; HTTP threads ask held() before a publish

    # ------------------------------------------------------------------------------------- operations
    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (RedisError, OSError) as e:
            raise TransportError(f"lease {what} on {self.key} at Redis {self._shown} failed: {e}") from e

    def try_acquire(self) -> bool:
        """``SET key token NX PX lease_ms``; True when this contender holds the lease now (already held: renewed).

        Raises:
            TransportError: Redis could not be reached.
        """
        with self._lock:
            if self._holder:
                return self.renew()
            sent = time.monotonic()

            def run() -> Any:
                pipe = self._r.pipeline(transaction=False)
                pipe.set(self.key, self.token, nx=True, px=self.config.lease_ms)
                pipe.pttl(self.key)  # when the holder's lease runs out: the next attempt is timed to it
                return pipe.execute()

            got, pttl = self._call("acquire", run)
            if got:
                self._became_leader(sent)
            elif isinstance(pttl, int) and pttl >= 0:
                self._next_attempt = min(self._next_attempt, sent + pttl / 1000 + EXPIRY_SLACK_S)
            return bool(got)

    def renew(self) -> bool:
        """Extend the lease while the key still holds this contender's token; False (and a loss) otherwise.

        Raises:
            TransportError: Redis could not be reached (the lease stays trusted until its local deadline).
        """
        with self._lock:
            sent = time.monotonic()
            ok = bool(self._call("renew",
                                 lambda: self._renew(keys=[self.key], args=[self.token, self.config.lease_ms])))
            if not ok:
                self._lost()
            elif not self._holder or sent >= self._valid_until:
                self._became_leader(sent)  # the key still held our token although our deadline had passed
            else:
                self._valid_until = sent + self.config.trusted_s
            return ok

    def release(self) -> bool:
        """Give the lease up at once (a clean stop): delete the key only while it holds this token.

        Returns:
            Whether the key held this contender's token. Never raises: a release Redis did not see lapses by TTL.
        """
        with self._lock:
            self._holder, self._valid_until = False, 0.0
            try:
                return bool(self._call("release", lambda: self._release(keys=[self.key], args=[self.token])))
            except TransportError as e:
                self._failed(e)
                return False

    def holder(self) -> str | None:
        """The token in the key now (None: nobody leads). Raises :class:`TransportError`."""
        raw = self._call("read", lambda: self._r.get(self.key))
        return raw.decode(errors="replace") if isinstance(raw, bytes) else None

    def held(self) -> bool:
        """Whether this contender leads now, by its local deadline (no Redis call; checked before a publish)."""
        with self._lock:
            if self._holder and time.monotonic() >= self._valid_until:
                self._lost()  # lapsed without a successful renew: a peer may hold it from now on
            return self._holder

    def tick(self) -> bool:
        """Renew (holder) or try to acquire (others) when due; returns :meth:`held`. Never raises."""
        with self._lock:
            now = time.monotonic()
            if now >= self._next_attempt:
                self._next_attempt = now + self.config.renew_every_s  # try_acquire may bring it forward
                try:
                    self.try_acquire()
                except TransportError as e:
                    self._failed(e)
            return self.held()

    def stats(self) -> LeaseStats:
        return LeaseStats(leader=self.held(), acquisitions=self._acquisitions, losses=self._losses,
                          failures=self._failures, last_error=self._last_error)

    def close(self) -> None:
        """Release the lease (when held) and the connection."""
        if self._holder:
            self.release()
        self._r.close()

    # ---------------------------------------------------------------------------------------- helpers
    def _became_leader(self, sent: float) -> None:
        self._holder = True
        self._valid_until = sent + self.config.trusted_s
        self._acquisitions += 1

    def _lost(self) -> None:
        if self._holder:
            self._losses += 1
        self._holder, self._valid_until = False, 0.0

    def _failed(self, e: TransportError) -> None:
        self._failures += 1
        self._last_error = str(e)
