"""PolicyClient: lookups, validation, fail-static, following Redis; it never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from waiting import wait_until

from controller.client import ClientConfig, EngineHooks, PolicyClient
from controller.service.publish import RedisPublisher
from telemetry.policy_table import table_to_json
from telemetry.records import PolicyTable, RoundRecord, RowRecord
from telemetry.transport import RedisKeys

V1, V2, D = "target-v1", "target-v2", "draft-v1"
REPO = Path(__file__).resolve().parents[2]


def table(version: int, entries: dict[str, int] | None = None, default_k: int = 3, k_max: int = 8) -> PolicyTable:
    return PolicyTable(version=version, default_k=default_k, k_max=k_max, entries=entries or {}, created_at=1.0)


WAIT_S = 30.0  # a deadline for what another thread does, not a speed requirement: polls return when it holds


def test_fail_static_without_any_sidecar() -> None:
    c = PolicyClient(ClientConfig(V1, D, default_k=2))
    assert c.decide("code", 8, 100) == 2
    st = c.status()
    assert st.fail_static and st.mode == "fail-static" and "default_k=2" in st.detail


def test_fail_static_when_redis_is_unreachable() -> None:
    with PolicyClient(ClientConfig(V1, D, default_k=1, redis_url="redis://127.0.0.1:1/0", refresh_s=0.05)) as c:
        wait_until(lambda: c.status().last_error is not None, WAIT_S, "the connection error")
        assert c.decide("prose", 1, 10) == 1
        st = c.status()
        assert st.fail_static and not st.connected and "Redis unreachable" in st.detail


def test_lookup_exact_then_broader_then_default_and_versions() -> None:
    c = PolicyClient(ClientConfig(V1, D, default_k=0))
    assert c.apply(table(1, {f"{V1}|{D}|code|8|<=512": 5, f"{V1}|{D}|*|*|*": 2, f"{V2}|{D}|code|8|<=512": 7},
                         default_k=1))
    assert c.decide("code", 7, 300) == 5  # batch 7 -> bucket 8, context 300 -> <=512
    assert c.decide("code", 7, 300) == 5  # cached
    assert c.decide("prose", 7, 300) == 2  # falls back to the versions' wildcard
    assert c.decide("code", 300, 100_000) == 2  # beyond the last edges
    c.set_versions(V2, D)
    assert c.decide("code", 8, 1) == 7
    assert c.decide("prose", 8, 1) == 1  # nothing for v2 prose: default_k


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (table(5, {f"{V1}|{D}|code|8|<=512": 9}), "k_above_engine_max"),
        (table(1, {f"{V1}|{D}|code|8|<=512": 1}), "stale_version"),
    ],
)
def test_rejects_invalid_tables_and_keeps_the_last_good_one(bad: PolicyTable, reason: str) -> None:
    c = PolicyClient(ClientConfig(V1, D, default_k=0, k_max=8))
    assert c.apply(table(2, {f"{V1}|{D}|code|8|<=512": 4}))
    if reason == "k_above_engine_max":
        bad = PolicyTable(version=5, default_k=0, k_max=16, entries={f"{V1}|{D}|code|8|<=512": 12})
    assert not c.apply(bad)
    assert c.version == 2 and c.decide("code", 8, 1) == 4
    assert c.status().rejected == {reason: 1} and c.status().last_error


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (b"{not json", "undecodable"),
        (json.dumps({"schema_version": 99, "version": 7}).encode(), "unknown_schema_version"),
        (json.dumps({"schema_version": 1, "version": 7, "default_k": 0, "k_max": 8,
                     "entries": {"a|b|c|1|d": 11}}).encode(), "out_of_range"),
        (json.dumps({"schema_version": 1, "version": 7, "default_k": 0, "k_max": 8,
                     "entries": {"only|three|parts": 1}}).encode(), "bad_bucket_key|malformed"),
    ],
)
def test_rejects_malformed_json(text: bytes, reason: str) -> None:
    c = PolicyClient(ClientConfig(V1, D, default_k=2))
    assert not c.apply_json(text)
    (got,) = c.status().rejected.items()
    assert got[0] in reason.split("|") and got[1] == 1
    assert c.decide("code", 1, 1) == 2 and c.status().fail_static


def test_follows_redis_and_rejects_tables_pushed_by_hand(redis_url: str, redis_prefix: str) -> None:
    pub = RedisPublisher(redis_url, redis_prefix)
    key = f"{V1}|{D}|code|8|<=512"
    # the timer refresh is far beyond every wait below: whatever arrives, arrives by the pub/sub nudge
    with PolicyClient(ClientConfig(V1, D, default_k=1, redis_url=redis_url, prefix=redis_prefix,
                                   refresh_s=3600.0, rollback_after_s=3600.0)) as c:
        wait_until(lambda: c.status().connected, WAIT_S, "the client to connect")
        assert c.status().fail_static
        assert pub.publish(table(3, {key: 6}))
        wait_until(lambda: c.version == 3, WAIT_S, "v3 by the nudge")
        assert c.decide("code", 8, 10) == 6 and c.status().mode == "following"
        r = redis.Redis.from_url(redis_url)
        too_big = json.dumps({**json.loads(table_to_json(table(9, {key: 0}))), "entries": {key: 42}}).encode()
        for i, raw in enumerate((b"garbage", table_to_json(table(2, {key: 0})).encode(), too_big)):
            r.set(RedisKeys(redis_prefix).policy, raw)
            r.publish(RedisKeys(redis_prefix).policy_updates, "99")
            wait_until(lambda n=i + 1: sum(c.status().rejected.values()) >= n, WAIT_S, f"rejection {i}")
        assert c.version == 3 and c.decide("code", 8, 10) == 6
        assert set(c.status().rejected) == {"undecodable", "stale_version", "out_of_range"}
        # the sidecar overwrites junk and moves on
        assert pub.publish(table(4, {key: 2}), force=True)
        wait_until(lambda: c.version == 4, WAIT_S, "v4 by the nudge")
        r.close()
    pub.close()


def test_engine_hooks_switch_versions_and_record() -> None:
    c = PolicyClient(ClientConfig(V1, D, default_k=0))
    c.apply(table(1, {f"{V2}|{D}|*|*|*": 4}))
    hooks = EngineHooks(c, None)
    assert hooks.decide("code", 1, 1) == 3  # default of the table
    rnd = RoundRecord(0, 1, 0, 1, 0.0, 0.0, 0.0, V2, D, (RowRecord("code", 5, 0, 0, 1),))
    hooks.record(rnd)
    assert hooks.decide("code", 1, 1) == 4


def test_client_module_does_not_import_torch() -> None:
    code = "import sys, controller.client, controller.service.publish; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_an_older_table_that_stays_at_the_key_is_followed_back(redis_url: str, redis_prefix: str) -> None:
    # A forged table far ahead of the store is adopted (it is valid); the sidecar then puts its store's older
    # table back and keeps it there. The engine must not stay on the forged one until it restarts.
    pub = RedisPublisher(redis_url, redis_prefix)
    key = f"{V1}|{D}|code|8|<=512"
    with PolicyClient(ClientConfig(V1, D, default_k=1, redis_url=redis_url, prefix=redis_prefix, refresh_s=0.1,
                                   rollback_after_s=0.6)) as c:
        assert pub.publish(table(2**40, {key: 0}), force=True)  # the forger
        wait_until(lambda: c.version == 2**40, WAIT_S, "the forged table")
        assert pub.publish(table(12, {key: 5}), force=True)  # the sidecar puts its own table back
        wait_until(lambda: c.status().rejected.get("stale_version") == 1, WAIT_S, "the older table refused")
        assert c.version == 2**40  # refused at first: an older table pushed by hand is soon replaced
        # the sidecar keeps learning: a newer table every 0.2 s, all older than v2**40. The sleep paces this
        # producer so that no single table stays at the key for rollback_after_s (the client's real clock)
        for v in range(13, 19):
            time.sleep(0.2)
            assert pub.publish(table(v, {key: 5}))
        # one stretch of older tables (not one table staying 0.6 s): followed back while they keep coming
        assert c.version is not None and 12 <= c.version <= 18
        wait_until(lambda: c.version == 18, WAIT_S, "v18, the newest table")
        assert c.decide("code", 8, 10) == 5
        st = c.status()
        assert st.rollbacks == 1 and "followed the policy key back" in (st.last_error or "")
    with pytest.raises(ValueError, match="rollback_after_s"):
        ClientConfig(V1, D, refresh_s=1.0, rollback_after_s=0.5)
    pub.close()
