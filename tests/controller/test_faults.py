"""Sidecar faults: a Redis restart, a forged table version, counters that must not lie.

The Redis restart test runs its own ``redis-server`` (no persistence, so a restart comes back empty, as the probe's
did) and kills and restarts only that process, by PID.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import redis
from synthetic_feed import feed

from bench.faults import OwnRedis
from controller.service.publish import RedisPublisher
from controller.service.sidecar import Sidecar, SidecarConfig
from policies import REGISTRY
from telemetry.errors import StoreError
from telemetry.ingest import STORE_REJECTED, Consumer, ConsumerConfig
from telemetry.policy_table import table_to_json
from telemetry.records import PolicyTable
from telemetry.store import Store
from telemetry.synthetic import synthetic_rounds
from telemetry.transport import InProcessTransport, RedisConfig, RedisKeys, RedisStreamsTransport, Transport
from telemetry.wire import encode_batch

FAST = ConsumerConfig(consumer="c1", block_ms=10, claim_min_idle_ms=0, claim_interval_s=0.0, backoff_s=0.01)


def make(transport: Transport, store: Store, publisher: RedisPublisher, **cfg: object) -> Sidecar:
    return Sidecar(SidecarConfig(consumer=FAST, **cfg), transport, store,  # type: ignore[arg-type]
                   REGISTRY["goodput"](k_max=8), publisher)


# ------------------------------------------------------------------------------------- own redis-server
@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    """A redis-server of this test's own (the fault suite's), killed and restarted by PID on the same port."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed; the restart test starts its own")
    srv = OwnRedis(tmp_path)
    srv.start()
    yield srv
    srv.kill()


