"""Shared test configuration.

Tests of the Redis and PostgreSQL paths run against real servers. Locally a missing server skips them with the
reason; under CI (``CI`` set, as `.ci/run` runs) a missing server fails them, so a green CI means they ran.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn
from urllib.parse import quote

import pytest
import redis
from sqlalchemy import create_engine, text

# Under pytest-xdist the workers are processes on the same cores, and torch gives each of them one OpenMP thread
# per core: the threads then spin against each other (test_loop.py's greedy tests took 190 s on three workers, and
# 17 s with one thread each). One thread per worker, and per process a test starts, unless the environment says
# otherwise.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:  # imported before this file (by a plugin): the variable is read at import only
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def service_unavailable(message: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI requires the real service; .ci/run starts it)", pytrace=False)
    pytest.skip(message)


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
    return f"sqlite:///{tmp_path}/spectune.sqlite"


