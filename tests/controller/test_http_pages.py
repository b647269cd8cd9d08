"""The operator endpoint's shared renderings (``controller/service/http.py`` ``_Pages``), over real HTTP.

Pages read from the store are rendered once per burst of requests, follow this sidecar's writes at once and
anything else within ``page_max_age_s``; a failed rendering is answered to everyone who waited on it and not kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import pytest
from test_http import call

from controller.service.http import MAX_PAGES, HttpConfig, OperatorServer
from controller.service.publish import CallbackPublisher
from controller.service.sidecar import Sidecar, SidecarConfig
from policies import REGISTRY
from telemetry.errors import StoreError
from telemetry.ingest import ConsumerConfig
from telemetry.store import Store
from telemetry.transport import InProcessTransport

ANY = "*|*|*|*|*"


@pytest.fixture
def sidecar(sqlite_url: str) -> Iterator[Sidecar]:
    store = Store(sqlite_url, auto_upgrade=True)
    yield Sidecar(SidecarConfig(consumer=ConsumerConfig(consumer="c", block_ms=10)), InProcessTransport(), store,
                  REGISTRY["goodput"](k_max=8), CallbackPublisher())
    store.close()


@pytest.fixture
def serve(sidecar: Sidecar) -> Iterator[Callable[[HttpConfig], OperatorServer]]:
    started: list[OperatorServer] = []

    def start(cfg: HttpConfig) -> OperatorServer:
        started.append(OperatorServer(sidecar, config=cfg).start())
        return started[-1]

    yield start
    for srv in started:
        srv.close()


def count_calls(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str, delay_s: float = 0.0,
                fail: list[bool] | None = None) -> list[float]:
    """Wrap ``obj.name`` (the real method): each call is recorded, waits ``delay_s``, and raises a StoreError
    while ``fail[0]`` is set."""
    real, calls = getattr(obj, name), []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        time.sleep(delay_s)
        if fail and fail[0]:
            raise StoreError("reading pins failed: the database is down (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)
    return calls


def test_a_page_is_rendered_once_and_follows_this_endpoints_writes(
        sidecar: Sidecar, serve: Callable[[HttpConfig], OperatorServer], monkeypatch: pytest.MonkeyPatch) -> None:
    srv = serve(HttpConfig(page_max_age_s=60.0))
    calls = count_calls(monkeypatch, sidecar.store, "active_pins")
    assert [call(srv, "GET", "/pins") for _ in range(3)] == [(200, [])] * 3
    assert len(calls) == 1  # one query for three requests
    assert call(srv, "POST", "/pins", {"bucket": ANY, "k": 0, "reason": "incident 7"})[0] == 200
    assert [p["reason"] for p in call(srv, "GET", "/pins")[1]] == ["incident 7"]  # at once, not after 60 s
    assert call(srv, "DELETE", "/pins/" + quote(ANY, safe=""))[0] == 200
    assert call(srv, "GET", "/pins") == (200, [])


def test_what_changed_elsewhere_shows_within_the_max_age(
        sidecar: Sidecar, serve: Callable[[HttpConfig], OperatorServer]) -> None:
    srv = serve(HttpConfig(page_max_age_s=0.3))
    assert call(srv, "GET", "/pins") == (200, [])
    sidecar.store.pin(ANY, 2, "from the CLI", who="cli")  # as `spectune pin` does: straight into the store
    deadline = time.monotonic() + 0.3 + 2.0
    while call(srv, "GET", "/pins") == (200, []) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p["reason"] for p in call(srv, "GET", "/pins")[1]] == ["from the CLI"]
    assert sidecar.errors == 0


def test_concurrent_requests_for_a_page_wait_for_one_rendering(
        sidecar: Sidecar, serve: Callable[[HttpConfig], OperatorServer], monkeypatch: pytest.MonkeyPatch) -> None:
    srv = serve(HttpConfig(workers=4))
    calls = count_calls(monkeypatch, sidecar.store, "policy_versions", delay_s=0.3)
    got: list[tuple[int, Any]] = []
    threads = [threading.Thread(target=lambda: got.append(call(srv, "GET", "/policy/history?limit=3")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == [(200, [])] * 4
    assert len(calls) == 1  # the store was asked once, not once per worker


def test_a_failed_rendering_answers_its_waiters_and_is_not_kept(
        sidecar: Sidecar, serve: Callable[[HttpConfig], OperatorServer], monkeypatch: pytest.MonkeyPatch) -> None:
    srv = serve(HttpConfig(workers=4, page_max_age_s=60.0))
    down = [True]
    calls = count_calls(monkeypatch, sidecar.store, "active_pins", delay_s=0.3, fail=down)
    got: list[tuple[int, Any]] = []
    threads = [threading.Thread(target=lambda: got.append(call(srv, "GET", "/pins"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [code for code, _ in got] == [503] * 3 and all(r["reason"] == "unavailable" for _, r in got)
    down[0] = False
    assert call(srv, "GET", "/pins") == (200, [])  # the outage's answer was not kept for 60 s
    assert len(calls) == 2


def test_pages_kept_are_bounded(sidecar: Sidecar, serve: Callable[[HttpConfig], OperatorServer]) -> None:
    srv = serve(HttpConfig())
    for limit in range(1, MAX_PAGES + 40):
        assert call(srv, "GET", f"/deadletter?limit={limit}")[0] == 200
    assert len(srv._server.pages._pages) <= MAX_PAGES


def test_bad_queries_are_400_and_counted_before_any_shared_page(
        sidecar: Sidecar, serve: Callable[[HttpConfig], OperatorServer]) -> None:
    srv = serve(HttpConfig())
    assert call(srv, "GET", "/deadletter?limit=5")[0] == 200
    for _ in range(2):
        code, res = call(srv, "GET", "/deadletter?limit=" + "9" * 50)
        assert code == 400 and res["reason"] == "bad_limit"
    assert 'spectune_http_bad_requests_total{reason="bad_limit"} 2.0' in sidecar.metrics.exposition().decode()
