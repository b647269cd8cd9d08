"""``spectune export``: a projected table in each engine's own start-up format, validated against its rules.

Each ``*_export`` builds the engine's configuration from a projection (see :mod:`controller.offline.project`)
and runs the engine's own constraints on it (``validate_*``, which raise :class:`ExportError` naming the rule);
the result also carries the exported schedule as a decision function read back with the engine's own lookup
rule (``*_lookup``), so the caller can predict what the projection loses and check the round trip. A schedule
is keyed by batch bucket: the largest batch size of the bucket (``BucketConfig.batch_bucket``); batch sizes
above the last bucket fall in it (:func:`bucket_k`). Rules, from the engines' source:

- **vLLM 0.32** ``--speculative-config`` (``vllm/config/speculative.py``, ``SpeculativeConfig`` and its
  ``__post_init__``; ``vllm/v1/spec_decode/dynamic/utils.py``, ``validate_and_normalize_dynamic_sd_schedule`` and
  ``build_dynamic_sd_schedule_lookup``, which ``vllm/v1/core/sched/scheduler.py`` turns into
  ``Scheduler.dynamic_sd_lookup``): a ``method`` and a draft ``model`` (only model-free methods such as ``mtp`` or
  ``ngram`` go without one: "num_speculative_tokens was provided but without speculative model");
  ``num_speculative_tokens`` >= 1 is the maximum; ``num_speculative_tokens_per_batch_size`` is a non-empty list of
  ``[lo, hi, K]`` inclusive ranges with 1 <= lo <= hi, starting at 1, not overlapping, K >= 0 (the scheduler
  uses ``min(K, num_speculative_tokens)``); batch sizes past the last range keep its K. Only the fields of
  :data:`VLLM_SPEC_FIELDS` are accepted. Behind ``--context-grid``, all ``[bs_lo, bs_hi, ctx_lo, ctx_hi, K]``
  forming a rectangular (batch x context) grid: this is the context-aware dynamic SD of later vLLM
  (``DynamicSDLookup``); vLLM 0.32 rejects 5-item entries. K = 0 is not free (:data:`K0_NOTE`).
- **TensorRT-LLM** ``speculative_config`` in the ``--extra_llm_api_options`` YAML (``tensorrt_llm/llmapi/
  llm_args.py``: the ``SpeculativeConfig`` union is discriminated by ``decoding_type``, an unknown or missing one
  is refused; ``DecodingBaseConfig.validate_draft_len_schedule_and_sort``; ``DraftTargetDecodingConfig.
  validate_draft_target_config``; the models forbid unknown keys): ``decoding_type`` (``Draft_Target`` needs
  ``speculative_model`` / ``speculative_model_dir``), ``max_draft_len`` >= 1, ``draft_len_schedule`` ``{batch
  size: K}`` with keys >= 1, K >= 0, every K <= ``max_draft_len`` and K at the smallest key = ``max_draft_len``;
  it is read "up to key" (``tensorrt_llm/_torch/speculative/utils.py``, ``get_draft_len_for_batch_size``:
  ``bisect_left`` on the keys, past the largest key speculation is off).
- **SGLang** server flags (``python/sglang/srt/server_args.py``): ``--speculative-num-steps`` >= 1,
  ``--speculative-eagle-topk 1`` and ``--speculative-num-draft-tokens = steps + 1`` (a chain). Adaptive
  (``python/sglang/srt/speculative/adaptive_spec_params.py``, ``_load_adaptive_config``; routing in
  ``adaptive_step_router.py``, ``AdaptiveStepRouter.batch_size_key_for_batch``): integer-string batch-size keys
  are LOWER bounds (``bisect_right(keys, batch) - 1``, after padding the batch up to a CUDA-graph size), each
  holding a non-empty ``candidate_steps`` list of ints >= 0; EAGLE/EAGLE3 with topk 1 only.
- **HF transformers** assisted generation (``GenerationConfig``): ``num_assistant_tokens`` >= 1 with
  ``num_assistant_tokens_schedule="constant"`` (assisted generation runs at batch size 1).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
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
TABLE_ONLY_NOTE = ("NOT STARTABLE AS IS: --table-only wrote the schedule without {what}; {engine}'s own validator "
                   "rejects this file until you add {how}")

# vLLM 0.32 ``SpeculativeConfig`` fields (vllm/config/speculative.py) an operator sets in --speculative-config.
VLLM_SPEC_FIELDS = (
    "enforce_eager", "num_speculative_tokens", "model", "method", "draft_tensor_parallel_size",
    "tensor_parallel_size", "quantization", "moe_backend", "attention_backend", "kv_cache_dtype", "max_model_len",
    "revision", "code_revision", "index_share_for_mtp_iteration", "disable_padded_drafter_batch",
    "disable_eagle_block_drop", "use_local_argmax_reduction", "use_heterogeneous_vocab", "prompt_lookup_max",
    "prompt_lookup_min", "parallel_drafting", "num_speculative_tokens_per_batch_size",
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob", "draft_load_config", "rejection_sample_method", "synthetic_acceptance_rates",
    "synthetic_acceptance_length", "enable_adaptive_verification", "draft_sample_method", "dspark_draft_topk",
)
# Fields vLLM fills itself (create_speculative_config passes the target's; __post_init__ makes the draft's).
VLLM_ENGINE_FIELDS = ("target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config")
# ``SpeculativeMethod`` of vLLM 0.32; any "<model type>_mtp" is also accepted (vLLM renames it to "mtp").
VLLM_METHODS = ("ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle", "eagle3",
                "extract_hidden_states", "mtp", "dflash", "ngram_gpu", "dspark")
# Methods whose __post_init__ fills ``model`` itself when it is missing (the rest raise without one).
VLLM_MODEL_FREE_METHODS = ("mtp", "dspark", "ngram", "ngram_gpu", "suffix", "extract_hidden_states")
VLLM_DEFAULT_METHOD = "draft_model"  # what vLLM assumes when a model is given without a method

# TensorRT-LLM ``decoding_type`` discriminators spectune exports (tensorrt_llm/llmapi/llm_args.py), and whether the
# config's validator requires a draft model (``speculative_model``, alias ``speculative_model_dir``).
TRTLLM_DECODING_TYPES = {"Draft_Target": True, "NGram": False}
TRTLLM_DEFAULT_DECODING_TYPE = "Draft_Target"
TRTLLM_MODEL_KEY = "speculative_model_dir"  # the alias both older and current releases read
TRTLLM_SPEC_KEYS = ("decoding_type", "max_draft_len", "draft_len_schedule", TRTLLM_MODEL_KEY, "speculative_model")


class ExportError(SpectuneError):
    """A table cannot be expressed in an engine's format, or a config breaks one of the engine's rules."""


@dataclass(frozen=True)
class Export:
    """One engine's configuration and how it was made."""

    engine: str
    config: dict[str, Any]  # what the engine reads
    args: tuple[str, ...]  # the command-line flags that pass it
    notes: tuple[str, ...]  # what the operator should know (what was clamped, what K = 0 costs)
    k_of: KFn  # the exported schedule read back with the engine's rule: (request type, batch, context) -> k
    batches: tuple[int, ...] | None = None  # the batch buckets the engine applies it at (None: all)
    text: str = ""  # the file as the engine reads it (JSON unless the engine wants YAML)

    def render(self) -> str:
        return self.text or json.dumps(self.config)


