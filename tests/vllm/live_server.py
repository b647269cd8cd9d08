"""A running ``vllm serve`` as the tests talk to it: OpenAI completions, /metrics, the scheduler's status lines."""

from __future__ import annotations

import json
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Server:
    base_url: str
    model: str
    redis_url: str
    prefix: str
    log: Path
    status: Path
    _lock: threading.Lock
    trace: Path  # the scheduler's step trace (VllmSpectuneConfig.trace_path)

    def complete(self, prompt: str | list[int], max_tokens: int = 64, request_type: object = None,
                 **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "return_token_ids": True} | extra
        if request_type is not None:
            body["vllm_xargs"] = {"request_type": request_type}
        req = urllib.request.Request(f"{self.base_url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30) as r:
            return r.read().decode()

    def statuses(self) -> list[dict[str, Any]]:
        if not self.status.exists():
            return []
        return [json.loads(x) for x in self.status.read_text().splitlines() if x.strip()]

    def steps_since(self, t: float) -> list[dict[str, Any]]:
        """Trace lines of the steps that began at or after ``t`` (``time.perf_counter()``: one monotonic clock
        for every process on the machine)."""
        if not self.trace.exists():
            return []
        return [s for s in (json.loads(x) for x in self.trace.read_text().splitlines() if x.strip()) if s["t"] >= t]
