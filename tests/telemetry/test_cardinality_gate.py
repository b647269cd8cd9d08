"""The cardinality gate: caps on request types, buckets and version pairs, evidence-ranked places under a full
cap, and the consumer's split of a batch into stored windows and dead-lettered excess, on real Redis and SQLite."""

from __future__ import annotations

import pytest

from telemetry.cardinality import (
    TOO_MANY_BUCKETS,
    TOO_MANY_REQUEST_TYPES,
    TOO_MANY_VERSIONS,
    CardinalityGate,
    CardinalityLimits,
)
from telemetry.ingest import Consumer, ConsumerConfig
from telemetry.records import AcceptanceWindow, CostWindow, Stat, WindowBatch
from telemetry.store import Store
from telemetry.transport import RedisConfig, RedisStreamsTransport
from telemetry.wire import decode_batch, encode_batch

FAST = ConsumerConfig(consumer="c1", block_ms=10, claim_min_idle_ms=0, claim_interval_s=0.0, backoff_s=0.01)


def acc(rtype: str, ctx: str = "<=512", target: str = "t1", draft: str = "d1") -> AcceptanceWindow:
    return AcceptanceWindow(target, draft, rtype, ctx, k=2, rows=4, drafted=8, accepted=4, emitted=8,
                            hist=(1, 2, 1))


def cost(bb: int, ctx: str = "<=512", target: str = "t1", draft: str = "d1") -> CostWindow:
    s = Stat(2, 0.02, 0.0002, 0.01)
    return CostWindow(target, draft, bb, ctx, max_k=2, rounds=2, tokens_verified=3 * bb * 2, emitted=4 * bb,
                      batch_rows=2 * bb, draft_s=s, verify_s=s, other_s=s, latency_p50=0.01, latency_p95=0.01,
                      latency_p99=0.01)


def batch(seq: int, acceptance: list[AcceptanceWindow], costs: list[CostWindow] | None = None,
          engine: str = "e1") -> WindowBatch:
    return WindowBatch(engine, seq, float(seq), float(seq) + 0.25, tuple(acceptance), tuple(costs or ()))