def bucket_k(schedule: Mapping[int, int], batch_size: int) -> int:
    """The k a batch-bucket schedule gives a batch size: its bucket is the smallest key >= it, the last key past
    them all (``BucketConfig.batch_bucket``). The reference each exported schedule is read back against."""
    keys = sorted(schedule)
    i = bisect.bisect_left(keys, batch_size)
    return schedule[keys[min(i, len(keys) - 1)]]


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
def vllm_base(base: Mapping[str, Any] | None, draft_model: str | None = None,
              method: str | None = None) -> dict[str, Any]:
    """``--base`` merged with ``--draft-model`` / ``--method``, keys normalised as vLLM does (``-`` -> ``_``) and
    checked against vLLM 0.32's fields; ``method`` defaults to ``draft_model`` when a model is given."""
    spec = {str(k).replace("-", "_"): v for k, v in (base or {}).items()}
    unknown = sorted(set(spec) - set(VLLM_SPEC_FIELDS))
    if unknown:
        why = ("vLLM fills them itself" if set(unknown) <= set(VLLM_ENGINE_FIELDS)
               else "they are not SpeculativeConfig fields of vLLM 0.32")
        raise ExportError(f"--base keys {unknown} are refused ({why}); valid keys: {', '.join(VLLM_SPEC_FIELDS)}")
    if "num_speculative_tokens_per_batch_size" in spec:
        raise ExportError("--base must not hold num_speculative_tokens_per_batch_size: the exported table is that "
                          "schedule")
    for key, value in (("model", draft_model), ("method", method)):
        if value is None:
            continue
        if key in spec and spec[key] != value:
            raise ExportError(f"--base sets {key}={spec[key]!r} and --{'draft-model' if key == 'model' else key} "
                              f"says {value!r}: give it once")
        spec[key] = value
    if spec.get("model") is not None and spec.get("method") is None:
        spec["method"] = VLLM_DEFAULT_METHOD
    return spec