def _until(cond: object, sc: Sidecar, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        sc.step()
        if cond():  # type: ignore[operator]
            return time.monotonic() - t0
    raise AssertionError(f"not within {timeout_s}s; health={sc.health()}")


def test_a_redis_restart_gets_the_table_back_and_health_recovers(own_redis: OwnRedis, sqlite_url: str) -> None:
    cfg = RedisConfig(prefix="p", backoff_initial_s=0.01, backoff_max_s=0.1, socket_timeout_s=0.5,
                      connect_timeout_s=0.2)
    transport = RedisStreamsTransport(own_redis.url, cfg)
    feed(transport, 400)
    r = redis.Redis.from_url(own_redis.url)
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = make(transport, store, RedisPublisher(own_redis.url, "p"), publish_every_s=0.05)
        sc.drain(idle_steps=3)
        assert sc.version >= 1 and r.get("p:policy") is not None
        assert sc.health()["status"] == "ok"
        own_redis.kill()
        _until(lambda: sc.health()["status"] == "degraded", sc, 5)
        down = sc.health()
        assert down["last_error"] and down["previous_error"]["error"] == down["last_error"]
        own_redis.start()  # back, empty: no table, no stream, no group
        r = redis.Redis.from_url(own_redis.url)
        _until(lambda: r.get("p:policy") is not None, sc, 3)  # the table comes back without any change to it
        assert PolicyTable(**__import__("json").loads(r.get("p:policy"))).version == sc.version  # type: ignore[arg-type]
        _until(lambda: sc.health()["status"] == "ok", sc, 3)
        up = sc.health()
        assert up["transport_failures"] > 0  # the counters remember the outage
        assert up["last_error"] is None and up["previous_error"] is not None  # recovered; what happened is kept


@pytest.mark.parametrize("db", ["sqlite_url", "pg_url"])
def test_a_forged_version_in_redis_is_reported_not_adopted(db: str, request: pytest.FixtureRequest, redis_url: str,
                                                            redis_prefix: str) -> None:
    url = str(request.getfixturevalue(db))
    key = RedisKeys(redis_prefix).policy
    r = redis.Redis.from_url(redis_url)
    forged = PolicyTable(version=2**31, default_k=7, k_max=8, entries={"*|*|*|*|*": 7}, reason="forged")
    r.set(key, table_to_json(forged))
    t = InProcessTransport()
    with Store(url, auto_upgrade=True) as store:
        sc = make(t, store, RedisPublisher(redis_url, redis_prefix))
        feed(t, 300)
        sc.drain()
        table = sc.publish_now("after forgery") or sc.current
        assert table is not None and sc.version == table.version < 100  # counted from the store, not from Redis
        assert store.latest_policy_version() == table
        there = PolicyTable(**__import__("json").loads(r.get(key)))  # type: ignore[arg-type]
        assert there.version == sc.version and there.reason != "forged"  # the forgery was replaced
        ahead = sc.health()["policy_version_ahead"]
        assert ahead["version"] == 2**31 and ahead["store_version"] < 100
        assert "spectune_policy_version_ahead_total 1.0" in sc.metrics.exposition().decode()
        # a restart does not adopt it either, and a later forgery is reported again
        r.set(key, table_to_json(replace(forged, version=2**40)))
        sc2 = make(t, store, RedisPublisher(redis_url, redis_prefix))
        assert sc2.version == sc.version
        assert sc2.health()["policy_version_ahead"]["version"] == 2**40


def test_duplicates_do_not_count_rows_the_database_refused(pg_url: str) -> None:
    t = InProcessTransport()
    good = [feed_one(t, seq) for seq in (1, 2, 3)]
    refused = feed_one(t, 4, dropped_before=2**31)  # valid on the wire; PostgreSQL's INTEGER column refuses it
    with Store(pg_url, auto_upgrade=True) as store:
        c = Consumer(t, store, FAST)
        assert len(c.step()) == len(good)
        st = c.stats()
        assert (st.stored, st.duplicates, st.refused) == (3, 0, 1)
        assert st.rejected == {STORE_REJECTED: 1} and t.dead_letters()[0].source_id == refused
        t.publish(encode_batch(_batch(1)))  # a true redelivery is still a duplicate
        c.step()
        assert (c.stats().duplicates, c.stats().refused) == (1, 1)


def test_claimed_from_dead_consumers_excludes_our_own_reclaims(sqlite_url: str) -> None:
    t = InProcessTransport()
    for seq in (1, 2, 3):
        feed_one(t, seq)
    with Store(sqlite_url, auto_upgrade=True) as store:
        c = Consumer(t, store, FAST)
        with mock.patch.object(store, "ingest_new", side_effect=StoreError("database down")):
            assert c.step() == []  # read, not stored, left pending on c1
        assert not c.stats().store_ok
        assert len(c.step()) == 3  # claimed back from itself
        st = c.stats()
        assert (st.claimed, st.reclaimed, st.stored, st.store_ok) == (0, 3, 3, True)
        feed_one(t, 4)
        t.read("dead-consumer", 10, 0)  # another consumer takes it and dies
        c.step()
        assert (c.stats().claimed, c.stats().reclaimed) == (1, 3)


def _batch(seq: int, dropped_before: int = 0):  # type: ignore[no-untyped-def]
    from telemetry.aggregate import aggregate
    from telemetry.records import WindowBatch

    agg = aggregate(synthetic_rounds(20, seed=seq))
    return WindowBatch("e-ok", seq, 0.0, 0.25, agg.acceptance, agg.cost, dropped_before=dropped_before)


def feed_one(t: InProcessTransport, seq: int, dropped_before: int = 0) -> str:
    t.publish(encode_batch(_batch(seq, dropped_before)))
    return f"{seq}-0" if not t.dead_letters() else ""


def test_the_sidecar_refuses_to_publish_a_table_over_the_cap(sqlite_url: str, redis_url: str, redis_prefix: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import telemetry.policy_table

    monkeypatch.setattr(telemetry.policy_table, "MAX_TABLE_ENTRIES", 5)  # the synthetic feed makes 60 buckets
    t = InProcessTransport()
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = make(t, store, RedisPublisher(redis_url, redis_prefix))
        feed(t, 300)
        sc.drain()
        assert sc.publish_now("too big") is None and sc.version == 0
        assert store.latest_policy_version() is None
        assert sc.rejected.get("table_too_large", 0) >= 1 and "table_too_large" in (sc.last_error or "")
        assert redis.Redis.from_url(redis_url).get(RedisKeys(redis_prefix).policy) is None


def test_a_pin_says_when_it_reached_no_engine(sqlite_url: str) -> None:
    import json
    import urllib.request

    from controller.service.http import OperatorServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there once the socket closes
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = make(InProcessTransport(), store, RedisPublisher(dead, "p"))
        srv = OperatorServer(sc).start()
        try:
            req = urllib.request.Request(srv.url + "/pins", method="POST",
                                         data=json.dumps({"bucket": "*|*|*|*|*", "k": 2}).encode())
            with urllib.request.urlopen(req, timeout=10) as r:
                res = json.loads(r.read())
        finally:
            srv.close()
        assert res["policy_version"] == 1 and res["published"] is False
        assert sc.health()["status"] == "degraded" and sc.health()["unpublished_version"] == 1


def test_a_policy_key_of_another_redis_type_is_replaced(sqlite_url: str, redis_url: str, redis_prefix: str) -> None:
    # A hash (or list, set...) at the engines' key made every GET fail with WRONGTYPE: the sidecar took it for an
    # unreachable Redis, stayed "degraded" and never put its table back.
    key = RedisKeys(redis_prefix).policy
    r = redis.Redis.from_url(redis_url)
    r.hset(key, "version", str(2**40))
    t = InProcessTransport()
    pub = RedisPublisher(redis_url, redis_prefix)
    assert pub.current_version() is None and pub.current() is None  # no table of ours, not an outage
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = make(t, store, pub)
        feed(t, 300)
        sc.drain()
        assert (sc.publish_now("learned") or sc.current) is not None
        assert r.type(key) == b"string" and pub.current_version() == sc.version
        assert sc.published and sc.health()["status"] == "ok"
        r.delete(key)
        r.rpush(key, "junk")  # again, once a table is in force: the next tick replaces it
        sc.publish_if_changed("tick")
        assert r.type(key) == b"string" and pub.current_version() == sc.version
    pub.close()
    r.delete(key)
    r.close()
