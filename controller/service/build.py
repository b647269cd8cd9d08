"""The sidecar's one composition root: store, transport, publisher, policy, lease, alerts, the sidecar and its
operator endpoint, built from one :class:`SidecarSettings`.

``spectune sidecar``, the embedded demo and the controller benchmark all build their sidecar here; the engine
side's counterpart is :func:`controller.client.build_engine_hooks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from controller.service.alerts import (
    AlertConfig,
    AlertManager,
    AlertSink,
    LogSink,
    PrometheusSink,
    RedisStreamSink,
    WebhookConfig,
    WebhookSink,
)
from controller.service.http import OperatorServer
from controller.service.lease import Lease, LeaseConfig
from controller.service.metrics import SidecarMetrics
from controller.service.publish import Publisher, RedisPublisher
from controller.service.sidecar import Sidecar, SidecarConfig
from policies import REGISTRY
from telemetry.alerts_store import AlertStore
from telemetry.store import Store
from telemetry.transport import DEFAULT_PREFIX, RedisConfig, RedisKeys, RedisStreamsTransport, Transport

MAX_PORT = 65535
# The goodput policy's settings for an engine that runs one k per step (one_k_per_batch; vLLM). off_margin: turning
# speculation off needs 3% (the policy's default 10% pays for the reference engine's catch-up, a window at reduced
# speed; vLLM's lazy sync catches the draft up on the tokens it missed in one batched pass of the small draft), on
# top of one standard error of the measured difference (noise_z) and with hold_decisions after the switch.
# cost_speed_memory 0: the cost model learns raw seconds; its speed normalisation walked on vLLM's telemetry (see
# GoodputPolicy's docstring). tail_weight 1: a choice's goodput is weighed by its slowest request type's token rate
# relative to its best, as a serving engine's TPOT tail is set by the requests that accept least (GoodputPolicy).
VLLM_POLICY: dict[str, Any] = {"one_k_per_batch": True, "batch_cap": True, "explore_off": True, "off_margin": 0.03,
                               "cost_speed_memory": 0, "tail_weight": 1.0}


def _stream_sink(s: SidecarSettings, _metrics: SidecarMetrics) -> AlertSink:
    assert s.redis_url is not None  # SidecarSettings checks it
    return RedisStreamSink(s.redis_url, s.prefix)


# Where alerts go besides the alerts table, by name (SidecarSettings.alert_sinks).
ALERT_SINKS: dict[str, Callable[[SidecarSettings, SidecarMetrics], AlertSink]] = {
    "stream": _stream_sink,  # the {prefix}:alerts Redis stream, for other processes and dashboards
    "log": lambda _s, _m: LogSink(),  # one structured log line per alert
    "prometheus": lambda _s, m: PrometheusSink(m.registry),  # spectune_alerts_total in the sidecar's registry
}


@dataclass(frozen=True)
class SidecarSettings:
    """Everything one sidecar is built from (``spectune sidecar``'s options, the demo's and the benchmark's)."""

    db_url: str  # the SQL store: windows, policy versions, pins, alerts
    # Windows in, tables out, the leader lease and the alerts stream. None: the caller hands build_sidecar its
    # transport and publisher (the embedded mode's in-process queue and callback).
    redis_url: str | None = None
    prefix: str = DEFAULT_PREFIX  # Redis names (engines and sidecars of one deployment share it)
    auto_upgrade: bool = False  # migrate the database to head at start-up (else an old schema is an error)
    policy: str = "goodput"  # a name in policies.REGISTRY
    k_max: int = 8  # the largest k the policy may choose
    seed: int = 0  # the policy's RNG
    # The engines run one k per step for the whole batch (vLLM): every request type of a cell gets the same k, and a
    # larger batch never drafts deeper than a settled smaller one (GoodputPolicy batch_cap). Such an engine also
    # turns its draft off and on cheaply (spectune's lazy draft sync catches the draft up in one batched pass), so
    # speculation off is re-measured where its evidence is thin and needs a smaller margin (VLLM_POLICY).
    one_k_per_batch: bool = False
    # The goodput policy's weight on its slowest request type's token rate, the TPOT tail (GoodputPolicy tail_weight;
    # 0 is throughput alone). None: the engine kind's default, 1 with one_k_per_batch (VLLM_POLICY), else 0.
    tail_weight: float | None = None
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)  # decision timing, start-up replay, caps
    lease: LeaseConfig | None = None  # the leader lease ({prefix}:leader); None: always the leader (one sidecar)
    alerts: AlertConfig | None = None  # drift alerts and model updates; None: none raised
    alert_sinks: tuple[str, ...] = ()  # names in ALERT_SINKS, besides the alerts table
    alert_webhook: WebhookConfig | None = None  # also POST each alert here
    http_host: str | None = None  # the operator endpoint's address; None: no endpoint
    http_port: int = 0  # the operator endpoint's port; 0 picks a free one

    def __post_init__(self) -> None:
        if self.policy not in REGISTRY:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of: {', '.join(sorted(REGISTRY))}")
        if self.one_k_per_batch and self.policy != "goodput":
            raise ValueError(f"one_k_per_batch is a setting of the goodput policy, not of {self.policy!r}")
        if self.tail_weight is not None:
            if self.policy != "goodput":
                raise ValueError(f"tail_weight is a setting of the goodput policy, not of {self.policy!r}")
            if not 0.0 <= self.tail_weight < math.inf:
                raise ValueError(f"tail_weight must be a finite number >= 0, got {self.tail_weight}")
        if unknown := [s for s in self.alert_sinks if s not in ALERT_SINKS]:
            raise ValueError(f"unknown alert sinks {unknown}; choose among: {', '.join(ALERT_SINKS)}")
        if (self.alert_sinks or self.alert_webhook) and self.alerts is None:
            raise ValueError("alert sinks and a webhook need alerts on (SidecarSettings.alerts)")
        if self.redis_url is None and (self.lease is not None or "stream" in self.alert_sinks):
            raise ValueError("the leader lease and the alerts stream live in Redis: set SidecarSettings.redis_url")
        if not 0 <= self.http_port <= MAX_PORT:
            raise ValueError(f"SidecarSettings.http_port must be in [0, {MAX_PORT}], got {self.http_port}")