def vllm_export(schedule: dict[int, int], grid: dict[tuple[int, str], int] | None = None,
                contexts: Sequence[str] = (), base: Mapping[str, Any] | None = None, *,
                draft_model: str | None = None, method: str | None = None, table_only: bool = False) -> Export:
    """vLLM's ``--speculative-config`` from a batch-bucket schedule (or a (batch, context) grid).

    Args:
        schedule: batch bucket (its largest batch size) -> k.
        grid: (batch bucket, context label) -> k, emitted as 5-tuples when given.
        contexts: the context labels of ``grid`` (``<=512`` ... ``>8192``), in order.
        base: the rest of the speculative config (``method``, ``model``, ...), vLLM 0.32 fields only.
        draft_model: the draft model (vLLM's ``model``), a path or a Hub id.
        method: vLLM's speculative method (default ``draft_model`` when a model is given).
        table_only: write the schedule even without what vLLM needs to start (a loud note says so).
    """
    spec = vllm_base(base, draft_model, method)
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
    notes = []
    given = spec.get("num_speculative_tokens")
    if given is not None:
        if not _is_int(given) or given < 1:
            raise ExportError(f"--base num_speculative_tokens must be an int >= 1, got {given!r}")
        if given < k_max:
            over = sorted({f"{r[0]}-{r[1]}" for r in rows if r[-1] > given})
            raise ExportError(f"--base num_speculative_tokens={given} but the table drafts up to k={k_max} (batch "
                              f"sizes {', '.join(over)}); vLLM would silently cap those at {given}. Raise it to "
                              f"{k_max}, or leave it out of --base (spectune sets it to the table's largest k)")
        if given > k_max:
            notes.append(f"num_speculative_tokens={given} from --base kept: vLLM reserves {given} lookahead slots "
                         f"per request although the table never drafts more than {k_max}")
    cfg = {**spec, "num_speculative_tokens": given or k_max, "num_speculative_tokens_per_batch_size": rows}
    validate_vllm(cfg, require_model=not table_only)
    if table_only and not _vllm_startable(cfg):
        notes.insert(0, TABLE_ONLY_NOTE.format(
            what="a draft model or method", engine="vLLM",
            how='"method" and "model" (--draft-model PATH, or --base \'{"method": ..., "model": ...}\')'))
    if any(r[-1] == 0 for r in rows):
        notes.append(K0_NOTE)
    if grid is not None:
        notes.append("context-dependent 5-item schedule: vLLM 0.32 rejects 5-item entries; it needs a vLLM with "
                     "context-aware dynamic SD (DynamicSDLookup)")
    sched = [tuple(r) for r in rows]
    n_spec = int(cfg["num_speculative_tokens"])
    return Export("vllm", cfg, ("--speculative-config", _json(cfg)), tuple(notes),
                  lambda rt, b, ctx: min(n_spec, vllm_lookup(sched, b, ctx)), text=json.dumps(cfg))


