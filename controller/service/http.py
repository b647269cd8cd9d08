"""The operator's HTTP endpoint of a sidecar (stdlib ``http.server`` on a bounded pool; JSON in and out).

=========================  ===========================================================================
``GET /health``            liveness and counters; the error in force and the previous one (time), leader, lease
``GET /policy``            the table in force (with its version and reason)
``GET /policy/history``    the newest stored versions (``?limit=N``, default 20), newest first
``GET /pins``              pins in force
``POST /pins``             ``{"bucket": key, "k": int, "reason": str}``: pin k for a bucket key (``*`` parts allowed)
``DELETE /pins/{bucket}``  remove the pin on a (URL-encoded) bucket key
``GET /metrics``           Prometheus exposition of this sidecar's registry
``GET /deadletter``        the newest rejected entries with their reasons (``?limit=N``, default 50)
``GET /alerts``            the newest drift alerts and model updates, newest first (``?limit=N``, default 50;
                           ``unacked=1``: only those no operator acked; ``kind=acceptance_drift``...)
=========================  ===========================================================================

Bad input gets ``400`` with ``{"error": ..., "reason": ...}`` and is counted in
``spectune_http_bad_requests_total{reason}``; nothing an operator sends can stop the sidecar.

Serving (see :class:`HttpConfig`): one thread accepts connections and reads requests with a selector; a
connection goes to a bounded pool of workers only when a whole request (head and body) has arrived on it, and comes
back to the selector after the response (keep-alive; a response leaves in one write). A worker therefore never
waits on a client: an idle connection holds no thread and is closed after ``idle_timeout_s``; a request that is
not whole ``request_timeout_s`` after its first byte (half-sent, or trickled a byte at a time) is cut and counted
in ``spectune_http_requests_timed_out_total``; when every worker is busy and ``max_queued`` connections already
wait, a new request gets ``503`` at once. A client that goes away mid-response is counted in
``spectune_http_client_disconnects_total``, not as a sidecar error.

Shared renderings: ``GET /policy`` keeps its rendering while the table in force is the same object. The pages read
from the store or from Redis (``/pins``, ``/policy/history``, ``/alerts``, ``/deadletter``, each per query) are
shared for up to ``page_max_age_s``, and rendered again at once when this sidecar's table version moves (and, for
``/alerts`` and ``/deadletter``, when it raised an alert or dead-lettered an entry) or after a pin through this
endpoint; what changed elsewhere (a pin from ``spectune pin``, a peer's dead letter, an operator's ack) shows within
``page_max_age_s``. Requests for a page that is being rendered wait for that rendering instead of querying again: a
burst of dashboards costs the store one query per page, and a slow page does not occupy every worker.
"""

from __future__ import annotations

import contextlib
import io
import json
import queue
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from controller.service.sidecar import Sidecar
from telemetry.alerts import ALERT_KINDS, alert_to_json
from telemetry.errors import SpectuneError
from telemetry.records import PolicyTable, RecordError
from telemetry.wire import parse_bucket_key

MAX_BODY_BYTES = 16 << 10  # a pin request is a few hundred bytes
MAX_HEAD_BYTES = 64 << 10  # request line and headers (http.server's own line limit); past it: 431
# http.server's own refusals, by status, as the reason label of spectune_http_bad_requests_total
ERROR_REASONS = {400: "bad_request", 414: "line_too_long", 431: "head_too_large", 501: "method_not_allowed",
                 505: "bad_http_version"}
READ_CHUNK = 64 << 10  # bytes read from a readable connection at a time
_CONTENT_LENGTH = re.compile(rb"^content-length[ \t]*:[ \t]*(\d{1,12})[ \t]*\r?$", re.IGNORECASE | re.MULTILINE)
MAX_LIMIT = 1000  # history / dead-letter pages
PAYLOAD_PREVIEW = 200  # bytes of a dead letter's payload shown
SWEEP_S = 0.1  # how often the accept thread closes connections idle past their deadline
METRICS_MAX_AGE_S = 1.0  # GET /metrics may serve a rendering this old (scrapers poll every 10-60 s)
MAX_PAGES = 64  # shared renderings kept: limit=1..1000 x filters is unbounded, memory must not be
WRITE_BUFFER = 64 << 10  # a response up to this size leaves in one write (a larger body: in a second one)
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 b'Content-Length: 62\r\n\r\n{"error": "too many requests; retry", "reason": "overloaded"}\n')


