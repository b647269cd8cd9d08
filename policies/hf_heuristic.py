"""``hf_heuristic``: transformers' ``num_assistant_tokens_schedule="heuristic"``.

Source: ``transformers/generation/candidate_generator.py``, ``AssistedCandidateGenerator.update_candidate_strategy``
(the schedules ``"heuristic"`` and ``"heuristic_transient"``): after each round,

    if num_matches == int(num_assistant_tokens): num_assistant_tokens += 2.0
    else: num_assistant_tokens = max(1.0, num_assistant_tokens - 1.0)

It never turns speculation off. transformers starts from ``GenerationConfig.num_assistant_tokens`` (default 20).
:func:`heuristic_step` is that rule, one round at a time.

Adaptation to windows (the only departures from the source, each forced by what reaches a policy):

- transformers drafts as many tokens as the state says; our engine drafts at most ``k_max``. The state is kept
  in ``[1, k_max]`` (transformers' own cap on candidates, the remaining ``max_length``, plays the same part).
- transformers updates once per round of one sequence. An acceptance window with one row *is* one round and gets
  exactly that update. A window of many rows run at the same k gets one update in the direction the per-round
  rule drifts at the window's all-accepted fraction p: ``+2`` with probability p and ``-1`` otherwise drift up
  iff ``2p - (1 - p) > 0``, i.e. p > 1/3 (at p = 0 or 1 this is the per-round rule itself).
- State is per (versions, request type, context bucket): acceptance windows do not carry the batch bucket, and
  the rule does not look at cost.
"""

from __future__ import annotations

from typing import Any

from policies.base import Decision, DecisionKind, Policy, Window
from telemetry.records import AcceptanceWindow, Bucket

HF_DEFAULT_NUM_ASSISTANT_TOKENS = 20  # transformers GenerationConfig default
UP_STEP = 2  # "+2 when all drafts were accepted"
DOWN_STEP = 1  # "else -1"
MIN_K = 1  # max(1, k - 1): the heuristic never turns speculation off

StateKey = tuple[str, str, str, str]  # (target version, draft version, request type, context bucket)


def heuristic_step(k: int, num_matches: int, k_max: int) -> int:
    """transformers' per-round update: ``k + 2`` if every one of the k drafts matched, else ``max(1, k - 1)``.

    Args:
        k: ``num_assistant_tokens`` of the round (the drafts it ran).
        num_matches: drafts the target accepted in the round, ``0..k``.
        k_max: the cap on the state (see the module doc).
    """
    return min(k_max, k + UP_STEP) if num_matches == k else max(MIN_K, k - DOWN_STEP)


def window_step(k: int, rows: int, full_rows: int, k_max: int) -> int:
    """One window's update: the per-round rule for a one-row window, else its drift at p = full_rows / rows."""
    p = full_rows / rows
    drifts_up = UP_STEP * p - DOWN_STEP * (1.0 - p) > 0.0  # one row: p is 1 or 0, that round's own outcome
    return heuristic_step(k, num_matches=k if drifts_up else 0, k_max=k_max)


class HFHeuristicPolicy(Policy):
    """transformers' +2 / -1 heuristic, one state per (versions, request type, context bucket).

    Args:
        initial_k: starting draft length (transformers' default 20; the state is kept in ``[1, k_max]``).
        k_max: see :class:`~policies.base.Policy`.
        seed: unused (deterministic rule).
    """

    name = "hf_heuristic"

    def __init__(self, initial_k: int = HF_DEFAULT_NUM_ASSISTANT_TOKENS, k_max: int = 8, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        if initial_k < MIN_K:
            raise ValueError(f"initial_k must be >= {MIN_K} (the heuristic never turns speculation off), "
                             f"got {initial_k}")
        self.initial_k = initial_k
        self._k: dict[StateKey, int] = {}

    def _start(self) -> int:
        return max(MIN_K, min(self.initial_k, self.k_max))

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        b = bucket
        k = self._k.get((b.target_version, b.draft_version, b.request_type, b.context_bucket))
        if k is None:
            return Decision(k=self._start(), reason="initial num_assistant_tokens", kind=DecisionKind.FIRST)
        return Decision(k=k, reason="num_assistant_tokens after the +2/-1 heuristic", kind=DecisionKind.RULE)

    def _observe(self, window: Window) -> None:
        if not isinstance(window, AcceptanceWindow) or window.k == 0 or window.rows == 0:
            return
        w = window
        key = (w.target_version, w.draft_version, w.request_type, w.context_bucket)
        k = self._k.get(key, self._start())
        if w.k != k:
            return  # a window run at another k (e.g. from an older table) says nothing about this step
        self._k[key] = window_step(k, w.rows, w.hist[w.k], self.k_max)

    def _get_state(self) -> dict[str, Any]:
        return {"k": [[*key, k] for key, k in sorted(self._k.items())]}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._k = {(str(t), str(d), str(r), str(c)): int(k) for t, d, r, c, k in state["k"]}
