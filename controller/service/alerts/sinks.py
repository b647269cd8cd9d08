"""Where an alert goes once raised: a Redis stream, a log line, a webhook, a Prometheus counter.

The ``alerts`` table is not a sink: it is the record (it gives the alert the id an operator acks), written first by
:class:`~controller.service.alerts.manager.AlertManager`. The sinks are notifications and consumers of the one
:class:`~telemetry.alerts.Alert`, each in its own class.

:class:`AlertSink` is the extension point: :meth:`AlertSink.emit` does the shared work (a failing sink is counted
and logged, never raised into the sidecar's loop) and calls ``_emit``. None of them blocks for long: the webhook
queues and posts from its own thread.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis
from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import RedisError

from telemetry.alerts import ALERT_KINDS, Alert, alert_to_json
from telemetry.errors import TransportError
from telemetry.transport import DEFAULT_PREFIX, PAYLOAD_FIELD, RedisKeys
from telemetry.urls import redact_url

__all__ = [
    "AlertSink", "LogSink", "PrometheusSink", "RedisStreamSink", "WebhookConfig", "WebhookSink",
    "alerts_stream",
]

log = logging.getLogger(__name__)

ALERTS_STREAM_MAXLEN = 10_000  # alerts are rare; the table keeps them all, the stream only the recent ones


def alerts_stream(keys: RedisKeys) -> str:
    """``{prefix}:alerts``: the stream of raised alerts (one JSON field ``v`` per entry)."""
    return keys.alerts


class AlertSink(ABC):
    """A consumer of raised alerts."""

    def __init__(self) -> None:
        self.failures = 0  # emits that raised (logged with the reason)

    def emit(self, alert: Alert) -> None:
        """Hand ``alert`` on; a failure is counted and logged, never raised (the sidecar's loop goes on)."""
        try:
            self._emit(alert)
        except Exception as e:
            self.failures += 1
            log.error("alert sink %s failed for alert %s (%s): %s", type(self).__name__, alert.id, alert.kind, e)

    @abstractmethod
    def _emit(self, alert: Alert) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release what the sink holds."""


class RedisStreamSink(AlertSink):
    """Appends each alert's JSON to ``{prefix}:alerts`` (capped near :data:`ALERTS_STREAM_MAXLEN` entries).

    Args:
        url: the Redis URL the sidecar uses.
        prefix: the deployment's key prefix (see :class:`telemetry.transport.RedisKeys`).
    """

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, maxlen: int = ALERTS_STREAM_MAXLEN) -> None:
        super().__init__()
        self.url = url
        self.stream = alerts_stream(RedisKeys(prefix))
        self._maxlen = maxlen
        self._redis = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)

    def _emit(self, alert: Alert) -> None:
        try:
            self._redis.xadd(self.stream, {PAYLOAD_FIELD: json.dumps(alert_to_json(alert))},
                             maxlen=self._maxlen, approximate=True)
        except RedisError as e:
            raise TransportError(f"adding an alert to {self.stream} on {redact_url(self.url)} failed: {e}; "
                                 "the alert is still in the alerts table") from e

    def close(self) -> None:
        self._redis.close()


class LogSink(AlertSink):
    """One structured log line per alert: the JSON in the message, the dict in ``extra["spectune_alert"]``."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.WARNING) -> None:
        super().__init__()
        self._log = logger or logging.getLogger("spectune.alerts")
        self._level = level

    def _emit(self, alert: Alert) -> None:
        payload = alert_to_json(alert)
        self._log.log(self._level, "spectune alert %s", json.dumps(payload, sort_keys=True),
                      extra={"spectune_alert": payload})


class PrometheusSink(AlertSink):
    """``spectune_alerts_total{kind=...}``, every kind present from the start (at 0).

    Args:
        registry: where to register (the sidecar's :class:`~controller.service.metrics.SidecarMetrics` registry);
            a fresh private one by default, never the global one.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.alerts = Counter("spectune_alerts", "Alerts raised, by kind (model_update, acceptance_drift, "
                              "cost_drift).", ["kind"], registry=self.registry)
        for kind in ALERT_KINDS:
            self.alerts.labels(kind=kind)

    def _emit(self, alert: Alert) -> None:
        self.alerts.labels(kind=alert.kind).inc()


@dataclass(frozen=True)
class WebhookConfig:
    """An HTTP endpoint that receives each alert as a JSON POST."""

    url: str  # http(s) URL; an operator's chat or paging bridge
    timeout_s: float = 2.0  # per attempt; the webhook's thread waits this long, never the caller
    max_attempts: int = 4  # first try + retries; then the alert is given up (it stays in the table)
    backoff_s: float = 0.5  # wait before the first retry, doubled after each (0.5, 1, 2 s)
    queue_size: int = 1000  # alerts waiting to be posted; a full queue drops new ones (counted)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"WebhookConfig.url must be an http(s) URL, got {redact_url(self.url)!r}")
        if self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError("WebhookConfig.timeout_s must be > 0 and backoff_s >= 0")
        if self.max_attempts < 1 or self.queue_size < 1:
            raise ValueError("WebhookConfig.max_attempts and queue_size must be >= 1")


class WebhookSink(AlertSink):
    """POSTs each alert's JSON from a background thread, with bounded retries and exponential backoff.

    ``emit`` only enqueues (never blocks); a full queue drops the alert and counts it in ``dropped``. An attempt
    fails on a connection error, a timeout or a non-2xx status; after ``max_attempts`` the alert is counted in
    ``gave_up`` and logged. ``close`` stops the thread promptly (a backoff wait is interrupted); alerts still
    queued then are counted in ``dropped``.
    """

    def __init__(self, config: WebhookConfig) -> None:
        super().__init__()
        self.config = config
        self.delivered = 0
        self.attempts = 0
        self.gave_up = 0
        self.dropped = 0
        self._queue: queue.Queue[Alert] = queue.Queue(maxsize=config.queue_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spectune-alert-webhook", daemon=True)
        self._thread.start()

    def _emit(self, alert: Alert) -> None:
        try:
            self._queue.put_nowait(alert)
        except queue.Full:
            self.dropped += 1
            log.warning("alert webhook queue full (%d); dropped alert %s (it stays in the alerts table)",
                        self.config.queue_size, alert.id)

    def pending(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                alert = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self._deliver(alert)
            self._queue.task_done()

    def _deliver(self, alert: Alert) -> None:
        body = json.dumps(alert_to_json(alert)).encode()
        delay = self.config.backoff_s
        last: Exception | None = None
        attempt = 0
        for attempt in range(1, self.config.max_attempts + 1):
            self.attempts += 1
            try:
                self._post(body)
                self.delivered += 1
                return
            except (OSError, urllib.error.URLError) as e:  # HTTPError, timeouts and refusals are all OSErrors
                last = e
            if attempt < self.config.max_attempts and self._stop.wait(delay):
                break  # closing: stop retrying
            delay *= 2
        self.gave_up += 1
        log.error("alert webhook %s gave up on alert %s after %d attempts: %s",
                  redact_url(self.config.url), alert.id, attempt, last)

    def _post(self, body: bytes) -> None:
        req = urllib.request.Request(self.config.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
            status = int(resp.status)
        if not 200 <= status < 300:
            raise urllib.error.HTTPError(self.config.url, status, "non-2xx", None, None)  # type: ignore[arg-type]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (waiting at most ``timeout_s`` for an attempt in flight); queued alerts are dropped."""
        self._stop.set()
        self._thread.join(timeout_s)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self.dropped += 1

    def flush(self, timeout_s: float) -> bool:
        """Wait until the queue is empty and the last attempt ended (tests, shutdown); True if it did in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