@dataclass(frozen=True)
class HttpConfig:
    """How the operator endpoint serves: bounded threads, timeouts, a real listen backlog."""

    workers: int = 4  # threads answering requests (sub-ms each; more only add GIL switching on a small machine)
    idle_timeout_s: float = 5.0  # a keep-alive connection with no request this long is closed
    request_timeout_s: float = 10.0  # a whole request (head and body, from its first byte) or a response write
    max_queued: int = 256  # connections with a request waiting for a worker; past this: 503 at once
    backlog: int = 128  # listen(2) backlog (socketserver: 5): a burst of 20+ clients must not wait for SYN retries
    # how old a shared store / Redis page may be (its own changes re-render at once); 0: every request queries
    page_max_age_s: float = 1.0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.max_queued < 1 or self.backlog < 1:
            raise ValueError("HttpConfig needs workers, max_queued and backlog >= 1")
        if self.idle_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("HttpConfig timeouts must be > 0")
        if self.page_max_age_s < 0:
            raise ValueError("HttpConfig.page_max_age_s must be >= 0")


class BadRequest(Exception):
    """A 400: ``reason`` is the countable label, the message says what to send instead."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Flight:
    """One rendering of a page in progress; requests for the same page wait on it and take its outcome."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.body: bytes | None = None
        self.error: BaseException | None = None


class _Pages:
    """Rendered GET pages shared between requests (see the module docstring).

    A page is served again while its ``stamp`` (cheap in-memory state its content follows: the table version,
    the alerts raised) is unchanged, it is younger than ``max_age_s`` and no write through this endpoint came
    after it began rendering (:meth:`invalidate`). At most one rendering per page runs at a time.
    """

    def __init__(self, max_age_s: float) -> None:
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._pages: dict[Hashable, tuple[float, Hashable, bytes]] = {}  # key -> (began, stamp, body)
        self._flights: dict[Hashable, _Flight] = {}
        self._generation = 0  # moved by invalidate(): a rendering begun before a write is not kept

    def get(self, key: Hashable, stamp: Hashable, render: Callable[[], bytes]) -> bytes:
        with self._lock:
            page = self._pages.get(key)
            if page is not None and page[1] == stamp and time.monotonic() - page[0] < self._max_age_s:
                return page[2]
            flight = self._flights.get(key)
            if flight is None:
                flight = self._flights[key] = _Flight()
                generation = self._generation
                leader = True
            else:
                leader = False
        if not leader:
            flight.done.wait()  # the leader sets it whatever happens (finally below)
            if flight.error is not None:
                raise flight.error
            assert flight.body is not None
            return flight.body
        began = time.monotonic()
        try:
            flight.body = render()
        except BaseException as e:  # the waiters answer as this request does (a store outage: 503 for all)
            flight.error = e
            raise
        finally:
            with self._lock:
                if self._flights.get(key) is flight:
                    del self._flights[key]
                if flight.body is not None and generation == self._generation and self._max_age_s > 0:
                    while len(self._pages) >= MAX_PAGES:
                        del self._pages[next(iter(self._pages))]  # the oldest inserted
                    self._pages.pop(key, None)  # re-inserted last: insertion order is age order
                    self._pages[key] = (began, stamp, flight.body)
            flight.done.set()
        return flight.body

    def invalidate(self) -> None:
        """A write through this endpoint: no page rendered before it is served after it."""
        with self._lock:
            self._generation += 1
            self._pages.clear()
            self._flights.clear()  # later requests render anew instead of joining a rendering begun before


