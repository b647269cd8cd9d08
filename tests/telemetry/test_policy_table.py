"""The policy table's one lookup, its JSON form and its validation."""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import partial

import pytest

from telemetry.policy_table import RowLookup, lookup, policy_table_from_json, table_to_json
from telemetry.records import Bucket, PolicyTable, RecordError

T, D = "t1", "d1"


def test_lookup_goes_from_the_exact_bucket_to_broader_ones_then_the_default() -> None:
    table = PolicyTable(version=1, default_k=1, entries={
        f"{T}|{D}|code|8|<=512": 5, f"{T}|{D}|*|8|*": 4, f"{T}|{D}|*|*|*": 3, "*|*|code|8|<=512": 2})
    assert lookup(table, Bucket(T, D, "code", 8, "<=512")) == 5
    assert lookup(table, Bucket(T, D, "prose", 8, "<=512")) == 4
    assert lookup(table, Bucket(T, D, "prose", 16, "<=512")) == 3
    assert lookup(table, Bucket("t2", D, "code", 8, "<=512")) == 2
    assert lookup(table, Bucket("t2", D, "prose", 8, "<=512")) == 1


def test_row_lookup_buckets_rows_and_resolves_each_bucket_once() -> None:
    seen: list[Bucket] = []

    def resolve(b: Bucket) -> int:
        seen.append(b)
        return b.batch_bucket

    rows = RowLookup(resolve, T, D)
    assert rows("code", 7, 300) == 8 and rows("code", 8, 512) == 8  # both in (8, <=512)
    assert rows("code", 1000, 100_000) == 256  # beyond the last edges: the last batch bucket, >8192
    assert seen == [Bucket(T, D, "code", 8, "<=512"), Bucket(T, D, "code", 256, ">8192")]
    table = PolicyTable(version=1, default_k=0, entries={f"{T}|{D}|code|8|<=512": 6})
    assert RowLookup(partial(lookup, table), T, D)("code", 5, 100) == 6


def test_the_json_form_is_sorted_and_round_trips() -> None:
    t = PolicyTable(version=7, default_k=2, k_max=8, entries={"*|*|b|*|*": 1, "*|*|a|*|*": 3}, created_at=1.5,
                    reason="why")
    text = table_to_json(t)
    assert json.loads(text) == asdict(t) and text == json.dumps(asdict(t), sort_keys=True, separators=(",", ":"))
    assert policy_table_from_json(text) == t


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"default_k": 9}, "out_of_range"),  # above k_max = 8
        ({"entries": {"*|*|*|*|*": 9}}, "out_of_range"),
        ({"entries": {"*|*|*|04|*": 1}}, "bad_bucket_key"),
        ({"version": -1}, "out_of_range"),
        ({"k_max": True}, "bad_type"),
        ({"created_at": -0.0}, "negative_time"),
        ({"schema_version": 2, "k_max": "junk"}, "unknown_schema_version"),  # the version is named first
    ],
)
def test_a_bad_table_is_refused_with_its_reason(change: dict[str, object], reason: str) -> None:
    d = {**asdict(PolicyTable(version=1, default_k=0, k_max=8)), **change}
    with pytest.raises(RecordError) as e:
        policy_table_from_json(json.dumps(d))
    assert e.value.reason == reason


def test_json_constants_in_a_table_are_named_non_finite() -> None:
    text = table_to_json(PolicyTable(version=1, default_k=0, created_at=1.0)).replace('"created_at":1.0',
                                                                                    '"created_at":NaN')
    with pytest.raises(RecordError) as e:
        policy_table_from_json(text)
    assert e.value.reason == "non_finite"
