"""``batch_table``: vLLM's ``num_speculative_tokens_per_batch_size``, a hand-set K per batch-size range.

Source: ``vllm/v1/spec_decode/dynamic/utils.py`` (vllm-project/vllm PR #32374, Dynamic SD),
``validate_and_normalize_dynamic_sd_schedule`` and ``build_dynamic_sd_schedule_lookup``:

- entries are all ``[bs_lo, bs_hi, K]`` or all ``[bs_lo, bs_hi, ctx_lo, ctx_hi, K]``; ranges are **inclusive**,
  batch-size ranges non-overlapping, the first starting at 1; context ranges contiguous from 1, the last one
  open-ended, and every batch-size range has the same context ranges (a rectangular grid);
- a batch size in a **gap** between two ranges takes the **previous** range's K, one past the last range keeps the
  last K; the K run is ``min(num_speculative_tokens, K)`` (here: clamped to ``k_max``);
- a context length picks the first context range whose end is >= it (the last one beyond).

The batch size of a bucket is its ``batch_bucket`` (the bucket's upper edge, as an engine pads to a CUDA-graph
size); its context length is a representative of its context bucket (:func:`~telemetry.records.context_length`).
TensorRT-LLM's ``draft_len_schedule`` is another format with other rules: :mod:`policies.trtllm_schedule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from policies.base import Decision, DecisionKind, Policy
from telemetry.records import Bucket, context_length

CTX_INFINITY = 2**31 - 1  # as vLLM's _CTX_INFINITY: the last context range is open-ended
DEFAULT_SCHEDULE = ((1, 4, 4), (5, 16, 2), (17, 64, 1), (65, 256, 0))  # a typical hand-set table

Entry = tuple[int, int, int, int, int]  # (bs_lo, bs_hi, ctx_lo, ctx_hi, K), normalized


def normalize_schedule(schedule: Sequence[Sequence[int]]) -> list[Entry]:
    """vLLM ``validate_and_normalize_dynamic_sd_schedule``: checked 5-item entries sorted by (bs_lo, ctx_lo).

    Raises:
        ValueError: naming the rule the schedule breaks.
    """
    if not schedule:
        raise ValueError("the schedule must not be empty")
    arities = {len(e) for e in schedule}
    if not arities <= {3, 5}:
        raise ValueError("each entry must be [bs_lo, bs_hi, K] or [bs_lo, bs_hi, ctx_lo, ctx_hi, K]")
    if len(arities) > 1:
        raise ValueError("entries must all be 3-item or all 5-item; vLLM does not mix the two forms")
    rows: list[Entry] = []
    for e in schedule:
        lo, hi, clo, chi, k = (int(e[0]), int(e[1]), 1, CTX_INFINITY, int(e[2])) if len(e) == 3 else map(int, e)
        if lo <= 0 or lo > hi:
            raise ValueError(f"batch-size range ({lo}, {hi}) must be positive with start <= end")
        if clo <= 0 or clo > chi:
            raise ValueError(f"context range ({clo}, {chi}) must be positive with start <= end")
        if k < 0:
            raise ValueError(f"K must be >= 0, got {k}")
        rows.append((lo, hi, clo, chi, k))
    bs_ranges = sorted({(r[0], r[1]) for r in rows})
    for (_, prev_hi), (lo, _) in pairwise(bs_ranges):
        if lo <= prev_hi:
            raise ValueError("batch-size ranges must not overlap")
    if bs_ranges[0][0] != 1:
        raise ValueError("the first batch-size range must start at 1 so every batch size has a K")
    ctx_ranges = sorted({(r[2], r[3]) for r in rows})
    if len(rows) != len(bs_ranges) * len(ctx_ranges):
        raise ValueError(f"the schedule must be a rectangular grid: {len(rows)} entries for {len(bs_ranges)} "
                         f"batch-size ranges x {len(ctx_ranges)} context ranges")
    if ctx_ranges[0][0] != 1:
        raise ValueError("the first context range must start at 1")
    for (_, prev_hi), (lo, _) in pairwise(ctx_ranges):
        if lo != prev_hi + 1:
            raise ValueError("context ranges must be contiguous, without gaps or overlaps")
    hi_of = {lo: hi for lo, hi in ctx_ranges[:-1]} | {ctx_ranges[-1][0]: CTX_INFINITY}  # the last is open-ended
    if len({(r[0], r[1], r[2]) for r in rows}) != len(rows):
        raise ValueError("duplicate schedule cell")
    return sorted(((lo, hi, clo, hi_of[clo], k) for lo, hi, clo, _, k in rows), key=lambda r: (r[0], r[2]))


def vllm_schedule_lookup(schedule: Sequence[Entry], batch_size: int, context_len: int) -> int:
    """K for (batch size, context) as vLLM's dense lookup holds it (before the ``num_speculative_tokens`` cap).

    Args:
        schedule: the output of :func:`normalize_schedule`.
        batch_size: runtime batch size (>= 1).
        context_len: runtime context length in tokens.
    """
    ctx_ranges = sorted({(r[2], r[3]) for r in schedule})
    ctx = next(((lo, hi) for lo, hi in ctx_ranges if context_len <= hi), ctx_ranges[-1])
    k = 0  # unreachable: the first range starts at 1
    for lo, hi, _, _, rk in (r for r in schedule if (r[2], r[3]) == ctx):  # sorted by bs_lo
        if batch_size < lo:
            return k  # a gap between ranges: the previous range's K
        k = rk
        if batch_size <= hi:
            return k
    return k  # past the last range: the last K


class BatchTablePolicy(Policy):
    """A fixed vLLM ``num_speculative_tokens_per_batch_size`` table. Learns nothing.

    Args:
        schedule: ``[[bs_lo, bs_hi, K], ...]`` or ``[[bs_lo, bs_hi, ctx_lo, ctx_hi, K], ...]`` (inclusive).
        k_max: see :class:`~policies.base.Policy` (vLLM's ``num_speculative_tokens`` cap).
        seed: unused.
    """

    name = "batch_table"

    def __init__(self, schedule: Sequence[Sequence[int]] = DEFAULT_SCHEDULE, k_max: int = 8, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        self.schedule = normalize_schedule(schedule)

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        bs = max(1, bucket.batch_bucket)
        k = vllm_schedule_lookup(self.schedule, bs, context_length(bucket.context_bucket))
        return Decision(k=k, reason=f"vLLM schedule at batch {bs}", kind=DecisionKind.RULE)

    def _get_state(self) -> dict[str, Any]:
        return {"schedule": [list(e) for e in self.schedule]}

    def _set_state(self, state: dict[str, Any]) -> None:
        self.schedule = normalize_schedule(state["schedule"])
