"""How a long-running spectune process (``spectune engine``, ``spectune sidecar``) is asked to stop."""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what a service manager and Ctrl-C send


def install_stop_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` instead of killing the process, so that it ends cleanly: an engine finishes
    its round and flushes telemetry, a sidecar finishes its step and releases its lease. Call it from the main
    thread (Python runs signal handlers there only)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
