"""Fixtures for the telemetry tests: real Redis, real SQLite, real PostgreSQL, each isolated per test.

Redis: ``SPECTUNE_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); every test gets its own key prefix
and its keys are deleted afterwards. PostgreSQL: ``SPECTUNE_TEST_PG_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/test``); every test gets its own schema (via ``search_path`` in the
URL), dropped afterwards. A service that is not reachable skips its tests with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from telemetry.records import RoundRecord, RowRecord
from telemetry.transport import RedisConfig, RedisStreamsTransport


@pytest.fixture
def redis_transport(redis_url: str, redis_prefix: str) -> Iterator[RedisStreamsTransport]:
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    yield t
    t.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each database test runs on SQLite and on PostgreSQL."""
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(name))


RoundFactory = Callable[..., RoundRecord]


@pytest.fixture
def make_round() -> RoundFactory:
    """Build a round from ``(request_type, context_len, k, accepted)`` rows; emitted defaults to accepted + 1."""

    def make(
        rows: list[tuple[str, int, int, int]],
        *,
        draft_s: float = 0.001,
        verify_s: float = 0.004,
        other_s: float = 0.0005,
        target: str = "t1",
        draft: str = "d1",
        round_index: int = 0,
        emitted: list[int] | None = None,
    ) -> RoundRecord:
        recs = tuple(
            RowRecord(rt, ctx, k, acc, emitted[i] if emitted else acc + 1) for i, (rt, ctx, k, acc) in enumerate(rows)
        )
        max_k = max((r.k for r in recs), default=0)
        return RoundRecord(
            round_index=round_index, batch_size=len(recs), max_k=max_k,
            tokens_verified=sum(r.k + 1 for r in recs),  # packed verification
            draft_s=draft_s, verify_s=verify_s, other_s=other_s, target_version=target, draft_version=draft,
            rows=recs,
        )

    return make
