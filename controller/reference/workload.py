"""A mixed, phased workload for the reference engine (the ``spectune engine`` process and the demo).

A workload is a list of :class:`Phase`: for a stretch of wall time the driver keeps ``load`` requests in flight
(submitted or decoding), drawing each request's type from ``mix`` and making ``long_fraction`` of them
long-context. Request ``i`` of a seed is always the same request, so two runs with different policies see the
same stream of requests and their tokens per second compare fairly phase by phase.

Prompts are real held-out text (:func:`engine.corpus.held_out_prompts`); building them parses the standard
library, so the pool is cached as JSON under ``cache_dir``.

Sampling: code and structured requests decode greedily (temperature 0, as tool calls and completions usually
do); prose samples at temperature 1. That is part of why their acceptance differs.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.corpus import held_out_prompts
from engine.loop import Request, SpecEngine
from telemetry.records import REQUEST_TYPES, RoundRecord

SHORT_PROMPT = 96  # bytes: a chat-sized prompt, context bucket <=512
LONG_PROMPT = 1400  # bytes: lands in the <=2048 context bucket and still fits max_context with the output
POOL_SIZE = 48  # prompts per (type, length) in the pool
MAX_NEW_TOKENS = (32, 96)  # range of output lengths
TEMPERATURE = {"code": 0.0, "prose": 1.0, "structured": 0.0}
POOL_VERSION = 1  # bump when the pool's recipe changes (invalidates caches)
STRUCTURED_HEAVY = (0.1, 0.1, 0.8)  # a tool-calling stretch: the structured bucket fills fast enough to watch
STRUCTURED_SCHEMAS = (1, 2)  # engine.corpus's structured schemas (2: the mix the updated target was trained on)


@dataclass(frozen=True)
class Phase:
    """A stretch of the workload."""

    name: str
    seconds: float  # wall time spent in the phase
    load: int  # requests kept in flight (the engine's batch size once they are admitted)
    mix: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)  # weights of code, prose, structured
    long_fraction: float = 0.0  # share of requests with a long prompt
    update: bool = False  # swap the target to the updated model when the phase starts
    structured_schema: int = 1  # JSON schema of structured prompts: 2 without ``update`` is a silent drift

    def __post_init__(self) -> None:
        if self.seconds <= 0 or self.load < 1:
            raise ValueError(f"Phase {self.name!r} needs seconds > 0 and load >= 1")
        if len(self.mix) != len(REQUEST_TYPES) or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise ValueError(f"Phase {self.name!r}: mix must be {len(REQUEST_TYPES)} non-negative weights")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"Phase {self.name!r}: long_fraction must be in [0, 1]")
        if self.structured_schema not in STRUCTURED_SCHEMAS:
            raise ValueError(f"Phase {self.name!r}: structured_schema must be one of {STRUCTURED_SCHEMAS}")


# Load rises to a large batch and falls; long-context requests arrive; traffic turns structured-heavy at a low
# load, then structured prompts switch to the second JSON schema with no version change (a silent drift: the
# sidecar must notice it from acceptance alone); the model update lands after it (its target was trained on
# schema 2, which stays).
WORKLOADS: dict[str, tuple[Phase, ...]] = {
    "demo": (
        Phase("warm-up", 8, load=4),
        Phase("rising", 8, load=16, mix=(0.4, 0.3, 0.3)),
        Phase("peak", 10, load=48),
        Phase("long-context", 8, load=8, mix=(0.2, 0.6, 0.2), long_fraction=0.6),
        Phase("structured", 9, load=4, mix=STRUCTURED_HEAVY),
        Phase("silent drift", 9, load=4, mix=STRUCTURED_HEAVY, structured_schema=2),
        Phase("model update", 10, load=8, mix=(0.3, 0.2, 0.5), update=True, structured_schema=2),
        Phase("falling", 4, load=2, structured_schema=2),
    ),
    "steady": (Phase("steady", 3600, load=8),),
}


def scaled(phases: Sequence[Phase], factor: float) -> tuple[Phase, ...]:
    """The same phases, each ``factor`` times as long (``--quick`` runs use a small factor)."""
    from dataclasses import replace

    return tuple(replace(p, seconds=p.seconds * factor) for p in phases)


class PromptPool:
    """Held-out prompts per request type, short and long, cached on disk.

    Args:
        seed: which cut of the held-out text.
        cache_dir: where the pool is cached (None: no cache).

    Structured prompts of schema 2 (:meth:`get` with ``schema=2``) are built on first use and cached beside the
    pool, so a workload that never drifts never pays for them.
    """

    def __init__(self, seed: int = 0, cache_dir: Path | None = None) -> None:
        self._seed, self._cache_dir = seed, cache_dir
        path = cache_dir / f"prompts-v{POOL_VERSION}-s{seed}.json" if cache_dir else None
        if path is not None and path.exists():
            raw = json.loads(path.read_text())
        else:
            raw = {
                f"{t}/{n}": [p.hex() for p in held_out_prompts(t, POOL_SIZE, n, seed)]
                for t in REQUEST_TYPES for n in (SHORT_PROMPT, LONG_PROMPT)
            }
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(raw))
        self._pool = {k: [bytes.fromhex(h) for h in v] for k, v in raw.items()}

    def _schema_pool(self, schema: int) -> None:
        """Add schema ``schema``'s structured prompts to the pool (cached as their own file)."""
        d = self._cache_dir
        path = d / f"prompts-v{POOL_VERSION}-s{self._seed}-structured{schema}.json" if d else None
        if path is not None and path.exists():
            raw = json.loads(path.read_text())
        else:
            raw = {f"structured/{n}": [p.hex() for p in held_out_prompts("structured", POOL_SIZE, n, self._seed,
                                                                        schema_version=schema)]
                   for n in (SHORT_PROMPT, LONG_PROMPT)}
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(raw))
        self._pool.update({f"{k}@{schema}": [bytes.fromhex(h) for h in v] for k, v in raw.items()})

    def get(self, request_type: str, long: bool, i: int, schema: int = 1) -> bytes:
        key = f"{request_type}/{LONG_PROMPT if long else SHORT_PROMPT}"
        if request_type == "structured" and schema != 1:
            key = f"{key}@{schema}"
            if key not in self._pool:
                self._schema_pool(schema)
        lst = self._pool[key]
        return lst[i % len(lst)]


