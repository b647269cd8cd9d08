"""A recorded /metrics endpoint for the ``--follow`` tests (the ``scrape_url`` fixture serves it)."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler
from typing import ClassVar


class Scrapes(BaseHTTPRequestHandler):
    """A /metrics endpoint for ``--follow``: the given bodies one per request (None: a 500), then 404s."""

    bodies: ClassVar[list[str | None]] = []
    served: ClassVar[int] = 0

    def do_GET(self) -> None:
        cls = type(self)
        body = cls.bodies[cls.served] if cls.served < len(cls.bodies) else None
        cls.served += 1
        if body is None:
            self.send_error(500 if cls.served <= len(cls.bodies) else 404)
            return
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass
