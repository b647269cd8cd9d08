"""``spectune export``: a projected table in each engine's own start-up format, validated against its rules.

Each ``*_export`` builds the engine's configuration from a projection (see :mod:`controller.offline.project`)
and runs the engine's documented constraints on it (``validate_*``, which raise :class:`ExportError` naming the
rule); the result also carries the exported schedule as a decision function, so the caller can predict what the
projection loses. Rules, from the engines' source:

- **vLLM** ``--speculative-config`` (``vllm/v1/spec_decode/dynamic/utils.py``,
  ``validate_and_normalize_dynamic_sd_schedule``): ``num_speculative_tokens`` >= 1 is the maximum;
  ``num_speculative_tokens_per_batch_size`` is a non-empty list of ``[lo, hi, K]`` inclusive ranges with
  1 <= lo <= hi, starting at 1, not overlapping, 0 <= K <= num_speculative_tokens; or, behind ``--context-grid``,
  all ``[bs_lo, bs_hi, ctx_lo, ctx_hi, K]`` forming a rectangular (batch x context) grid. Batch sizes past the
  last range keep its K. K = 0 is not free (:data:`K0_NOTE`).
- **TensorRT-LLM** ``speculative_config`` (``tensorrt_llm/llmapi/llm_args.py``, ``draft_len_schedule``;
  ``tensorrt_llm/_torch/speculative/utils.py``, ``get_draft_len_for_batch_size``): ``{upper_bound_batch_size:
  K}`` where K applies to batch sizes up to its key; keys >= 1, 0 <= K <= ``max_draft_len``, the value at the
  smallest key equals ``max_draft_len``; batch sizes above the largest key run without speculation. (Releases
  before the "up to key" semantics read keys as lower bounds and required key 1.)
- **SGLang** server flags (``python/sglang/srt/server_args.py``; adaptive: ``python/sglang/srt/speculative/
  adaptive_spec_params.py``): ``--speculative-num-steps`` >= 1, ``--speculative-eagle-topk 1`` and
  ``--speculative-num-draft-tokens = steps + 1`` (a chain); or ``--speculative-adaptive
  --speculative-adaptive-config FILE`` whose integer-string batch-size keys each hold a non-empty
  ``candidate_steps`` list of ints >= 0 (EAGLE/EAGLE3 with topk 1 only).
- **HF transformers** assisted generation (``GenerationConfig``): ``num_assistant_tokens`` >= 1 with
  ``num_assistant_tokens_schedule="constant"`` (assisted generation runs at batch size 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from controller.offline.project import KFn
from telemetry.errors import SpectuneError
from telemetry.records import MAX_DRAFT_LEN

CTX_INFINITY = 2**31 - 1  # vLLM's _CTX_INFINITY: the last context range is open-ended

ENGINES = ("vllm", "trtllm", "sglang", "sglang-adaptive", "hf")
K0_NOTE = ("K = 0 in a vLLM schedule is not free: the scheduler keys K on every scheduled request (prefills too) "
           "and keeps reserving num_speculative_tokens lookahead KV slots per request, so a threshold can thrash "
           "and crowd the KV cache (vLLM issue #49548). The prediction charges K = 0 as plain decoding.")


class ExportError(SpectuneError):
    """A table cannot be expressed in an engine's format, or a config breaks one of the engine's rules."""


@dataclass(frozen=True)
class Export:
    """One engine's configuration and how it was made."""

    engine: str
    config: dict[str, Any]  # what the engine reads (JSON; also valid YAML for TensorRT-LLM)
    args: tuple[str, ...]  # the command-line flags that pass it
    notes: tuple[str, ...]  # what the operator should know (what was clamped, what K = 0 costs)
    k_of: KFn  # the exported schedule as (request type, batch, context) -> k, for the predicted loss
    batches: tuple[int, ...] | None = None  # the batch buckets the engine applies it at (None: all)