class SidecarService:
    """A built sidecar, its operator endpoint, and the resources it owns.

    Build it with :func:`build_sidecar`. :meth:`close` releases what the build made, newest first: the endpoint,
    the lease's connection, the alert manager (its counts flushed, its webhook thread stopped), the alert store,
    the publisher and transport it built (not those the caller passed in), the store.

    Attributes:
        sidecar: the sidecar (run it with :meth:`Sidecar.run` or :meth:`Sidecar.start`).
        server: the operator endpoint, already serving (None unless ``http_host`` was set).
        settings: what it was built from.
    """

    def __init__(self, sidecar: Sidecar, server: OperatorServer | None, settings: SidecarSettings,
                 owned: ExitStack) -> None:
        self.sidecar = sidecar
        self.server = server
        self.settings = settings
        self._owned = owned

    def close(self) -> None:
        self._owned.close()

    def __enter__(self) -> SidecarService:
        return self

    def __exit__(self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None) -> None:
        self.close()


def build_sidecar(settings: SidecarSettings, *, transport: Transport | None = None,
                  publisher: Publisher | None = None) -> SidecarService:
    """A sidecar wired in one place, from ``settings``.

    Args:
        settings: what to build.
        transport: where windows come from. None: Redis Streams at ``settings.redis_url`` under its prefix, owned
            and closed by the service. Given: shared with its owner (the embedded mode's in-process queue, which
            the engine's hooks write) and left open.
        publisher: where tables go. None: Redis at ``settings.redis_url``, owned. Given: left open. A Redis
            publisher is fenced by the lease, when there is one.

    Raises:
        ValueError: no transport or publisher given and no ``settings.redis_url`` to build one from.
        StoreError: the database cannot be reached, or its schema is out of date (``SchemaOutOfDateError``).
        TransportError: Redis cannot be reached.

    Whatever was built before a failure is closed again.
    """
    if (transport is None or publisher is None) and settings.redis_url is None:
        raise ValueError("build_sidecar needs a transport and a publisher, or SidecarSettings.redis_url")
    policy_kw: dict[str, Any] = dict(VLLM_POLICY) if settings.one_k_per_batch else {}
    if settings.tail_weight is not None:
        policy_kw["tail_weight"] = settings.tail_weight
    policy = REGISTRY[settings.policy](k_max=settings.k_max, seed=settings.seed, **policy_kw)
    with ExitStack() as owned:
        store = owned.enter_context(Store(settings.db_url, auto_upgrade=settings.auto_upgrade))
        if transport is None:
            assert settings.redis_url is not None
            transport = RedisStreamsTransport(settings.redis_url, RedisConfig(prefix=settings.prefix))
            owned.callback(transport.close)
        if publisher is None:
            assert settings.redis_url is not None
            publisher = RedisPublisher(settings.redis_url, settings.prefix)
            owned.callback(publisher.close)
        metrics = SidecarMetrics()
        alerts: AlertManager | None = None
        if settings.alerts is not None:
            alert_store = AlertStore(settings.db_url)  # after Store: the schema is at head (or auto_upgrade made it)
            owned.callback(alert_store.close)
            sinks = [ALERT_SINKS[name](settings, metrics) for name in settings.alert_sinks]
            if settings.alert_webhook is not None:
                sinks.append(WebhookSink(settings.alert_webhook))
            alerts = AlertManager(settings.alerts, store=alert_store, sinks=sinks)
            owned.callback(alerts.close)  # flushes the registry's counts, stops the webhook's thread
        lease: Lease | None = None
        if settings.lease is not None:
            assert settings.redis_url is not None
            lease = Lease(settings.redis_url, RedisKeys(settings.prefix).leader, settings.lease)
            owned.callback(lease.close)  # Sidecar.run() releases it; this closes the connection
            if isinstance(publisher, RedisPublisher):
                publisher.fence(lease.key, lease.token)  # the engines' key is written only while this sidecar leads
        sidecar = Sidecar(settings.sidecar, transport, store, policy, publisher, metrics, alerts=alerts, lease=lease)
        server = None
        if settings.http_host is not None:
            server = OperatorServer(sidecar, settings.http_host, settings.http_port).start()
            owned.callback(server.close)
        return SidecarService(sidecar, server, settings, owned.pop_all())
