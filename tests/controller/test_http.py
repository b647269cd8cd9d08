"""The operator endpoint over real HTTP on a sidecar with an in-process transport and SQLite."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from controller.service.http import OperatorServer
from controller.service.publish import CallbackPublisher
from controller.service.sidecar import Sidecar, SidecarConfig
from policies import REGISTRY
from telemetry.emitter import Emitter, EmitterConfig
from telemetry.ingest import ConsumerConfig
from telemetry.store import Store
from telemetry.synthetic import synthetic_rounds
from telemetry.transport import InProcessTransport


@pytest.fixture
def server(sqlite_url: str) -> Iterator[tuple[OperatorServer, Sidecar, InProcessTransport]]:
    t = InProcessTransport()
    store = Store(sqlite_url, auto_upgrade=True)
    sc = Sidecar(SidecarConfig(consumer=ConsumerConfig(consumer="c", block_ms=10)), t, store,
                 REGISTRY["goodput"](k_max=8), CallbackPublisher())
    srv = OperatorServer(sc).start()
    yield srv, sc, t
    srv.close()
    store.close()


def call(srv: OperatorServer, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(srv.url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            payload = r.read()
            code = r.status
    except urllib.error.HTTPError as e:
        payload, code = e.read(), e.code
    try:
        return code, json.loads(payload)
    except ValueError:
        return code, payload.decode()


Served = tuple[OperatorServer, Sidecar, InProcessTransport]


def test_health_policy_pins_history_metrics_deadletter(server: Served) -> None:
    srv, sc, t = server
    assert call(srv, "GET", "/health")[1]["status"] == "ok"
    assert call(srv, "GET", "/policy")[0] == 404  # nothing learnt yet
    em = Emitter(t, EmitterConfig("e1"), start=False)
    for r in synthetic_rounds(300):
        em.record(r)
    em.flush()
    t.publish(b"junk")
    sc.drain()
    sc.publish_now("test")
    code, pol = call(srv, "GET", "/policy")
    assert code == 200 and pol["version"] == sc.version
    code, res = call(srv, "POST", "/pins", {"bucket": "*|*|*|*|*", "k": 0, "reason": "incident 42"})
    assert code == 200 and res["policy_version"] == pol["version"] + 1
    assert set(call(srv, "GET", "/policy")[1]["entries"].values()) == {0}
    assert call(srv, "GET", "/pins")[1][0]["reason"] == "incident 42"
    code, res = call(srv, "DELETE", "/pins/" + quote("*|*|*|*|*", safe=""))
    assert code == 200 and res["policy_version"] == pol["version"] + 2
    assert call(srv, "DELETE", "/pins/" + quote("*|*|*|*|*", safe=""))[0] == 404
    hist = call(srv, "GET", "/policy/history?limit=2")[1]
    assert [h["version"] for h in hist] == [pol["version"] + 2, pol["version"] + 1]
    code, text = call(srv, "GET", "/metrics")
    assert code == 200 and "spectune_policy_version" in text
    dl = call(srv, "GET", "/deadletter")[1]
    assert dl[0]["reason"] == "undecodable" and dl[0]["payload_preview"] == "junk"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{nope", "bad_json"),
        (b"[1, 2]", "bad_json"),
        (json.dumps({"bucket": "a|b", "k": 1}).encode(), "bad_bucket_key"),
        (json.dumps({"bucket": "*|*|*|*|*", "k": 99}).encode(), "out_of_range"),
        (json.dumps({"bucket": "*|*|*|*|*", "k": True}).encode(), "out_of_range"),
        (json.dumps({"bucket": 3, "k": 1}).encode(), "bad_bucket_key"),
    ],
)
def test_bad_requests_are_400_with_a_reason_and_counted(server: Served, body: bytes, reason: str) -> None:
    srv, sc, _ = server
    code, res = call(srv, "POST", "/pins", raw=body)
    assert code == 400 and res["reason"] == reason and res["error"]
    assert f'spectune_http_bad_requests_total{{reason="{reason}"}} 1.0' in sc.metrics.exposition().decode()
    assert call(srv, "GET", "/policy/history?limit=zero")[0] == 400
    assert call(srv, "GET", "/nowhere")[0] == 404
    assert call(srv, "GET", "/health")[0] == 200  # still serving


def test_metrics_renderings_are_shared_within_their_max_age() -> None:
    from controller.service.metrics import SidecarMetrics

    m = SidecarMetrics()
    first = m.exposition(max_age_s=60.0)
    m.windows_ingested.inc(5)
    assert m.exposition(max_age_s=60.0) is first  # within the age: the same rendering, no new work
    fresh = m.exposition()  # max_age_s=0 renders now
    assert fresh != first and b"spectune_windows_ingested_total 5.0" in fresh
