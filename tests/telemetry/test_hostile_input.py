"""Hostile input at the telemetry boundary: bucket keys, wire types, table sizes, URL secrets."""

from __future__ import annotations

import json

import pytest

from telemetry.aggregate import aggregate
from telemetry.migrate import upgrade
from telemetry.policy_table import (
    MAX_TABLE_BYTES,
    MAX_TABLE_ENTRIES,
    check_table_size,
    policy_table_from_json,
    table_to_json,
)
from telemetry.records import POLICY_SCHEMA_VERSION, PolicyTable, RecordError, WindowBatch
from telemetry.store import Store
from telemetry.synthetic import synthetic_rounds
from telemetry.urls import redact_url
from telemetry.wire import parse_bucket, parse_bucket_key, window_batch_from_dict, window_batch_to_dict


def _valid_batch(seq: int = 1) -> WindowBatch:
    agg = aggregate(synthetic_rounds(30, seed=seq))
    return WindowBatch("e-ok", seq, 0.0, 0.25, agg.acceptance, agg.cost)


# Characters str.isdigit() or int() accept that are not ASCII digits, and other near-misses of a batch bucket.
BAD_BATCH_PARTS = ["²", "٣", "８", " 4", "4 ", "+4", "-4", "04", "0", "4_0", "", "1e3"]


@pytest.mark.parametrize("part", BAD_BATCH_PARTS)
def test_the_one_bucket_key_parser_wants_ascii_digits(part: str) -> None:
    key = f"t|d|code|{part}|<=512"
    for parse in (lambda: parse_bucket_key(key), lambda: parse_bucket(key)):
        with pytest.raises(RecordError) as e:
            parse()
        assert e.value.reason == "bad_bucket_key"
    table = {"version": 1, "default_k": 0, "k_max": 8, "entries": {key: 1}, "schema_version": POLICY_SCHEMA_VERSION}
    with pytest.raises(RecordError) as e:
        policy_table_from_json(json.dumps(table))
    assert e.value.reason == "bad_bucket_key"


@pytest.mark.parametrize("key", ["t|d|co\x00de|8|<=512", "t|d|code|8|<=512\n", "t|d|\u200bx|8|*",
                                 "t|d|" + "x" * 65 + "|8|*", "t|d|code|8", "t|d|code|8|<=512|x", "t||code|8|*"])
def test_labels_follow_the_wire_rule(key: str) -> None:
    with pytest.raises(RecordError) as e:
        parse_bucket_key(key)
    assert e.value.reason == "bad_bucket_key"


def test_wildcards_only_where_allowed() -> None:
    assert parse_bucket_key("*|*|*|*|*") == ("*", "*", "*", None, "*")
    assert parse_bucket_key("t|d|code|16|<=512", wildcard=False) == ("t", "d", "code", 16, "<=512")
    with pytest.raises(RecordError):
        parse_bucket_key("t|d|code|*|<=512", wildcard=False)
    with pytest.raises(RecordError):
        parse_bucket("t|d|*|8|<=512")  # a Bucket is one exact bucket


@pytest.mark.parametrize("part", ["²", "٣"])
def test_a_pin_needs_an_ascii_batch_bucket(sqlite_url: str, part: str) -> None:
    upgrade(sqlite_url)
    with Store(sqlite_url) as s:
        with pytest.raises(RecordError) as e:
            s.pin(f"*|*|*|{part}|*", 1, "x")
        assert e.value.reason == "bad_bucket_key"
        assert s.active_pins() == []


@pytest.mark.parametrize("value", [True, 1.0])
def test_schema_version_must_be_the_int_itself(value: object) -> None:
    d = window_batch_to_dict(_valid_batch())
    d["schema_version"] = value
    with pytest.raises(RecordError) as e:
        window_batch_from_dict(d)
    assert e.value.reason == "unknown_schema_version"
    t = json.loads(table_to_json(PolicyTable(version=1, default_k=0)))
    t["schema_version"] = value
    with pytest.raises(RecordError) as e:
        policy_table_from_json(json.dumps(t))
    assert e.value.reason == "unknown_schema_version"