def _ranges(batches: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(lo, hi, edge)`` of each batch bucket: an edge is the largest batch size of its bucket."""
    out, lo = [], 1
    for b in sorted(batches):
        out.append((lo, b, b))
        lo = b + 1
    return out


def _ctx_ranges(contexts: Sequence[str]) -> list[tuple[int, int, str]]:
    """``(lo, hi, label)`` of ``<=N`` / ``>N`` context labels, the last one open-ended as vLLM's."""
    out, lo = [], 1
    for label in contexts:
        if label.startswith("<="):
            hi = int(label[2:])
            out.append((lo, hi, label))
            lo = hi + 1
        elif label.startswith(">"):
            out.append((lo, CTX_INFINITY, label))
    return out


# -------------------------------------------------------------------------------------------------- vLLM
def vllm_export(schedule: dict[int, int], grid: dict[tuple[int, str], int] | None = None,
                 contexts: Sequence[str] = (), base: dict[str, Any] | None = None) -> Export:
    """vLLM's ``--speculative-config`` from a batch-bucket schedule (or a (batch, context) grid).

    Args:
        schedule: batch bucket (its largest batch size) -> k.
        grid: (batch bucket, context label) -> k, emitted as 5-tuples when given.
        contexts: the context labels of ``grid`` (``<=512`` ... ``>8192``), in order.
        base: the rest of the speculative config (``method``, ``model``) to merge in.
    """
    if grid is not None:
        rows = [[lo, hi, clo, chi, grid[(b, label)]] for lo, hi, b in _ranges(list(schedule))
                for clo, chi, label in _ctx_ranges(contexts)]
    else:
        rows = []
        for lo, hi, b in _ranges(list(schedule)):
            if rows and rows[-1][2] == schedule[b]:
                rows[-1][1] = hi  # merge neighbouring ranges with the same K
            else:
                rows.append([lo, hi, schedule[b]])
    k_max = max(r[-1] for r in rows)
    if k_max == 0:
        raise ExportError("the table turns speculation off at every batch size; run vLLM without "
                          "--speculative-config")
    cfg = {**(base or {}), "num_speculative_tokens": k_max, "num_speculative_tokens_per_batch_size": rows}
    validate_vllm(cfg)
    notes = [K0_NOTE] if any(r[-1] == 0 for r in rows) else []
    if grid is not None:
        notes.append("context-dependent 5-tuple schedule: needs a vLLM with context-aware dynamic SD")
    sched = [tuple(r) for r in rows]
    return Export("vllm", cfg, ("--speculative-config", _json(cfg)), tuple(notes),
                  lambda rt, b, ctx: vllm_lookup(sched, b, ctx))


def vllm_lookup(rows: Sequence[tuple[int, ...]], batch_size: int, context: str) -> int:
    """K of a validated, gap-free schedule under vLLM's semantics: the range holding the batch size (past the
    last range, its K); with 5-tuples, within the context range holding the context bucket's upper edge (an
    unknown context: the first context range)."""
    if len(rows[0]) == 5:
        ctx_len = _ctx_len(context)
        hi = min((r[3] for r in rows if r[3] >= ctx_len), default=max(r[3] for r in rows))
        rows = [(r[0], r[1], r[4]) for r in rows if r[3] == hi]
    rows = sorted(rows)
    return next((r[2] for r in rows if r[0] <= batch_size <= r[1]), rows[-1][2])


def _ctx_len(label: str) -> int:
    """A context bucket label's representative length: ``<=N`` -> N, ``>N`` -> N + 1, unknown -> 1."""
    if label.startswith("<=") and label[2:].isdigit():
        return int(label[2:])
    if label.startswith(">") and label[1:].isdigit():
        return int(label[1:]) + 1
    return 1


def validate_vllm(cfg: Any) -> None:
    """vLLM's rules for ``num_speculative_tokens`` and ``num_speculative_tokens_per_batch_size``."""
    if not isinstance(cfg, dict):
        raise ExportError("the speculative config must be a JSON object")
    k_max = cfg.get("num_speculative_tokens")
    if not isinstance(k_max, int) or isinstance(k_max, bool) or not 1 <= k_max <= MAX_DRAFT_LEN:
        raise ExportError(f"num_speculative_tokens must be an int in [1, {MAX_DRAFT_LEN}], got {k_max!r}")
    rows = cfg.get("num_speculative_tokens_per_batch_size")
    if not isinstance(rows, list) or not rows:
        raise ExportError("num_speculative_tokens_per_batch_size must be a non-empty list")
    arity = {len(r) if isinstance(r, list) else -1 for r in rows}
    if arity not in ({3}, {5}):
        raise ExportError("entries must all be [lo, hi, K] or all [bs_lo, bs_hi, ctx_lo, ctx_hi, K], not a mix")
    for r in rows:
        if not all(_is_int(x) for x in r):
            raise ExportError(f"entry {r} must hold integers only")
        if not 1 <= r[0] <= r[1] or (len(r) == 5 and not 1 <= r[2] <= r[3]):
            raise ExportError(f"entry {r}: ranges need 1 <= lo <= hi")
        if not 0 <= r[-1] <= k_max:
            raise ExportError(f"entry {r}: K must be in [0, num_speculative_tokens={k_max}]")
    if arity == {3}:
        _check_ranges([(r[0], r[1]) for r in rows], "batch-size")
        return
    ctx = sorted({(r[2], r[3]) for r in rows})
    _check_ranges(ctx, "context")
    grids = {c: sorted((r[0], r[1]) for r in rows if (r[2], r[3]) == c) for c in ctx}
    first = next(iter(grids.values()))
    if any(g != first for g in grids.values()) or len(rows) != len(first) * len(ctx):
        raise ExportError("5-tuple entries must form a rectangular grid: the same batch-size ranges in every "
                          "context range, each pair once")
    _check_ranges(first, "batch-size")


def _check_ranges(ranges: list[tuple[int, int]], what: str) -> None:
    ranges = sorted(ranges)
    if ranges[0][0] != 1:
        raise ExportError(f"the first {what} range must start at 1, got {ranges[0][0]}")
    for (_, prev_hi), (lo, _) in pairwise(ranges):
        if lo <= prev_hi:
            raise ExportError(f"{what} ranges overlap: one ends at {prev_hi}, the next starts at {lo}")


# --------------------------------------------------------------------------------------------- TRT-LLM
def trtllm_export(schedule: dict[int, int], max_batch_size: int | None = None) -> Export:
    """TensorRT-LLM's ``speculative_config`` with ``max_draft_len`` and ``draft_len_schedule``.

    Args:
        schedule: batch bucket (its largest batch size) -> k.
        max_batch_size: the engine's largest batch; the last key is raised to it so no batch runs past the
            schedule (above the largest key TensorRT-LLM turns speculation off).
    """
    keys = sorted(schedule)
    notes = []
    if max_batch_size is not None and max_batch_size > keys[-1]:
        schedule = {**schedule, max_batch_size: schedule[keys[-1]]}
        del schedule[keys[-1]]
        keys = sorted(schedule)
    top = schedule[keys[0]]
    if top == 0:
        raise ExportError(f"the table turns speculation off at batch sizes up to {keys[0]}; TensorRT-LLM needs the "
                          "smallest batch to draft the most (draft_len_schedule at its smallest key = "
                          "max_draft_len >= 1)")
    clamped = [b for b in keys if schedule[b] > top]
    if clamped:
        notes.append(f"batch sizes {clamped} drafted more than batch {keys[0]} in the table; clamped to "
                     f"max_draft_len={top} (TensorRT-LLM's rule)")
    merged: dict[int, int] = {}
    for b in keys:
        k = min(schedule[b], top)
        if merged and list(merged.values())[-1] == k:
            del merged[max(merged)]  # "up to key": the run's largest key covers the run
        merged[b] = k
    while len(merged) > 1 and merged[max(merged)] == 0:
        del merged[max(merged)]  # above the largest key is off anyway
    if merged[max(merged)] > 0:  # the table drafts at its largest batch bucket; TensorRT-LLM stops past the key
        notes.append(f"batch sizes above {max(merged)} run without speculation (TensorRT-LLM turns it off past the "
                     "largest key); pass --max-batch-size to cover larger batches")
    cfg = {"speculative_config": {"max_draft_len": top,
                                  "draft_len_schedule": {str(b): k for b, k in sorted(merged.items())}}}
    validate_trtllm(cfg)
    return Export("trtllm", cfg, ("--extra_llm_api_options", "FILE"), tuple(notes),
                  lambda rt, b, ctx: trtllm_lookup(merged, b))


def trtllm_lookup(schedule: dict[int, int], batch_size: int) -> int:
    """draft_len under "up to key" semantics: the smallest key >= the batch size; past the largest key, off."""
    return next((schedule[key] for key in sorted(schedule) if batch_size <= key), 0)


def validate_trtllm(cfg: Any) -> None:
    """TensorRT-LLM's rules for ``max_draft_len`` and ``draft_len_schedule``."""
    spec = cfg.get("speculative_config") if isinstance(cfg, dict) else None
    if not isinstance(spec, dict):
        raise ExportError("the config must hold a speculative_config object")
    top = spec.get("max_draft_len")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ExportError(f"max_draft_len must be an int >= 1, got {top!r}")
    raw = spec.get("draft_len_schedule")
    if not isinstance(raw, dict) or not raw:
        raise ExportError("draft_len_schedule must be a non-empty {batch size: draft length} object")
    sched = {}
    for key, k in raw.items():
        try:
            b = int(key)
        except (TypeError, ValueError):
            raise ExportError(f"draft_len_schedule key {key!r} is not an integer batch size") from None
        if b < 1:
            raise ExportError(f"draft_len_schedule: batch size threshold must be >= 1, got {b}")
        if not _is_int(k) or k < 0:
            raise ExportError(f"draft_len_schedule: draft length must be an int >= 0, got {k!r} at {b}")
        if k > top:
            raise ExportError(f"draft_len_schedule[{b}]={k} exceeds max_draft_len={top}")
        sched[b] = k
    if sched[min(sched)] != top:
        raise ExportError(f"draft_len_schedule at its smallest key {min(sched)} is {sched[min(sched)]}; it must "
                          f"equal max_draft_len={top}")


# ---------------------------------------------------------------------------------------------- SGLang
def sglang_export(k: int) -> Export:
    """SGLang's static chain: ``--speculative-num-steps k --speculative-eagle-topk 1 --speculative-num-draft-tokens
    k + 1``."""
    if k < 1:
        raise ExportError("the table's traffic-weighted k is 0 (speculation off); run SGLang without speculative "
                          "flags")
    cfg = {"speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1}
    validate_sglang(cfg)
    return Export("sglang", cfg, ("--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                                  "--speculative-num-draft-tokens", str(k + 1)), (), lambda rt, b, ctx: k)


def validate_sglang(cfg: Any) -> None:
    steps, topk, tokens = (cfg.get(n) for n in ("speculative_num_steps", "speculative_eagle_topk",
                                                 "speculative_num_draft_tokens"))
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ExportError(f"--speculative-num-steps must be an int >= 1, got {steps!r}")
    if topk != 1:
        raise ExportError(f"--speculative-eagle-topk must be 1 (a chain, one k), got {topk!r}")
    if tokens != steps + 1:
        raise ExportError(f"--speculative-num-draft-tokens must be num_steps + 1 = {steps + 1} with topk 1, "
                          f"got {tokens!r}")


def sglang_adaptive_export(candidates: dict[int, list[int]], schedule: dict[int, int],
                           config_path: str = "adaptive.json") -> Export:
    """SGLang's adaptive speculation: per batch-size slot, the k values the learned table uses there.

    Args:
        candidates: batch bucket -> the k values the table holds there (``candidate_steps``).
        schedule: batch bucket -> the traffic-weighted k (what the prediction assumes the EMA settles on).
        config_path: where the caller writes the config (named in the flags).
    """
    cfg = {str(b): {"candidate_steps": sorted(set(ks))} for b, ks in sorted(candidates.items())}
    steps = max(k for ks in candidates.values() for k in ks)
    if steps < 1:
        raise ExportError("the table turns speculation off at every batch size; run SGLang without speculative "
                          "flags")
    validate_sglang_adaptive(cfg, steps)
    args = ("--speculative-adaptive", "--speculative-adaptive-config", config_path, "--speculative-num-steps",
            str(steps), "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1))
    note = ("adaptive speculation needs --speculative-algorithm EAGLE or EAGLE3; the prediction assumes each slot's "
            "EMA settles on the traffic-weighted k")
    return Export("sglang-adaptive", cfg, args, (note,), lambda rt, b, ctx: schedule[b])


def validate_sglang_adaptive(cfg: Any, num_steps: int) -> None:
    if not isinstance(cfg, dict):
        raise ExportError("the adaptive config must be a JSON object")
    slots = {key: v for key, v in cfg.items() if isinstance(key, str) and key.isdigit()}
    if not slots:
        raise ExportError('the adaptive config needs at least one integer-string batch-size key, e.g. '
                          '{"1": {"candidate_steps": [1, 3]}}')
    union: set[int] = set()
    for key, entry in slots.items():
        steps = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if not isinstance(steps, list) or not steps or not all(_is_int(s) and s >= 0 for s in steps):
            raise ExportError(f"batch size {key}: candidate_steps must be a non-empty list of ints >= 0, got {steps!r}")
        union.update(steps)
    if num_steps not in union or num_steps < 1:
        raise ExportError(f"--speculative-num-steps {num_steps} must be >= 1 and one of the candidate steps "
                          f"{sorted(union)}")


# --------------------------------------------------------------------------------------- HF transformers
def hf_export(k: int) -> Export:
    """``GenerationConfig(num_assistant_tokens=k, num_assistant_tokens_schedule="constant")`` (batch size 1)."""
    if k < 1:
        raise ExportError("the table turns speculation off at batch size 1; generate without assistant_model")
    cfg = {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant"}
    validate_hf(cfg)
    return Export("hf", cfg, (), ("assisted generation runs at batch size 1: exported from the batch-1 bucket",),
                  lambda rt, b, ctx: k, batches=(1,))


def validate_hf(cfg: Any) -> None:
    n = cfg.get("num_assistant_tokens") if isinstance(cfg, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ExportError(f"num_assistant_tokens must be an int >= 1, got {n!r}")
    if cfg.get("num_assistant_tokens_schedule") != "constant":
        raise ExportError("num_assistant_tokens_schedule must be \"constant\" (spectune's k does not move at run "
                          "time; 'heuristic' would let transformers change it)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _json(cfg: dict[str, Any]) -> str:
    import json

    return json.dumps(cfg, separators=(",", ":"))
