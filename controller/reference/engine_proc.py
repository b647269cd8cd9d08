"""``spectune engine``: the reference engine as a process that follows the policy and streams telemetry.

It embeds :class:`~controller.client.EngineHooks` exactly as a third-party engine would: ``hooks.decide`` is the
engine's policy function, ``hooks.record`` takes every :class:`~telemetry.records.RoundRecord`. Windows go to
Redis (``--redis-url``) for a sidecar to consume; the table comes back through the same Redis.

With ``status_path`` it appends one JSON line per ``status_every_s`` and on every policy version change:
``{"t", "rounds", "tokens", "version", "k_by_type" (of the latest round), "fail_static", ...}``, and a final
line with the emitter's counts (``"final": true``) when it stops (SIGTERM/SIGINT stop it cleanly, flushing
telemetry first).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.client import ClientConfig, EngineHooks, build_engine_hooks
from controller.reference.workload import WORKLOADS, Phase, PromptPool, RequestStream, drive, scaled, warm_up
from engine.profiles import DEFAULT_PROFILE, get_profile
from telemetry.emitter import EmitterConfig
from telemetry.records import RecordError, RoundRecord
from telemetry.transport import DEFAULT_PREFIX
from telemetry.wire import check_label

if TYPE_CHECKING:
    from engine.loader import Models
    from engine.loop import SpecEngine

PROGRESS_EVERY_S = 10.0  # seconds between progress lines


@dataclass(frozen=True)
class EngineProcConfig:
    """One engine process."""

    redis_url: str  # windows out, policy in
    engine_id: str  # unique per engine process (idempotency key of its windows)
    checkpoints: Path | None = None  # None: the shipped checkpoints
    profile: str = DEFAULT_PROFILE  # target/draft pair (engine/profiles.py): xl = a large target's cost
    device: str | None = None  # None: CUDA when present, else CPU
    prefix: str = DEFAULT_PREFIX
    workload: str = "steady"  # a name in controller.reference.workload.WORKLOADS
    duration_s: float | None = None  # stop after this long (None: the workload's own length)
    load: int | None = None  # override every phase's in-flight requests
    default_k: int = 2  # fail-static k until a table arrives
    k_max: int = 8
    max_batch: int = 64
    window_s: float = 0.25  # emitter window
    refresh_s: float = 1.0  # client timer refresh
    seed: int = 0
    status_path: Path | None = None
    status_every_s: float = 0.5
    prompt_cache: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # free-form labels copied into status lines

    def __post_init__(self) -> None:
        try:
            check_label(self.engine_id, "engine id")  # it travels with every window: the wire's label rule
        except RecordError as e:
            raise ValueError(e.detail) from None
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        get_profile(self.profile)  # a ValueError naming the profiles
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration must be > 0 seconds")
        if self.load is not None and not 1 <= self.load <= self.max_batch:
            raise ValueError(f"load must be in [1, max_batch={self.max_batch}]")
        if not 0 <= self.default_k <= self.k_max:
            raise ValueError(f"default k must be in [0, k_max={self.k_max}]")


def phases_for(cfg: EngineProcConfig) -> tuple[Phase, ...]:
    """The workload, with the load override and cut or stretched to ``duration_s``."""
    from dataclasses import replace

    phases = WORKLOADS[cfg.workload]
    if cfg.load is not None:
        phases = tuple(replace(p, load=cfg.load) for p in phases)
    if cfg.duration_s is not None:
        phases = scaled(phases, cfg.duration_s / sum(p.seconds for p in phases))
    return phases


class _Status:
    """Writes the status lines (the engine's own account of what it decoded under which policy)."""

    def __init__(self, path: Path | None, hooks: EngineHooks, every_s: float, extra: dict[str, Any]) -> None:
        self._path, self._hooks, self._every, self._extra = path, hooks, every_s, extra
        self._next = 0.0
        self._version: int | None = None
        self.rounds = self.tokens = 0
        self.k_by_type: dict[str, int] = {}  # k per request type in the latest round (types absent from it omitted)

    def on_round(self, r: RoundRecord) -> None:
        self.rounds += 1
        self.tokens += r.emitted
        # The latest round only: a type absent from recent rounds must not report the k it had before a policy
        # change (a reader would take that stale k for a pin not applied).
        self.k_by_type = {row.request_type: row.k for row in r.rows}
        v = self._hooks.client.version
        now = time.monotonic()
        if v != self._version or now >= self._next:
            self._version = v
            self._next = now + self._every
            self.write()

    def write(self, **more: Any) -> None:
        if self._path is None:
            return
        st = self._hooks.client.status()
        line = {"t": time.time(), "rounds": self.rounds, "tokens": self.tokens, "version": st.version,
                "k_by_type": dict(self.k_by_type), "fail_static": st.fail_static, "mode": st.mode,
                "rejected": st.rejected, "connected": st.connected, "applied_at": st.last_update_at,
                **self._extra, **more}
        with self._path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def run_engine(cfg: EngineProcConfig, stop: threading.Event | None = None,
               say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load the models, follow the policy, decode the workload, stream telemetry. Returns final counts.

    Args:
        cfg: the process settings.
        stop: set it to finish the current round, flush telemetry and return.
        say: receives a one-line progress summary every ``PROGRESS_EVERY_S`` (the CLI prints it).
    """
    from engine.loader import load_models
    from engine.loop import EngineConfig, SpecEngine

    stop = stop or threading.Event()
    models = load_models(cfg.checkpoints, cfg.device, with_update=True, profile=cfg.profile)
    engine = SpecEngine(models.target, models.draft, EngineConfig(max_batch=cfg.max_batch, k_max=cfg.k_max,
                                                                  seed=cfg.seed),
                        models.target_version, models.draft_version)
    hooks = build_engine_hooks(
        ClientConfig(target_version=models.target_version, draft_version=models.draft_version,
                     default_k=cfg.default_k, k_max=cfg.k_max, redis_url=cfg.redis_url, prefix=cfg.prefix,
                     refresh_s=cfg.refresh_s),
        EmitterConfig(engine_id=cfg.engine_id, interval_s=cfg.window_s))
    status = _Status(cfg.status_path, hooks, cfg.status_every_s, {"engine_id": cfg.engine_id, **cfg.extra})
    next_say = [PROGRESS_EVERY_S]
    said = [0, 0.0]  # tokens and time at the last progress line

    def on_round(r: RoundRecord, phase: Phase, t: float) -> None:
        hooks.record(r)
        status.on_round(r)
        if say is not None and t >= next_say[0]:
            next_say[0] = t + PROGRESS_EVERY_S
            tps = (status.tokens - said[0]) / max(1e-9, t - said[1])
            said[0], said[1] = status.tokens, t
            say(f"{t:7.1f}s {phase.name}: batch {r.batch_size}, {tps:.0f} tok/s, {hooks.client.status().detail}")

    pool = PromptPool(cfg.seed, cfg.prompt_cache)
    warm_up(engine, pool, cfg.default_k)
    try:
        wall = drive(engine, hooks.decide, phases_for(cfg), RequestStream(pool, cfg.seed), on_round,
                     model_update(engine, models, hooks), stop.is_set)
    finally:
        hooks.close()
    assert hooks.emitter is not None
    es = hooks.emitter.stats()
    final = {"final": True, "wall_s": wall, "rounds_recorded": es.rounds_recorded, "windows_sent": es.windows_sent,
             "windows_built": es.windows_built, "windows_dropped": es.windows_dropped,
             "emitter_last_error": es.last_error, "client": asdict(hooks.client.status())}
    status.write(**final)
    return {**final, "rounds": status.rounds, "tokens": status.tokens}


def model_update(engine: SpecEngine, models: Models, hooks: EngineHooks) -> Callable[[], None]:
    """The workload's model update (``drive``'s ``on_update``): swap in the updated target, and decide under its
    version from the next round on. Nothing happens when the updated target was not loaded."""

    def update() -> None:
        if models.target_v2 is not None:
            engine.swap_target(models.target_v2, models.target_v2_version)
            hooks.set_versions(models.target_v2_version, models.draft_version)

    return update