@pytest.mark.parametrize("field", ["window_start", "window_end"])
def test_negative_zero_is_not_a_time(field: str) -> None:
    d = window_batch_to_dict(_valid_batch())
    d["window_start"], d["window_end"] = 0.0, 0.0
    d[field] = -0.0
    with pytest.raises(RecordError) as e:
        window_batch_from_dict(d)
    assert e.value.reason == "negative_time"
    d = window_batch_to_dict(_valid_batch())
    d["cost"] = [dict(c) for c in d["cost"]]
    d["cost"][0]["latency_p50"] = -0.0
    with pytest.raises(RecordError):
        window_batch_from_dict(d)
    t = json.loads(table_to_json(PolicyTable(version=1, default_k=0)))
    t["created_at"] = -0.0
    with pytest.raises(RecordError):
        policy_table_from_json(json.dumps(t))
    assert window_batch_from_dict(window_batch_to_dict(_valid_batch())) == _valid_batch()  # 0.0 still fine


def test_policy_tables_have_a_size_cap() -> None:
    many = {f"t|d|r{i}|8|*": 1 for i in range(MAX_TABLE_ENTRIES + 1)}
    too_many = PolicyTable(version=1, default_k=0, entries=many)
    with pytest.raises(RecordError) as e:
        policy_table_from_json(table_to_json(too_many))
    assert e.value.reason == "table_too_large"
    with pytest.raises(RecordError) as e:
        check_table_size(too_many)
    assert e.value.reason == "table_too_large"
    padded = json.loads(table_to_json(PolicyTable(version=1, default_k=0)))
    padded["reason"] = " " * MAX_TABLE_BYTES  # few entries, too many bytes: refused before parsing
    with pytest.raises(RecordError) as e:
        policy_table_from_json(json.dumps(padded))
    assert e.value.reason == "table_too_large"
    ok = PolicyTable(version=1, default_k=0, entries=dict(list(many.items())[:100]))
    check_table_size(ok)
    assert policy_table_from_json(table_to_json(ok)) == ok


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("redis://127.0.0.1:6379/0?password=hunter2", "hunter2"),
        ("redis://u:hunter2@127.0.0.1:6379/0", "hunter2"),
        ("postgresql+psycopg://u@db:5432/test?password=hunter2&sslmode=require", "hunter2"),
        ("postgresql+psycopg://u:hunter2@db/test?options=-csearch_path%3Dx", "hunter2"),
        ("rediss://127.0.0.1/0?ssl_keyfile_password=hunter2", "hunter2"),
        # SQLAlchemy reads the password up to the first '@': '#', '?' and '/' inside it are the password's
        ("postgresql+psycopg://postgres:pa#dbs3cret@127.0.0.1:5999/x", "dbs3cret"),
        ("postgresql+psycopg://postgres:pa?dbs3cret@127.0.0.1:5999/x", "dbs3cret"),
        ("postgresql+psycopg://postgres:pa/dbs3cret@127.0.0.1:5999/x", "dbs3cret"),
        ("http://op:s3cr#et@127.0.0.1:9100", "et@"),
        ("https://hooks.example/alert?api_key=hunter2&channel=ops", "hunter2"),
    ],
)
def test_one_helper_redacts_passwords_wherever_they_are(url: str, secret: str) -> None:
    shown = redact_url(url)
    assert secret not in shown and "***" in shown
    assert shown.split("://")[0] == url.split("://")[0]  # still says what it is


@pytest.mark.parametrize("url", ["postgresql+psycopg://postgres:pa#dbs3cret@127.0.0.1:5999/x",
                                 "redis://u:p?w/d@10.0.0.1:6380/2"])
def test_redaction_keeps_what_sqlalchemy_reads_as_host_port_and_database(url: str) -> None:
    from sqlalchemy.engine import make_url

    shown, real = make_url(redact_url(url)), make_url(url)
    assert (shown.host, shown.port, shown.database, shown.username) == (real.host, real.port, real.database,
                                                                        real.username)
    assert shown.password == "***" and real.password and real.password not in redact_url(url)


def test_urls_without_secrets_are_shown_as_given() -> None:
    for url in ("sqlite:////abs/path/spectune.db", "sqlite:///rel.db", "redis://127.0.0.1:6379/0",
                "http://127.0.0.1:9100/health", "postgresql+psycopg://postgres@127.0.0.1:5432/test"):
        assert redact_url(url) == url


def test_store_and_transport_errors_use_the_redaction(redis_url: str) -> None:
    from telemetry.errors import StoreError, TransportError
    from telemetry.transport import RedisStreamsTransport

    bad = "redis://127.0.0.1:1/0?password=hunter2"
    t = RedisStreamsTransport(bad)
    with pytest.raises(TransportError) as e:
        t.publish(b"{}")
    assert "hunter2" not in str(e.value)
    with pytest.raises(StoreError) as e2:
        Store("postgresql+psycopg://u@127.0.0.1:1/x?password=hunter2&connect_timeout=1")
    assert "hunter2" not in str(e2.value)
