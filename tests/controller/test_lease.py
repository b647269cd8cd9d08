"""The leader lease on real Redis, the store feed on real PostgreSQL, and three sidecar processes failing over."""

from __future__ import annotations

import json
import time
from unittest import mock

import pytest
import redis
from sqlalchemy import create_engine, text
from synthetic_feed import feed
from waiting import wait_until

from bench._faults_scaleout import run_scaleout
from controller.service.lease import Lease, LeaseConfig
from controller.service.publish import RedisPublisher
from controller.service.sidecar import Sidecar, SidecarConfig
from policies import REGISTRY
from telemetry.ingest import ConsumerConfig
from telemetry.store import Store
from telemetry.transport import RedisConfig, RedisKeys, RedisStreamsTransport
from telemetry.window_feed import WindowFeed, WindowFeedConfig

LEASE_MS = 300  # short enough for expiry tests to take a fraction of a second
SIDECAR_LEASE_MS = 3000  # a sidecar's step on a busy machine must not outlast its lease
STALE_LEASE_MS = 1000  # the stale-leader test waits this out


def lease(redis_url: str, prefix: str, token: str, lease_ms: int = LEASE_MS) -> Lease:
    return Lease(redis_url, RedisKeys(prefix).leader, LeaseConfig(lease_ms), token=token)


def test_config_is_validated_at_the_edge() -> None:
    with pytest.raises(ValueError, match="lease_ms"):
        LeaseConfig(50)
    assert LeaseConfig(3000).renew_every_s == pytest.approx(1.0)
    assert LeaseConfig(3000).trusted_s < 3.0


def test_acquire_is_exclusive_and_release_hands_over_at_once(redis_url: str, redis_prefix: str) -> None:
    a, b = lease(redis_url, redis_prefix, "a"), lease(redis_url, redis_prefix, "b")
    assert a.try_acquire() and a.held()
    assert not b.try_acquire() and not b.held()
    assert a.holder() == b.holder() == "a"
    pttl = redis.Redis.from_url(redis_url).pttl(RedisKeys(redis_prefix).leader)
    assert 0 < pttl <= LEASE_MS
    assert a.release() and not a.held()
    assert b.try_acquire() and b.holder() == "b"  # no wait for the TTL after a clean release
    assert not a.release()  # compare-and-delete: a cannot remove b's lease
    assert b.holder() == "b"
    a.close()
    b.close()


def test_renewal_keeps_the_lease_past_its_ttl(redis_url: str, redis_prefix: str) -> None:
    a, b = lease(redis_url, redis_prefix, "a"), lease(redis_url, redis_prefix, "b")
    assert a.tick()
    end = time.monotonic() + 3 * LEASE_MS / 1000
    while time.monotonic() < end:  # the holder ticks (renews every lease/3); the other keeps trying
        assert a.tick()
        assert not b.tick()
        time.sleep(0.02)
    assert a.stats().acquisitions == 1 and a.stats().losses == 0
    a.close()
    b.close()


def test_a_dead_holder_is_replaced_after_its_ttl(redis_url: str, redis_prefix: str) -> None:
    a, b = lease(redis_url, redis_prefix, "a"), lease(redis_url, redis_prefix, "b")
    assert a.tick()  # a "dies": it never ticks again
    assert not b.tick()  # the key still holds a's token
    wait_until(b.tick, 10 * LEASE_MS / 1000, "b to take the lease once the dead holder's key expired")
    assert not a.held()  # its local deadline passed before the key expired
    assert not a.renew() and a.stats().losses == 1  # compare-and-extend refuses: the key holds b's token
    assert b.holder() == "b"
    a.close()
    b.close()


def test_a_holder_cut_off_from_redis_steps_down_by_its_local_deadline(redis_url: str, redis_prefix: str) -> None:
    a = lease(redis_url, redis_prefix, "a")
    assert a.tick()
    a._r.connection_pool.reset()  # point the holder at a dead server from now on
    a._r.connection_pool.connection_kwargs.update(port=1, host="127.0.0.1")
    deadline = time.monotonic() + LeaseConfig(LEASE_MS).trusted_s
    while time.monotonic() < deadline - 0.05:
        assert a.tick()  # renewals fail, yet the lease Redis granted still stands
        time.sleep(0.02)  # paces the holder's ticks, as the sidecar's loop does
    wait_until(lambda: not a.tick(), 5.0, "the cut-off holder to step down at its local deadline")
    assert a.stats().failures >= 1 and a.stats().losses == 1
    a.close()


