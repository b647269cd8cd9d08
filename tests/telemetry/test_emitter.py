"""The engine-side emitter: windows, sequence numbers, bounded buffering and drop accounting."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import pytest
from waiting import wait_until

from telemetry.emitter import Emitter, EmitterConfig
from telemetry.errors import TransportError
from telemetry.synthetic import synthetic_rounds
from telemetry.transport import InProcessTransport, RedisConfig, RedisStreamsTransport
from telemetry.wire import decode_batch


class FlakyTransport(InProcessTransport):
    """An in-process transport that can be switched off (stands in for a network outage)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def publish(self, payloads: bytes | Sequence[bytes]) -> None:
        if self.down:
            raise TransportError("down for the test")
        super().publish(payloads)


def _drain(t: InProcessTransport) -> list:
    return [decode_batch(p) for _, p in t.read("c", 10_000, 0)]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="engine_id"):
        EmitterConfig(engine_id="")
    with pytest.raises(ValueError, match="sample_rate"):
        EmitterConfig(engine_id="e", sample_rate=1.5)
    with pytest.raises(ValueError, match="interval_s"):
        EmitterConfig(engine_id="e", interval_s=0)


def test_flush_builds_one_window_with_monotonic_seq() -> None:
    t = InProcessTransport()
    em = Emitter(t, EmitterConfig(engine_id="e1"), start=False)
    rounds = list(synthetic_rounds(100, seed=1))
    for r in rounds[:60]:
        em.record(r)
    assert em.flush() == 1
    assert em.flush() == 0  # an empty window is not sent
    for r in rounds[60:]:
        em.record(r)
    em.flush()
    b1, b2 = _drain(t)
    assert b1.engine_id == "e1" and b2.seq > b1.seq
    assert b2.window_start == pytest.approx(b1.window_end, abs=1.0)
    assert sum(c.rounds for c in b1.cost) == 60 and sum(c.rounds for c in b2.cost) == 40
    s = em.stats()
    assert (s.rounds_recorded, s.windows_built, s.windows_sent, s.windows_dropped) == (100, 2, 2, 0)


def test_background_thread_flushes_on_interval_and_when_full() -> None:
    t = InProcessTransport()
    with Emitter(t, EmitterConfig(engine_id="e1", interval_s=0.05, max_rounds_per_window=50)) as em:
        for r in synthetic_rounds(120, seed=2):
            em.record(r)
        # the thread sends on its own, before close()
        wait_until(lambda: em.stats().windows_sent >= 1, 30, "the emitter's thread to send a window")
    batches = _drain(t)
    assert sum(c.rounds for b in batches for c in b.cost) == 120
    assert [b.seq for b in batches] == sorted({b.seq for b in batches})


def test_restarted_engine_continues_above_its_previous_seq() -> None:
    t = InProcessTransport()
    seqs: list[int] = []
    for _ in range(2):
        em = Emitter(t, EmitterConfig(engine_id="same"), start=False)
        em.record(next(synthetic_rounds(1)))
        em.close()
        seqs.extend(b.seq for b in _drain(t))
    assert seqs[1] > seqs[0]


def test_outage_keeps_newest_windows_and_reports_every_drop() -> None:
    t = FlakyTransport()
    em = Emitter(t, EmitterConfig(engine_id="e1", max_buffered_windows=3), start=False)
    rounds = synthetic_rounds(1000, seed=4)
    t.down = True
    for _ in range(8):  # 8 windows built, 3 kept, 5 dropped
        em.record(next(rounds))
        em.flush()
    s = em.stats()
    assert (s.windows_built, s.buffered, s.windows_dropped, s.publish_failures) == (8, 3, 5, 8)
    t.down = False
    em.record(next(rounds))
    assert em.flush() == 3  # the 9th window pushed one more old window out before the send
    em.record(next(rounds))
    assert em.flush() == 1  # ... and this one reports that last drop
    batches = _drain(t)
    assert em.stats().windows_dropped == 6
    # The loss travels downstream: the sum of dropped_before over what arrived equals what was dropped.
    assert sum(b.dropped_before for b in batches) == 6
    assert [b.seq for b in batches] == sorted(b.seq for b in batches)


def test_invalid_rounds_are_counted_not_sent(make_round) -> None:
    t = InProcessTransport()
    em = Emitter(t, EmitterConfig(engine_id="e1"), start=False)
    em.record(make_round([("code", 10, 2, 3)]))  # accepted > k
    em.record(make_round([("code", 10, 2, 1)]))
    em.flush()
    (b,) = _drain(t)
    assert sum(c.rounds for c in b.cost) == 1
    assert em.stats().rounds_rejected == {"accepted_gt_drafted": 1}


def test_sampling_is_seeded_and_bounded() -> None:
    def sampled(seed: int) -> list[int]:
        t = InProcessTransport()
        em = Emitter(t, EmitterConfig(engine_id="e", sample_rate=0.1, max_sampled_per_window=5, seed=seed),
                     start=False)
        for r in synthetic_rounds(200, seed=5):
            em.record(r)
        em.flush()
        (b,) = _drain(t)
        return [r.round_index for r in b.sampled_rounds]

    assert sampled(1) == sampled(1)
    assert 0 < len(sampled(1)) <= 5


def test_pending_cap_drops_rounds_instead_of_growing() -> None:
    em = Emitter(InProcessTransport(), EmitterConfig(engine_id="e", max_pending_rounds=10), start=False)
    for r in synthetic_rounds(25, seed=6):
        em.record(r)
    assert em.stats().rounds_dropped == 15


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens here once the socket closes


class ThreadRecordingRedis(RedisStreamsTransport):
    """A Redis transport that notes the thread each publish (the network I/O) runs on."""

    def __init__(self, url: str, config: RedisConfig) -> None:
        super().__init__(url, config)
        self.publish_threads: list[int] = []

    def publish(self, payloads: bytes | Sequence[bytes]) -> None:
        self.publish_threads.append(threading.get_ident())
        super().publish(payloads)


def test_redis_down_record_never_waits_on_the_network_and_drops_are_reported() -> None:
    # record() stays far below a decode step when Redis is down because it never does I/O: every publish attempt
    # runs on the emitter's own thread (how long record() takes is a benchmark's figure, not a test's).
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    t = ThreadRecordingRedis(url, RedisConfig(connect_timeout_s=0.2, socket_timeout_s=0.2, backoff_max_s=0.2))
    em = Emitter(t, EmitterConfig(engine_id="e1", interval_s=0.01, max_buffered_windows=4))
    for r in synthetic_rounds(400, seed=7):
        em.record(r)
        time.sleep(0.001)  # paces the rounds like a decode loop: the flush thread builds windows meanwhile
    wait_until(lambda: em.stats().publish_failures >= 1, 30, "the emitter's thread to fail a publish")
    before_close = list(t.publish_threads)
    em.close(timeout_s=2)
    s = em.stats()
    assert before_close and threading.get_ident() not in before_close  # the caller's thread never published
    assert s.windows_sent == 0 and s.publish_failures >= 1
    assert s.windows_dropped >= 1 and s.buffered <= 4
    assert s.last_error is not None and "127.0.0.1" in s.last_error
    t.close()


def test_payload_is_plain_json_by_default() -> None:
    t = InProcessTransport()
    em = Emitter(t, EmitterConfig(engine_id="e1"), start=False)
    em.record(next(synthetic_rounds(1)))
    em.flush()
    ((_, payload),) = t.read("c", 10, 0)
    assert payload.startswith(b"{") and decode_batch(payload).engine_id == "e1"