def vllm_lookup(rows: Sequence[tuple[int, ...]], batch_size: int, context: str) -> int:
    """K of a validated schedule under vLLM's ``build_dynamic_sd_schedule_lookup``: the range holding the batch
    size; in a gap or past the last range, the K of the range before it. With 5-tuples, within the context range
    holding the context bucket's representative length (``DynamicSDLookup.bucket_of``: the first range whose
    upper end is >= it, else the last)."""
    if len(rows[0]) == 5:
        ctx_len = _ctx_len(context)
        his = sorted({r[3] for r in rows})
        hi = next((h for h in his if ctx_len <= h), his[-1])
        rows = [(r[0], r[1], r[4]) for r in rows if r[3] == hi]
    k = 0
    for lo, _, rk in sorted(rows):
        if lo > batch_size:
            break
        k = rk
    return k


def _ctx_len(label: str) -> int:
    """A context bucket label's representative length: ``<=N`` -> N, ``>N`` -> N + 1, unknown -> 1."""
    if label.startswith("<=") and label[2:].isdigit():
        return int(label[2:])
    if label.startswith(">") and label[1:].isdigit():
        return int(label[1:]) + 1
    return 1


def _vllm_startable(cfg: Mapping[str, Any]) -> bool:
    """Whether vLLM's ``SpeculativeConfig.__post_init__`` finds a draft model (or can do without one)."""
    method = cfg.get("method")
    if cfg.get("model") is not None:
        return True
    return method in VLLM_MODEL_FREE_METHODS or (isinstance(method, str) and method.endswith("_mtp"))


def validate_vllm(cfg: Any, require_model: bool = True) -> None:
    """vLLM 0.32's rules for a ``--speculative-config``: its fields, the schedule, and a draft model or method."""
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
    else:
        ctx = sorted({(r[2], r[3]) for r in rows})
        _check_ranges(ctx, "context")
        grids = {c: sorted((r[0], r[1]) for r in rows if (r[2], r[3]) == c) for c in ctx}
        first = next(iter(grids.values()))
        if any(g != first for g in grids.values()) or len(rows) != len(first) * len(ctx):
            raise ExportError("5-tuple entries must form a rectangular grid: the same batch-size ranges in every "
                              "context range, each pair once")
        _check_ranges(first, "batch-size")
    unknown = sorted(set(cfg) - set(VLLM_SPEC_FIELDS))
    if unknown:
        raise ExportError(f"keys {unknown} are not vLLM 0.32 SpeculativeConfig fields; valid keys: "
                          f"{', '.join(VLLM_SPEC_FIELDS)}")
    method = cfg.get("method")
    if method is not None and method not in VLLM_METHODS and not (isinstance(method, str)
                                                                   and method.endswith("_mtp")):
        raise ExportError(f"method {method!r} is not one of vLLM 0.32's: {', '.join(VLLM_METHODS)}")
    if require_model and not _vllm_startable(cfg):
        raise ExportError(f"vLLM rejects this config (\"num_speculative_tokens was provided but without speculative "
                          f"model\", method {method or VLLM_DEFAULT_METHOD!r}): pass --draft-model PATH (method "
                          f"{VLLM_DEFAULT_METHOD}), or --base '{{\"method\": ..., \"model\": ...}}'; model-free "
                          f"methods: {', '.join(VLLM_MODEL_FREE_METHODS)}. --table-only writes the bare schedule")


