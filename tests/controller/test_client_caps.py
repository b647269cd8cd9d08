"""The client's side of the policy-table size cap (an oversized table is refused, not parsed), against real Redis."""

from __future__ import annotations

import time

import redis

from controller.client import ClientConfig, PolicyClient
from telemetry.policy_table import MAX_TABLE_BYTES, MAX_TABLE_ENTRIES, table_to_json
from telemetry.records import PolicyTable
from telemetry.transport import RedisKeys


def test_an_oversized_table_is_refused_unread_and_the_last_good_one_stays(redis_url: str, redis_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)
    key = RedisKeys(redis_prefix).policy
    good = PolicyTable(version=1, default_k=2, k_max=8, entries={"*|*|code|*|*": 3})
    r.set(key, table_to_json(good))
    c = PolicyClient(ClientConfig("t", "d", redis_url=redis_url, prefix=redis_prefix), start=False)
    assert c.refresh() and c.version == 1
    huge = PolicyTable(version=2, default_k=1, k_max=8, reason="x" * (MAX_TABLE_BYTES + 1))
    r.set(key, table_to_json(huge))
    for _ in range(3):
        assert c.refresh()
    st = c.status()
    assert c.version == 1 and st.rejected == {"table_too_large": 1} and st.connected
    wide = PolicyTable(version=3, default_k=1, k_max=8,
                       entries={f"t|d|r{i}|8|*": 1 for i in range(MAX_TABLE_ENTRIES + 1)})
    assert not c.apply(wide)  # in-process tables meet the same cap
    r.set(key, table_to_json(PolicyTable(version=4, default_k=1, k_max=8, created_at=time.time())))
    assert c.refresh() and c.version == 4
    c.close()
