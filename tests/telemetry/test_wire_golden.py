"""The bytes on the wire and the errors for bad ones are fixed: engines and sidecars of different builds share them.

The constants below are what engines and sidecars of schema version 1 exchange. However the wire definitions are
built from :mod:`telemetry.records`, the codec must write and read exactly these bytes, and refuse a bad payload
with the same reason and the same words (operators count and search dead letters by them).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from telemetry import wire
from telemetry.records import (
    AcceptanceWindow,
    CostWindow,
    RecordError,
    RoundRecord,
    RowRecord,
    Stat,
    WindowBatch,
)
from telemetry.wire import decode_batch, encode_batch

_ROWS = (RowRecord("code", 130, 3, 2, 3), RowRecord("prose", 4097, 0, 0, 1))
BATCH = WindowBatch(
    "engine-7", 12345678901, 1700000000.0, 1700000000.25,
    (AcceptanceWindow("t-v1", "d-v1", "code", "<=512", 3, 4, 12, 7, 10, (1, 0, 2, 1)),
     AcceptanceWindow("t-v1", "d-v1", "prose", ">8192", 0, 2, 0, 0, 2, (2,))),
    (CostWindow("t-v1", "d-v1", 2, "<=8192", 3, 2, 9, 6, 4, Stat(2, 0.0025, 3.125e-06, 0.0015),
                Stat(2, 0.008, 3.2e-05, 0.004), Stat(2, 0.001, 5e-07, 0.0005), 0.001, 0.0025, 0.003),),
    (RoundRecord(round_index=41, batch_size=2, max_k=3, tokens_verified=5, draft_s=0.00125, verify_s=0.004,
                 other_s=0.0005, target_version="t-v1", draft_version="d-v1", rows=_ROWS, timestamp=1700000000.25,
                 prefill_s=0.0375),),
    dropped_before=3,
)

GOLDEN_JSON = (
    b'{"engine_id":"engine-7","seq":12345678901,"window_start":1700000000.0,"window_end":1700000000.25,'
    b'"acceptance":[{"target_version":"t-v1","draft_version":"d-v1","request_type":"code","context_bucket":"<=512",'
    b'"k":3,"rows":4,"drafted":12,"accepted":7,"emitted":10,"hist":[1,0,2,1]},{"target_version":"t-v1",'
    b'"draft_version":"d-v1","request_type":"prose","context_bucket":">8192","k":0,"rows":2,"drafted":0,'
    b'"accepted":0,"emitted":2,"hist":[2]}],"cost":[{"target_version":"t-v1","draft_version":"d-v1",'
    b'"batch_bucket":2,"context_bucket":"<=8192","max_k":3,"rounds":2,"tokens_verified":9,"emitted":6,'
    b'"batch_rows":4,"draft_s":{"count":2,"total":0.0025,"sumsq":3.125e-6,"max":0.0015},"verify_s":{"count":2,'
    b'"total":0.008,"sumsq":0.000032,"max":0.004},"other_s":{"count":2,"total":0.001,"sumsq":5e-7,"max":0.0005},'
    b'"latency_p50":0.001,"latency_p95":0.0025,"latency_p99":0.003}],"sampled_rounds":[{"round_index":41,'
    b'"batch_size":2,"max_k":3,"tokens_verified":5,"draft_s":0.00125,"verify_s":0.004,"other_s":0.0005,'
    b'"target_version":"t-v1","draft_version":"d-v1","rows":[{"request_type":"code","context_len":130,"k":3,'
    b'"accepted":2,"emitted":3},{"request_type":"prose","context_len":4097,"k":0,"accepted":0,"emitted":1}],'
    b'"timestamp":1700000000.25,"prefill_s":0.0375,"costed":true}],"dropped_before":3,"schema_version":1}'
)
GOLDEN_MSGPACK = bytes.fromhex(
    "89a9656e67696e655f6964a8656e67696e652d37a3736571cf00000002dfdc1c35ac77696e646f775f7374617274cb41d954fc40000000aa"
    "77696e646f775f656e64cb41d954fc40100000aa616363657074616e6365928aae7461726765745f76657273696f6ea4742d7631ad647261"
    "66745f76657273696f6ea4642d7631ac726571756573745f74797065a4636f6465ae636f6e746578745f6275636b6574a53c3d353132a16b"
    "03a4726f777304a7647261667465640ca8616363657074656407a7656d69747465640aa46869737494010002018aae7461726765745f7665"
    "7273696f6ea4742d7631ad64726166745f76657273696f6ea4642d7631ac726571756573745f74797065a570726f7365ae636f6e74657874"
    "5f6275636b6574a53e38313932a16b00a4726f777302a76472616674656400a8616363657074656400a7656d697474656402a46869737491"
    "02a4636f7374918fae7461726765745f76657273696f6ea4742d7631ad64726166745f76657273696f6ea4642d7631ac62617463685f6275"
    "636b657402ae636f6e746578745f6275636b6574a63c3d38313932a56d61785f6b03a6726f756e647302af746f6b656e735f766572696669"
    "656409a7656d697474656406aa62617463685f726f777304a764726166745f7384a5636f756e7402a5746f74616ccb3f647ae147ae147ba5"
    "73756d7371cb3eca36e2eb1c432da36d6178cb3f589374bc6a7efaa87665726966795f7384a5636f756e7402a5746f74616ccb3f80624dd2"
    "f1a9fca573756d7371cb3f00c6f7a0b5ed8da36d6178cb3f70624dd2f1a9fca76f746865725f7384a5636f756e7402a5746f74616ccb3f50"
    "624dd2f1a9fca573756d7371cb3ea0c6f7a0b5ed8da36d6178cb3f40624dd2f1a9fcab6c6174656e63795f703530cb3f50624dd2f1a9fcab"
    "6c6174656e63795f703935cb3f647ae147ae147bab6c6174656e63795f703939cb3f689374bc6a7efaae73616d706c65645f726f756e6473"
    "918dab726f756e645f696e64657829aa62617463685f73697a6502a56d61785f6b03af746f6b656e735f766572696669656405a764726166"
    "745f73cb3f547ae147ae147ba87665726966795f73cb3f70624dd2f1a9fca76f746865725f73cb3f40624dd2f1a9fcae7461726765745f76"
    "657273696f6ea4742d7631ad64726166745f76657273696f6ea4642d7631a4726f77739285ac726571756573745f74797065a4636f6465ab"
    "636f6e746578745f6c656ecc82a16b03a8616363657074656402a7656d69747465640385ac726571756573745f74797065a570726f7365ab"
    "636f6e746578745f6c656ecd1001a16b00a8616363657074656400a7656d697474656401a974696d657374616d70cb41d954fc40100000a9"
    "70726566696c6c5f73cb3fa3333333333333a6636f73746564c3ae64726f707065645f6265666f726503ae736368656d615f76657273696f"
    "6e01"
)


@pytest.mark.parametrize(("encoding", "golden"), [("json", GOLDEN_JSON), ("msgpack", GOLDEN_MSGPACK)])
def test_the_bytes_on_the_wire_are_the_golden_ones(encoding: str, golden: bytes) -> None:
    assert encode_batch(BATCH, encoding) == golden  # type: ignore[arg-type]
    assert decode_batch(golden) == BATCH


def test_a_round_without_prefill_reads_as_no_prefill() -> None:
    b = decode_batch(GOLDEN_JSON.replace(b',"prefill_s":0.0375', b""))
    old_round = dataclasses.replace(BATCH.sampled_rounds[0], prefill_s=0.0)
    assert b == dataclasses.replace(BATCH, sampled_rounds=(old_round,))


def test_a_round_without_costed_reads_as_costed() -> None:
    # Engines that predate RoundRecord.costed send every round's seconds as a measurement of its k.
    b = decode_batch(GOLDEN_JSON.replace(b',"costed":true', b""))
    assert b == BATCH and b.sampled_rounds[0].costed
    uncosted = dataclasses.replace(BATCH.sampled_rounds[0], costed=False)
    batch = dataclasses.replace(BATCH, sampled_rounds=(uncosted,))
    assert decode_batch(encode_batch(batch)) == batch


# (text in GOLDEN_JSON, what replaces it, reason, detail): the detail names the field by its path, in msgspec's words.
GOLDEN_ERRORS = [
    ('"seq":12345678901', '"seq":-1', "out_of_range", "Expected `int` >= 0 - at `$.seq`"),
    ('"window_end":1700000000.25', '"window_end":"soon"', "bad_type",
     "Expected `float`, got `str` - at `$.window_end`"),
    (',"schema_version":1', "", "unknown_schema_version", "schema_version=None, this build reads 1"),
    ('"schema_version":1', '"schema_version":2', "unknown_schema_version", "schema_version=2, this build reads 1"),
    ('"k":3,"rows":4', '"k":17,"rows":4', "out_of_range", "Expected `int` <= 16 - at `$.acceptance[0].k`"),
    ('"hist":[1,0,2,1]', '"hist":[1,0,2,-1]', "out_of_range", "Expected `int` >= 0 - at `$.acceptance[0].hist[3]`"),
    ('"context_bucket":"<=512",', "", "bad_type",
     "Object missing required field `context_bucket` - at `$.acceptance[0]`"),
    ('"batch_bucket":2', '"batch_bucket":0', "out_of_range", "Expected `int` >= 1 - at `$.cost[0].batch_bucket`"),
    ('"rounds":2', '"rounds":0', "out_of_range", "Expected `int` >= 1 - at `$.cost[0].rounds`"),
    ('"draft_s":{"count":2,"total":0.0025', '"draft_s":{"count":2,"total":-0.0025', "negative_time",
     "Expected `float` >= 0.0 - at `$.cost[0].draft_s.total`"),
    ('"sumsq":0.000032', '"sumsq":true', "bad_type", "Expected `float`, got `bool` - at `$.cost[0].verify_s.sumsq`"),
    ('"batch_size":2', '"batch_size":0', "out_of_range", "Expected `int` >= 1 - at `$.sampled_rounds[0].batch_size`"),
    ('"context_len":4097', '"context_len":1099511627777', "out_of_range",
     "Expected `int` <= 1099511627776 - at `$.sampled_rounds[0].rows[1].context_len`"),
    ('"k":0,"accepted":0,"emitted":1', '"k":0,"accepted":0,"emitted":1.5', "bad_type",
     "Expected `int`, got `float` - at `$.sampled_rounds[0].rows[1].emitted`"),
    ('"prefill_s":0.0375', '"prefill_s":null', "bad_type",
     "Expected `float`, got `null` - at `$.sampled_rounds[0].prefill_s`"),
    ('"acceptance":[', '"acceptance":{"x":1},"y":[', "bad_type", "Expected `array`, got `object` - at `$.acceptance`"),
    ('"accepted":7', '"accepted":8', "bad_hist", "hist does not add up to accepted"),
    ('"tokens_verified":5', '"tokens_verified":9', "bad_tokens_verified",
     "tokens_verified=9 outside [batch_size, batch_size * (max_k + 1)] = [2, 8]"),
]


@pytest.mark.parametrize(("old", "new", "reason", "detail"), GOLDEN_ERRORS)
def test_bad_bytes_are_refused_with_the_golden_reason_and_words(old: str, new: str, reason: str, detail: str) -> None:
    assert GOLDEN_JSON.count(old.encode()) == 1
    with pytest.raises(RecordError) as e:
        decode_batch(GOLDEN_JSON.replace(old.encode(), new.encode()))
    assert (e.value.reason, e.value.detail) == (reason, detail)


@pytest.mark.parametrize(
    ("record", "struct"),
    [(Stat, wire._Stat), (AcceptanceWindow, wire._Acceptance), (CostWindow, wire._Cost), (RowRecord, wire._Row),
     (RoundRecord, wire._Round), (WindowBatch, wire._Batch)],
)
def test_the_wire_structs_are_types_hypothesis_can_draw(record: type, struct: type) -> None:
    # bench/faults.py draws hostile documents with st.from_type on these structs.
    assert isinstance(struct, type)
    assert struct.__struct_fields__ == tuple(f.name for f in dataclasses.fields(record))  # type: ignore[attr-defined]

    @settings(max_examples=5, database=None, deadline=None)
    @given(st.from_type(struct))
    def draw(s: object) -> None:
        assert isinstance(s, struct)

    draw()
