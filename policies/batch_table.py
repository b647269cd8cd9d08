"""``batch_table``: a hand-set draft length per batch size, as engines take it at start-up.

Two source formats, both read from the engines' own code:

- vLLM ``speculative_config.num_speculative_tokens_per_batch_size``: a list of ``[start_bs, end_bs, K]``
  (or ``[start_bs, end_bs, ctx_lo, ctx_hi, K]``) entries, inclusive ranges starting at 1. Batch sizes past the
  last range keep the last K (``vllm/v1/spec_decode/dynamic/utils.py``,
  ``validate_and_normalize_dynamic_sd_schedule`` and ``build_dynamic_sd_schedule_lookup``).
- TensorRT-LLM ``draft_len_schedule``: ``{batch_size_key: draft_len}`` where each key is the largest batch size
  its draft_len applies to ("up to key"), found by ``bisect`` (``tensorrt_llm/_torch/speculative/utils.py``,
  ``get_draft_len_for_batch_size``; ``tensorrt_llm/_torch/speculative/drafter.py``, ``Drafter``). Above the
  largest key, and above ``max_concurrency`` (``Drafter.should_use_spec_decode``), speculation is off.

The batch size of a bucket is its ``batch_bucket`` (the bucket's upper edge).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from policies.base import Decision, Policy, context_len_of
from telemetry.records import Bucket

CTX_INFINITY = 2**31 - 1  # as vLLM's _CTX_INFINITY: the last context range is open-ended


def vllm_schedule_lookup(schedule: list[list[int]], batch_size: int, context_len: int) -> int:
    """K for (batch size, context) under vLLM's ``num_speculative_tokens_per_batch_size`` semantics.

    Args:
        schedule: ``[[start_bs, end_bs, K], ...]`` or ``[[start_bs, end_bs, ctx_lo, ctx_hi, K], ...]``.
        batch_size: runtime batch size (>= 1).
        context_len: runtime context length in tokens.
    """
    rows = [(e[0], e[1], 1, CTX_INFINITY, e[2]) if len(e) == 3 else tuple(e) for e in schedule]
    ctx_ranges = sorted({(r[2], r[3]) for r in rows})
    ctx = next(((lo, hi) for lo, hi in ctx_ranges if context_len <= hi), ctx_ranges[-1])
    in_ctx = sorted((r for r in rows if (r[2], r[3]) == ctx), key=lambda r: r[0])
    last_k = in_ctx[0][4]
    for lo, hi, _, _, k in in_ctx:
        if batch_size < lo:
            return last_k  # gap between ranges: vLLM fills it with the previous range's K
        last_k = k
        if batch_size <= hi:
            return k
    return last_k  # past the last range: keep the last K


def trtllm_schedule_lookup(schedule: dict[int, int], batch_size: int, max_concurrency: int | None = None) -> int:
    """draft_len for a batch size under TensorRT-LLM's ``draft_len_schedule`` ("up to key") semantics."""
    if max_concurrency is not None and batch_size > max_concurrency:
        return 0
    keys = sorted(schedule)
    i = bisect_left(keys, batch_size)
    return schedule[keys[i]] if i < len(keys) else 0


def _validate_vllm(schedule: list[list[int]]) -> None:
    if not schedule or any(len(e) not in (3, 5) for e in schedule) or len({len(e) for e in schedule}) > 1:
        raise ValueError("schedule entries must all be [start_bs, end_bs, K] or all [bs_lo, bs_hi, ctx_lo, ctx_hi, K]")
    for e in schedule:
        if e[0] <= 0 or e[0] > e[1] or e[-1] < 0:
            raise ValueError(f"bad schedule entry {e}: need 1 <= start_bs <= end_bs and K >= 0")
    if min(e[0] for e in schedule) != 1:
        raise ValueError("the first batch-size range must start at 1 (as vLLM requires)")


class BatchTablePolicy(Policy):
    """A fixed table from batch size (and optionally context) to k. Learns nothing.

    Args:
        schedule: vLLM-style ``[[start_bs, end_bs, K], ...]`` (3- or 5-item entries).
        draft_len_schedule: alternatively a TensorRT-LLM ``{batch_size_key: draft_len}``.
        max_concurrency: TensorRT-LLM's cap above which speculation is off.
        k_max: see :class:`~policies.base.Policy`.
        seed: unused.
    """

    name = "batch_table"

    def __init__(
        self,
        schedule: list[list[int]] | None = None,
        draft_len_schedule: dict[int, int] | None = None,
        max_concurrency: int | None = None,
        k_max: int = 8,
        seed: int = 0,
    ) -> None:
        super().__init__(k_max=k_max, seed=seed)
        if schedule is None and draft_len_schedule is None:
            schedule = [[1, 4, 4], [5, 16, 2], [17, 64, 1], [65, 256, 0]]  # a typical hand-set table
        if schedule is not None:
            _validate_vllm(schedule)
        self.schedule = [list(map(int, e)) for e in schedule] if schedule is not None else None
        self.draft_len_schedule = {int(k): int(v) for k, v in (draft_len_schedule or {}).items()} or None
        self.max_concurrency = max_concurrency

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        bs = max(1, bucket.batch_bucket)
        if self.schedule is not None:
            k = vllm_schedule_lookup(self.schedule, bs, context_len_of(bucket.context_bucket))
            return Decision(k=k, reason=f"vLLM schedule at batch {bs}")
        assert self.draft_len_schedule is not None
        k = trtllm_schedule_lookup(self.draft_len_schedule, bs, self.max_concurrency)
        return Decision(k=k, reason=f"TensorRT-LLM draft_len_schedule at batch {bs}")

    def _get_state(self) -> dict[str, Any]:
        return {"schedule": self.schedule,
                "draft_len_schedule": {str(k): v for k, v in (self.draft_len_schedule or {}).items()},
                "max_concurrency": self.max_concurrency}

    def _set_state(self, state: dict[str, Any]) -> None:
        self.schedule = state["schedule"]
        self.draft_len_schedule = {int(k): int(v) for k, v in state["draft_len_schedule"].items()} or None
        self.max_concurrency = state["max_concurrency"]