def _check_ranges(ranges: list[tuple[int, int]], what: str) -> None:
    ranges = sorted(ranges)
    if ranges[0][0] != 1:
        raise ExportError(f"the first {what} range must start at 1, got {ranges[0][0]}")
    for (_, prev_hi), (lo, _) in pairwise(ranges):
        if lo <= prev_hi:
            raise ExportError(f"{what} ranges overlap: one ends at {prev_hi}, the next starts at {lo}")


# --------------------------------------------------------------------------------------------- TRT-LLM
def trtllm_export(schedule: dict[int, int], max_batch_size: int | None = None, *, draft_model: str | None = None,
                  decoding_type: str = TRTLLM_DEFAULT_DECODING_TYPE, table_only: bool = False) -> Export:
    """TensorRT-LLM's ``speculative_config`` with ``decoding_type``, the draft model, ``max_draft_len`` and
    ``draft_len_schedule``.

    Args:
        schedule: batch bucket (its largest batch size) -> k.
        max_batch_size: the engine's largest batch; the last key is raised to it so no batch runs past the
            schedule (above the largest key TensorRT-LLM turns speculation off).
        draft_model: the draft model directory or Hub id (``speculative_model_dir``).
        decoding_type: one of :data:`TRTLLM_DECODING_TYPES`.
        table_only: write the schedule even without the draft model the decoding type needs (a loud note says so).
    """
    if decoding_type not in TRTLLM_DECODING_TYPES:
        raise ExportError(f"--decoding-type {decoding_type!r}: spectune exports {sorted(TRTLLM_DECODING_TYPES)} "
                          "(TensorRT-LLM refuses a missing or unknown decoding_type)")
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
    if schedule[keys[-1]] > 0:  # the table drafts at its largest batch bucket; TensorRT-LLM stops past the key
        notes.append(f"batch sizes above {max(merged)} run without speculation (TensorRT-LLM turns it off past the "
                     "largest key); pass --max-batch-size to cover larger batches")
    spec: dict[str, Any] = {"decoding_type": decoding_type, "max_draft_len": top}
    if draft_model is not None:
        spec[TRTLLM_MODEL_KEY] = draft_model
    spec["draft_len_schedule"] = dict(sorted(merged.items()))
    cfg = {"speculative_config": spec}
    needs_model = TRTLLM_DECODING_TYPES[decoding_type] and draft_model is None
    validate_trtllm(cfg, require_model=not table_only)
    if needs_model:
        notes.insert(0, TABLE_ONLY_NOTE.format(what="a draft model", engine="TensorRT-LLM",
                                               how=f"{TRTLLM_MODEL_KEY} (--draft-model PATH)"))
    return Export("trtllm", cfg, ("--extra_llm_api_options", "FILE"), tuple(notes),
                  lambda rt, b, ctx: trtllm_lookup(merged, b), text=trtllm_yaml(cfg))


def trtllm_lookup(schedule: Mapping[int, int], batch_size: int) -> int:
    """``get_draft_len_for_batch_size``: the K of the first key >= the batch size (``bisect_left``); past the
    largest key, 0 (speculation off)."""
    keys = sorted(schedule)
    i = bisect.bisect_left(keys, batch_size)
    return schedule[keys[i]] if i < len(keys) else 0


def trtllm_yaml(cfg: Mapping[str, Any]) -> str:
    """The ``--extra_llm_api_options`` YAML: integer schedule keys stay integers (``dict[int, int]``)."""
    spec = cfg["speculative_config"]
    lines = ["speculative_config:"]
    for key, value in spec.items():
        if isinstance(value, dict):
            lines.append(f"  {key}:")
            lines.extend(f"    {b}: {k}" for b, k in value.items())
        else:
            lines.append(f"  {key}: {json.dumps(value)}")
    return "\n".join(lines)


