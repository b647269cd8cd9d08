"""The sinks: a webhook that retries with backoff and gives up without blocking, a log line, a full queue."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controller.service.alerts import AlertSink, LogSink, WebhookConfig, WebhookSink
from telemetry.alerts import MODEL_UPDATE, Alert

HOLD_S = 30.0  # the longest a held attempt waits for its answer (a test that forgets to open the gate)


class _RecordingStop(threading.Event):
    """A sink's stop event that records each backoff wait it is asked for: the sink's delays, read exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return super().wait(timeout)


def _alert(i: int = 1) -> Alert:
    return Alert(kind=MODEL_UPDATE, bucket="t2|d1|*|*|*", target_version="t2", draft_version="d1",
                 previous_target_version="t1", previous_draft_version="d1", detected_at=1.0, message="update", id=i)


class _Server:
    """A local HTTP endpoint answering ``status`` to every POST and recording the bodies.

    It answers once ``gate`` is set (at once by default); a test clears it to hold an attempt in flight.
    """

    def __init__(self, status: int) -> None:
        self.bodies: list[bytes] = []
        self.gate = threading.Event()
        self.gate.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                outer.gate.wait(HOLD_S)
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.gate.set()  # a held handler answers, so shutdown does not wait for HOLD_S
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def failing_server() -> Iterator[_Server]:
    s = _Server(500)
    yield s
    s.close()


@pytest.fixture
def ok_server() -> Iterator[_Server]:
    s = _Server(204)
    yield s
    s.close()


def test_webhook_retries_with_backoff_then_gives_up_without_blocking(failing_server: _Server) -> None:
    sink = WebhookSink(WebhookConfig(failing_server.url, timeout_s=HOLD_S, max_attempts=3, backoff_s=0.1))
    sink._stop = stop = _RecordingStop()  # read before each use, so the running thread backs off on this one
    try:
        failing_server.gate.clear()  # the endpoint holds its answer: no attempt can end before the gate opens
        sink.emit(_alert())
        assert sink.attempts <= 1 and sink.gave_up == 0  # emit() returned with the delivery still under way
        failing_server.gate.set()
        assert sink.flush(timeout_s=HOLD_S)
        assert len(failing_server.bodies) == 3 and sink.attempts == 3
        assert sink.gave_up == 1 and sink.delivered == 0 and sink.failures == 0
        assert stop.waits == [0.1, 0.2]  # 0.1 s before the first retry, then doubled
        assert json.loads(failing_server.bodies[0])["kind"] == MODEL_UPDATE
    finally:
        sink.close()


def test_webhook_delivers_to_a_working_endpoint(ok_server: _Server) -> None:
    sink = WebhookSink(WebhookConfig(ok_server.url))
    sink.emit(_alert())
    assert sink.flush(timeout_s=10.0)
    sink.close()
    assert sink.delivered == 1 and sink.attempts == 1 and len(ok_server.bodies) == 1


def test_an_unreachable_webhook_neither_blocks_nor_raises() -> None:
    # A port nothing listens on: every attempt is refused at once; the backoff (far longer than the test) runs in
    # the sink's thread, so that thread holds at most one alert while the five are emitted.
    sink = WebhookSink(WebhookConfig("http://127.0.0.1:9/hook", max_attempts=2, backoff_s=3600.0, queue_size=2))
    for i in range(5):
        sink.emit(_alert(i))
    assert sink.gave_up == 0  # every emit() returned while the first alert was still being retried
    assert sink.dropped >= 2  # a full queue (2) drops and counts what one alert in flight leaves over
    sink.close(timeout_s=HOLD_S)  # interrupts the backoff
    assert sink.gave_up + sink.dropped == 5


def test_webhook_config_is_checked() -> None:
    with pytest.raises(ValueError, match="http"):
        WebhookConfig("ftp://example/hook")
    with pytest.raises(ValueError, match="max_attempts"):
        WebhookConfig("http://example/hook", max_attempts=0)


def test_log_sink_writes_one_structured_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="spectune.alerts"):
        LogSink().emit(_alert())
    [rec] = caplog.records
    assert rec.spectune_alert["kind"] == MODEL_UPDATE  # type: ignore[attr-defined]
    assert json.loads(rec.getMessage().removeprefix("spectune alert "))["previous_target_version"] == "t1"


def test_a_failing_sink_is_counted_not_raised() -> None:
    class Broken(AlertSink):
        def _emit(self, alert: Alert) -> None:
            raise RuntimeError("down")

    s = Broken()
    s.emit(_alert())
    assert s.failures == 1