def make(redis_url: str, prefix: str, db_url: str, name: str, token: str, lease_ms: int = SIDECAR_LEASE_MS,  # type: ignore[no-untyped-def]
         **cfg) -> Sidecar:
    rcfg = RedisConfig(prefix=prefix)
    return Sidecar(
        SidecarConfig(consumer=ConsumerConfig(consumer=name, count=4, block_ms=5), **cfg),
        RedisStreamsTransport(redis_url, rcfg), Store(db_url), REGISTRY["goodput"](k_max=8),
        RedisPublisher(redis_url, prefix), lease=lease(redis_url, prefix, token, lease_ms))


def test_only_the_leader_publishes_and_it_learns_every_consumers_windows(redis_url: str, redis_prefix: str,
                                                                        pg_url: str) -> None:
    Store(pg_url, auto_upgrade=True).close()
    sent = feed(RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix)), 600, per_window=20)
    a = make(redis_url, redis_prefix, pg_url, "a", "a", publish_every_windows=4)
    b = make(redis_url, redis_prefix, pg_url, "b", "b", publish_every_windows=4)
    for _ in range(200):
        a.step()
        b.step()
        if a.windows_ingested + b.windows_ingested == sent:
            break
    for _ in range(3):
        a.step()
        b.step()
    assert a.windows_ingested > 0 and b.windows_ingested > 0  # ingestion scaled out ...
    leader, follower = (a, b) if a.health()["leader"] else (b, a)
    assert leader.health()["leader"] and not follower.health()["leader"]
    assert follower.history == [] and leader.version >= 1  # ... deciding did not
    assert leader.lease is not None and leader.lease.stats().losses == 0
    rows = len(leader.store.acceptance_windows()) + len(leader.store.cost_windows())
    assert leader.windows_observed == rows  # every consumer's windows, each once
    assert follower.windows_observed == rows  # the follower is a warm standby
    assert follower.publish_now("pin") is None  # a follower never publishes, even when asked
    expo = leader.metrics.exposition().decode()
    assert "spectune_sidecar_leader 1.0" in expo
    assert 'spectune_sidecar_lease_events_total{event="acquired"} 1.0' in expo
    assert "spectune_sidecar_leader 0.0" in follower.metrics.exposition().decode()
    for sc in (a, b):
        sc.release_lease()
        sc.store.close()


def test_a_stale_leader_whose_lease_expired_cannot_publish(redis_url: str, redis_prefix: str, pg_url: str) -> None:
    Store(pg_url, auto_upgrade=True).close()
    feed(RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix)), 300, per_window=20)
    a = make(redis_url, redis_prefix, pg_url, "a", "a", STALE_LEASE_MS, publish_every_windows=4)
    a.drain(idle_steps=3)
    assert a.health()["leader"] and a.version >= 1
    v_a = a.version
    leader_key = RedisKeys(redis_prefix).leader
    r = redis.Redis.from_url(redis_url)
    wait_until(lambda: not r.exists(leader_key), 10.0, "a's lease to expire in Redis (a stalls: no tick)")
    b = make(redis_url, redis_prefix, pg_url, "b", "b", STALE_LEASE_MS, publish_every_windows=4)
    assert b.windows_observed == a.windows_observed  # replayed the store at start-up
    b.step()
    assert b.health()["leader"] and b.version >= v_a  # caught up: continues from the store's version
    b.store.pin("*|*|*|*|*", 0, "fence test", who="test")
    table_b = b.publish_now("pin")
    assert table_b is not None and table_b.version > v_a
    v_b = table_b.version
    # a wakes up and, before any tick, tries to publish: its local deadline has passed, so it refuses
    assert a.publish_now("stale") is None and not a.health()["leader"]
    # even past the local check (a clock that lied), Redis no longer confirms its lease: no version is taken
    assert a.lease is not None
    a.lease._holder, a.lease._valid_until = True, time.monotonic() + 10
    a.leadership.leader = True
    a.store.unpin("*|*|*|*|*")
    assert a.publish_now("stale forced") is None and not a.leadership.leader
    assert b.store.latest_policy_version().version == v_b  # type: ignore[union-attr]
    assert RedisPublisher(redis_url, redis_prefix).current_version() == v_b
    assert a.version == v_b  # it adopted the leader's table
    for sc in (a, b):
        sc.release_lease()
        sc.store.close()


