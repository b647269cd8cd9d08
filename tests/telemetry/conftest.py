"""Fixtures for the telemetry tests: real Redis, real SQLite, real PostgreSQL, each isolated per test.

Redis: ``SPECTUNE_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); every test gets its own key prefix
and its keys are deleted afterwards. PostgreSQL: ``SPECTUNE_TEST_PG_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/test``); every test gets its own schema (via ``search_path`` in the
URL), dropped afterwards. A service that is not reachable skips its tests with the reason.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import quote

import pytest
import redis
from sqlalchemy import create_engine, text

from telemetry.records import RoundRecord, RowRecord
from telemetry.transport import RedisConfig, RedisStreamsTransport
from tests.conftest import service_unavailable

REDIS_URL = os.environ.get("SPECTUNE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_URL = os.environ.get("SPECTUNE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as e:
        service_unavailable(f"Redis not reachable at {REDIS_URL} ({e}); start redis-server or set SPECTUNE_TEST_REDIS_URL")  # noqa: E501
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"spectune-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(f"{prefix}:*"))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture
def redis_transport(redis_url: str, redis_prefix: str) -> Iterator[RedisStreamsTransport]:
    t = RedisStreamsTransport(redis_url, RedisConfig(prefix=redis_prefix))
    yield t
    t.close()


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    try:
        eng = create_engine(PG_URL, connect_args={"connect_timeout": 2})
        with eng.connect() as c:
            c.execute(text("select 1"))
        eng.dispose()
    except Exception as e:
        service_unavailable(f"PostgreSQL not reachable at {PG_URL} ({type(e).__name__}); set SPECTUNE_TEST_PG_URL")
    return PG_URL


@pytest.fixture
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """A URL whose connections see only a fresh, per-test schema."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    eng = create_engine(pg_admin_url)
    with eng.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in pg_admin_url else "?"
    yield f"{pg_admin_url}{sep}options={quote(f'-csearch_path={schema}')}"
    with eng.begin() as c:
        c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    eng.dispose()


@pytest.fixture
def sqlite_url(tmp_path: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path}/spectune.sqlite"


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
            round_index=round_index, batch_size=len(recs), max_k=max_k, tokens_verified=len(recs) * (max_k + 1),
            draft_s=draft_s, verify_s=verify_s, other_s=other_s, target_version=target, draft_version=draft,
            rows=recs,
        )

    return make
