"""``trtllm_schedule``: TensorRT-LLM's ``draft_len_schedule``, a draft length per batch size "up to" a key.

Source: ``tensorrt_llm/_torch/speculative/utils.py``, ``get_draft_len_for_batch_size``, and
``tensorrt_llm/llmapi/llm_args.py``, ``DecodingBaseConfig``:

- keys are **upper bounds**: a batch size uses the draft length of the **smallest key >= it** (``bisect_left``);
  above the largest key speculation is off (draft length 0). ``{4: 4, 8: 2, 32: 1}``: batch 1-4 -> 4, 5-8 -> 2,
  9-32 -> 1, 33+ -> 0;
- keys are >= 1 and draft lengths >= 0; the smallest key's draft length must equal ``max_draft_len`` and none may
  exceed it (``validate_draft_len_schedule_and_sort``);
- ``max_concurrency`` (a plain cutoff) and ``draft_len_schedule`` are mutually exclusive; ``max_concurrency`` alone
  becomes ``{max_concurrency: max_draft_len}``.

Here ``max_draft_len`` is the largest draft length the schedule names (``k_max`` for ``max_concurrency``): a
policy has no engine-side ``max_draft_len`` of its own. The batch size of a bucket is its ``batch_bucket``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from typing import Any

from policies.base import Decision, DecisionKind, Policy
from telemetry.records import Bucket

DEFAULT_DRAFT_LEN_SCHEDULE = {4: 4, 16: 2, 64: 1}  # a typical hand-set table; batch > 64 runs without drafts


def validate_draft_len_schedule(schedule: Mapping[int, int]) -> dict[int, int]:
    """TensorRT-LLM's checks; returns the schedule sorted by key.

    Raises:
        ValueError: naming the rule the schedule breaks.
    """
    if not schedule:
        raise ValueError("draft_len_schedule must not be empty")
    out = {int(bs): int(k) for bs, k in sorted(schedule.items())}
    for bs, k in out.items():
        if bs < 1:
            raise ValueError(f"draft_len_schedule: batch size threshold must be >= 1, got {bs}")
        if k < 0:
            raise ValueError(f"draft_len_schedule: draft length must be >= 0, got {k}")
    smallest = next(iter(out))
    if out[smallest] != max(out.values()):
        raise ValueError(f"draft_len_schedule[{smallest}] (the smallest key) must be max_draft_len, the largest "
                         f"draft length, got {out[smallest]} < {max(out.values())}")
    return out


def trtllm_schedule_lookup(schedule: Mapping[int, int], batch_size: int) -> int:
    """The draft length for a batch size: the smallest key >= it, else 0 (``get_draft_len_for_batch_size``)."""
    keys = sorted(schedule)
    i = bisect_left(keys, batch_size)
    return schedule[keys[i]] if i < len(keys) else 0


class TRTLLMSchedulePolicy(Policy):
    """A fixed TensorRT-LLM ``draft_len_schedule``. Learns nothing.

    Args:
        draft_len_schedule: ``{batch_size_upper_bound: draft_len}``.
        max_concurrency: alternatively TensorRT-LLM's plain cutoff (mutually exclusive with the schedule).
        k_max: see :class:`~policies.base.Policy`.
        seed: unused.
    """

    name = "trtllm_schedule"

    def __init__(self, draft_len_schedule: Mapping[int, int] | None = None, max_concurrency: int | None = None,
                 k_max: int = 8, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        if draft_len_schedule is not None and max_concurrency is not None:
            raise ValueError("max_concurrency and draft_len_schedule are mutually exclusive (as in TensorRT-LLM): "
                             "use max_concurrency for a plain cutoff, or draft_len_schedule")
        if max_concurrency is not None:
            draft_len_schedule = {max_concurrency: k_max}
        self.draft_len_schedule = validate_draft_len_schedule(
            draft_len_schedule if draft_len_schedule is not None else DEFAULT_DRAFT_LEN_SCHEDULE)

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        bs = max(1, bucket.batch_bucket)
        k = trtllm_schedule_lookup(self.draft_len_schedule, bs)
        return Decision(k=k, reason=f"TensorRT-LLM draft_len_schedule at batch {bs}", kind=DecisionKind.RULE)

    def _get_state(self) -> dict[str, Any]:
        return {"draft_len_schedule": [[bs, k] for bs, k in self.draft_len_schedule.items()]}

    def _set_state(self, state: dict[str, Any]) -> None:
        pairs = state["draft_len_schedule"]
        self.draft_len_schedule = validate_draft_len_schedule({int(bs): int(k) for bs, k in pairs})