def test_the_feed_hands_out_rows_committed_out_of_id_order(pg_url: str) -> None:
    """A slow consumer's transaction holds a lower id than one committed after it: the feed still delivers it."""
    from telemetry.transport import InProcessTransport
    from telemetry.wire import decode_batch

    t = InProcessTransport()
    feed(t, 160, per_window=80)
    first, second = (decode_batch(p) for _, p in t.read("x", 10, 0))
    with Store(pg_url, auto_upgrade=True) as store:
        store.ingest([first])
        f = WindowFeed(store, WindowFeedConfig(gap_grace_s=30))
        f.start_at_top()
        eng = create_engine(pg_url)
        with eng.connect() as c:
            tx = c.begin()  # the slow consumer: its row takes the next id, uncommitted
            late = c.execute(text(
                "INSERT INTO acceptance_windows (batch_id, bucket_id, rows, drafted, accepted, emitted, hist) "
                "SELECT batch_id, bucket_id, rows, drafted, accepted, emitted, hist FROM acceptance_windows "
                "ORDER BY id LIMIT 1 RETURNING id")).scalar_one()
            store.ingest([second])  # a faster consumer commits higher ids
            acc, cost = f.poll()
            assert len(acc) == len(second.acceptance) and len(cost) == len(second.cost)
            assert all(w.id > late for w in acc) and f.stats()["gaps_open"] == 1
            tx.commit()
        eng.dispose()
        acc, cost = f.poll()
        assert [w.id for w in acc] == [late] and cost == []  # delivered once it committed
        assert f.poll() == ([], []) and f.stats()["gaps_open"] == 0


@pytest.mark.slow
def test_three_sidecar_processes_fail_over_after_a_kill_9_of_the_leader(redis_url: str, pg_url: str) -> None:
    # Three sidecar processes share two cores here, and the new leader's first steps learn every stored window:
    # under a full suite such a step can outlast a 2 s lease (the new leader then loses it to a peer: two
    # publisher switches, still no table flip and one publisher at a time), so the lease is 4 s. The lease bounds
    # failover time, which is asserted relative to it. Pending entries of the killed leader are claimed after 1 s.
    lease_ms = 4000
    res = run_scaleout(redis_url, pg_url, lease_ms=lease_ms, claim_idle_ms=1000, windows=160, seed=0)
    detail = json.dumps(res, sort_keys=True)
    assert res["leader_killed"] is not None and res["new_leader"] not in (None, res["leader_killed"]), detail
    assert res["publishers_at_once"] == 1, detail
    assert res["failover_s"] is not None and res["failover_s"] <= lease_ms / 1000 + 2, detail
    assert res["table_flips"] == 0 and res["versions_published_twice"] == 0, detail
    assert res["publisher_switches"] <= 1, detail  # the publisher changed at the failover, and only then
    assert res["windows_sent"] == 160 and res["windows_lost"] == 0 and res["windows_duplicated"] == 0, detail
    assert res["rounds_stored"] == res["rounds_sent"], detail
    # the new leader's policy learned every stored window, though its own consumer stored only a share of them
    assert res["leader_saw_peer_windows"], detail
    assert res["new_leader_own_batches"] < res["windows_stored"], detail
    assert not res["sidecar_crashed"], detail


def test_without_a_lease_the_sidecar_always_leads(sqlite_url: str) -> None:
    from controller.service.publish import CallbackPublisher
    from telemetry.transport import InProcessTransport

    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(SidecarConfig(consumer=ConsumerConfig(consumer="c", block_ms=5)), InProcessTransport(), store,
                     REGISTRY["goodput"](k_max=8), CallbackPublisher())
        h = sc.health()
        assert h["leader"] is True and h["lease"] is None
        assert "spectune_sidecar_leader 1.0" in sc.metrics.exposition().decode()