def validate_trtllm(cfg: Any, require_model: bool = True) -> None:
    """TensorRT-LLM's rules for ``speculative_config``: the decoding type, its draft model, ``max_draft_len`` and
    ``draft_len_schedule``."""
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
    unknown = sorted(set(spec) - set(TRTLLM_SPEC_KEYS))
    if unknown:
        raise ExportError(f"speculative_config keys {unknown} are not exported by spectune (TensorRT-LLM forbids "
                          f"unknown keys); expected {list(TRTLLM_SPEC_KEYS)}")
    kind = spec.get("decoding_type")
    if kind not in TRTLLM_DECODING_TYPES:
        raise ExportError(f"decoding_type must be one of {sorted(TRTLLM_DECODING_TYPES)} (TensorRT-LLM: \"Invalid "
                          f"decoding type: {kind}\")")
    has_model = spec.get(TRTLLM_MODEL_KEY) is not None or spec.get("speculative_model") is not None
    if require_model and TRTLLM_DECODING_TYPES[kind] and not has_model:
        raise ExportError(f"decoding_type {kind} needs a draft model (TensorRT-LLM: \"speculative_model must be "
                          "specified for DraftTarget\"): pass --draft-model PATH, or --table-only for the bare "
                          "schedule")


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
                                  "--speculative-num-draft-tokens", str(k + 1)), (), lambda rt, b, ctx: k,
                  text=json.dumps(cfg))


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

    SGLang keys a slot by the SMALLEST batch size it serves, so each batch bucket (keyed by its largest batch size
    in spectune) is written under its lower bound: the edge before it + 1.

    Args:
        candidates: batch bucket -> the k values the table holds there (``candidate_steps``).
        schedule: batch bucket -> the traffic-weighted k (what the prediction assumes the EMA settles on).
        config_path: where the caller writes the config (named in the flags).
    """
    lower = {b: lo for lo, _, b in _ranges(list(candidates))}
    cfg = {str(lower[b]): {"candidate_steps": sorted(set(ks))} for b, ks in sorted(candidates.items())}
    steps = max(k for ks in candidates.values() for k in ks)
    if steps < 1:
        raise ExportError("the table turns speculation off at every batch size; run SGLang without speculative "
                          "flags")
    validate_sglang_adaptive(cfg, steps)
    args = ("--speculative-adaptive", "--speculative-adaptive-config", config_path, "--speculative-num-steps",
            str(steps), "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1))
    note = ("adaptive speculation needs --speculative-algorithm EAGLE or EAGLE3; the prediction assumes each slot's "
            "EMA settles on the traffic-weighted k. With CUDA graphs SGLang pads a batch up to a graph size before "
            f"choosing its slot: keep the bucket edges {sorted(candidates)} among --cuda-graph-bs")
    by_key = {lower[b]: schedule[b] for b in candidates}
    keys = sorted(by_key)
    return Export("sglang-adaptive", cfg, args, (note,),
                  lambda rt, b, ctx: by_key[sglang_adaptive_lookup(keys, b)], text=json.dumps(cfg))


def sglang_adaptive_lookup(keys: Sequence[int], batch_size: int, cuda_graph_bs: Sequence[int] | None = None) -> int:
    """``AdaptiveStepRouter.batch_size_key_for_batch``: pad the batch up to the next CUDA-graph batch size (when
    graphs are on), then the largest key <= it (``bisect_right - 1``), the smallest key below them all."""
    if cuda_graph_bs:
        graphs = sorted(cuda_graph_bs)
        g = bisect.bisect_left(graphs, batch_size)
        if g < len(graphs):
            batch_size = graphs[g]
    ordered = sorted(keys)
    return ordered[max(0, bisect.bisect_right(ordered, batch_size) - 1)]


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
                  lambda rt, b, ctx: k, batches=(1,), text=json.dumps(cfg))


def validate_hf(cfg: Any) -> None:
    n = cfg.get("num_assistant_tokens") if isinstance(cfg, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ExportError(f"num_assistant_tokens must be an int >= 1, got {n!r}")
    if cfg.get("num_assistant_tokens_schedule") != "constant":
        raise ExportError("num_assistant_tokens_schedule must be \"constant\" (spectune's k does not move at run "
                          "time; 'heuristic' would let transformers change it)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _json(cfg: Mapping[str, Any]) -> str:
    return json.dumps(cfg, separators=(",", ":"))
