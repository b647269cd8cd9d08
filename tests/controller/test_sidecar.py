"""The sidecar with real stores and transports: learning, publishing, pins, bad input, restart, shared group."""

from __future__ import annotations

import pytest
import redis
from synthetic_feed import feed
from waiting import wait_until

from controller.client import ClientConfig, PolicyClient
from controller.service.publish import CallbackPublisher, RedisPublisher
from controller.service.sidecar import Sidecar, SidecarConfig, apply_pins
from policies import REGISTRY
from telemetry.ingest import ConsumerConfig
from telemetry.records import PolicyTable
from telemetry.store import Pin, Store
from telemetry.transport import InProcessTransport, RedisConfig, RedisStreamsTransport, Transport

FAST = ConsumerConfig(consumer="c1", block_ms=10, claim_min_idle_ms=0, claim_interval_s=0.0)


def make(transport: Transport, store: Store, publisher=None, consumer: ConsumerConfig = FAST,  # type: ignore[no-untyped-def]
         **cfg) -> Sidecar:
    return Sidecar(SidecarConfig(consumer=consumer, **cfg), transport, store, REGISTRY["goodput"](k_max=8),
                   publisher or CallbackPublisher())


def test_learns_publishes_and_stores_every_version(sqlite_url: str) -> None:
    t = InProcessTransport()
    client = PolicyClient(ClientConfig("target-v1", "draft-v1", default_k=0))
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = make(t, store, CallbackPublisher(client.apply), publish_every_windows=8)
        sent = feed(t, 1200)
        sc.drain()
        assert sc.windows_ingested == sent and sc.version >= 1
        stored = store.policy_versions(limit=100)
        assert [p.version for p in stored] == list(range(sc.version, 0, -1))
        assert all(p.reason.startswith("learned") for p in stored)
        assert client.version == sc.version and not client.status().fail_static
        assert len(sc.current.entries) == 3 * 5 * 4  # types x batch buckets seen x context buckets seen
        expo = sc.metrics.exposition().decode()
        for name in ("spectune_spec_decode_num_drafts_total", "spectune_spec_decode_num_draft_tokens_total",
                     "spectune_spec_decode_num_accepted_tokens_total", "spectune_mean_acceptance_length",
                     "spectune_spec_decode_num_accepted_tokens_per_pos_total", "spectune_chosen_k",
                     "spectune_decision_seconds_bucket", "spectune_windows_ingested_total"):
            assert name in expo, name
        assert f"spectune_policy_version {float(sc.version)}" in expo


def test_pins_override_the_policy_and_unpinning_restores_it(sqlite_url: str) -> None:
    t = InProcessTransport()
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = make(t, store)
        feed(t, 600)
        sc.drain()
        learned = dict(sc.current.entries)
        store.pin("target-v1|draft-v1|code|*|*", 0, "code looks bad", who="test")
        table = sc.publish_now("pin")
        assert table is not None and "pin" in table.reason
        code = {k: v for k, v in table.entries.items() if "|code|" in k}
        assert code and all(v == 0 for v in code.values())
        assert all(table.entries[k] == learned[k] for k in learned if "|code|" not in k)
        store.unpin("target-v1|draft-v1|code|*|*")
        table2 = sc.publish_now("unpin")
        assert table2 is not None and table2.version == table.version + 1
        assert {k: v for k, v in table2.entries.items() if k in learned} == {
            k: v for k, v in sc.current.entries.items() if k in learned}


def test_most_specific_pin_wins() -> None:
    e = {"a|b|code|8|<=512": 3, "a|b|prose|8|<=512": 3}
    pins = [Pin("*|*|*|*|*", 1, "", "t", 0.0), Pin("a|b|code|*|*", 5, "", "t", 0.0)]
    out = apply_pins(e, pins)
    assert out["a|b|code|8|<=512"] == 5 and out["a|b|prose|8|<=512"] == 1 and out["*|*|*|*|*"] == 1


def test_bad_input_is_dead_lettered_counted_and_never_fatal(sqlite_url: str) -> None:
    t = InProcessTransport()
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = make(t, store)
        t.publish([b"not json", b'{"schema_version": 99}', b"\x93\x01\x02\x03"])
        sent = feed(t, 200)
        sc.drain()
        assert sc.windows_ingested == sent
        assert sum(sc.rejected.values()) == 3
        assert len(t.dead_letters()) == 3
        assert 'spectune_records_rejected_total{reason="undecodable"}' in sc.metrics.exposition().decode()


