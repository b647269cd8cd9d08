"""Wire encoding: JSON and msgpack round trips, and no byte string crashes the decoders."""

from __future__ import annotations

import contextlib
import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from telemetry.aggregate import aggregate
from telemetry.records import MAX_ENCODED_BYTES, RecordError, WindowBatch
from telemetry.synthetic import synthetic_rounds
from telemetry.wire import decode_batch, encode_batch, window_batch_from_dict, window_batch_to_dict


def _batch() -> WindowBatch:
    rounds = list(synthetic_rounds(50, seed=1))
    agg = aggregate(rounds)
    return WindowBatch("e1", 7, 1.0, 1.25, agg.acceptance, agg.cost, tuple(rounds[:3]), dropped_before=2)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_round_trip(encoding: str) -> None:
    b = _batch()
    assert decode_batch(encode_batch(b, encoding)) == b  # type: ignore[arg-type]


def test_msgpack_is_smaller_with_the_same_shape() -> None:
    b = _batch()
    packed = encode_batch(b, "msgpack")
    assert len(packed) < len(encode_batch(b, "json"))
    assert msgpack.unpackb(packed) == json.loads(encode_batch(b, "json"))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda d: d.update(schema_version=99), "unknown_schema_version"),
        (lambda d: d.update(seq="7"), "bad_type"),
        (lambda d: d["cost"][0].update(latency_p50=-1.0), "negative_time"),
        (lambda d: d["acceptance"][-1].update(accepted=10**6), "accepted_gt_drafted"),
    ],
)
def test_msgpack_is_validated_like_json(mutate, reason: str) -> None:
    d = window_batch_to_dict(_batch())
    mutate(d)
    with pytest.raises(RecordError) as e:
        decode_batch(msgpack.packb(d))
    assert e.value.reason == reason


def test_nan_is_rejected_in_both_encodings() -> None:
    d = window_batch_to_dict(_batch())
    d["cost"][0]["latency_p99"] = float("nan")
    for payload in (json.dumps(d).encode(), msgpack.packb(d)):  # Python's json writes NaN, though JSON has none
        with pytest.raises(RecordError) as e:
            decode_batch(payload)
        assert e.value.reason == "non_finite"


def test_oversized_payloads_are_rejected_unread() -> None:
    for payload in (b"{" + b" " * MAX_ENCODED_BYTES + b"}", b"\x80" * (MAX_ENCODED_BYTES + 1)):
        with pytest.raises(RecordError) as e:
            decode_batch(payload)
        assert e.value.reason == "too_large"


_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=2048))
def test_no_byte_string_crashes_the_decoder(data: bytes) -> None:
    with contextlib.suppress(RecordError):
        decode_batch(data)
    with contextlib.suppress(RecordError):
        decode_batch(b"{" + data)  # the JSON path too


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=15), inner, max_size=6),
    max_leaves=30,
)


@_FUZZ
@given(_json)
def test_no_structure_crashes_the_validator(obj: object) -> None:
    # Structured fuzz reaches deeper than random bytes: valid JSON / msgpack of arbitrary shape.
    for payload in (json.dumps(obj).encode(), msgpack.packb(obj)):
        with contextlib.suppress(RecordError):
            decode_batch(payload)


@_FUZZ
@given(st.sampled_from(["acceptance", "cost"]), st.text(max_size=12), _json)
def test_corrupting_one_field_of_a_valid_batch_never_crashes(section: str, key: str, value: object) -> None:
    d = window_batch_to_dict(_batch())
    d[section][0][key] = value
    with contextlib.suppress(RecordError):
        decode_batch(json.dumps(d).encode())
    with contextlib.suppress(RecordError):
        decode_batch(msgpack.packb(d))


def test_numbers_beyond_a_float_are_rejected_not_crashing() -> None:
    # A 5000-digit int trips Python's int-parsing limit; a 400-digit one parses but cannot become a float; a
    # 20-digit one fits no 64-bit column of the store. All must be a RecordError, as any other bad input.
    d = window_batch_to_dict(_batch())
    text = json.dumps(d, separators=(",", ":")).encode()
    with pytest.raises(RecordError) as e:
        decode_batch(text.replace(b'"seq":7', b'"seq":' + b"1" * 5000))
    assert e.value.reason == "undecodable"
    with pytest.raises(RecordError) as e:
        decode_batch(text.replace(b'"window_start":1.0', b'"window_start":1' + b"0" * 400))
    assert e.value.reason == "out_of_range"
    with pytest.raises(RecordError) as e:
        decode_batch(text.replace(b'"seq":7', b'"seq":' + b"1" * 20))
    assert e.value.reason == "out_of_range"


@pytest.mark.parametrize(
    ("section", "key", "value", "reason"),
    [
        ("acceptance", "k", True, "bad_type"),  # a bool is not an int, though isinstance says so
        ("acceptance", "rows", 3.0, "bad_type"),
        ("acceptance", "k", 17, "out_of_range"),
        ("acceptance", "hist", [0, -1], "out_of_range"),
        ("acceptance", "request_type", "a|b", "bad_name"),
        ("cost", "rounds", 0, "out_of_range"),
        ("cost", "batch_rows", False, "bad_type"),
        ("cost", "draft_s", {"count": 1, "total": float("inf"), "sumsq": 0.0, "max": 0.0}, "non_finite"),
        # Finite, but no engine measures it: its sums would overflow what a policy learns to inf.
        ("cost", "verify_s", {"count": 1, "total": 1e308, "sumsq": 1e308, "max": 1e308}, "implausible"),
        ("cost", "verify_s", {"count": 1, "total": 3600.0 * 1000, "sumsq": 0.0, "max": 0.0}, "implausible"),
        ("cost", "emitted", 1 << 41, "out_of_range"),
        ("acceptance", "emitted", 1 << 41, "out_of_range"),
    ],
)
def test_each_rule_names_its_reason(section: str, key: str, value: object, reason: str) -> None:
    d = window_batch_to_dict(_batch())
    d[section] = [dict(x) for x in d[section]]
    d[section][0][key] = value
    with pytest.raises(RecordError) as e:
        window_batch_from_dict(d)
    assert e.value.reason == reason


def test_int_subclasses_are_still_accepted_and_converted() -> None:
    import enum

    class K(enum.IntEnum):
        FOUR = 4

    d = window_batch_to_dict(_batch())
    entry = next(dict(a) for a in d["acceptance"] if a["k"] == 4)
    entry["k"] = K.FOUR
    d["acceptance"] = [entry]
    got = window_batch_from_dict(d).acceptance[0]
    assert got.k == 4 and type(got.k) is int
