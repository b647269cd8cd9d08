"""Fixtures for the offline tests (recorded engine outputs live in ``fixtures/``): a store on each database."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest
from scrape_server import Scrapes


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each store test runs on SQLite and on PostgreSQL (a fresh schema per test)."""
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(name))


@pytest.fixture
def scrape_url() -> Iterator[str]:
    """The URL of a :class:`Scrapes` server; a test sets ``Scrapes.bodies`` before following it."""
    Scrapes.bodies, Scrapes.served = [], 0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Scrapes)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()
    srv.server_close()
    t.join()
