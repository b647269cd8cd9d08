"""What the transport keeps to itself: the Redis names and readable dead letters, newest first."""

from __future__ import annotations

import pytest

from telemetry.transport import InProcessTransport, RedisKeys, RedisStreamsTransport, Transport


def test_every_redis_name_comes_from_one_prefix() -> None:
    k = RedisKeys("spectune")
    assert (k.windows, k.deadletter, k.policy, k.policy_updates, k.alerts, k.pattern) == (
        "spectune:windows", "spectune:deadletter", "spectune:policy", "spectune:policy-updates", "spectune:alerts",
        "spectune:*")
    for bad in ("", "two words"):
        with pytest.raises(ValueError, match="prefix"):
            RedisKeys(bad)


@pytest.mark.parametrize("kind", ["in-process", "redis"])
def test_recent_dead_letters_are_newest_first_and_readable(kind: str, request: pytest.FixtureRequest) -> None:
    t: Transport = InProcessTransport() if kind == "in-process" else request.getfixturevalue("redis_transport")
    t.publish([b"one", b"two", b"three"])
    entries = t.read("c", 10, 100)
    for (eid, payload), reason in zip(entries, ("r1", "r2", "r3"), strict=True):
        t.deadletter(eid, payload, reason)
    recent = t.recent_dead_letters(2)
    assert [(d.reason, d.payload, d.size) for d in recent] == [("r3", b"three", 5), ("r2", b"two", 3)]
    assert [d.reason for d in t.dead_letters()] == ["r1", "r2", "r3"]
    assert recent[0].source_id == entries[2][0] and recent[0].at > 0
    if isinstance(t, RedisStreamsTransport):
        assert t.deadletter_stream == RedisKeys(t.config.prefix).deadletter
