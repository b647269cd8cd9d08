"""The sidecar with an alert manager: a model update is raised, stored, streamed and served on ``GET /alerts``;
an acceptance drift re-opens its bucket in the policy; alert failures never stop the sidecar (real Redis, SQLite
and PostgreSQL)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import redis
from synthetic_feed import feed
from test_http import call
from waiting import wait_until

from controller.service.alerts import AlertConfig, AlertManager, PrometheusSink, RedisStreamSink
from controller.service.http import OperatorServer
from controller.service.metrics import SidecarMetrics
from controller.service.publish import CallbackPublisher
from controller.service.sidecar import Sidecar, SidecarConfig
from policies import REGISTRY
from telemetry.alerts import ACCEPTANCE_DRIFT, MODEL_UPDATE, Alert
from telemetry.alerts_store import AlertStore
from telemetry.ingest import ConsumerConfig
from telemetry.store import Store
from telemetry.transport import InProcessTransport, RedisKeys

REPO = Path(__file__).resolve().parents[2]
FAST = ConsumerConfig(consumer="c1", block_ms=10, claim_min_idle_ms=0, claim_interval_s=0.0)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url"))


@pytest.fixture
def served(db_url: str, redis_url: str, redis_prefix: str) -> Iterator[tuple[OperatorServer, Sidecar, AlertStore]]:
    store = Store(db_url, auto_upgrade=True)
    alert_store = AlertStore(db_url)
    metrics = SidecarMetrics()
    mgr = AlertManager(AlertConfig(), store=alert_store,
                       sinks=[RedisStreamSink(redis_url, redis_prefix), PrometheusSink(metrics.registry)])
    sc = Sidecar(SidecarConfig(consumer=FAST), InProcessTransport(), store, REGISTRY["goodput"](k_max=8),
                 CallbackPublisher(), metrics, alerts=mgr)
    srv = OperatorServer(sc).start()
    yield srv, sc, alert_store
    srv.close()
    mgr.close()
    alert_store.close()
    store.close()


def test_a_second_target_version_raises_stores_streams_and_serves_a_model_update(
        served: tuple[OperatorServer, Sidecar, AlertStore], redis_url: str, redis_prefix: str) -> None:
    srv, sc, alert_store = served
    t = sc.transport
    assert isinstance(t, InProcessTransport)
    feed(t, 200, target_version="target-v1")
    sc.drain()
    assert sc.recent_alerts == []  # the first pair is the starting point, not an update
    assert call(srv, "GET", "/alerts")[1] == []
    feed(t, 200, target_version="target-v2", seed=1)
    sc.drain()
    assert [a.kind for a in sc.recent_alerts] == [MODEL_UPDATE]
    stored = alert_store.list_alerts(10)
    assert [(a.kind, a.target_version, a.previous_target_version) for a in stored] == [
        (MODEL_UPDATE, "target-v2", "target-v1")]
    entries = redis.Redis.from_url(redis_url).xrange(RedisKeys(redis_prefix).alerts)
    assert [json.loads(fields[b"v"])["kind"] for _, fields in entries] == [MODEL_UPDATE]
    code, body = call(srv, "GET", "/alerts?limit=5")
    assert code == 200 and [(a["id"], a["kind"], a["bucket"]) for a in body] == [
        (stored[0].id, MODEL_UPDATE, "target-v2|draft-v1|*|*|*")]
    assert call(srv, "GET", "/alerts?kind=model_update")[1] == body
    assert call(srv, "GET", "/alerts?kind=cost_drift")[1] == []
    assert stored[0].id is not None
    alert_store.ack(stored[0].id, "test")
    assert call(srv, "GET", "/alerts?unacked=1")[1] == []
    assert call(srv, "GET", "/alerts?unacked=0")[1][0]["acked_by"] == "test"
    h = call(srv, "GET", "/health")[1]
    assert h["alerts"] == {"raised": {MODEL_UPDATE: 1}, "failures": 0, "reopened": 0}
    assert 'spectune_alerts_total{kind="model_update"} 1.0' in sc.metrics.exposition().decode()


@pytest.mark.parametrize(("query", "reason"), [
    ("limit=0", "bad_limit"), ("limit=x", "bad_limit"), ("limit=100000", "bad_limit"), ("unacked=yes", "bad_unacked"),
    ("unacked=", "bad_limit"), ("kind=nope", "bad_kind"),
])
def test_bad_alert_queries_are_400(sqlite_url: str, query: str, reason: str) -> None:
    with Store(sqlite_url, auto_upgrade=True) as store:
        mgr = AlertManager()  # in memory: GET /alerts serves what this sidecar raised
        sc = Sidecar(SidecarConfig(consumer=FAST), InProcessTransport(), store, REGISTRY["goodput"](k_max=8),
                     CallbackPublisher(), alerts=mgr)
        srv = OperatorServer(sc).start()
        try:
            code, body = call(srv, "GET", f"/alerts?{query}")
            if query == "unacked=":  # parse_qs drops an empty value: the default applies
                assert code == 200 and body == []
            else:
                assert code == 400 and body["reason"] == reason
            assert call(srv, "GET", "/alerts")[0] == 200
        finally:
            srv.close()


def test_a_sidecar_without_alerts_still_learns_and_says_alerts_are_off(sqlite_url: str) -> None:
    with Store(sqlite_url, auto_upgrade=True) as store:
        t = InProcessTransport()
        sc = Sidecar(SidecarConfig(consumer=FAST), t, store, REGISTRY["goodput"](k_max=8), CallbackPublisher())
        srv = OperatorServer(sc).start()
        try:
            feed(t, 200, target_version="target-v1")
            feed(t, 200, target_version="target-v2", seed=1)
            sc.drain()
            sc.publish_now("test")
            assert sc.version >= 1 and sc.recent_alerts == [] and sc.health()["alerts"] is None
            code, body = call(srv, "GET", "/alerts")
            assert code == 404 and body["reason"] == "alerts_off"
        finally:
            srv.close()


def _drift(bucket: str = "target-v1|draft-v1|code|*|<=512") -> Alert:
    return Alert(kind=ACCEPTANCE_DRIFT, bucket=bucket, target_version="target-v1", draft_version="draft-v1",
                 detected_at=1.0, message="acceptance rate fell", k=4, before=0.8, before_count=900, after=0.5,
                 after_count=600, statistic="acceptance_rate", count_unit="rows")


def test_an_acceptance_drift_reopens_its_bucket_and_alert_failures_are_counted(sqlite_url: str) -> None:
    with Store(sqlite_url, auto_upgrade=True) as store:
        t = InProcessTransport()
        mgr = mock.create_autospec(AlertManager, instance=True)
        mgr.observe_batch.side_effect = [[_drift()], RuntimeError("detector bug"), *([[]] * 1000)]
        mgr.stats = Counter()
        policy = REGISTRY["goodput"](k_max=8)
        sc = Sidecar(SidecarConfig(consumer=FAST), t, store, policy, CallbackPublisher(), alerts=mgr)
        with mock.patch.object(policy, "reopen", wraps=policy.reopen) as reopen:
            feed(t, 200, target_version="target-v1")
            sent = sc.drain()
        reopen.assert_called_once_with("target-v1", "draft-v1", "code", "<=512")
        assert mgr.observe_batch.call_count == sent == sc.windows_ingested  # every new batch, after the failure too
        assert sc.alert_failures == 1 and sc.reopened == 1 and "detector bug" in (sc.last_error or "")
        assert [a.kind for a in sc.recent_alerts] == [ACCEPTANCE_DRIFT]
        assert sc.health()["alerts"] == {"raised": {}, "failures": 1, "reopened": 1}
        sc.publish_now("still deciding")
        assert sc.version >= 1


def test_spectune_sidecar_serves_alerts_and_checks_its_alert_flags(
        redis_url: str, redis_prefix: str, sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from controller.cli import main

    base = ["sidecar", "--redis-url", redis_url, "--prefix", redis_prefix, "--db-url", sqlite_url, "--auto-upgrade"]
    assert main([*base, "--alert-webhook", "ftp://nowhere"]) == 2
    assert "http(s) URL" in capsys.readouterr().err
    assert main([*base, "--no-alerts", "--alert-webhook", "http://127.0.0.1:1/hook"]) == 2
    assert "--no-alerts" in capsys.readouterr().err
    ready = tmp_path / "ready.json"
    argv = [*base, "--http-port", "0", "--duration", "30", "--ready-file", str(ready),
            "--alert-webhook", "http://127.0.0.1:1/hook"]
    code = f"from controller.cli import main; raise SystemExit(main({argv!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 60, "the sidecar to serve (or exit)")
        assert ready.exists(), proc.communicate(timeout=10)[0] if proc.poll() is not None else "not ready"
        url = json.loads(ready.read_text())["url"]
        with urllib.request.urlopen(url + "/alerts?unacked=1", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read()) == []
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert json.loads(r.read())["alerts"] == {"raised": {}, "failures": 0, "reopened": 0}
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and "alerts on + webhook" in out, out


def test_the_demo_report_lists_the_learned_runs_alerts(sqlite_url: str) -> None:
    from controller.reference.demo_report import alert_rows

    with Store(sqlite_url, auto_upgrade=True) as store:
        sc = Sidecar(SidecarConfig(consumer=FAST), InProcessTransport(), store, REGISTRY["goodput"](k_max=8),
                     CallbackPublisher(), alerts=AlertManager())
        update = Alert(kind=MODEL_UPDATE, bucket="target-v2|draft-v1|*|*|*", target_version="target-v2",
                       draft_version="draft-v1", previous_target_version="target-v1",
                       previous_draft_version="draft-v1", detected_at=112.5, message="model update")
        sc.recent_alerts += [update, _drift()]
        assert alert_rows(sc, started_at=100.0) == [
            ["12.5s", MODEL_UPDATE, "target-v2|draft-v1|*|*|*", "target-v1 / draft-v1 -> target-v2 / draft-v1"],
            ["-99.0s", ACCEPTANCE_DRIFT, "target-v1|draft-v1|code|*|<=512 k=4", "target-v1 / draft-v1"],
        ]