@pytest.mark.parametrize("field", ["max_request_types", "max_buckets", "max_version_pairs"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8"])
def test_limits_are_validated(field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=field):
        CardinalityLimits(**{field: bad})  # type: ignore[arg-type]


def test_each_cap_has_its_reason_and_known_labels_stay_admitted() -> None:
    g = CardinalityGate(CardinalityLimits(max_request_types=3, max_buckets=40, max_version_pairs=2))
    assert all(g.admit(acc(t)) is None for t in ("a", "b", "c"))
    assert g.admit(acc("d")) == TOO_MANY_REQUEST_TYPES
    assert g.admit(acc("a")) is None  # a type already tracked keeps coming in
    assert g.admit(acc("a", target="t2")) is None
    assert g.admit(acc("a", target="t3")) == TOO_MANY_VERSIONS
    # t1|d1: 3 types x 1 context; batch buckets multiply: 3 x 4 = 12, then 3 x 4 x 2 = 24 with a second context
    assert all(g.admit(cost(bb)) is None for bb in (1, 2, 4, 8))
    assert g.buckets == 12 + 1
    assert g.admit(acc("a", ctx="<=2048")) is None
    assert g.buckets == 24 + 1
    assert g.admit(cost(16)) is None and g.admit(cost(32)) is None  # 3 x 6 x 2 + 1 = 37 fits ...
    assert g.admit(cost(64)) == TOO_MANY_BUCKETS  # ... 3 x 7 x 2 + 1 = 43 does not
    assert g.admit(acc("a", ctx=">8192")) == TOO_MANY_BUCKETS  # 3 x 6 x 3 + 1 = 55: a new context neither
    assert g.buckets == 37 and g.stats() == {
        "request_types": 3, "buckets": 37, "version_pairs": 2, "candidates": 2, "evicted": 0,
        "refused_too_many_buckets": 2, "refused_too_many_request_types": 1, "refused_too_many_versions": 1}


def test_a_flood_is_capped_and_a_redelivery_splits_the_same_way() -> None:
    g = CardinalityGate(CardinalityLimits(max_request_types=8))
    flood = batch(1, [acc("code")] + [acc(f"forged-{i}") for i in range(1000)], [cost(4)])
    first = g.split(flood)
    assert g.request_types == 8
    assert first.admitted is not None and first.reason == TOO_MANY_REQUEST_TYPES
    assert [a.request_type for a in first.admitted.acceptance] == ["code"] + [f"forged-{i}" for i in range(7)]
    assert first.admitted.cost == flood.cost  # the legitimate windows of the batch are kept
    assert first.excess_windows == 1000 - 7
    again = g.split(flood)
    assert again == first
    assert g.split(batch(2, [acc("forged-999")])).admitted is None


def test_the_consumer_stores_the_rest_and_dead_letters_the_excess(redis_url: str, redis_prefix: str,
                                                                   sqlite_url: str) -> None:
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    with Store(sqlite_url, auto_upgrade=True) as store:
        c = Consumer(t, store, FAST, gate=CardinalityGate(CardinalityLimits(max_request_types=2)))
        t.publish([encode_batch(batch(1, [acc("code"), acc("prose"), acc("x1"), acc("x2")], [cost(4)])),
                   encode_batch(batch(2, [acc("x3")])),
                   encode_batch(batch(3, [acc("code")]))])
        fresh = c.step()
        assert [(b.seq, len(b.acceptance), len(b.cost)) for b in fresh] == [(1, 2, 1), (3, 1, 0)]
        assert sorted(w.window.request_type for w in store.acceptance_windows()) == ["code", "code", "prose"]
        assert len(store.cost_windows()) == 1
        dead = t.dead_letters()
        assert [d.reason for d in dead] == [TOO_MANY_REQUEST_TYPES] * 2
        excess = [decode_batch(d.payload) for d in dead]
        assert sorted(a.request_type for b in excess for a in b.acceptance) == ["x1", "x2", "x3"]
        assert {(b.engine_id, b.seq) for b in excess} == {("e1", 1), ("e1", 2)}  # where they came from
        assert c.stats().rejected == {TOO_MANY_REQUEST_TYPES: 3}  # counted per window
        # Per entry: seq 1 was stored with two windows dead-lettered apart, seq 2 was dead-lettered whole, so the
        # three entries are 2 stored + 1 dead-lettered (what the fault suite's fuzz accounting adds up).
        assert (c.stats().stored, c.stats().dead_lettered_entries) == (2, 1)
        assert t.client.xpending(t.stream, "sidecar")["pending"] == 0  # every entry settled
    t.close()


def test_forged_labels_that_filled_the_caps_give_way_to_real_traffic() -> None:
    """A full cap is not first come, first served: forged types and version pairs that came once each are evicted
    by a real new type and a real model update once those have brought ``promote_windows`` windows."""
    lim = CardinalityLimits(max_request_types=8, max_version_pairs=4, promote_windows=16)
    g = CardinalityGate(lim)
    for _ in range(50):
        assert g.admit(acc("code")) is None
    for i in range(200):
        g.admit(acc(f"forged-{i}"))
        g.admit(acc("code", target=f"forged-t{i}"))
    assert g.request_types == 8 and g.version_pairs == 4
    assert g.take_evictions() == []

    # Evidence decays a little per window, so a label crosses promote_windows on about its 17th window.
    answers = [g.admit(acc("prose")) for _ in range(631)]
    first = answers.index(None)
    assert lim.promote_windows - 1 <= first <= lim.promote_windows + 1
    assert set(answers[:first]) == {TOO_MANY_REQUEST_TYPES} and set(answers[first:]) == {None}  # in, for good
    update = [g.admit(acc("code", target="t2")) for _ in range(2406)]
    first = update.index(None)
    assert first <= lim.promote_windows + 1 and set(update[first:]) == {None}

    evicted = g.take_evictions()
    assert [e.kind for e in evicted] == ["request_type", "version_pair"]
    assert evicted[0].request_type is not None and evicted[0].request_type.startswith("forged-")
    assert evicted[1].versions is not None and evicted[1].versions[0].startswith("forged-t")
    assert g.take_evictions() == []  # handed over once
    assert g.admit(acc("code")) is None  # the label with the most evidence was never at risk
    assert g.stats()["evicted"] == 2


def test_labels_of_equal_traffic_do_not_take_turns_and_candidates_are_bounded() -> None:
    lim = CardinalityLimits(max_request_types=2, promote_windows=4, promote_ratio=2.0, max_candidates=8)
    g = CardinalityGate(lim)
    for _ in range(20):
        g.admit(acc("a"))
        g.admit(acc("b"))
        g.admit(acc("c"))  # as much traffic as a and b: never twice the weakest, so never promoted
    assert g.request_types == 2 and g.stats()["evicted"] == 0
    for i in range(1000):  # one window each: candidates, of which at most 2 x max_candidates are remembered
        g.admit(acc(f"x{i}"))
    assert g.stats()["candidates"] <= 2 * lim.max_candidates + 1
    assert g.stats()["evicted"] == 0


def test_a_full_bucket_cap_gives_way_to_a_label_that_earned_a_place() -> None:
    """Forged version pairs fill the bucket cap; a real new type of the real pair then needs buckets, and the
    weakest forged pair is evicted for it, never the real pair."""
    lim = CardinalityLimits(max_buckets=24, max_version_pairs=16, promote_windows=16)
    g = CardinalityGate(lim)
    for _ in range(40):
        assert g.admit(acc("code")) is None and g.admit(cost(1)) is None and g.admit(cost(2)) is None
    for i in range(20):  # each forged pair: 1 type x 2 batch buckets
        g.admit(acc("code", target=f"forged-t{i}"))
        g.admit(cost(1, target=f"forged-t{i}"))
        g.admit(cost(2, target=f"forged-t{i}"))
    assert g.buckets <= lim.max_buckets and g.admit(acc("prose")) == TOO_MANY_BUCKETS
    answers = [g.admit(acc("prose")) for _ in range(40)]
    assert answers[-1] is None and g.admit(acc("prose")) is None
    evicted = g.take_evictions()
    assert evicted and all(e.versions is not None and e.versions[0].startswith("forged-t") for e in evicted)
    assert g.admit(acc("code")) is None and g.buckets <= lim.max_buckets
