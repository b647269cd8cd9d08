"""``static``: one fixed k for every bucket — what most deployments run (vLLM ``num_speculative_tokens``)."""

from __future__ import annotations

from typing import Any

from policies.base import Decision, Policy
from telemetry.records import Bucket


class StaticPolicy(Policy):
    """Always the same k. Learns nothing; unknown buckets get the same k.

    Args:
        k: the draft length (clamped to ``[0, k_max]``).
        k_max: see :class:`~policies.base.Policy`.
        seed: unused (kept for a uniform constructor).
    """

    name = "static"

    def __init__(self, k: int = 3, k_max: int = 8, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        return Decision(k=self.k, reason=f"static k={self.k}")

    def _get_state(self) -> dict[str, Any]:
        return {"k": self.k}

    def _set_state(self, state: dict[str, Any]) -> None:
        self.k = int(state["k"])
