"""The operator's HTTP endpoint of a sidecar (stdlib ``ThreadingHTTPServer``; JSON in and out).

=========================  ===========================================================================
``GET /health``            liveness and counters (windows ingested, rejections, last error)
``GET /policy``            the table in force (with its version and reason)
``GET /policy/history``    the newest stored versions (``?limit=N``, default 20), newest first
``GET /pins``              pins in force
``POST /pins``             ``{"bucket": key, "k": int, "reason": str}``: pin k for a bucket key (``*`` parts allowed)
``DELETE /pins/{bucket}``  remove the pin on a (URL-encoded) bucket key
``GET /metrics``           Prometheus exposition of this sidecar's registry
``GET /deadletter``        the newest rejected entries with their reasons (``?limit=N``, default 50)
=========================  ===========================================================================

Bad input gets ``400`` with ``{"error": ..., "reason": ...}`` and is counted in
``spectune_http_bad_requests_total{reason}``; nothing an operator sends can stop the sidecar.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy.exc import SQLAlchemyError

from controller.sidecar import Sidecar
from telemetry.errors import SpectuneError
from telemetry.records import RecordError
from telemetry.transport import DeadLetter, RedisStreamsTransport

MAX_BODY_BYTES = 16 << 10  # a pin request is a few hundred bytes
MAX_LIMIT = 1000  # history / dead-letter pages
PAYLOAD_PREVIEW = 200  # bytes of a dead letter's payload shown


class BadRequest(Exception):
    """A 400: ``reason`` is the countable label, the message says what to send instead."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def recent_dead_letters(sidecar: Sidecar, limit: int) -> list[DeadLetter]:
    """Newest dead letters first (Redis: XREVRANGE; in-process: the tail of the list)."""
    t = sidecar.transport
    if isinstance(t, RedisStreamsTransport):
        out = []
        raw: Any = t.client.xrevrange(t.deadletter_stream, count=limit)
        for _eid, f in raw or []:
            out.append(DeadLetter(
                source_id=f.get(b"source_id", b"").decode(errors="replace"),
                reason=f.get(b"reason", b"").decode(errors="replace"),
                payload=f.get(b"v", b""), size=int(f.get(b"size", b"0")), at=float(f.get(b"at", b"0")),
            ))
        return out
    return list(reversed(t.dead_letters(100_000)))[:limit]


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the sidecar's output is its own, not an access log."""

    # ------------------------------------------------------------------------------------------ plumbing
    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, json.dumps(obj, sort_keys=True).encode() + b"\n")

    def _dispatch(self, method: str) -> None:
        sc = self.server.sidecar
        try:
            parts = urlsplit(self.path)
            self._route(method, parts.path.rstrip("/") or "/", parse_qs(parts.query))
        except BadRequest as e:
            sc.metrics.http_bad_requests.labels(e.reason).inc()
            self._json(400, {"error": str(e), "reason": e.reason})
        except (SpectuneError, SQLAlchemyError) as e:
            self._json(503, {"error": f"the sidecar's store or transport failed: {e}", "reason": "unavailable"})
        except Exception as e:  # an endpoint bug answers 500, never kills the server thread silently
            sc._error(e)
            self._json(500, {"error": f"{type(e).__name__}: {e}", "reason": "internal"})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # ------------------------------------------------------------------------------------------- routes
    def _route(self, method: str, path: str, query: dict[str, list[str]]) -> None:
        sc = self.server.sidecar
        if method == "GET" and path == "/health":
            return self._json(200, sc.health())
        if method == "GET" and path == "/policy":
            cur = sc.current
            if cur is None:
                return self._json(404, {"error": "no policy published yet; the sidecar has seen no windows",
                                        "reason": "no_policy"})
            return self._json(200, asdict(cur))
        if method == "GET" and path == "/policy/history":
            limit = _limit(query, 20)
            return self._json(200, [
                {"version": t.version, "created_at": t.created_at, "reason": t.reason, "default_k": t.default_k,
                 "entries": t.entries}
                for t in sc.store.policy_versions(limit=limit)
            ])
        if method == "GET" and path == "/pins":
            return self._json(200, [asdict(p) for p in sc.store.active_pins()])
        if method == "POST" and path == "/pins":
            return self._pin()
        if method == "DELETE" and path.startswith("/pins/"):
            key = unquote(path[len("/pins/"):])
            if not sc.store.unpin(key, who="http"):
                return self._json(404, {"error": f"no active pin on {key!r}", "reason": "no_pin"})
            table = sc.publish_now(f"unpin {key}")
            return self._json(200, {"unpinned": key, "policy_version": table.version if table else sc.version})
        if method == "GET" and path == "/metrics":
            return self._send(200, sc.metrics.exposition(), CONTENT_TYPE_LATEST)
        if method == "GET" and path == "/deadletter":
            limit = _limit(query, 50)
            return self._json(200, [
                {"source_id": d.source_id, "reason": d.reason, "size": d.size, "at": d.at,
                 "payload_preview": d.payload[:PAYLOAD_PREVIEW].decode(errors="replace")}
                for d in recent_dead_letters(sc, limit)
            ])
        known = ("/health", "/policy", "/policy/history", "/pins", "/metrics", "/deadletter")
        return self._json(404, {"error": f"no route {method} {path}; try one of {', '.join(known)}",
                                "reason": "not_found"})

    def _pin(self) -> None:
        sc = self.server.sidecar
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError as e:
            raise BadRequest("bad_length", "Content-Length must be an integer") from e
        if n <= 0 or n > MAX_BODY_BYTES:
            raise BadRequest("bad_length", f"send a JSON body of 1..{MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(self.rfile.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest("bad_json", f"body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise BadRequest("bad_json", 'send an object: {"bucket": "t|d|type|batch|ctx", "k": 0, "reason": "..."}')
        bucket, k, reason = body.get("bucket"), body.get("k"), body.get("reason", "")
        if not isinstance(bucket, str):
            raise BadRequest("bad_bucket_key", '"bucket" must be a string like "target-v1|draft-v1|code|*|*"')
        if not isinstance(reason, str):
            raise BadRequest("bad_type", '"reason" must be a string')
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= sc.policy.k_max:
            raise BadRequest("out_of_range", f'"k" must be an int in [0, {sc.policy.k_max}] (the policy\'s k_max)')
        try:
            pin = sc.store.pin(bucket, k, reason, who="http")
        except RecordError as e:
            raise BadRequest(e.reason, str(e)) from e
        table = sc.publish_now(f"pin {bucket}={k}")
        self._json(200, {"pinned": asdict(pin), "policy_version": table.version if table else sc.version})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], sidecar: Sidecar) -> None:
        super().__init__(addr, _Handler)
        self.sidecar = sidecar


def _limit(query: dict[str, list[str]], default: int) -> int:
    raw = query.get("limit", [str(default)])[0]
    try:
        n = int(raw)
    except ValueError as e:
        raise BadRequest("bad_limit", f"limit must be an integer in [1, {MAX_LIMIT}], got {raw!r}") from e
    if not 1 <= n <= MAX_LIMIT:
        raise BadRequest("bad_limit", f"limit must be in [1, {MAX_LIMIT}], got {n}")
    return n


class OperatorServer:
    """The endpoint on a background thread.

    Args:
        sidecar: the sidecar it reports on and pins through.
        host, port: where to listen (port 0 picks a free one; see :attr:`port`).
    """

    def __init__(self, sidecar: Sidecar, host: str = "127.0.0.1", port: int = 0) -> None:
        try:
            self._server = _Server((host, port), sidecar)
        except OSError as e:
            raise SpectuneError(
                f"cannot listen on {host}:{port} ({e}); choose another --http-port or stop what uses it"
            ) from e
        self._thread = threading.Thread(target=self._server.serve_forever, name="spectune-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = self._server.server_address[0]
        return f"http://{host!s}:{self.port}"

    def start(self) -> OperatorServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
