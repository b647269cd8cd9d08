"""Aggregation of hand-built rounds into acceptance and cost windows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from telemetry.aggregate import aggregate, percentiles
from telemetry.records import BucketConfig, WindowBatch
from telemetry.synthetic import synthetic_rounds
from telemetry.wire import decode_batch, encode_batch, window_batch_from_dict, window_batch_to_dict


def test_acceptance_counts_rows_per_key_including_k0(make_round) -> None:
    r1 = make_round([("code", 100, 4, 4), ("code", 200, 4, 1), ("prose", 100, 0, 0)])
    r2 = make_round([("code", 300, 4, 0), ("code", 3000, 4, 2)], round_index=1)
    agg = aggregate([r1, r2])
    by_key = {(a.request_type, a.context_bucket, a.k): a for a in agg.acceptance}
    assert set(by_key) == {("code", "<=512", 4), ("prose", "<=512", 0), ("code", "<=8192", 4)}
    a = by_key[("code", "<=512", 4)]
    assert (a.rows, a.drafted, a.accepted, a.emitted) == (3, 12, 5, 8)
    assert a.hist == (1, 1, 0, 0, 1)
    assert a.mean_acceptance_length == pytest.approx(8 / 3)  # counts the bonus token
    assert a.acceptance_curve() == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    off = by_key[("prose", "<=512", 0)]
    assert (off.rows, off.drafted, off.accepted, off.emitted, off.hist) == (1, 0, 0, 1, (1,))
    assert agg.rounds == 2 and agg.rejected == {}


def test_cost_keyed_by_batch_bucket_max_context_and_max_k(make_round) -> None:
    r1 = make_round([("code", 100, 4, 4), ("code", 600, 2, 1), ("prose", 50, 0, 0)], draft_s=0.002, verify_s=0.01)
    r2 = make_round([("code", 100, 4, 3), ("code", 700, 1, 0), ("code", 10, 0, 0)], draft_s=0.004, verify_s=0.02)
    r3 = make_round([("code", 100, 2, 2)], draft_s=0.001, verify_s=0.003)
    agg = aggregate([r1, r2, r3], BucketConfig(batch_edges=(1, 2, 4), context_edges=(512, 2048)))
    by_key = {(c.batch_bucket, c.context_bucket, c.max_k): c for c in agg.cost}
    assert set(by_key) == {(4, "<=2048", 4), (1, "<=512", 2)}
    c = by_key[(4, "<=2048", 4)]
    # Packed verification: the window carries the tokens really verified, sum over rows of k + 1.
    assert (c.rounds, c.batch_rows, c.tokens_verified) == (2, 6, (5 + 3 + 1) + (5 + 2 + 1))
    assert c.emitted == (5 + 2 + 1) + (4 + 1 + 1)
    assert c.draft_s.count == 2 and c.draft_s.total == pytest.approx(0.006) and c.draft_s.max == pytest.approx(0.004)
    assert c.verify_s.sumsq == pytest.approx(0.01**2 + 0.02**2)
    # per-token latency of a row = round wall seconds / tokens that row emitted
    w1, w2 = 0.002 + 0.01 + 0.0005, 0.004 + 0.02 + 0.0005
    lat = [w1 / 5, w1 / 2, w1 / 1, w2 / 4, w2 / 1, w2 / 1]
    assert [c.latency_p50, c.latency_p95, c.latency_p99] == pytest.approx(np.percentile(lat, [50, 95, 99]))


def test_rows_that_emitted_nothing_have_no_latency(make_round) -> None:
    r = make_round([("code", 10, 2, 0), ("code", 10, 2, 1)], emitted=[0, 2])
    (c,) = aggregate([r]).cost
    assert c.latency_p50 == pytest.approx(r.wall_s / 2)
    assert percentiles([]) == [0.0, 0.0, 0.0]


def test_invalid_rounds_are_left_out_and_counted(make_round) -> None:
    good = make_round([("code", 10, 2, 1)])
    bad_acc = make_round([("code", 10, 2, 3)])
    bad_time = make_round([("code", 10, 2, 1)], verify_s=math.nan)
    neg_time = make_round([("code", 10, 2, 1)], draft_s=-1.0)
    bad_name = make_round([("a|b", 10, 2, 1)])
    agg = aggregate([good, bad_acc, bad_time, neg_time, bad_name])
    assert agg.rounds == 1
    assert agg.rejected == {"accepted_gt_drafted": 1, "non_finite": 1, "negative_time": 1, "bad_name": 1}


def test_aggregates_pass_wire_validation() -> None:
    agg = aggregate(synthetic_rounds(500, seed=3))
    batch = WindowBatch("e1", 1, 0.0, 0.25, agg.acceptance, agg.cost)
    back = decode_batch(encode_batch(batch))
    assert back == batch
    assert sum(a.rows for a in agg.acceptance) == sum(c.batch_rows for c in agg.cost)
    assert sum(c.rounds for c in agg.cost) == 500


def test_prefill_counts_for_latency_but_not_for_the_cost_of_k(make_round) -> None:
    from dataclasses import replace

    plain = make_round([("code", 10, 2, 1)], draft_s=0.002, verify_s=0.01, other_s=0.0005)
    admitting = replace(plain, prefill_s=0.05)
    (c,) = aggregate([admitting]).cost
    assert c.other_s.total == pytest.approx(0.0005) and c.draft_s.total + c.verify_s.total == pytest.approx(0.012)
    assert c.latency_p50 == pytest.approx(admitting.wall_s / 2) and admitting.wall_s == pytest.approx(0.0625)
    assert aggregate([replace(plain, prefill_s=-1.0)]).rejected == {"negative_time": 1}
    # On the wire: sampled rounds carry it; rounds from engines that predate it read as 0.
    batch = WindowBatch("e", 0, 0.0, 1.0, (), (), (admitting,))
    assert decode_batch(encode_batch(batch)).sampled_rounds[0].prefill_s == pytest.approx(0.05)
    d = window_batch_to_dict(WindowBatch("e", 0, 0.0, 1.0, (), (), (plain,)))
    del d["sampled_rounds"][0]["prefill_s"]
    assert window_batch_from_dict(d).sampled_rounds[0].prefill_s == 0.0


def test_an_uncosted_round_counts_for_acceptance_not_for_cost(make_round) -> None:
    from dataclasses import replace

    plain = make_round([("code", 10, 2, 1)], draft_s=0.002, verify_s=0.01, other_s=0.0005)
    mixed = replace(make_round([("code", 10, 2, 2), ("prose", 20, 2, 0)], draft_s=0.002, verify_s=0.5,
                               other_s=0.0005), costed=False)
    agg = aggregate([plain, mixed])
    assert agg.rounds == 2 and sum(a.rows for a in agg.acceptance) == 3
    (c,) = agg.cost
    assert (c.rounds, c.batch_rows) == (1, 1) and c.verify_s.total == pytest.approx(0.01)
    assert aggregate([mixed]).cost == ()


def test_a_round_claiming_more_tokens_verified_than_its_rows_can_is_rejected(make_round) -> None:
    from dataclasses import replace

    good = make_round([("code", 100, 4, 4), ("code", 600, 0, 0)])
    assert good.tokens_verified == 5 + 1
    padded = replace(good, tokens_verified=2 * 5)  # a padded engine's count: still within the bounds
    too_many = replace(good, tokens_verified=2 * 5 + 1)
    too_few = replace(good, tokens_verified=1)
    agg = aggregate([good, padded, too_many, too_few], BucketConfig())
    assert agg.rounds == 2 and agg.rejected == {"bad_tokens_verified": 2}
