"""Seeded synthetic round records: plausible engine output for tests, benchmarks and demos without torch.

Acceptance follows the usual i.i.d. model (each draft token accepted with probability ``alpha`` of its request
type until the first rejection); round times grow with batch size and ``max_k + 1``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from telemetry.records import MAX_DRAFT_LEN, RoundRecord, RowRecord

DEFAULT_ALPHA = {"code": 0.8, "prose": 0.6, "structured": 0.9}  # typical draft agreement per workload


@dataclass(frozen=True)
class SyntheticConfig:
    """What the simulated engine looks like."""

    target_version: str = "target-v1"
    draft_version: str = "draft-v1"
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16, 32)  # drawn per round
    ks: tuple[int, ...] = (0, 2, 4, 6)  # per-row k drawn from these
    alpha: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_ALPHA))
    max_context: int = 10_000
    step_s: float = 0.004  # seconds of one target position (verify cost per scored position, roughly)
    draft_step_s: float = 0.0005  # seconds of one draft step for the whole batch

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("SyntheticConfig.batch_sizes must be non-empty positive ints")
        if not self.ks or min(self.ks) < 0 or max(self.ks) > MAX_DRAFT_LEN:
            raise ValueError(f"SyntheticConfig.ks must lie in [0, {MAX_DRAFT_LEN}]")
        if not self.alpha or any(not 0.0 <= a <= 1.0 for a in self.alpha.values()):
            raise ValueError("SyntheticConfig.alpha must map request types to probabilities")


def synthetic_rounds(n: int, seed: int = 0, config: SyntheticConfig | None = None) -> Iterator[RoundRecord]:
    """Yield ``n`` rounds from a seeded RNG (same seed, same rounds)."""
    cfg = config or SyntheticConfig()
    rng = random.Random(seed)
    types = sorted(cfg.alpha)
    for i in range(n):
        bs = rng.choice(cfg.batch_sizes)
        rows = []
        for _ in range(bs):
            rt = rng.choice(types)
            k = rng.choice(cfg.ks)
            acc = 0
            while acc < k and rng.random() < cfg.alpha[rt]:
                acc += 1
            rows.append(RowRecord(rt, rng.randrange(cfg.max_context), k, acc, acc + 1))
        max_k = max(r.k for r in rows)
        yield RoundRecord(
            round_index=i, batch_size=bs, max_k=max_k, tokens_verified=sum(r.k + 1 for r in rows),
            draft_s=cfg.draft_step_s * max_k, verify_s=cfg.step_s * (1 + 0.02 * bs * (max_k + 1)),
            other_s=cfg.step_s * 0.05 * rng.random(), target_version=cfg.target_version,
            draft_version=cfg.draft_version, rows=tuple(rows), timestamp=float(i),
        )