def test_restart_resumes_from_the_group_and_the_latest_version(redis_url: str, redis_prefix: str,
                                                              sqlite_url: str) -> None:
    cfg = RedisConfig(prefix=redis_prefix)
    engine_side = RedisStreamsTransport(redis_url, cfg)
    sent = feed(engine_side, 400, "engine-a", seed=1, per_window=20)  # two engines feed one sidecar
    sent += feed(engine_side, 400, "engine-b", seed=2, per_window=20)
    store = Store(sqlite_url, auto_upgrade=True)
    t1 = RedisStreamsTransport(redis_url, cfg)
    sc1 = make(t1, store, RedisPublisher(redis_url, redis_prefix),
               consumer=ConsumerConfig(consumer="a", count=8, block_ms=10, claim_min_idle_ms=60_000))
    for _ in range(3):  # ingest part of the stream, then "crash" with entries delivered but not acknowledged
        sc1.step()
    sc1.publish_now("before crash")
    v1 = sc1.version
    t1.client.xreadgroup("sidecar", "a", {t1.stream: ">"}, count=5)  # delivered, never acked: pending on "a"
    done_before = store.batch_count()
    assert 0 < done_before < sent
    sc2 = make(RedisStreamsTransport(redis_url, cfg), store, RedisPublisher(redis_url, redis_prefix),
               consumer=ConsumerConfig(consumer="b", block_ms=10, claim_min_idle_ms=0, claim_interval_s=0.0))
    assert sc2.version == v1  # continues the counter
    sc2.drain(idle_steps=3)
    assert store.batch_count() == sent  # nothing lost ...
    rounds = sum(w.window.rounds for w in store.cost_windows())
    assert rounds == 800  # ... nothing counted twice
    table = sc2.publish_now("after restart") or sc2.current
    assert table is not None and sc2.version >= v1
    raw = redis.Redis.from_url(redis_url).get(f"{redis_prefix}:policy")
    assert raw is not None and f'"version":{sc2.version}'.encode() in raw
    store.close()


@pytest.mark.slow
def test_two_sidecars_share_the_group_and_versions_only_go_up(redis_url: str, redis_prefix: str,
                                                              pg_url: str) -> None:
    cfg = RedisConfig(prefix=redis_prefix)
    sent = feed(RedisStreamsTransport(redis_url, cfg), 600, per_window=20)
    store_a = Store(pg_url, auto_upgrade=True)
    store_b = Store(pg_url)
    a = make(RedisStreamsTransport(redis_url, cfg), store_a, RedisPublisher(redis_url, redis_prefix),
             consumer=ConsumerConfig(consumer="a", count=4, block_ms=10), publish_every_windows=4)
    b = make(RedisStreamsTransport(redis_url, cfg), store_b, RedisPublisher(redis_url, redis_prefix),
             consumer=ConsumerConfig(consumer="b", count=4, block_ms=10), publish_every_windows=4)
    seen = []
    r = redis.Redis.from_url(redis_url)
    for _ in range(40):
        a.step()
        b.step()
        raw = r.get(f"{redis_prefix}:policy")
        if raw:
            seen.append(PolicyTable(**{k: v for k, v in __import__("json").loads(raw).items()}).version)
    a.drain()
    b.drain()
    assert a.windows_ingested > 0 and b.windows_ingested > 0
    assert a.windows_ingested + b.windows_ingested == sent == store_a.batch_count()
    assert seen == sorted(seen)
    versions = [p.version for p in store_a.policy_versions(limit=1000)]
    assert len(versions) == len(set(versions))
    store_a.close()
    store_b.close()


def test_spec_decode_counters_follow_vllm_conventions() -> None:
    from controller.service.metrics import SidecarMetrics
    from telemetry.records import AcceptanceWindow

    m = SidecarMetrics()
    # 4 rows at k=3: accepted 0, 1, 3, 3 drafts -> hist [1, 1, 0, 2]; emitted = accepted + 1 per row
    m.on_acceptance(AcceptanceWindow("t", "d", "code", "<=512", 3, 4, 12, 7, 11, (1, 1, 0, 2)))
    m.on_acceptance(AcceptanceWindow("t", "d", "code", "<=512", 0, 5, 0, 0, 5, (5,)))  # speculation off: no drafts
    text = m.exposition().decode()
    lab = 'context_bucket="<=512",draft_version="d",request_type="code",target_version="t"'
    assert f"spectune_spec_decode_num_drafts_total{{{lab}}} 4.0" in text
    assert f"spectune_spec_decode_num_draft_tokens_total{{{lab}}} 12.0" in text
    assert f"spectune_spec_decode_num_accepted_tokens_total{{{lab}}} 7.0" in text  # bonus tokens excluded
    for pos, n in ((0, 3), (1, 2), (2, 2)):  # rows whose draft at position pos was kept
        plab = f'context_bucket="<=512",draft_version="d",position="{pos}",request_type="code",target_version="t"'
        assert f"spectune_spec_decode_num_accepted_tokens_per_pos_total{{{plab}}} {n}.0" in text
    assert f"spectune_mean_acceptance_length{{{lab}}} 2.75" in text  # 11 emitted / 4 rows, bonus included


