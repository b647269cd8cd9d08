"""build_engine_hooks: the one wiring of policy client, emitter and transport that engines embed."""

from __future__ import annotations

import pytest
import redis

from controller.client import ClientConfig, build_engine_hooks
from telemetry.emitter import EmitterConfig
from telemetry.records import PolicyTable, RoundRecord, RowRecord
from telemetry.transport import InProcessTransport

V1, V2, D = "target-v1", "target-v2", "draft-v1"


def _round(target: str = V1) -> RoundRecord:
    return RoundRecord(0, 1, 2, 3, 0.001, 0.002, 0.0, target, D, (RowRecord("code", 5, 2, 1, 2),))


def test_in_process_hooks_share_the_queue_and_take_tables_by_apply() -> None:
    t = InProcessTransport()
    hooks = build_engine_hooks(ClientConfig(V1, D, default_k=1), EmitterConfig("e1"), t)
    assert hooks.decide("code", 1, 1) == 1  # fail-static until a table arrives
    assert hooks.client.apply(PolicyTable(version=1, default_k=3, entries={f"{V2}|{D}|*|*|*": 5}, created_at=1.0))
    assert hooks.decide("code", 1, 1) == 3
    hooks.set_versions(V2, D)  # a model update: the next round's rows are decided under the new version
    assert hooks.decide("code", 1, 1) == 5
    hooks.record(_round(V2))
    hooks.close()
    assert t.read("sidecar", 10, 0)  # flushed on close into the shared queue, which stays open for its owner


def test_redis_hooks_own_their_transport(redis_url: str, redis_prefix: str) -> None:
    hooks = build_engine_hooks(ClientConfig(V1, D, redis_url=redis_url, prefix=redis_prefix), EmitterConfig("e1"))
    hooks.record(_round())
    hooks.close()
    r = redis.Redis.from_url(redis_url)
    try:
        assert r.xlen(f"{redis_prefix}:windows") >= 1
    finally:
        r.close()


def test_hooks_need_somewhere_to_send_windows() -> None:
    with pytest.raises(ValueError, match="needs a transport"):
        build_engine_hooks(ClientConfig(V1, D), EmitterConfig("e1"))