class RequestStream:
    """Request ``i`` is a pure function of the seed and ``i`` (same stream for every policy)."""

    def __init__(self, pool: PromptPool, seed: int = 0) -> None:
        self._pool = pool
        self._seed = seed
        self.issued = 0

    def next(self, phase: Phase) -> Request:
        i = self.issued
        self.issued += 1
        rng = random.Random(self._seed * 1_000_003 + i)
        rtype = rng.choices(REQUEST_TYPES, weights=phase.mix)[0]
        long = rng.random() < phase.long_fraction
        return Request(
            request_id=f"r{i}", request_type=rtype,
            prompt=self._pool.get(rtype, long, rng.randrange(1 << 30), phase.structured_schema),
            max_new_tokens=rng.randint(*MAX_NEW_TOKENS), temperature=TEMPERATURE.get(rtype, 1.0),
        )


def warm_up(engine: SpecEngine, pool: PromptPool, k: int = 2) -> None:
    """Decode a few short requests so one-off costs (allocator, thread pools, kernels) stay out of measurements."""
    for i, rtype in enumerate(REQUEST_TYPES):
        engine.submit(Request(f"warm-up-{i}", rtype, pool.get(rtype, False, i), max_new_tokens=8))
    while not engine.idle():
        engine.step(lambda *_: k)
    engine.pop_finished()


RoundHook = Callable[[RoundRecord, Phase, float], None]  # (round, phase, seconds since the workload began)


def drive(engine: SpecEngine, decide: Callable[[str, int, int], int], phases: Sequence[Phase],
          stream: RequestStream, on_round: RoundHook, on_update: Callable[[], None] | None = None,
          stop: Callable[[], bool] = lambda: False) -> float:
    """Run the phases on ``engine``: keep each phase's load in flight, step with ``decide``, report every round.

    Args:
        engine: the engine (its model update, if any, is done by ``on_update``).
        decide: the engine's policy function (request type, batch size, context length) -> k.
        phases: the workload.
        stream: where requests come from.
        on_round: called after every round (record it, plot it).
        on_update: called when a phase with ``update=True`` starts (swap the target).
        stop: polled every round; True ends the workload early.

    Returns:
        Wall seconds the workload ran.
    """
    t0 = time.monotonic()
    for phase in phases:
        if phase.update and on_update is not None:
            on_update()
        end = time.monotonic() + phase.seconds
        while time.monotonic() < end and not stop():
            while engine.active + len(engine.waiting) < phase.load:
                engine.submit(stream.next(phase))
            r = engine.step(decide)
            engine.pop_finished()
            if r is not None:
                on_round(r, phase, time.monotonic() - t0)
        if stop():
            break
    return time.monotonic() - t0