def test_a_failing_policy_never_takes_the_sidecar_down(sqlite_url: str) -> None:
    from policies.base import Decision
    from policies.static import StaticPolicy
    from telemetry.records import Bucket

    class Broken(StaticPolicy):
        def _decide(self, bucket: Bucket, explore: bool) -> Decision:
            raise ZeroDivisionError("bug")

    t = InProcessTransport()
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(SidecarConfig(consumer=FAST), t, store, Broken(), CallbackPublisher())
        feed(t, 100)
        sc.drain()
        assert sc.publish_now("x") is None and sc.current is None
        assert sc.rejected.get("policy_error", 0) >= 1 and "ZeroDivisionError" in (sc.last_error or "")
        assert sc.windows_ingested > 0


def test_buckets_without_traffic_are_not_explored(sqlite_url: str) -> None:
    # After a model update the old version's cells get no more windows: they must keep their last k (no probes,
    # no Thompson draws there) while the new version's cells learn. Before, the old cells kept being probed (k=0
    # probes included) on every publish, and the table's default k followed them.
    from policies.base import Decision
    from policies.goodput import GoodputPolicy
    from telemetry.records import Bucket

    class Recording(GoodputPolicy):
        def __init__(self) -> None:
            super().__init__(k_max=8, seed=0)
            self.calls: list[tuple[str, bool]] = []

        def decide(self, bucket: Bucket, explore: bool = True) -> Decision:
            self.calls.append((bucket.target_version, explore))
            return super().decide(bucket, explore)

    t = InProcessTransport()
    pol = Recording()
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(SidecarConfig(consumer=FAST, publish_every_windows=8, explore_active_decisions=2), t, store,
                     pol, CallbackPublisher())
        feed(t, 600, target_version="target-v1", seed=0)
        sc.drain()
        sc.publish_now("learned")
        assert any(v == "target-v1" and e for v, e in pol.calls)  # v1 explored while it had traffic
        pol.calls.clear()
        quiet: dict[str, int] | None = None
        calls_quiet = 0
        for i in range(8):  # the update: v2 traffic only, a decision after each burst
            feed(t, 200, target_version="target-v2", seed=10 + i)
            sc.drain()
            sc.publish_now("learned")
            assert sc.current is not None
            v1_now = {k: v for k, v in sc.current.entries.items() if k.startswith("target-v1|")}
            if i == 2:  # past explore_active_decisions: v1 is quiet from here on
                quiet, calls_quiet = v1_now, len(pol.calls)
            elif i > 2:
                assert v1_now == quiet
        assert quiet
        v1 = [e for v, e in pol.calls[calls_quiet:] if v == "target-v1"]
        v2 = [e for v, e in pol.calls[calls_quiet:] if v == "target-v2"]
        assert not any(v1)  # quiet cells are never explored: they keep the k they got without exploration,
        assert len(v1) <= len(quiet)  # decided at most once more (when they went quiet), not on every publish ...
        assert any(v2)  # ... while the cells with traffic explore


def test_run_reports_every_published_version_and_stops_after_its_duration(sqlite_url: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    import controller.service.tables as tables_mod

    monkeypatch.setattr(tables_mod, "HISTORY_KEEP", 2)  # versions are reported by number, not history position
    t = InProcessTransport()
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = make(t, store, publish_every_windows=8)
        feed(t, 400)
        seen: list[int] = []
        loop = threading.Thread(target=sc.run, kwargs={"duration_s": 3.0,
                                                       "on_publish": lambda pv: seen.append(pv.table.version)})
        loop.start()
        # versions published before run() started are not its to report: the pins go out once it reported the
        # first version it learned from the windows fed above
        wait_until(lambda: seen, 30, "run() to report its first version")
        for k in range(5):  # pins publish from another thread, as the operator endpoint does
            store.pin("*|*|code|*|*", k, "test")
            sc.publish_now("pin")
        loop.join(30)  # run() ends by itself after duration_s; the join's timeout only bounds a broken run
        assert not loop.is_alive()
        assert len(seen) >= 4 and seen == list(range(seen[0], sc.version + 1))
