"""A flood of forged labels against a sidecar on real Redis: decisions stay within their time budget so the
leader keeps publishing, real new labels displace forged ones, Redis streams are trimmed once stored, stuck states
show in /health and the metrics, and a pin sent to a follower says that the leader applies it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any

import pytest
from synthetic_feed import feed

from controller.service import sidecar as sidecar_module
from controller.service.http import OperatorServer
from controller.service.lease import Lease, LeaseConfig
from controller.service.publish import RedisPublisher
from controller.service.sidecar import Sidecar, SidecarConfig
from policies.base import Decision
from policies.goodput import GoodputPolicy
from telemetry.cardinality import TOO_MANY_REQUEST_TYPES, CardinalityLimits
from telemetry.ingest import ConsumerConfig
from telemetry.records import AcceptanceWindow, Bucket, WindowBatch
from telemetry.store import Store
from telemetry.transport import RedisConfig, RedisKeys, RedisStreamsTransport
from telemetry.wire import encode_batch

FAST = ConsumerConfig(consumer="c1", block_ms=10, claim_min_idle_ms=0, claim_interval_s=0.0, backoff_s=0.01)
QUIET = dict(consumer=FAST, warm_start_windows=0, publish_every_windows=10**6, publish_every_s=3600)


def acc(rtype: str, target: str = "target-v1", ctx: str = "<=512") -> AcceptanceWindow:
    return AcceptanceWindow(target, "draft-v1", rtype, ctx, k=2, rows=4, drafted=8, accepted=4, emitted=8,
                            hist=(1, 2, 1))


def forged(t: RedisStreamsTransport, types: int, per_batch: int = 50, engine: str = "forger") -> None:
    """``types`` well-formed acceptance windows, each of a new request type and a new version pair."""
    batches = []
    for seq in range(types // per_batch):
        ws = [acc(f"forged-{seq * per_batch + i}") for i in range(per_batch)]
        ws += [acc("code", target=f"forged-t{seq * per_batch + i}") for i in range(per_batch)]
        batches.append(WindowBatch(engine, seq + 1, float(seq), seq + 0.25, tuple(ws), ()))
    t.publish([encode_batch(b) for b in batches])


class FakeClock:
    """The sidecar's perf_counter, advanced by the policy: each decide costs ``per_decide`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class SlowPolicy(GoodputPolicy):
    def __init__(self, clock: FakeClock, per_decide: float) -> None:
        super().__init__(k_max=8, seed=0)
        self.clock, self.per_decide, self.decided = clock, per_decide, 0

    def decide(self, bucket: Bucket, explore: bool = True) -> Decision:
        self.clock.now += self.per_decide
        self.decided += 1
        return super().decide(bucket, explore)


