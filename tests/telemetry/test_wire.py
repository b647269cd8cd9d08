"""The wire's rules are one set: the decoder, the engine's round check and the policies' window check agree."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace

import msgpack
import pytest

from telemetry.aggregate import aggregate
from telemetry.emitter import Emitter, EmitterConfig
from telemetry.records import AcceptanceWindow, RecordError, Stat, WindowBatch
from telemetry.synthetic import synthetic_rounds
from telemetry.transport import InProcessTransport
from telemetry.wire import (
    check_label,
    check_round,
    check_rounds,
    check_window,
    decode_batch,
    encode_batch,
    window_batch_from_dict,
    window_batch_to_dict,
)


def _batch(**kw: object) -> WindowBatch:
    agg = aggregate(synthetic_rounds(40, seed=5))
    return WindowBatch("e1", 3, 1.0, 1.25, agg.acceptance, agg.cost, **kw)  # type: ignore[arg-type]


def _error(fn: object, *args: object) -> RecordError:
    with pytest.raises(RecordError) as e:
        fn(*args)  # type: ignore[operator]
    return e.value


def _reason(fn: object, *args: object) -> str:
    return _error(fn, *args).reason


def test_the_travelling_shape_is_the_records_fields() -> None:
    # SCHEMA_VERSION stays 1: what travels is what dataclasses.asdict gives.
    b = _batch(sampled_rounds=tuple(synthetic_rounds(2, seed=1)))
    shape = json.loads(json.dumps(dataclasses.asdict(b)))
    assert json.loads(encode_batch(b)) == json.loads(json.dumps(window_batch_to_dict(b))) == shape
    for encoding in ("json", "msgpack"):
        assert decode_batch(encode_batch(b, encoding)) == b  # type: ignore[arg-type]


def test_a_round_the_engine_refuses_is_refused_on_the_wire_for_the_same_reason(make_round) -> None:
    good = make_round([("code", 10, 2, 1), ("code", 10, 2, 2)])
    bad = [
        (replace(good, tokens_verified=good.tokens_verified + 10), "bad_tokens_verified"),
        (replace(good, verify_s=math.nan), "non_finite"),
        (replace(good, draft_s=-0.0), "negative_time"),
        (replace(good, target_version="t\x00"), "bad_name"),
        (make_round([("code", 10, 2, 3)]), "accepted_gt_drafted"),
    ]
    check_round(good)
    for r, reason in bad:
        assert _reason(check_round, r) == reason
        assert aggregate([r]).rejected == {reason: 1}
        # the window's check: each round its own verdict, whether a field or a rule between fields is broken
        verdicts = check_rounds([good, r, good])
        assert verdicts[0] is None and verdicts[2] is None and verdicts[1] is not None
        assert (verdicts[1].reason, verdicts[1].detail) == (reason, _error(check_round, r).detail)
        assert aggregate([good, r, good]).rejected == {reason: 1} and aggregate([good, r, good]).rounds == 2
        d = window_batch_to_dict(_batch(sampled_rounds=(r,)))
        assert _reason(window_batch_from_dict, d) == reason
        assert _reason(decode_batch, msgpack.packb(d)) == reason


def test_a_window_the_policies_refuse_is_refused_on_the_wire_for_the_same_reason() -> None:
    b = _batch()
    a = next(x for x in b.acceptance if x.accepted > 0)
    c = b.cost[0]
    bad = [
        (replace(a, hist=(a.rows, *([0] * a.k))), "bad_hist"),  # every row at 0 accepted: not `accepted`
        (replace(a, drafted=a.drafted + 1), "bad_drafted"),
        (replace(a, request_type="a|b"), "bad_name"),
        (replace(c, tokens_verified=c.batch_rows - 1), "bad_tokens_verified"),
        (replace(c, draft_s=Stat(1, -math.inf, 0.0, 0.0)), "non_finite"),
        (replace(c, latency_p95=-0.0), "negative_time"),
    ]
    for w, reason in bad:
        assert _reason(check_window, w) == reason
        field = "acceptance" if isinstance(w, AcceptanceWindow) else "cost"
        wire = replace(b, **{field: (w,)})
        assert _reason(decode_batch, msgpack.packb(window_batch_to_dict(wire))) == reason
    assert _reason(check_window, object()) == "bad_type"


def test_one_label_rule() -> None:
    assert check_label("target-v1", "x") == "target-v1"
    for bad in ("", "a|b", "x" * 65, "tab\there", "\u200bzero-width"):
        assert _reason(check_label, bad, "x") == "bad_name"
    assert _reason(check_label, 7, "x") == "bad_type"
    with pytest.raises(ValueError, match="engine_id"):
        EmitterConfig(engine_id="e\x00")


def test_json_constants_are_named_non_finite_and_other_garbage_undecodable() -> None:
    text = json.dumps(window_batch_to_dict(_batch()))
    assert _reason(decode_batch, text.replace('"window_end": 1.25', '"window_end": Infinity').encode()) == "non_finite"
    assert _reason(decode_batch, text[:-5].encode()) == "undecodable"
    assert _reason(decode_batch, msgpack.packb(0) + b"trailing") == "undecodable"


def test_the_emitter_samples_only_rounds_the_sidecar_would_accept(make_round) -> None:
    t = InProcessTransport()
    em = Emitter(t, EmitterConfig(engine_id="e1", sample_rate=1.0), start=False)
    good = make_round([("code", 10, 2, 1)])
    em.record(good)
    em.record(replace(good, draft_s=-1.0))  # left out of the aggregates and of the sample
    em.flush()
    ((_, payload),) = t.read("c", 10, 0)
    b = decode_batch(payload)
    assert b.sampled_rounds == (good,) and em.stats().rounds_rejected == {"negative_time": 1}
