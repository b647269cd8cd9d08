"""``hf_heuristic``: transformers' ``num_assistant_tokens_schedule="heuristic"``.

Source: ``transformers/generation/candidate_generator.py``, ``AssistedCandidateGenerator.update_candidate_strategy``:
after each round, ``num_assistant_tokens += 2`` when every draft was accepted (``num_matches ==
num_assistant_tokens``), else ``num_assistant_tokens = max(1, num_assistant_tokens - 1)``. It never turns
speculation off. transformers starts from ``GenerationConfig.num_assistant_tokens`` (default 20).

Adaptation to windows: transformers updates once per round of one sequence. A window aggregates many rows run at
the same k, so we apply one update per acceptance window, moving in the direction of the rule's expected drift:
``+2`` with probability p (all accepted) and ``-1`` otherwise drift up iff ``2p - (1 - p) > 0``, i.e. p > 1/3 —
the same fixed point the per-round rule hovers around. State is per bucket (versions, type, context); the batch
bucket is ignored because acceptance windows do not carry it and the rule does not look at cost.
"""

from __future__ import annotations

from typing import Any

from policies.base import Decision, Policy, Window
from telemetry.records import AcceptanceWindow, Bucket

HF_DEFAULT_NUM_ASSISTANT_TOKENS = 20  # transformers GenerationConfig default
UP_STEP = 2  # "+2 when all drafts were accepted"
DOWN_STEP = 1  # "else -1"
MIN_K = 1  # max(1, k - 1): the heuristic never turns speculation off


def heuristic_step(k: int, full_fraction: float, k_max: int) -> int:
    """One window's update: +2 if the rule drifts up (p_all_accepted > 1/3), else max(1, k - 1)."""
    up = UP_STEP * full_fraction - DOWN_STEP * (1.0 - full_fraction) > 0.0
    return min(k_max, k + UP_STEP) if up else max(MIN_K, k - DOWN_STEP)


class HFHeuristicPolicy(Policy):
    """transformers' +2 / -1 heuristic, one state per (versions, request type, context bucket).

    Args:
        initial_k: starting draft length (transformers' default 20, clamped to ``k_max``).
        k_max: see :class:`~policies.base.Policy`.
        seed: unused (deterministic rule).
    """

    name = "hf_heuristic"

    def __init__(self, initial_k: int = HF_DEFAULT_NUM_ASSISTANT_TOKENS, k_max: int = 8, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        self.initial_k = initial_k
        self._k: dict[str, int] = {}

    @staticmethod
    def _key(t: str, d: str, r: str, c: str) -> str:
        return f"{t}|{d}|{r}|{c}"

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        b = bucket
        for key in (self._key(b.target_version, b.draft_version, b.request_type, b.context_bucket),):
            if key in self._k:
                return Decision(k=self._k[key], reason="heuristic state")
        return Decision(k=max(MIN_K, min(self.initial_k, self.k_max)), reason="initial num_assistant_tokens")

    def _observe(self, window: Window) -> None:
        if not isinstance(window, AcceptanceWindow) or window.k == 0 or window.rows == 0:
            return
        w = window
        key = self._key(w.target_version, w.draft_version, w.request_type, w.context_bucket)
        k = self._k.get(key, max(MIN_K, min(self.initial_k, self.k_max)))
        if w.k != k:
            return  # a window run at another k (e.g. from an older table) says nothing about this step
        self._k[key] = heuristic_step(k, w.hist[w.k] / w.rows, self.k_max)

    def _get_state(self) -> dict[str, Any]:
        return {"k": dict(self._k)}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._k = {str(k): int(v) for k, v in state["k"].items()}
