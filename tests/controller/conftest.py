"""Fixtures for the controller tests: real Redis, real SQLite and PostgreSQL, the shipped checkpoints.

Redis and PostgreSQL as in ``tests/telemetry`` (``SPECTUNE_TEST_REDIS_URL``, ``SPECTUNE_TEST_PG_URL``); each test
gets its own Redis key prefix / PostgreSQL schema. Model tests use the shipped checkpoints; while they are being
trained, ``SPECTUNE_CHECKPOINTS`` points at another folder (read here, and only here).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from sqlalchemy import create_engine, text

from tests.conftest import service_unavailable

REPO = Path(__file__).resolve().parents[2]
CHECKPOINTS = Path(os.environ.get("SPECTUNE_CHECKPOINTS", str(REPO / "checkpoints")))
REDIS_URL = os.environ.get("SPECTUNE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_URL = os.environ.get("SPECTUNE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
PYTHON = sys.executable


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
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'spectune.sqlite'}"


@pytest.fixture(scope="session")
def checkpoints() -> Path:
    if not (CHECKPOINTS / "manifest.json").exists():
        pytest.fail(f"no checkpoints at {CHECKPOINTS}; run `spectune train` or set SPECTUNE_CHECKPOINTS")
    return CHECKPOINTS


@pytest.fixture(scope="session")
def prompt_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prompt pool per test session (building it parses the standard library)."""
    from controller.workload import PromptPool

    d = tmp_path_factory.mktemp("prompts")
    PromptPool(0, d)
    return d
