"""The engine-side emitter: record rounds cheaply, aggregate and ship windows on a background thread.

The engine calls :meth:`Emitter.record` once per round. That call only appends to a list under a lock (well
under a microsecond of work), so it never slows the decoding loop. Every ``interval_s`` (or sooner, when a
window is full) a background thread swaps the list out, aggregates it (:func:`telemetry.aggregate.aggregate`),
encodes one :class:`~telemetry.records.WindowBatch` and publishes everything buffered.

When the transport is down, encoded windows wait in a bounded buffer; past ``max_buffered_windows`` the oldest
are dropped, counted, and the count travels in ``dropped_before`` of the next batch built, so the loss is
reported downstream, never silent (``sum(dropped_before)`` over delivered batches equals the windows lost).

Sequence numbers are per engine id and strictly increasing; they start at the wall-clock microsecond, so an
engine that restarts under the same id continues above its previous numbers and idempotent ingestion on
``(engine_id, seq)`` never mistakes a new batch for a redelivered one.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from telemetry.aggregate import aggregate
from telemetry.errors import TransportError
from telemetry.records import (
    DEFAULT_BUCKETS,
    BucketConfig,
    RecordError,
    RoundRecord,
    WindowBatch,
)
from telemetry.transport import Transport
from telemetry.wire import ENCODINGS, Encoding, check_label, check_round, encode_batch

MIN_INTERVAL_S = 0.001  # below this the flush thread would spin
CLOSE_JOIN_S = 5.0  # how long close() waits for the flush thread's last send


@dataclass(frozen=True)
class EmitterConfig:
    """Emitter settings (one engine process, one emitter)."""

    engine_id: str  # unique per engine process or replica; part of the idempotency key (engine_id, seq)
    interval_s: float = 0.25  # window length: short enough for live learning, long enough to aggregate
    max_rounds_per_window: int = 4096  # flush early past this many rounds, so a window stays small on the wire
    max_pending_rounds: int = 1 << 16  # hard cap on rounds waiting for aggregation; beyond it rounds are dropped
    max_buffered_windows: int = 240  # windows kept while the transport is down (~1 minute at 250 ms)
    sample_rate: float = 0.0  # fraction of raw rounds shipped for offline replay (0 = none)
    max_sampled_per_window: int = 64  # keeps sampled rounds from blowing the payload size cap
    seed: int = 0  # the sampler's own RNG
    buckets: BucketConfig = DEFAULT_BUCKETS  # must match the sidecar's
    encoding: Encoding = "json"  # "json" or "msgpack"

    def __post_init__(self) -> None:
        try:
            check_label(self.engine_id, "EmitterConfig.engine_id")  # it travels: the wire's label rule
        except RecordError as e:
            raise ValueError(e.detail) from None
        if self.interval_s < MIN_INTERVAL_S:
            raise ValueError(f"EmitterConfig.interval_s must be >= {MIN_INTERVAL_S}, got {self.interval_s}")
        for name in ("max_rounds_per_window", "max_pending_rounds", "max_buffered_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"EmitterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_sampled_per_window < 0:
            raise ValueError("EmitterConfig.max_sampled_per_window must be >= 0")
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"EmitterConfig.sample_rate must be in [0, 1], got {self.sample_rate}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"EmitterConfig.encoding must be one of {ENCODINGS}, got {self.encoding!r}")


@dataclass(frozen=True)
class EmitterStats:
    """What the emitter did so far (a snapshot)."""

    rounds_recorded: int  # rounds handed to record()
    rounds_dropped: int  # rounds dropped because aggregation fell behind (pending cap) or after close()
    rounds_rejected: dict[str, int]  # rounds left out of aggregates because they failed validation, by reason
    windows_built: int
    windows_sent: int
    windows_dropped: int  # windows dropped from the buffer while the transport was down
    windows_unencodable: int  # windows that could not be encoded even without sampled rounds
    publish_failures: int  # failed publish attempts
    buffered: int  # windows waiting to be sent now
    last_error: str | None


@dataclass
class _Outgoing:
    payload: bytes
    dropped_before: int


class Emitter:
    """Aggregates an engine's rounds into windows and ships them through a :class:`Transport`.

    Args:
        transport: where windows go; the caller owns it (the emitter never closes it).
        config: the settings.
        start: start the background flush thread now (tests may drive :meth:`flush` by hand instead).
    """

    def __init__(self, transport: Transport, config: EmitterConfig, start: bool = True) -> None:
        self._transport = transport
        self._cfg = config
        self._lock = threading.Lock()  # guards _pending and _rounds_* (the hot path)
        self._pending: list[RoundRecord] = []
        self._rounds_recorded = 0
        self._rounds_dropped = 0
        self._closed = False
        self._flush_lock = threading.Lock()  # one flush at a time; guards everything below
        self._outbox: deque[_Outgoing] = deque()
        self._drop_carry = 0
        self._seq = -1
        self._window_start = time.time()
        self._rng = random.Random(config.seed)
        self._rejected: dict[str, int] = {}
        self._built = self._sent = self._dropped = self._unencodable = self._failures = 0
        self._last_error: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name=f"spectune-emitter-{config.engine_id}", daemon=True)
            self._thread.start()

    @property
    def config(self) -> EmitterConfig:
        return self._cfg

    # ------------------------------------------------------------------------------------------ hot path
    def record(self, round_: RoundRecord) -> None:
        """Hand over one round. Constant time, never blocks on I/O, never raises for bad data."""
        with self._lock:
            self._rounds_recorded += 1
            if self._closed or len(self._pending) >= self._cfg.max_pending_rounds:
                self._rounds_dropped += 1
                return
            self._pending.append(round_)
            full = len(self._pending) >= self._cfg.max_rounds_per_window
        if full:
            self._wake.set()

    # ------------------------------------------------------------------------------------ flush thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._cfg.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.flush()
            except Exception as e:  # the thread must outlive any surprise; the error is reported in stats()
                self._last_error = f"flush failed: {type(e).__name__}: {e}"

    def flush(self) -> int:
        """Close the current window, then try to send everything buffered.

        Returns:
            The number of windows sent by this call.
        """
        with self._flush_lock:
            self._build_window()
            return self._send()

    def _build_window(self) -> None:
        with self._lock:
            rounds, self._pending = self._pending, []
        end = time.time()
        start, self._window_start = self._window_start, end
        if not rounds:
            return
        agg = aggregate(rounds, self._cfg.buckets)
        for reason, n in agg.rejected.items():
            self._rejected[reason] = self._rejected.get(reason, 0) + n
        if not agg.rounds:
            return
        sampled: tuple[RoundRecord, ...] = ()
        if self._cfg.sample_rate > 0:
            rate, rng = self._cfg.sample_rate, self._rng
            chosen = [r for r in rounds if rng.random() < rate and _valid(r)]  # one bad round must not sink a batch
            sampled = tuple(chosen[: self._cfg.max_sampled_per_window])
        self._seq = max(self._seq + 1, time.time_ns() // 1000)
        batch = WindowBatch(
            engine_id=self._cfg.engine_id, seq=self._seq, window_start=start, window_end=max(start, end),
            acceptance=agg.acceptance, cost=agg.cost, sampled_rounds=sampled, dropped_before=self._drop_carry,
        )
        try:
            payload = encode_batch(batch, self._cfg.encoding)
        except (RecordError, ValueError) as e:
            try:  # sampled rounds are optional; the aggregates are what matter
                payload = encode_batch(replace(batch, sampled_rounds=()), self._cfg.encoding)
            except (RecordError, ValueError):
                self._unencodable += 1
                self._last_error = f"window not encodable: {e}"
                return
        self._built += 1
        self._outbox.append(_Outgoing(payload, self._drop_carry))
        self._drop_carry = 0
        while len(self._outbox) > self._cfg.max_buffered_windows:
            old = self._outbox.popleft()  # keep the newest windows: they describe the engine as it is now
            self._dropped += 1
            self._drop_carry += 1 + old.dropped_before

    def _send(self) -> int:
        if not self._outbox:
            return 0
        items = list(self._outbox)
        try:
            self._transport.publish([o.payload for o in items])
        except TransportError as e:
            self._failures += 1
            self._last_error = str(e)
            return 0
        for _ in items:
            self._outbox.popleft()
        self._sent += len(items)
        return len(items)

    # ------------------------------------------------------------------------------------------ control
    def close(self, timeout_s: float = CLOSE_JOIN_S) -> None:
        """Stop the flush thread and make a last attempt to send what is buffered."""
        with self._lock:
            self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        try:
            self.flush()
        except Exception as e:  # closing must not raise into the engine's shutdown path
            self._last_error = f"final flush failed: {type(e).__name__}: {e}"

    def stats(self) -> EmitterStats:
        with self._lock:
            recorded, rdropped = self._rounds_recorded, self._rounds_dropped
        return EmitterStats(
            rounds_recorded=recorded, rounds_dropped=rdropped, rounds_rejected=dict(self._rejected),
            windows_built=self._built, windows_sent=self._sent, windows_dropped=self._dropped,
            windows_unencodable=self._unencodable, publish_failures=self._failures,
            buffered=len(self._outbox), last_error=self._last_error,
        )

    def __enter__(self) -> Emitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _valid(r: RoundRecord) -> bool:
    try:
        check_round(r)
    except RecordError:
        return False
    return True
