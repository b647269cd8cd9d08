"""Feeding a sidecar's transport with seeded synthetic rounds, as an engine's emitter would send them."""

from __future__ import annotations

from telemetry.emitter import Emitter, EmitterConfig
from telemetry.synthetic import SyntheticConfig, synthetic_rounds
from telemetry.transport import Transport


def feed(transport: Transport, n_rounds: int, engine_id: str = "e1", *, seed: int = 0, per_window: int = 40,
         target_version: str | None = None) -> int:
    """Send ``n_rounds`` synthetic rounds (:func:`telemetry.synthetic.synthetic_rounds`) as window batches.

    Args:
        transport: where the batches go.
        n_rounds: rounds to send.
        engine_id: the sending engine.
        seed: the rounds' seed (same seed, same rounds).
        per_window: rounds per window batch (the emitter is flushed after each).
        target_version: the rounds' target version (None: :class:`~telemetry.synthetic.SyntheticConfig`'s).

    Returns:
        Windows sent.
    """
    config = None if target_version is None else SyntheticConfig(target_version=target_version)
    em = Emitter(transport, EmitterConfig(engine_id), start=False)
    for i, r in enumerate(synthetic_rounds(n_rounds, seed=seed, config=config)):
        em.record(r)
        if i % per_window == per_window - 1:
            em.flush()
    em.flush()
    return em.stats().windows_sent
