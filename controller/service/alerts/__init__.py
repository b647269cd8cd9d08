"""Drift alerts: a model-version registry, river change detectors per bucket, and the sinks alerts go to.

The sidecar holds one :class:`AlertManager` and calls :meth:`AlertManager.observe_batch` with each new batch;
operators list and ack alerts through :class:`telemetry.alerts_store.AlertStore`. The record is
:class:`telemetry.alerts.Alert`.
"""

from controller.service.alerts.detectors import (
    DETECTORS,
    BucketMonitor,
    Change,
    ChangeDetector,
    DetectorSpec,
    estimate_change_point,
    make_detector,
)
from controller.service.alerts.manager import (
    ACCEPTANCE_MONITOR,
    COST_MONITOR,
    FIRST_DRAFT_MONITOR,
    AlertConfig,
    AlertManager,
    MonitorConfig,
)
from controller.service.alerts.registry import ModelRegistry
from controller.service.alerts.sinks import (
    AlertSink,
    LogSink,
    PrometheusSink,
    RedisStreamSink,
    WebhookConfig,
    WebhookSink,
    alerts_stream,
)

__all__ = [
    "ACCEPTANCE_MONITOR",
    "COST_MONITOR",
    "DETECTORS",
    "FIRST_DRAFT_MONITOR",
    "AlertConfig",
    "AlertManager",
    "AlertSink",
    "BucketMonitor",
    "Change",
    "ChangeDetector",
    "DetectorSpec",
    "LogSink",
    "ModelRegistry",
    "MonitorConfig",
    "PrometheusSink",
    "RedisStreamSink",
    "WebhookConfig",
    "WebhookSink",
    "alerts_stream",
    "estimate_change_point",
    "make_detector",
]
