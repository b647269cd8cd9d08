"""What a demo run logged, round by round and row by row: written by :mod:`controller.reference.demo`, read by it (the
hindsight table, the progress line) and by :mod:`controller.reference.demo_report` (tables and plots).

``t`` is seconds into the workload when the round ended; ``phase`` indexes the workload's phases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controller.service.sidecar import PublishedVersion


@dataclass(frozen=True, slots=True)
class RoundLog:
    """One engine round of a demo run."""

    t: float
    phase: int
    target_version: str
    batch_size: int
    max_context: int  # longest context in the batch: picks the round's context bucket
    max_k: int  # largest k of the round's rows: the k whose cost the round paid
    emitted: int
    wall_s: float


@dataclass(frozen=True, slots=True)
class RowLog:
    """One row (request) of an engine round of a demo run."""

    t: float
    phase: int
    target_version: str
    request_type: str
    k: int  # drafted tokens (0: speculation off for this row)
    accepted: int
    emitted: int  # bonus token included


@dataclass
class RunLog:
    """What one run did, round by round and row by row (the plots and tables read these)."""

    name: str
    rounds: list[RoundLog] = field(default_factory=list)
    rows: list[RowLog] = field(default_factory=list)
    wall_s: float = 0.0
    history: list[PublishedVersion] = field(default_factory=list)
    started_at: float = 0.0  # wall clock (time.time) at the start of the workload

    def tokens(self, phase: int | None = None) -> int:
        return sum(r.emitted for r in self.rounds if phase is None or r.phase == phase)
