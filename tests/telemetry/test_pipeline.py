"""Engine records -> emitter -> real Redis -> consumer -> SQLite / PostgreSQL, with failures on the way."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import msgpack
import pytest
import redis

from telemetry.aggregate import aggregate
from telemetry.emitter import Emitter, EmitterConfig
from telemetry.errors import TransportError
from telemetry.ingest import Consumer, ConsumerConfig
from telemetry.migrate import upgrade
from telemetry.records import MAX_ENCODED_BYTES, WindowBatch
from telemetry.store import Store
from telemetry.synthetic import synthetic_rounds
from telemetry.transport import GROUP, InProcessTransport, RedisConfig, RedisStreamsTransport
from telemetry.wire import decode_batch, encode_batch, window_batch_to_dict


def _drain(consumer: Consumer, want: int, timeout_s: float = 10.0) -> list[WindowBatch]:
    out: list[WindowBatch] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        out.extend(consumer.step())
    return out


def _valid_batch(seq: int = 1) -> WindowBatch:
    agg = aggregate(synthetic_rounds(30, seed=seq))
    return WindowBatch("e-ok", seq, 0.0, 0.25, agg.acceptance, agg.cost)


def _valid_dict(seq: int = 1) -> dict:
    return window_batch_to_dict(_valid_batch(seq))


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_round_trip_through_redis_into_the_store(
    redis_transport: RedisStreamsTransport, db_url: str, encoding: str
) -> None:
    upgrade(db_url)
    rounds = list(synthetic_rounds(300, seed=11))
    emitters = [
        Emitter(redis_transport, EmitterConfig(engine_id=f"eng-{i}", encoding=encoding), start=False)  # type: ignore[arg-type]
        for i in range(3)
    ]
    for i, r in enumerate(rounds):
        em = emitters[i % 3]
        em.record(r)
        if i % 50 == 49:
            em.flush()
    for em in emitters:
        em.close()
    sent = sum(em.stats().windows_sent for em in emitters)
    with Store(db_url) as store:
        consumer = Consumer(redis_transport, store, ConsumerConfig(consumer="c1", count=4, block_ms=50))
        got = _drain(consumer, sent)
        assert len(got) == sent and store.batch_count() == sent
        # Every round arrived exactly once, as cost and as acceptance rows.
        assert sum(w.window.rounds for w in store.cost_windows()) == len(rounds)
        assert sum(w.window.rows for w in store.acceptance_windows()) == sum(r.batch_size for r in rounds)
        assert sum(w.window.accepted for w in store.acceptance_windows()) == sum(
            row.accepted for r in rounds for row in r.rows)
    assert redis_transport.client.xpending(redis_transport.stream, GROUP)["pending"] == 0


def test_redelivery_after_a_consumer_dies_stores_each_window_once(
    redis_transport: RedisStreamsTransport, sqlite_url: str
) -> None:
    upgrade(sqlite_url)
    em = Emitter(redis_transport, EmitterConfig(engine_id="e1"), start=False)
    for r in synthetic_rounds(100, seed=12):
        em.record(r)
        if r.round_index % 10 == 9:
            em.flush()
    assert em.stats().windows_sent == 10
    with Store(sqlite_url) as store:
        # Consumer A reads and stores 4 windows, then dies before acknowledging them.
        entries = redis_transport.read("dead", 4, 100)
        assert store.ingest([decode_batch(p) for _, p in entries]) == 4
        pending = redis_transport.client.xpending(redis_transport.stream, GROUP)
        assert pending["pending"] == 4 and pending["consumers"][0]["name"] == b"dead"
        # Consumer B claims them (XAUTOCLAIM) and reads the rest: 10 windows stored, each once.
        b = Consumer(redis_transport, store, ConsumerConfig(consumer="b", claim_min_idle_ms=0, block_ms=50))
        got = _drain(b, 6)
        s = b.stats()
        assert s.claimed == 4 and s.duplicates == 4 and s.stored == 6 and len(got) == 6
        assert store.batch_count() == 10
        assert sum(w.window.rounds for w in store.cost_windows()) == 100
    assert redis_transport.client.xpending(redis_transport.stream, GROUP)["pending"] == 0


def test_malformed_entries_are_dead_lettered_with_a_reason(
    redis_transport: RedisStreamsTransport, sqlite_url: str
) -> None:
    upgrade(sqlite_url)
    wrong_type = _valid_dict(1)
    wrong_type["seq"] = "one"
    nan = _valid_dict(2)
    nan["cost"][0]["latency_p95"] = float("nan")
    negative = _valid_dict(3)
    negative["cost"][0]["draft_s"]["total"] = -0.5
    too_many = _valid_dict(4)
    too_many["acceptance"][-1]["accepted"] = too_many["acceptance"][-1]["drafted"] + 1
    future = _valid_dict(5)
    future["schema_version"] = 99
    cases = [
        (json.dumps(wrong_type).encode(), "bad_type"),
        (json.dumps(nan).encode(), "non_finite"),  # Python's json writes NaN; the reader refuses it
        (msgpack.packb(negative), "negative_time"),
        (json.dumps(too_many).encode(), "accepted_gt_drafted"),
        (b"{" + b" " * MAX_ENCODED_BYTES + b"}", "too_large"),
        (json.dumps(future).encode(), "unknown_schema_version"),
        (b"\x00\xffgarbage\x13", "undecodable"),
        (b"", "undecodable"),
    ]
    good = [encode_batch(_valid_batch(10 + i)) for i in range(3)]
    # Interleave: bad input must not stop the good batches around it.
    redis_transport.publish([good[0], *[p for p, _ in cases[:4]], good[1], *[p for p, _ in cases[4:]], good[2]])
    with Store(sqlite_url) as store:
        c = Consumer(redis_transport, store, ConsumerConfig(consumer="c", count=3, block_ms=50))
        got = _drain(c, 3)
        for _ in range(3):
            c.step()  # and it keeps going after the bad ones
        assert len(got) == 3 and store.batch_count() == 3
        expected: dict[str, int] = {}
        for _, reason in cases:
            expected[reason] = expected.get(reason, 0) + 1
        assert c.stats().rejected == expected
    dead = redis_transport.dead_letters(100)
    assert sorted(d.reason for d in dead) == sorted(r for _, r in cases)
    big = next(d for d in dead if d.reason == "too_large")
    assert big.size > MAX_ENCODED_BYTES and len(big.payload) < big.size  # kept, truncated, with its real size
    assert redis_transport.client.xpending(redis_transport.stream, GROUP)["pending"] == 0


def test_consumer_survives_a_redis_outage(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    t = RedisStreamsTransport("redis://127.0.0.1:1/0", RedisConfig(connect_timeout_s=0.1, socket_timeout_s=0.1))
    with Store(sqlite_url) as store:
        c = Consumer(t, store, ConsumerConfig(consumer="c", backoff_s=0.01))
        assert c.step() == [] and c.step() == []
        assert c.stats().transport_failures == 2
    with pytest.raises(TransportError, match=r"127\.0\.0\.1:1"):
        t.publish(b"{}")


def test_auth_failure_is_a_transport_error(redis_url: str, redis_prefix: str) -> None:
    url = redis_url.replace("redis://", "redis://nobody:wrong-password@", 1)
    t = RedisStreamsTransport(url, RedisConfig(prefix=redis_prefix))
    with pytest.raises(TransportError) as e:
        t.publish(b"{}")
    assert "wrong-password" not in str(e.value)


def test_publish_trims_the_stream_approximately(redis_url: str, redis_prefix: str) -> None:
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix, maxlen=100))
    t.publish([b"{}"] * 1000)
    n = redis.Redis.from_url(redis_url).xlen(t.stream)
    assert 100 <= n < 1000
    t.close()


def test_in_process_transport_has_the_same_semantics(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    t = InProcessTransport()
    em = Emitter(t, EmitterConfig(engine_id="e1"), start=False)
    for r in synthetic_rounds(40, seed=13):
        em.record(r)
        if r.round_index % 10 == 9:
            em.flush()
    t.publish(b"not json")
    with Store(sqlite_url) as store:
        assert len(t.read("dead", 2, 0)) == 2  # read, never acked
        c = Consumer(t, store, ConsumerConfig(consumer="c", claim_min_idle_ms=0, block_ms=10))
        got = _drain(c, 4)
        assert len(got) == 4 and store.batch_count() == 4
        assert c.stats().rejected == {"undecodable": 1}
    assert t.pending == 0 and [d.reason for d in t.dead_letters()] == ["undecodable"]


def test_a_read_with_a_duplicate_and_a_bad_entry_stores_the_good_once_and_dead_letters_the_bad(
    redis_transport: RedisStreamsTransport, db_url: str
) -> None:
    # One read of 9 entries: a redelivered batch and an invalid one sit between good ones.
    upgrade(db_url)
    bad = _valid_dict(4)
    bad["acceptance"][0]["drafted"] += 1
    payloads = [encode_batch(_valid_batch(seq)) for seq in (1, 2, 3)]
    payloads += [json.dumps(bad).encode(), encode_batch(_valid_batch(2))]  # invalid; then a duplicate of seq 2
    payloads += [encode_batch(_valid_batch(seq)) for seq in (5, 6, 7, 8)]
    redis_transport.publish(payloads)
    with Store(db_url) as store:
        c = Consumer(redis_transport, store, ConsumerConfig(consumer="c", count=9, block_ms=50))
        got = c.step()
        assert [b.seq for b in got] == [1, 2, 3, 5, 6, 7, 8]  # in the order read, each once
        s = c.stats()
        assert (s.received, s.stored, s.duplicates, s.rejected) == (9, 7, 1, {"bad_drafted": 1})
        assert store.batch_count() == 7
        assert [w.window for w in store.acceptance_windows()] == [a for b in got for a in b.acceptance]
        assert [w.window for w in store.cost_windows()] == [x for b in got for x in b.cost]
    assert [d.reason for d in redis_transport.dead_letters()] == ["bad_drafted"]
    assert redis_transport.client.xpending(redis_transport.stream, GROUP)["pending"] == 0


def test_the_collector_is_paused_only_during_a_step() -> None:
    import gc

    from telemetry.ingest import _collector_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError), _collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("a step failed")
    assert gc.isenabled()  # back on, even after an error
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_a_step_leaves_its_survivors_in_the_oldest_generation() -> None:
    import gc

    from telemetry.ingest import _collector_paused

    with _collector_paused():
        kept = [[i] for i in range(10_000)]  # tracked containers that outlive the step
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 1_000  # not waiting for a young collection to traverse them
    assert kept[-1] == [9_999]


def test_objects_an_application_froze_stay_frozen() -> None:
    import gc

    from telemetry.ingest import _collector_paused

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with _collector_paused():
            pass
        assert gc.get_freeze_count() == frozen and gc.isenabled()
    finally:
        gc.unfreeze()


def test_a_busy_consumer_runs_a_full_collection_now_and_then(sqlite_url: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    import telemetry.ingest as ingest

    upgrade(sqlite_url)
    t = InProcessTransport()
    t.publish([encode_batch(_valid_batch(seq)) for seq in (1, 2)])
    full: list[int] = []
    monkeypatch.setattr(ingest, "FULL_COLLECTION_INTERVAL_S", 0.0)
    monkeypatch.setattr(ingest.gc, "collect", lambda generation=2: full.append(generation) or 0)
    with Store(sqlite_url) as store:
        c = Consumer(t, store, ConsumerConfig(consumer="c", block_ms=10))
        assert len(c.step()) == 2
    assert full == [2] and gc.isenabled()


def test_a_step_decodes_and_stores_with_the_collector_paused(sqlite_url: str) -> None:
    import gc

    upgrade(sqlite_url)
    t = InProcessTransport()
    t.publish([encode_batch(_valid_batch(seq)) for seq in (1, 2)])
    with Store(sqlite_url) as store:
        seen: list[bool] = []
        real = store.ingest_new

        def ingest_new(batches: Sequence[WindowBatch]) -> list[WindowBatch]:
            seen.append(gc.isenabled())
            return real(batches)

        store.ingest_new = ingest_new  # type: ignore[method-assign]
        c = Consumer(t, store, ConsumerConfig(consumer="c", block_ms=10))
        assert len(c.step()) == 2
    assert seen == [False] and gc.isenabled()
