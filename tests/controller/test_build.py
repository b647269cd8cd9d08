"""build_sidecar: the one wiring of store, transport, publisher, policy, lease, alerts and operator endpoint."""

from __future__ import annotations

import json
import urllib.request

import pytest
from synthetic_feed import feed

from controller.service.alerts import AlertConfig
from controller.service.build import SidecarSettings, build_sidecar
from controller.service.lease import LeaseConfig
from controller.service.publish import CallbackPublisher, RedisPublisher
from controller.service.sidecar import SidecarConfig
from policies import GoodputPolicy
from telemetry.ingest import ConsumerConfig
from telemetry.records import PolicyTable
from telemetry.transport import InProcessTransport

FAST = SidecarConfig(consumer=ConsumerConfig(consumer="c1", block_ms=10), warm_start_windows=0,
                     publish_every_windows=8)


@pytest.mark.parametrize(("kw", "match"), [
    ({"policy": "nope"}, "unknown policy 'nope'"),
    ({"policy": "static", "one_k_per_batch": True}, "setting of the goodput policy"),
    ({"alert_sinks": ("log",)}, "need alerts on"),
    ({"alerts": AlertConfig(), "alert_sinks": ("pager",)}, "unknown alert sinks"),
    ({"lease": LeaseConfig()}, "live in Redis"),
    ({"alerts": AlertConfig(), "alert_sinks": ("stream",)}, "live in Redis"),
    ({"http_port": 70_000}, "http_port"),
    ({"policy": "static", "tail_weight": 1.0}, "tail_weight is a setting of the goodput policy"),
    ({"tail_weight": -0.5}, "tail_weight must be a finite number >= 0"),
    ({"tail_weight": float("nan")}, "tail_weight must be a finite number >= 0"),
])
def test_settings_refuse_what_cannot_be_built(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SidecarSettings(db_url="sqlite://", **kw)  # type: ignore[arg-type]


def test_without_redis_the_caller_brings_transport_and_publisher(sqlite_url: str) -> None:
    with pytest.raises(ValueError, match="needs a transport and a publisher"):
        build_sidecar(SidecarSettings(db_url=sqlite_url, auto_upgrade=True))


def test_embedded_sidecar_shares_the_callers_queue_and_leaves_it_open(sqlite_url: str) -> None:
    t = InProcessTransport()
    tables: list[PolicyTable] = []
    settings = SidecarSettings(db_url=sqlite_url, auto_upgrade=True, sidecar=FAST)
    with build_sidecar(settings, transport=t, publisher=CallbackPublisher(tables.append)) as service:
        sc = service.sidecar
        assert service.server is None and sc.lease is None and sc.alerts is None and sc.transport is t
        feed(t, 100)
        sc.drain()
        assert tables and tables[-1].version == sc.version
    feed(t, 1)  # the queue belongs to the caller: still open after the service closed
    assert t.read("sidecar", 10, 0)


def test_redis_sidecar_with_lease_alerts_and_endpoint(redis_url: str, redis_prefix: str, sqlite_url: str) -> None:
    settings = SidecarSettings(
        db_url=sqlite_url, redis_url=redis_url, prefix=redis_prefix, auto_upgrade=True, sidecar=FAST,
        lease=LeaseConfig(1000), alerts=AlertConfig(), alert_sinks=("stream", "log", "prometheus"),
        http_host="127.0.0.1")
    service = build_sidecar(settings)
    try:
        sc = service.sidecar
        assert sc.lease is not None and sc.lease.key == f"{redis_prefix}:leader"
        assert isinstance(sc.publisher, RedisPublisher) and sc.alerts is not None and service.server is not None
        with urllib.request.urlopen(f"{service.server.url}/health", timeout=5) as resp:
            health = json.loads(resp.read())
        assert health["lease"]["key"] == sc.lease.key and health["alerts"] is not None
    finally:
        service.close()
    with pytest.raises(OSError):  # the endpoint is closed with the service
        urllib.request.urlopen(f"{service.server.url}/health", timeout=2)


def test_one_k_per_batch_caps_a_larger_batch_by_a_smaller_ones_k(sqlite_url: str) -> None:
    # vLLM runs one k per step: its sidecar's policy never drafts a larger batch deeper than a settled smaller one,
    # and it turns the draft off and on cheaply: k = 0 is re-checked where thinly measured, off needs a 3% margin;
    # its cost model learns raw seconds (GoodputPolicy's cost_speed_memory says why).
    for one_k, cap in ((True, True), (False, False)):
        settings = SidecarSettings(db_url=sqlite_url, auto_upgrade=True, sidecar=FAST, one_k_per_batch=one_k)
        with build_sidecar(settings, transport=InProcessTransport(), publisher=CallbackPublisher(print)) as service:
            policy = service.sidecar.policy
            assert isinstance(policy, GoodputPolicy)
            assert policy.one_k_per_batch is one_k and policy.batch_cap is cap
            assert policy.explore_off is one_k and policy.off_margin == (0.03 if one_k else 0.10)
            assert policy._cost.speed_memory == (0 if one_k else 3)  # vLLM's sidecar learns raw seconds
            assert policy.tail_weight == (1.0 if one_k else 0.0)  # vLLM's TPOT tail is weighed by default
    # an operator's weight replaces the engine kind's default
    settings = SidecarSettings(db_url=sqlite_url, auto_upgrade=True, sidecar=FAST, one_k_per_batch=True,
                               tail_weight=0.25)
    with build_sidecar(settings, transport=InProcessTransport(), publisher=CallbackPublisher(print)) as service:
        policy = service.sidecar.policy
        assert isinstance(policy, GoodputPolicy) and policy.tail_weight == 0.25 and policy.batch_cap