class _Handler(BaseHTTPRequestHandler):
    """One connection's request handler; the server calls :meth:`handle_one_request` once per request."""

    server: _Server
    protocol_version = "HTTP/1.1"
    # Headers and body go out in one write (flushed by handle_one_request / the keep-alive loop): a header
    # write then a body write is two segments, and Nagle holds the second until the client ACKs the first.
    wbufsize = WRITE_BUFFER
    disable_nagle_algorithm = True  # what is written is a whole response: send it now

    def __init__(self, sock: socket.socket, addr: Any, server: _Server) -> None:
        self.request, self.client_address, self.server = sock, addr, server
        self.setup()
        sock.settimeout(server.config.request_timeout_s)  # a response write stalls at most this long
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the sidecar's output is its own, not an access log."""

    # ------------------------------------------------------------------------------------------ plumbing
    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        try:
            self.end_headers()  # into the write buffer; sent with the body
            self.wfile.write(body)
        except OSError:  # the client went away (reset, broken pipe, write timeout): its loss, not our error
            self.close_connection = True
            self.server.sidecar.metrics.on_http_client_gone()

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, _dumps(obj))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a bad request line, an unknown method, a line too long) in this endpoint's
        JSON shape, counted like every other bad request, instead of an HTML page."""
        reason = ERROR_REASONS.get(code, "bad_request")
        self.server.sidecar.metrics.http_bad_requests.labels(reason).inc()
        self.close_connection = True
        self.request_version = self.protocol_version  # the default, HTTP/0.9, would send the body without a head
        self.requestline = getattr(self, "requestline", "")
        text = message or explain or f"HTTP {code}"
        if code == 501:
            text = f"method {self.command!r} is not served here; use GET, POST or DELETE"
        self._json(code, {"error": text, "reason": reason})

    def _page(self, key: Hashable, stamp: Hashable, render: Callable[[], Any]) -> None:
        """A 200 JSON page, shared with other requests for ``key`` while ``stamp`` holds (see :class:`_Pages`)."""
        self._send(200, self.server.pages.get(key, stamp, lambda: _dumps(render())))

    def _dispatch(self, method: str) -> None:
        sc = self.server.sidecar
        try:
            parts = urlsplit(self.path)
            self._route(method, parts.path.rstrip("/") or "/", parse_qs(parts.query))
        except BadRequest as e:
            sc.metrics.http_bad_requests.labels(e.reason).inc()
            self._json(400, {"error": str(e), "reason": e.reason})
        except RecordError as e:  # input the records layer refused, wherever it was checked
            sc.metrics.http_bad_requests.labels(e.reason).inc()
            self._json(400, {"error": str(e), "reason": e.reason})
        except OSError:  # reading the body from a client that went away
            self.close_connection = True
            sc.metrics.on_http_client_gone()
        except SpectuneError as e:  # the store and the transports translate their libraries' errors
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
            return self._send(200, self.server.policy_page(cur))
        if method == "GET" and path == "/policy/history":
            limit = _limit(query, 20)
            return self._page(("history", limit), sc.version, lambda: [
                {"version": t.version, "created_at": t.created_at, "reason": t.reason, "default_k": t.default_k,
                 "entries": t.entries}
                for t in sc.store.policy_versions(limit=limit)
            ])
        if method == "GET" and path == "/pins":  # a pin that changes the table moves the version
            return self._page(("pins",), sc.version, lambda: [asdict(p) for p in sc.store.active_pins()])
        if method == "POST" and path == "/pins":
            return self._pin()
        if method == "DELETE" and path.startswith("/pins/"):
            key = unquote(path[len("/pins/"):])
            parse_bucket_key(key)  # RecordError -> 400: no key that could not be pinned reaches the database
            if not sc.store.unpin(key, who="http"):
                return self._json(404, {"error": f"no active pin on {key!r}", "reason": "no_pin"})
            self.server.pages.invalidate()
            if not sc.is_leader:
                return self._json(202, {"unpinned": key, "policy_version": sc.version, "leader": False,
                                        "applied_by": "the leader sidecar, at its next decision"})
            table = sc.publish_now(f"unpin {key}")
            return self._json(200, {"unpinned": key, "policy_version": table.version if table else sc.version,
                                    "leader": True})
        if method == "GET" and path == "/metrics":
            return self._send(200, sc.metrics.exposition(METRICS_MAX_AGE_S), CONTENT_TYPE_LATEST)
        if method == "GET" and path == "/deadletter":
            limit = _limit(query, 50)
            # every dead letter this sidecar wrote is counted in its rejections (sum() runs in C under the GIL:
            # the loop thread cannot resize the dict mid-sum)
            return self._page(("deadletter", limit), sum(sc.rejected.values()), lambda: [
                {"source_id": d.source_id, "reason": d.reason, "size": d.size, "at": d.at,
                 "payload_preview": d.payload[:PAYLOAD_PREVIEW].decode(errors="replace")}
                for d in sc.transport.recent_dead_letters(limit)
            ])
        if method == "GET" and path == "/alerts":
            return self._alerts(query)
        known = ("/health", "/policy", "/policy/history", "/pins", "/metrics", "/deadletter", "/alerts")
        return self._json(404, {"error": f"no route {method} {path}; try one of {', '.join(known)}",
                                "reason": "not_found"})

    def _alerts(self, query: dict[str, list[str]]) -> None:
        """``GET /alerts``: from the ``alerts`` table, or the ones this sidecar raised when it keeps none."""
        sc = self.server.sidecar
        limit = _limit(query, 50)
        unacked = query.get("unacked", ["0"])[0]
        if unacked not in ("0", "1"):
            raise BadRequest("bad_unacked", f"unacked must be 0 or 1, got {unacked[:50]!r}")
        kind = query["kind"][0] if "kind" in query else None
        if kind is not None and kind not in ALERT_KINDS:
            raise BadRequest("bad_kind", f"kind must be one of {', '.join(ALERT_KINDS)}, got {kind[:50]!r}")
        if sc.alerts is None:
            return self._json(404, {"error": "alerts are off on this sidecar; start it with --alerts",
                                    "reason": "alerts_off"})
        store = sc.alerts.store
        raised = sc.recent_alerts  # trimmed to a fixed length: its newest entry says whether one was raised
        stamp = (sc.version, len(raised), id(raised[-1]) if raised else None)

        def render() -> list[dict[str, Any]]:
            if store is not None:
                found = store.list_alerts(limit, unacked_only=unacked == "1", kind=kind)
            else:  # kept in memory only: none can have been acked
                found = [a for a in reversed(sc.recent_alerts) if kind is None or a.kind == kind][:limit]
            return [alert_to_json(a) for a in found]

        return self._page(("alerts", limit, unacked, kind), stamp, render)

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
        except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an int past 4300 digits, nesting too deep
            raise BadRequest("bad_json", f"body is not JSON this endpoint reads: {str(e)[:200]}") from e
        if not isinstance(body, dict):
            raise BadRequest("bad_json", 'send an object: {"bucket": "t|d|type|batch|ctx", "k": 0, "reason": "..."}')
        bucket, k, reason = body.get("bucket"), body.get("k"), body.get("reason", "")
        if not isinstance(bucket, str):
            raise BadRequest("bad_bucket_key", '"bucket" must be a string like "target-v1|draft-v1|code|*|*"')
        parse_bucket_key(bucket)  # the same rules as tables on the wire (RecordError -> 400)
        if not isinstance(reason, str):
            raise BadRequest("bad_type", '"reason" must be a string')
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= sc.policy.k_max:
            raise BadRequest("out_of_range", f'"k" must be an int in [0, {sc.policy.k_max}] (the policy\'s k_max)')
        try:
            pin = sc.store.pin(bucket, k, reason, who="http")
        except RecordError as e:
            raise BadRequest(e.reason, str(e)) from e
        self.server.pages.invalidate()
        if not sc.is_leader:
            # A follower stores the pin; the leader applies stored pins at its next decision (publish_every_s).
            self._json(202, {"pinned": asdict(pin), "policy_version": sc.version, "published": False,
                             "leader": False, "applied_by": "the leader sidecar, at its next decision"})
            return
        table = sc.publish_now(f"pin {bucket}={k}")
        # "published": false says the pin is stored but no engine has it yet (the sidecar keeps retrying).
        self._json(200, {"pinned": asdict(pin), "policy_version": table.version if table else sc.version,
                         "published": sc.published and sc.is_leader, "leader": sc.is_leader})


class _Conn:
    """A client connection: its handler, the bytes read from it that no worker has answered yet, and when it is
    closed (idle between requests, or a request still not whole)."""

    def __init__(self, sock: socket.socket, addr: Any, server: _Server) -> None:
        self.sock = sock
        self.handler = _Handler(sock, addr, server)
        self.deadline = time.monotonic() + server.config.idle_timeout_s
        self.inbuf = bytearray()  # read by the selector thread; taken a request at a time by a worker

    def request_size(self) -> int | None:
        """Bytes of the first whole request in ``inbuf`` (request line, headers, Content-Length body); ``None``
        while it is not whole. A head past ``MAX_HEAD_BYTES`` or a body past ``MAX_BODY_BYTES`` counts as whole
        at what has arrived: the handler refuses it without reading the rest."""
        end = self.inbuf.find(b"\r\n\r\n")
        if end < 0:
            return len(self.inbuf) if len(self.inbuf) > MAX_HEAD_BYTES else None
        m = _CONTENT_LENGTH.search(self.inbuf, 0, end)
        n = int(m.group(1)) if m else 0  # no or a bad length: the handler answers from the head alone
        if n > MAX_BODY_BYTES:
            return len(self.inbuf)
        return end + 4 + n if len(self.inbuf) >= end + 4 + n else None

    def take(self, n: int) -> bytes:
        req = bytes(self.inbuf[:n])
        del self.inbuf[:n]
        return req

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.handler.finish()
        with contextlib.suppress(OSError):
            self.sock.close()


class _Server(HTTPServer):
    """Accepts on one thread, watches idle connections with a selector, answers on a bounded pool."""

    def __init__(self, addr: tuple[str, int], sidecar: Sidecar, config: HttpConfig) -> None:
        self.request_queue_size = config.backlog  # read by server_activate(): listen(backlog)
        super().__init__(addr, _Handler)
        self.sidecar = sidecar
        self.config = config
        self._pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="spectune-http")
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._back: queue.SimpleQueue[_Conn] = queue.SimpleQueue()  # connections workers hand back
        self._waiting = 0  # connections submitted to the pool and not yet picked up by a worker
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self.pages = _Pages(config.page_max_age_s)
        self._policy_page: tuple[PolicyTable | None, bytes] = (None, b"")  # (the table, its rendering)

    def policy_page(self, table: PolicyTable) -> bytes:
        """``GET /policy``'s body, rendered once per table object (tables are frozen; a new version is a new
        object)."""
        held, body = self._policy_page  # one read: a pair another worker replaced is still a matching pair
        if held is not table:
            body = _dumps(asdict(table))
            self._policy_page = (table, body)
        return body

    def serve(self) -> None:
        """The accept / idle-watch loop (the server thread)."""
        self.socket.setblocking(False)
        self._sel.register(self.socket, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        next_sweep = time.monotonic() + SWEEP_S
        while not self._stop.is_set():
            for key, _ in self._sel.select(SWEEP_S):
                if key.fileobj is self.socket:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    self._read(key.data)
            while True:
                try:
                    self._watch(self._back.get_nowait())
                except queue.Empty:
                    break
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + SWEEP_S
                for key in list(self._sel.get_map().values()):
                    if isinstance(key.data, _Conn) and key.data.deadline <= now:
                        self._sel.unregister(key.fileobj)
                        if key.data.inbuf:  # a request still not whole request_timeout_s after its first byte
                            self.sidecar.metrics.on_http_request_timed_out()
                        key.data.close()  # else idle past idle_timeout_s
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, _Conn):
                key.data.close()
        while True:  # handed back by a worker after the last loop
            try:
                self._back.get_nowait().close()
            except queue.Empty:
                break
        self._sel.close()

    def _accept(self) -> None:
        for _ in range(self.config.backlog):  # drain a burst in one wake-up
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: leave it in the backlog, try again on the next loop
                return
            try:
                self._watch(_Conn(sock, addr, self))
            except OSError:
                with contextlib.suppress(OSError):
                    sock.close()

    def _watch(self, conn: _Conn) -> None:
        if conn.request_size() is not None:  # pipelined: the next request is already here
            self._dispatch(conn)
            return
        if conn.inbuf:  # part of the next request came with the last one: its clock is running
            conn.deadline = time.monotonic() + self.config.request_timeout_s
        conn.sock.setblocking(False)  # read here only when readable; never wait on a client in this thread
        self._sel.register(conn.sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        """What a readable connection sent, kept until a whole request is there (then a worker answers it)."""
        try:
            data = conn.sock.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client closed (or reset) the connection
            self._sel.unregister(conn.sock)
            if conn.inbuf:
                self.sidecar.metrics.on_http_client_gone()
            conn.close()
            return
        if not conn.inbuf:  # a request's first byte: the whole of it must arrive within request_timeout_s
            conn.deadline = time.monotonic() + self.config.request_timeout_s
        conn.inbuf += data
        if conn.request_size() is not None:
            self._sel.unregister(conn.sock)
            self._dispatch(conn)

    def _dispatch(self, conn: _Conn) -> None:
        with self._count_lock:
            full = self._waiting >= self.config.max_queued
            if not full:
                self._waiting += 1
        if full:
            with contextlib.suppress(OSError):
                conn.sock.settimeout(0.1)
                conn.sock.sendall(BUSY_RESPONSE)
            self.sidecar.metrics.on_http_overloaded()
            conn.close()
            return
        self._pool.submit(self._serve_one, conn)

    def _serve_one(self, conn: _Conn) -> None:
        """A worker: answer the whole requests read so far, then hand the connection back (or close it)."""
        with self._count_lock:
            self._waiting -= 1
        h = conn.handler
        try:
            conn.sock.settimeout(self.config.request_timeout_s)  # a response write stalls at most this long
            while (n := conn.request_size()) is not None:
                if conn.inbuf.find(b"\r\n\r\n") < 0:  # a head past MAX_HEAD_BYTES and still not ended
                    h.command = ""
                    h.send_error(431, f"request head over {MAX_HEAD_BYTES} bytes")
                    h.wfile.flush()
                    conn.close()
                    return
                h.rfile = io.BytesIO(conn.take(n))
                h.close_connection = True
                h.handle_one_request()  # sets close_connection = False for a keep-alive request
                if h.close_connection or self._stop.is_set():
                    h.wfile.flush()
                    conn.close()
                    return
                h.wfile.flush()
        except OSError:  # reset, broken pipe, or a response write past request_timeout_s: the client's problem
            self.sidecar.metrics.on_http_client_gone()
            conn.close()
            return
        except Exception as e:  # never a traceback on stderr; the endpoint's own errors answer 500 in _dispatch
            self.sidecar._error(e)
            conn.close()
            return
        conn.deadline = time.monotonic() + self.config.idle_timeout_s
        self._back.put(conn)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.server_close()
        self._wake_r.close()
        self._wake_w.close()


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True).encode() + b"\n"


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
        config: pool size, timeouts and backlog (:class:`HttpConfig`).
    """

    def __init__(self, sidecar: Sidecar, host: str = "127.0.0.1", port: int = 0,
                 config: HttpConfig | None = None) -> None:
        self.config = config or HttpConfig()
        try:
            self._server = _Server((host, port), sidecar, self.config)
        except OSError as e:
            raise SpectuneError(
                f"cannot listen on {host}:{port} ({e}); choose another --http-port or stop what uses it"
            ) from e
        self._thread = threading.Thread(target=self._server.serve, name="spectune-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def backlog(self) -> int:
        return self._server.request_queue_size

    @property
    def url(self) -> str:
        host = self._server.server_address[0]
        return f"http://{host!s}:{self.port}"

    def start(self) -> OperatorServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.stop()
        self._thread.join(5)
        self._server.close()
