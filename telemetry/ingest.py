"""The sidecar's ingestion step: transport -> validate -> store -> acknowledge.

One :meth:`Consumer.step` reads a batch of entries (first any a dead consumer left pending too long, then new
ones), validates each, moves invalid ones to the dead-letter stream with their reason (counted by reason),
stores the valid ones in one transaction and acknowledges them only after the commit. A crash between commit
and acknowledgement redelivers entries the store already holds; idempotent ingestion stores them once.

Bad input never crashes the loop and is never silently dropped. A store or transport outage is counted and the
step returns nothing; the unacknowledged entries stay pending and are claimed again after ``claim_min_idle_ms``.

With a :class:`~telemetry.cardinality.CardinalityGate`, a valid batch is split first: windows whose labels would
take the tracked request types, buckets or version pairs past their caps are dead-lettered (one dead letter
holding those windows, under the entry's id, with the reason most of them crossed) and counted per window; the
batch's other windows are stored. The excess is dead-lettered after the rest is committed and before the entry
is acknowledged, so a failure in between redelivers the entry (the store skips what it holds, the gate splits it
the same way).
"""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from telemetry.cardinality import CardinalityGate, Split
from telemetry.errors import StoreError, StoreRejectedError, TransportError
from telemetry.records import MAX_NAME_LEN, RecordError, WindowBatch
from telemetry.store import Store
from telemetry.transport import Entry, Transport
from telemetry.wire import decode_batch, encode_batch

STORE_REJECTED = "store_rejected"  # dead-letter reason: valid on the wire, but the database refused it
MAX_INFLIGHT_TRACKED = 100_000  # own unacknowledged ids remembered (a few reads' worth; oldest forgotten first)
# Steps move their survivors to the oldest generation without the collector counting them, so its own trigger for
# full collections may not fire under steady load; the consumer runs one this often (tens of ms each, without torch).
FULL_COLLECTION_INTERVAL_S = 60.0


def default_consumer_name() -> str:
    """``host-pid``: unique per sidecar process, stable for its lifetime."""
    return f"{socket.gethostname()}-{os.getpid()}"[:MAX_NAME_LEN]


@dataclass(frozen=True)
class ConsumerConfig:
    """One sidecar consumer in the ``sidecar`` group."""

    consumer: str = field(default_factory=default_consumer_name)  # name within the consumer group
    count: int = 512  # entries per read: large reads amortise the store transaction
    block_ms: int = 200  # how long a read waits for new entries
    claim_min_idle_ms: int = 30_000  # entries pending this long belong to a consumer presumed dead
    claim_interval_s: float = 5.0  # how often to look for such entries
    backoff_s: float = 0.5  # pause after a transport or store failure, so an outage is not a busy loop

    def __post_init__(self) -> None:
        if not self.consumer or len(self.consumer) > MAX_NAME_LEN:
            raise ValueError(f"ConsumerConfig.consumer must be 1..{MAX_NAME_LEN} chars")
        if self.count < 1 or self.block_ms < 0 or self.claim_min_idle_ms < 0:
            raise ValueError("ConsumerConfig needs count >= 1, block_ms >= 0 and claim_min_idle_ms >= 0")
        if self.claim_interval_s < 0 or self.backoff_s < 0:
            raise ValueError("ConsumerConfig intervals must be >= 0")