def test_cli_lease_flags(capsys: pytest.CaptureFixture[str], redis_url: str, redis_prefix: str,
                         sqlite_url: str) -> None:
    from controller.cli import main

    Store(sqlite_url, auto_upgrade=True).close()
    base = ["sidecar", "--redis-url", redis_url, "--prefix", redis_prefix, "--db-url", sqlite_url,
            "--http-port", "0", "--no-alerts", "--duration", "0.5"]
    assert main([*base, "--lease-ms", "50"]) == 2
    assert "lease_ms must be an int >= 100" in capsys.readouterr().err
    assert main([*base, "--lease-ms", "1000"]) == 0
    assert f"leader lease {redis_prefix}:leader (1000 ms)" in capsys.readouterr().out
    assert redis.Redis.from_url(redis_url).get(f"{redis_prefix}:leader") is None  # released on a clean stop
    assert main([*base, "--no-lease"]) == 0
    assert "no lease (always the leader)" in capsys.readouterr().out


def test_the_publish_itself_is_fenced_by_the_lease_token(redis_url: str, redis_prefix: str) -> None:
    # A leader paused between its lease check and its write (GC, a stalled machine) must not overwrite its
    # successor's table: the publish script checks the lease key holds this sidecar's token as it writes.
    from controller.service.publish import FencedError
    from telemetry.records import PolicyTable

    keys = RedisKeys(redis_prefix)
    r = redis.Redis.from_url(redis_url)
    pub = RedisPublisher(redis_url, redis_prefix)
    pub.fence(keys.leader, "old-leader")
    try:
        r.set(keys.leader, "new-leader")
        for force in (False, True):
            with pytest.raises(FencedError, match="leader lease"):
                pub.publish(PolicyTable(version=7, default_k=2, k_max=8, reason="stale"), force=force)
        assert r.get(keys.policy) is None  # nothing written, no nudge
        r.set(keys.leader, "old-leader")
        assert pub.publish(PolicyTable(version=7, default_k=2, k_max=8, reason="leads"))
        assert json.loads(r.get(keys.policy) or b"{}")["version"] == 7
    finally:
        pub.close()
        r.delete(keys.leader, keys.policy)
        r.close()


def test_an_acceptance_drift_a_peer_raised_reopens_the_bucket_here(redis_url: str, redis_prefix: str,
                                                                   pg_url: str) -> None:
    # Each sidecar's detectors see only its own consumer's share of the windows, so the sidecar that notices a
    # drift may be a follower: the leader (and every warm standby) re-opens the bucket from the stored alert.
    from controller.service.alerts import AlertConfig, AlertManager
    from controller.service.sidecar import PEER_ALERTS_EVERY_S
    from telemetry.alerts import ACCEPTANCE_DRIFT, Alert
    from telemetry.alerts_store import AlertStore

    Store(pg_url, auto_upgrade=True).close()
    alert_store = AlertStore(pg_url)
    rcfg = RedisConfig(prefix=redis_prefix)
    feed(RedisStreamsTransport(redis_url, rcfg), 100, per_window=20)
    mgr = AlertManager(AlertConfig(), store=alert_store)
    sc = Sidecar(SidecarConfig(consumer=ConsumerConfig(consumer="a", count=8, block_ms=5)),
                 RedisStreamsTransport(redis_url, rcfg), Store(pg_url), REGISTRY["goodput"](k_max=8),
                 RedisPublisher(redis_url, redis_prefix), alerts=mgr,
                 lease=lease(redis_url, redis_prefix, "a", SIDECAR_LEASE_MS))
    try:
        sc.step()  # reads what is stored now: drifts from before it started are the past
        peer = alert_store.add(Alert(kind=ACCEPTANCE_DRIFT, bucket="target-v1|draft-v1|structured|*|<=512",
                                     target_version="target-v1", draft_version="draft-v1", detected_at=time.time(),
                                     message="a peer saw structured fall", k=3))
        with mock.patch.object(sc.policy, "reopen") as reopen:
            time.sleep(PEER_ALERTS_EVERY_S + 0.05)  # the sidecar's own clock: peers' alerts are read once a second
            sc.step()
            sc.step()  # read once only
        reopen.assert_called_once_with("target-v1", "draft-v1", "structured", "<=512")
        assert sc.reopened == 1 and peer.id is not None
    finally:
        sc.release_lease()
        mgr.close()
        sc.store.close()
        alert_store.close()