@pytest.mark.slow
def test_a_decision_stops_at_its_budget_and_the_next_one_goes_on_from_there(
        redis_url: str, redis_prefix: str, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(sidecar_module.time, "perf_counter", clock.perf_counter)
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    pol = SlowPolicy(clock, per_decide=0.0625)
    cfg = SidecarConfig(**QUIET, decide_budget_s=0.5)  # type: ignore[arg-type]
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(cfg, t, store, pol, RedisPublisher(redis_url, redis_prefix))
        feed(t, 400, seed=0)
        forged(t, 100)
        sc.drain()  # its first step took a decision too (publish_every_s had not started)
        buckets = len(sc.buckets())
        assert buckets > 100
        per_decision = round(cfg.decide_budget_s / pol.per_decide)

        pol.decided = 0
        sc.publish_now("learned")
        assert pol.decided == per_decision  # stopped at the budget ...
        assert sc.health()["deciding"]["deferred_buckets"] > 0  # ... with buckets left for the next decision
        assert sc.current is not None  # a table is out although not every bucket was reached

        for _ in range(buckets // per_decision + 1):  # each decision reaches the next share first
            pol.decided = 0
            sc.publish_now("learned")
            assert pol.decided <= per_decision
            if not sc.health()["deciding"]["deferred_buckets"]:
                break
        assert sc.health()["deciding"]["deferred_buckets"] == 0
        assert sc.current is not None and len(sc.current.entries) == buckets
        assert sc.metrics.registry.get_sample_value("spectune_decision_deferred_buckets") == 0
    t.close()


def test_forged_labels_give_way_to_a_real_new_type_and_a_real_model_update(
        redis_url: str, redis_prefix: str, sqlite_url: str) -> None:
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    limits = CardinalityLimits(max_request_types=8, max_version_pairs=4)
    cfg = SidecarConfig(**QUIET, limits=limits)  # type: ignore[arg-type]
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(cfg, t, store, GoodputPolicy(k_max=8), RedisPublisher(redis_url, redis_prefix))
        feed(t, 400, seed=0)
        sc.drain()
        forged(t, 200)
        sc.drain()
        sc.publish_now("learned")
        assert sc.rejected[TOO_MANY_REQUEST_TYPES] > 0
        assert sc.health()["status"] == "degraded" and "label_caps" in sc.health()["degraded_because"]

        # A real new type (631 windows) and a real model update (the same traffic on target-v2) arrive.
        real = [acc("real-new-type") for _ in range(631)]
        t.publish([encode_batch(WindowBatch("e9", i + 1, float(i), i + 0.25, tuple(real[i * 50:(i + 1) * 50]), ()))
                   for i in range(13)])
        feed(t, 2400, "e-v2", seed=2, target_version="target-v2")
        sc.drain()
        for _ in range(10):  # a decision has a time budget: the new buckets may take a few
            sc.publish_now("learned")
            if not sc.health()["deciding"]["deferred_buckets"]:
                break
        table = sc.current
        assert table is not None
        assert any("|real-new-type|" in key for key in table.entries)
        assert any(key.startswith("target-v2|") for key in table.entries)
        health = sc.health()
        assert health["evicted"].get("request_type", 0) >= 1 and health["evicted"].get("version_pair", 0) >= 1
        # the evicted labels left the table, the policy and the tracked buckets
        types = {b.request_type for b in sc.buckets()}
        assert "real-new-type" in types and len(types) <= limits.max_request_types
        assert health["tracked"]["request_types"] <= limits.max_request_types
        assert sc.metrics.registry.get_sample_value("spectune_labels_evicted_total", {"kind": "request_type"}) >= 1

        # A restart learns from the store and keeps the real labels.
        sc2 = Sidecar(replace(cfg, warm_start_windows=20_000), t, store, GoodputPolicy(k_max=8),
                      RedisPublisher(redis_url, redis_prefix))
        assert "real-new-type" in {b.request_type for b in sc2.buckets()}
        assert any(b.target_version == "target-v2" for b in sc2.buckets())
    t.close()


def test_the_windows_stream_is_trimmed_once_stored_and_unread_entries_stay(
        redis_url: str, redis_prefix: str, sqlite_url: str) -> None:
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    consumer = replace(FAST, claim_min_idle_ms=600_000, count=4)  # reads 4 entries a step, claims nothing
    cfg = SidecarConfig(**{**QUIET, "consumer": consumer}, trim_every_s=0.001,  # type: ignore[arg-type]
                        stream_backlog_degraded=5)
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(cfg, t, store, GoodputPolicy(k_max=8), RedisPublisher(redis_url, redis_prefix))
        sent = feed(t, 800, seed=0)
        assert t.stream_lengths()["windows"] == sent
        sc.drain()
        sc.step()
        assert t.stream_lengths()["windows"] == 0  # every entry was stored and acknowledged: none kept
        assert sc.health()["streams"]["trimmed"] == sent
        assert sc.metrics.registry.get_sample_value("spectune_stream_trimmed_entries_total") == sent
        assert len(store.acceptance_windows()) > 0

        # Entries delivered to a consumer that has not acknowledged them (it may die before storing them) stay,
        # with every entry after the oldest of them (a trim by MINID cuts below one id).
        sent = feed(t, 400, "e2", seed=1)
        held = t.read("other-consumer", 3, 10)
        assert len(held) == 3
        sc.drain()
        sc.step()
        assert t.stream_lengths()["windows"] == sent
        assert sc.health()["streams"]["unread"] == 0
        assert "stream_backlog" not in sc.degraded_because()  # entries held, none waiting to be read
        t.ack([eid for eid, _ in held])
        sc.step()
        assert t.stream_lengths()["windows"] == 0

        # A backlog above the bound is a stuck state: degraded, with its series.
        t.publish([encode_batch(WindowBatch("e3", i + 1, float(i), i + 0.25, (acc("code"),), ())) for i in range(20)])
        sc.step()  # reads 4, so 16 unread entries remain
        assert sc.health()["streams"]["unread"] == 16
        assert "stream_backlog" in sc.degraded_because()
        assert sc.metrics.registry.get_sample_value("spectune_sidecar_degraded", {"reason": "stream_backlog"}) == 1
        sc.drain()
        sc.step()
        assert "stream_backlog" not in sc.degraded_because()
        assert sc.metrics.registry.get_sample_value("spectune_sidecar_degraded", {"reason": "stream_backlog"}) == 0
    t.close()


def call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_pin_sent_to_a_follower_is_applied_by_the_leader_and_followers_report_its_version(
        redis_url: str, redis_prefix: str, sqlite_url: str) -> None:
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    key = RedisKeys(redis_prefix).leader
    # warm start on: the store feed then starts at the store's beginning, not at its top when first polled
    cfg = SidecarConfig(**{**QUIET, "publish_every_s": 0.001, "warm_start_windows": 1000})  # type: ignore[arg-type]
    with Store(sqlite_url, auto_upgrade=True) as store:
        leases = [Lease(redis_url, key, LeaseConfig(3000), token=name) for name in ("a", "b")]
        a, b = (Sidecar(replace(cfg, consumer=replace(FAST, consumer=name)), t, store, GoodputPolicy(k_max=8),
                        RedisPublisher(redis_url, redis_prefix), lease=lease)
                for name, lease in zip(("a", "b"), leases, strict=True))
        feed(t, 400, seed=0)
        a.drain()
        b.drain()
        leader, follower = (a, b) if a.is_leader else (b, a)
        assert leader.is_leader and not follower.is_leader
        leader.step()
        assert leader.version >= 1
        follower.step()
        assert follower.health()["policy_version"] == leader.version  # the store's newest, not 0

        srv = OperatorServer(follower).start()
        try:
            code, res = call(srv.url, "POST", "/pins", {"bucket": "target-v1|draft-v1|*|*|*", "k": 7, "reason": "x"})
            assert code == 202 and res["published"] is False and res["leader"] is False
            assert res["policy_version"] == leader.version
            before = leader.version
            leader.step()  # the leader's next decision applies the stored pin
            assert leader.version == before + 1 and leader.current is not None
            assert leader.current.entries["target-v1|draft-v1|*|*|*"] == 7
            follower.step()
            assert follower.health()["policy_version"] == leader.version
            code, res = call(srv.url, "DELETE", "/pins/target-v1|draft-v1|*|*|*")
            assert code == 202 and res["leader"] is False
        finally:
            srv.close()
        for sc in (a, b):
            sc.release_lease()
        for lease in leases:
            lease.close()
    t.close()


def test_an_overdue_decision_and_lease_churn_make_health_degraded(
        redis_url: str, redis_prefix: str, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(sidecar_module.time, "monotonic", lambda: now[0])
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    cfg = SidecarConfig(**{**QUIET, "publish_every_s": 1.0})  # type: ignore[arg-type]
    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(cfg, t, store, GoodputPolicy(k_max=8), RedisPublisher(redis_url, redis_prefix))
        feed(t, 200, seed=0)
        sc.drain()
        assert sc.health()["deciding"]["decisions"] >= 1 and sc.degraded_because() == []
        now[0] += 2 * cfg.publish_every_s + 1.5  # the loop is stuck: no step took the due decision
        assert sc.degraded_because() == ["decision_overdue"]
        assert sc.health()["deciding"]["overdue"] is True and sc.health()["status"] == "degraded"
        sc.step()  # the due decision is taken
        assert "decision_overdue" not in sc.degraded_because()

        for _ in range(sidecar_module.LEASE_CHURN_LOSSES):
            sc.leadership.leader = True
            sc.leadership.step_down("lost the leader lease")
            now[0] += 1.0
        assert "lease_churn" in sc.degraded_because()
        now[0] += sidecar_module.LEASE_CHURN_WINDOW_S
        assert "lease_churn" not in sc.degraded_because()
    t.close()