@dataclass(frozen=True)
class ConsumerStats:
    """What the consumer did so far (a snapshot)."""

    received: int  # entries read or claimed
    claimed: int  # of which taken over from another consumer presumed dead
    stored: int  # batches new to the store
    duplicates: int  # valid batches the store already held (redeliveries)
    rejected: dict[str, int]  # dead-lettered entries by reason
    transport_failures: int
    store_failures: int
    last_error: str | None
    reclaimed: int = 0  # entries claimed back from this consumer itself (left pending by a failure)
    refused: int = 0  # valid batches the database refused (dead-lettered as store_rejected); not duplicates
    dead_lettered_entries: int = 0  # entries dead-lettered whole (``rejected`` counts excess labels per window,
    # and an entry stored with some windows dead-lettered apart as excess is counted in ``stored``)
    transport_ok: bool = True  # the latest transport call succeeded (failures above are cumulative)
    store_ok: bool = True  # the latest store call succeeded


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a read's entries are decoded and stored.

    A read of ``count`` entries builds tens of thousands of records (acyclic: refcounting frees them), all alive
    until the step returns. Each automatic collection on the way would traverse them again, and as they survive
    into the oldest generation they trigger full collections of the whole process: a third of the consumer's
    CPU at 512 entries of 50 windows. If the collector was off before, it stays off.

    On the way out, the step's survivors (the batches it returns for the policies: ~170 tracked objects per
    entry, ~80,000 per read) go straight to the oldest generation, by freezing and unfreezing every tracked object
    (two list splices), instead of being traversed by the first young collection after the step: that pass cost
    ~20 ms a read (~40 us of CPU per entry, a fifth of the consumer's) and found nothing to free. The permanent
    generation is borrowed only when empty, so objects an application froze (``gc.freeze()`` before a fork) stay
    frozen. Cyclic garbage made during the step waits for a full collection; :class:`Consumer` runs one every
    ``FULL_COLLECTION_INTERVAL_S``, since promotions made this way do not count towards the collector's own.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        gc.enable()


class Consumer:
    """Moves window batches from a transport into a store.

    Args:
        transport: the sidecar side of the transport.
        store: where valid batches go.
        config: consumer settings.
        gate: caps on the labels tracked (None: every valid window is stored).
    """

    def __init__(self, transport: Transport, store: Store, config: ConsumerConfig | None = None,
                 gate: CardinalityGate | None = None) -> None:
        self._t = transport
        self._store = store
        self._cfg = config or ConsumerConfig()
        self._gate = gate
        self._next_claim = 0.0
        self._next_full_collection = time.monotonic() + FULL_COLLECTION_INTERVAL_S
        self._received = self._claimed = self._stored = self._duplicates = 0
        self._transport_failures = self._store_failures = 0
        self._transport_ok = self._store_ok = True
        self._reclaimed = self._refused = self._dead_lettered_entries = 0
        # Ids delivered to this consumer and not yet acknowledged or dead-lettered (insertion-ordered set): a
        # claim that returns one of these is a re-claim of our own, not a take-over from a dead consumer.
        self._inflight: dict[str, None] = {}
        self._rejected: dict[str, int] = {}
        self._last_error: str | None = None

    @property
    def config(self) -> ConsumerConfig:
        return self._cfg

    def step(self) -> list[WindowBatch]:
        """Read, validate, store and acknowledge one batch of entries.

        Returns:
            The batches newly stored by this step (redeliveries of stored batches are left out), for the
            caller to feed to the policies.
        """
        cfg = self._cfg
        entries: list[Entry] = []
        now = time.monotonic()
        try:
            if now >= self._next_claim:
                self._next_claim = now + cfg.claim_interval_s
                stale = self._t.claim_stale(cfg.consumer, cfg.claim_min_idle_ms, cfg.count)
                own = sum(1 for eid, _ in stale if eid in self._inflight)
                self._reclaimed += own  # our own entries, left pending by a store or transport failure
                self._claimed += len(stale) - own  # entries another consumer (presumed dead) left pending
                entries.extend(stale)
            if len(entries) < cfg.count:
                entries.extend(self._t.read(cfg.consumer, cfg.count - len(entries), cfg.block_ms))
            for eid, _ in entries:
                self._inflight[eid] = None
            while len(self._inflight) > MAX_INFLIGHT_TRACKED:  # entries trimmed while pending never settle
                del self._inflight[next(iter(self._inflight))]
            self._transport_ok = True
        except TransportError as e:
            self._transport_failure(e)
        if not entries:
            return []
        self._received += len(entries)
        if now >= self._next_full_collection:  # see _collector_paused
            self._next_full_collection = now + FULL_COLLECTION_INTERVAL_S
            gc.collect()
        with _collector_paused():
            return self._settle(entries)

    def _settle(self, entries: list[Entry]) -> list[WindowBatch]:
        """Validate, store and acknowledge the entries of one read."""
        valid: list[tuple[str, WindowBatch]] = []
        excess: dict[str, Split] = {}
        for eid, payload in entries:
            try:
                batch = decode_batch(payload)
            except RecordError as e:
                self._reject(eid, payload, e.reason)
                continue
            if self._gate is not None:
                split = self._gate.split(batch)
                if split.admitted is None:  # nothing of it is tracked: dead-lettered whole (and acknowledged)
                    self._reject_excess(eid, payload, split, whole=True)
                    continue
                if split.excess:
                    excess[eid] = split
                batch = split.admitted
            valid.append((eid, batch))
        if not valid:
            return []
        return self._store_and_ack(valid, {eid: p for eid, p in entries}, excess)

    def _store_and_ack(self, valid: list[tuple[str, WindowBatch]], payloads: dict[str, bytes],
                       excess: dict[str, Split] | None = None) -> list[WindowBatch]:
        refused = 0
        try:
            fresh = self._store.ingest_new([b for _, b in valid])
        except StoreRejectedError:
            # One poisonous batch must not block the others: store them one by one, dead-letter the refused.
            fresh, done = [], []
            for eid, b in valid:
                try:
                    fresh.extend(self._store.ingest_new([b]))
                    done.append((eid, b))
                except StoreRejectedError:
                    refused += 1  # dead-lettered (and acknowledged) with its reason; not a duplicate
                    self._reject(eid, payloads[eid], STORE_REJECTED)
                except StoreError as e:  # the rest stays pending and is claimed again
                    self._store_failure(e)
                    break
            valid = done
        except StoreError as e:
            self._store_failure(e)
            return []
        else:
            self._store_ok = True
        self._stored += len(fresh)
        self._refused += refused
        self._duplicates += len(valid) - len(fresh)  # stored, or already held: the refused are not in valid
        if excess:
            kept = {eid for eid, _ in valid}
            failed = {eid for eid, split in excess.items()
                      if eid in kept and not self._reject_excess(eid, payloads[eid], split, whole=False)}
            valid = [(eid, b) for eid, b in valid if eid not in failed]  # excess not dead-lettered yet: stays pending
        try:
            self._t.ack([eid for eid, _ in valid])
            self._settled([eid for eid, _ in valid])
        except TransportError as e:  # stored but not acked: redelivery will find them already stored
            self._transport_failure(e)
        return fresh

    def _reject(self, eid: str, payload: bytes, reason: str) -> None:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        self._dead_lettered_entries += 1
        try:
            self._t.deadletter(eid, payload, reason)
            self._settled([eid])
        except TransportError as e:  # stays pending; it is rejected again when claimed
            self._transport_failure(e)

    def _reject_excess(self, eid: str, payload: bytes, split: Split, *, whole: bool) -> bool:
        """Dead-letter the windows the gate refused (which acknowledges the entry), counted per window under the
        split's reason; ``whole``: none of the entry's windows was stored. Returns False when the transport failed
        (the entry stays pending)."""
        assert split.excess is not None and split.reason is not None
        try:
            data = encode_batch(split.excess)
        except RecordError:  # cannot happen for windows that decoded; keep the whole payload then
            data = payload
        try:
            self._t.deadletter(eid, data, split.reason)
        except TransportError as e:
            self._transport_failure(e)
            return False
        self._rejected[split.reason] = self._rejected.get(split.reason, 0) + split.excess_windows
        self._dead_lettered_entries += whole
        self._settled([eid])
        return True

    def _settled(self, ids: list[str]) -> None:
        for eid in ids:
            self._inflight.pop(eid, None)

    def _transport_failure(self, e: Exception) -> None:
        self._transport_ok = False
        self._transport_failures += 1
        self._last_error = str(e)
        time.sleep(self._cfg.backoff_s)

    def _store_failure(self, e: Exception) -> None:
        self._store_ok = False
        self._store_failures += 1
        self._last_error = f"store: {e}"
        time.sleep(self._cfg.backoff_s)

    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set (the sidecar's ingestion thread)."""
        while not stop.is_set():
            self.step()

    def stats(self) -> ConsumerStats:
        return ConsumerStats(
            received=self._received, claimed=self._claimed, stored=self._stored, duplicates=self._duplicates,
            rejected=dict(self._rejected), transport_failures=self._transport_failures,
            store_failures=self._store_failures, last_error=self._last_error,
            reclaimed=self._reclaimed, refused=self._refused, dead_lettered_entries=self._dead_lettered_entries,
            transport_ok=self._transport_ok, store_ok=self._store_ok,
        )
