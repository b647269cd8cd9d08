"""A closed-loop load on vLLM's OpenAI completions API, phase by phase, and what each phase measured.

Each phase keeps ``concurrency`` requests in flight for ``seconds``: every client sends a request, reads its
stream to the end and sends the next. Request ``i`` of a phase is the same for every configuration (type, prompt,
output length, temperature and seed come from :class:`~controller.reference.workload.RequestStream`), so
configurations compare on the same load. When the phase's time is up no new request starts; the ones in flight
finish (their tokens after the end do not count) before the next phase begins, so every phase starts from an
empty engine for every configuration.

Figures per phase (as vLLM's own ``benchmark_serving`` defines them):

- **tok/s**: output tokens that arrived inside the phase's window, over the window;
- **TPOT** of a request: ``(end - first token) / (output tokens - 1)``, over the requests that started inside
  the window and produced at least two tokens; p50 and p99 across them.
- **TTFT** of a request: ``first token - sent``, over the requests that produced a token; p50 and p99. A load
  whose tok/s and TPOT disagree (more tokens a second at a slower TPOT) spends the difference before the first
  token: prompt work and queueing, which a draft model adds to whatever k is.

Prompts travel as token ids (``[BOS] + bytes``): byte-level prompts cut at any byte need not be UTF-8.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from controller.reference.workload import Phase, RequestStream
from engine.model import BOS_ID

HTTP_TIMEOUT_S = 300.0  # one request at batch 32 on two cores can take a minute
ERROR_BACKOFF_S = 1.0
OUTPUT_SCALE = 2  # the reference workload's 32-96 output tokens, doubled: a serving load is mostly decoding


@dataclass(frozen=True)
class LoadPhase:
    """One stretch of the load."""

    name: str
    concurrency: int
    seconds: float
    long_fraction: float = 0.2  # share of requests with a long (~1.4k-token) prompt
    mix: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)  # code, prose, structured

    def as_workload_phase(self) -> Phase:
        return Phase(self.name, self.seconds, self.concurrency, self.mix, self.long_fraction)


@dataclass
class _Request:
    started: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens so far)
    error: str | None = None


def _percentile(values: tuple[float, ...], q: float) -> float | None:
    """The q-th percentile of a phase's per-request figures; None when no request gave one."""
    return float(np.percentile(values, q)) if values else None


@dataclass(frozen=True)
class PhaseResult:
    """What one phase measured."""

    name: str
    concurrency: int
    seconds: float  # the measured window
    tokens: int  # output tokens that arrived inside the window
    requests: int  # requests started inside the window
    completed: int  # ... of which completed
    errors: int
    tpots: tuple[float, ...]  # each finished request's TPOT (s): percentiles pooled over repeats need them
    ttfts: tuple[float, ...] = ()  # each request's time to its first token (s)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tpot_p50(self) -> float | None:
        return _percentile(self.tpots, 50)

    @property
    def tpot_p99(self) -> float | None:
        return _percentile(self.tpots, 99)

    @property
    def ttft_p50(self) -> float | None:
        return _percentile(self.ttfts, 50)

    @property
    def ttft_p99(self) -> float | None:
        return _percentile(self.ttfts, 99)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "concurrency": self.concurrency, "seconds": self.seconds, "tokens": self.tokens,
                "tok_s": self.tok_s, "requests": self.requests, "completed": self.completed, "errors": self.errors,
                "tpot_p50": self.tpot_p50, "tpot_p99": self.tpot_p99, "tpots": list(self.tpots),
                "ttft_p50": self.ttft_p50, "ttft_p99": self.ttft_p99}


def _stream_completion(url: str, model: str, req: Any, rec: _Request) -> None:
    """POST one streamed completion and record its token arrivals.

    No per-request ``seed``: vLLM 0.32's CPU runner fails a step (``CPU Generator does not use offset``) when a
    seeded request's prompt is split across steps, so sampled (prose) requests draw from the engine's generator.
    """
    parts = urlsplit(url)
    body: dict[str, Any] = {
        "model": model, "prompt": [BOS_ID, *req.prompt], "max_tokens": req.max_new_tokens * OUTPUT_SCALE,
        "temperature": req.temperature, "ignore_eos": False, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "vllm_xargs": {"request_type": req.request_type},
    }
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            usage = json.loads(data).get("usage") or {}
            n = int(usage.get("completion_tokens") or 0)
            if n > rec.tokens:
                now = time.perf_counter()
                if rec.first is None:
                    rec.first = now
                rec.tokens = n
                rec.arrivals.append((now, n))
        rec.end = time.perf_counter()
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def run_phase(url: str, model: str, phase: LoadPhase, stream: RequestStream) -> PhaseResult:
    """Drive one phase (closed loop) and measure it; returns after the requests in flight have finished."""
    wp = phase.as_workload_phase()
    lock = threading.Lock()
    records: list[_Request] = []
    t0 = time.perf_counter()
    t_end = t0 + phase.seconds

    def client() -> None:
        while True:
            with lock:
                now = time.perf_counter()
                if now >= t_end:
                    return
                req = stream.next(wp)
                rec = _Request(started=now)
                records.append(rec)
            _stream_completion(url, model, req, rec)
            if rec.error is not None:
                time.sleep(ERROR_BACKOFF_S)  # a failing server must not be hammered by a spinning client

    threads = [threading.Thread(target=client, daemon=True) for _ in range(phase.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HTTP_TIMEOUT_S + phase.seconds)
    return summarise(phase, records, t0, t_end)


def summarise(phase: LoadPhase, records: list[_Request], t0: float, t_end: float) -> PhaseResult:
    """The phase's figures from its requests' token arrivals (pure: tested on hand-made arrivals)."""
    tokens = 0
    for r in records:
        inside = [n for t, n in r.arrivals if t <= t_end]
        tokens += inside[-1] if inside else 0
    tpots = [(r.end - r.first) / (r.tokens - 1) for r in records
             if r.error is None and r.end is not None and r.first is not None and r.tokens >= 2]
    return PhaseResult(
        name=phase.name, concurrency=phase.concurrency, seconds=t_end - t0, tokens=tokens, requests=len(records),
        completed=sum(1 for r in records if r.end is not None and r.error is None),
        errors=sum(1 for r in records if r.error is not None),
        tpots=tuple(tpots),
        ttfts=tuple(r.first - r.started for r in records if r.error is None and r.first is not None),
    )
