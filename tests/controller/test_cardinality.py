"""A cardinality attack: well-formed batches with 1,000 new request types, through real Redis into a sidecar on
SQLite. Without caps every type would be tracked (one decision took about a minute) and every bucket decided
again on every publish."""

from __future__ import annotations

from synthetic_feed import feed

from controller.service.publish import RedisPublisher
from controller.service.sidecar import Sidecar, SidecarConfig
from policies.base import Decision
from policies.goodput import GoodputPolicy
from telemetry.cardinality import TOO_MANY_REQUEST_TYPES, CardinalityLimits
from telemetry.ingest import ConsumerConfig
from telemetry.records import AcceptanceWindow, Bucket, CostWindow, Stat, WindowBatch
from telemetry.store import Store
from telemetry.synthetic import DEFAULT_ALPHA
from telemetry.transport import RedisConfig, RedisStreamsTransport
from telemetry.wire import decode_batch, encode_batch

FAST = ConsumerConfig(consumer="c1", block_ms=10, claim_min_idle_ms=0, claim_interval_s=0.0, backoff_s=0.01)
FORGED_TYPES = 1000
PER_BATCH = 10  # forged types per batch (100 batches), each batch also carrying a legitimate window


class Counting(GoodputPolicy):
    def __init__(self) -> None:
        super().__init__(k_max=8, seed=0)
        self.decides = 0

    def decide(self, bucket: Bucket, explore: bool = True) -> Decision:
        self.decides += 1
        return super().decide(bucket, explore)


def forged_batch(seq: int) -> WindowBatch:
    """Well-formed windows of new request types, plus one window of a real type and one cost window."""
    def acc(rtype: str) -> AcceptanceWindow:
        return AcceptanceWindow("target-v1", "draft-v1", rtype, "<=512", k=2, rows=4, drafted=8, accepted=4,
                                emitted=8, hist=(1, 2, 1))

    s = Stat(2, 0.02, 0.0002, 0.01)
    c = CostWindow("target-v1", "draft-v1", 4, "<=512", max_k=2, rounds=2, tokens_verified=24, emitted=16,
                   batch_rows=8, draft_s=s, verify_s=s, other_s=s, latency_p50=0.01, latency_p95=0.01,
                   latency_p99=0.01)
    forged = [acc(f"forged-{seq * PER_BATCH + i}") for i in range(PER_BATCH)]
    return WindowBatch("forger", seq, float(seq), seq + 0.25, (acc("code"), *forged), (c,))


def test_a_flood_of_request_types_is_capped_dead_lettered_and_counted(redis_url: str, redis_prefix: str,
                                                                       sqlite_url: str) -> None:
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    pol = Counting()
    # A cap below the default (64) keeps the test quick: the first decision of every admitted bucket is O(types).
    # The decision's time budget is not under test here (test_label_flood.py covers it with a fake clock): on a
    # loaded CI machine the default 0.5 s can defer buckets, which the "quiet publish" below would then decide.
    cfg = SidecarConfig(consumer=FAST, warm_start_windows=0, publish_every_windows=10**6, publish_every_s=3600,
                        limits=CardinalityLimits(max_request_types=16), decide_budget_s=60.0)
    limit = cfg.limits.max_request_types
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(cfg, t, store, pol, RedisPublisher(redis_url, redis_prefix))
        feed(t, 200, seed=0)
        sc.drain()
        sc.publish_now("learned")
        assert sc.current is not None
        t.publish([encode_batch(forged_batch(seq)) for seq in range(FORGED_TYPES // PER_BATCH)])
        sc.drain()

        # The caps hold: the policy tracks `limit` types, the rest went to the dead-letter stream with the reason.
        admitted = limit - len(DEFAULT_ALPHA)
        assert sc.health()["tracked"]["request_types"] == limit
        assert len({b.request_type for b in sc.buckets()}) == limit
        assert len({k for s in sc.decider._seen.values() for k in s.types}) == limit
        excess = FORGED_TYPES - admitted
        assert sc.rejected[TOO_MANY_REQUEST_TYPES] == excess
        assert sc.metrics.registry.get_sample_value(
            "spectune_records_rejected_total", {"reason": TOO_MANY_REQUEST_TYPES}) == excess
        dead = t.dead_letters(1000)
        assert {d.reason for d in dead} == {TOO_MANY_REQUEST_TYPES}
        assert sum(len(decode_batch(d.payload).acceptance) for d in dead) == excess

        # Nothing else was lost: every batch's legitimate windows are stored.
        forger = [w for w in store.acceptance_windows(request_type="code") if w.engine_id == "forger"]
        assert len(forger) == FORGED_TYPES // PER_BATCH
        assert len([w for w in store.cost_windows() if w.engine_id == "forger"]) == FORGED_TYPES // PER_BATCH

        # A publish decides the buckets once; once their cells are quiet they keep their k and cost nothing.
        sc.publish_now("learned")
        assert len(sc.buckets()) > 10 * limit  # many buckets exist ...
        for _ in range(cfg.explore_active_decisions + 1):
            sc.publish_now("learned")
        pol.decides = 0
        before = sc.current
        sc.publish_now("learned")
        assert pol.decides == 0 and sc.current == before  # ... yet a quiet publish decides none of them

        # Legitimate traffic keeps working: its active cells are decided, and their number bounds the work.
        feed(t, 10, "e2", seed=1)
        sc.drain()
        pol.decides = 0
        sc.publish_now("learned")
        active = {b.key() for b in sc.buckets() if sc.decider.active(b)}
        assert 0 < pol.decides <= len(active) < len(sc.buckets())  # the types of the cells that had windows
        assert sc.current is not None and all(f"target-v1|draft-v1|{rt}|" in "".join(sc.current.entries)
                                              for rt in DEFAULT_ALPHA)
        assert sc.errors == 0
    t.close()


def test_a_restart_replays_no_more_types_than_the_cap(redis_url: str, redis_prefix: str, sqlite_url: str) -> None:
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    cfg = SidecarConfig(consumer=FAST, publish_every_windows=10**6, publish_every_s=3600)
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(cfg, t, store, GoodputPolicy(k_max=8), RedisPublisher(redis_url, redis_prefix))
        t.publish([encode_batch(forged_batch(seq)) for seq in range(20)])  # 200 forged types
        sc.drain()
        # A restart with a lower cap learns from the stored windows that fit under it, no more.
        low = SidecarConfig(consumer=FAST, limits=CardinalityLimits(max_request_types=8))
        sc2 = Sidecar(low, t, store, GoodputPolicy(k_max=8), RedisPublisher(redis_url, redis_prefix))
        assert sc2.health()["tracked"]["request_types"] == 8
        assert len({b.request_type for b in sc2.buckets()}) == 8
    t.close()
