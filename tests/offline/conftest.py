"""Fixtures for the offline tests (recorded engine outputs live in ``fixtures/``): a store on each database."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each store test runs on SQLite and on PostgreSQL (a fresh schema per test)."""
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(name))
