"""What every external source shares: the labels a source is ingested under, what a parsed record yields, and
the one builder of acceptance windows from a histogram.

Conventions (the vocabulary of ``telemetry/records.py``):

- A source's **model name** is the target version (``--version`` overrides it). Whatever a source cannot know is
  the label ``unknown`` (:data:`UNKNOWN`): the request type always (no engine reports it), the draft model
  version unless given, the context bucket unless the record says where the request's context started and ended
  and both fall in one bucket. Nothing is guessed.
- An acceptance window needs the histogram of accepted drafts at one draft length k. A record that cannot give
  it exactly (draft lengths mixed within the record, totals without a distribution) yields no window, or only
  the part of one its counts determine: it is *skipped* (or *partly stored*) with a countable reason, and its
  totals are kept in the summary. A record's ``totals`` name ``drafts`` (rows) only where the record determines
  them, and the summary's mean acceptance length is taken over exactly those records.
- Every reason a record is rejected or skipped is one of :data:`REASONS` (a short label and what it means), so a
  truncated value, a counter that went down and an engine restart are never reported as one another.
- ``emitted = accepted + rows`` (the bonus token counted, as vLLM counts acceptance length); engines report the
  verifier's view, so a row that finished mid-draft is counted as if it had emitted its bonus token.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from telemetry.errors import CountableError
from telemetry.records import (
    DEFAULT_BUCKETS,
    MAX_DRAFT_LEN,
    AcceptanceWindow,
    BucketConfig,
    CostWindow,
)
from telemetry.wire import check_label

UNKNOWN = "unknown"  # the label of what a source cannot know (request type, context bucket, draft version)
SEQ_MASK = (1 << 63) - 1  # window batch seqs are stored as BIGINT

# Why a record was rejected (malformed) or yields no window (skipped), one label each, with what it means for the
# operator. The summary prints the meaning of every reason it counts.
REASONS: dict[str, str] = {
    "truncated": "the record ends before its last field (a log line or file cut off mid-write)",
    "bad_log_line": "the marker is there but the fields are not in the engine's format",
    "bad_json": "not a JSON object",
    "bad_field": "a field is not a number, or out of its range",
    "missing_field": "a field the format requires is absent",
    "counter_went_down": "some counters went down while others did not: not a restart (a truncated or edited value?)",
    "counter_reset": "every counter went down together: the engine restarted; counted from zero after it",
    "per_position_exceeds_drafts": "more rows accepted a position than drafted at all",
    "per_position_rising": "more rows accepted a later position than an earlier one",
    "accepted_exceeds_drafted": "more draft tokens accepted than drafted",
    "mean_contradicts_counts": "the printed mean acceptance length contradicts the record's own counts",
    "inconsistent_counts": "the record's counts contradict each other",
    "mixed_draft_lengths": ("rows of several draft lengths in one record (a batch-size schedule such as vLLM's "
                            "num_speculative_tokens_per_batch_size, or adaptive steps): only what the counts "
                            "determine is stored"),
    "histogram_unknown": "totals only: which rows accepted how many drafts is not reported",
    "draft_count_unknown": "the number of rows that drafted cannot be told from the record",
    "no_model_name": "the record names no model; pass --model NAME or --version V",
    "no_spec_stats": "no speculative-decoding fields (speculation off?)",
    "no_spec_decode_counters": "no speculative-decoding counters (speculation off?)",
    "first_scrape": "cumulative counters: the first scrape or line is the baseline of the next",
    "idle": "nothing drafted in the interval",
    "scrape_failed": "the /metrics URL did not answer",
    "scrape_error": "the scrape could not be read for a reason no check foresaw (the error is kept with it)",
    "out_of_order": "counters below the previous scrape's of the same engine instance: an older scrape",
    "before_baseline": "not after the last scrape a previous run stored (re-ingested): it starts this run's intervals",
    "bad_baseline": "the last scrape a previous run stored cannot be read back: this run starts a new baseline",
    "bad_exposition": "not Prometheus text format, or spec-decode series without their labels",
}

# What each source cannot give ``spectune tune`` and how an operator supplies it, per kind of window
# (``acceptance`` / ``cost``). Read by ``spectune tune`` when a store lacks one kind of window.
MISSING: dict[str, dict[str, str]] = {
    "vllm-log": {
        "cost": ("vLLM's log lines carry acceptance only, no per-round time: ingest vLLM's /metrics (`spectune "
                 "ingest vllm-prom`), whose inter-token latency histogram and running-request gauge give cost, "
                 "or pass `spectune tune --calibration`"),
        "acceptance": ("`Speculative metrics:` lines (vLLM v0) give totals without a histogram; acceptance "
                       "windows come from them only at num_speculative_tokens=1. Upgrade to vLLM v1 "
                       "(`SpecDecoding metrics:` lines carry per-position rates) or ingest vllm-prom"),
    },
    "trtllm": {
        "acceptance": ("TensorRT-LLM's iteration stats (specDecodingStats) give per-iteration totals, not which "
                       "request accepted how many drafts; the histogram is determined only for iterations with one "
                       "drafting request (numRequestsWithDraftTokens == 1) or k = 1. Capture stats at low load "
                       "(max_batch_size 1, or concurrency 1 for a few minutes) so such iterations exist, then "
                       "ingest them again"),
        "cost": "",
    },
    "sglang": {
        "cost": ("SGLang reports no per-step time: meta_info's e2e_latency spans the request's whole life "
                 "(queueing and prefill included) and the /metrics gauges sglang:gen_throughput and "
                 "sglang:num_running_reqs are snapshots at the last decode log, without a step count "
                 "(python/sglang/srt/managers/scheduler_metrics_mixin.py). Supply cost with "
                 "`spectune tune --calibration` (a cost profile measured for the model pair), or ingest the same "
                 "model pair's cost from another engine"),
        "acceptance": ("meta_info without spec_correct_drafts_histogram (SGLang older than the histogram) "
                       "gives totals only: upgrade SGLang, or ingest requests served with one draft length"),
    },
    "sglang-prom": {
        "acceptance": ("SGLang's gauges give a mean acceptance length without a histogram: ingest the requests' "
                       "meta_info (`spectune ingest sglang FILE`, return_meta_info / --enable-metrics output)"),
        "cost": "",
    },
}


def missing_text(source: str, kind: str) -> str | None:
    """What ``source`` cannot give of ``kind`` (``acceptance`` or ``cost``) windows and how to supply it; None
    when nothing is missing or the source is not known here."""
    text = MISSING.get(source, {}).get(kind, "")
    return text or None


class SourceError(CountableError):
    """A record that is not in the format it claims to be. ``reason`` is a short, countable label."""


@dataclass(frozen=True)
class SourceLabels:
    """The labels every window of one ingested source carries.

    Raises:
        ValueError: a label breaks the bucket-key rules (1..64 printable characters, no ``|``).
    """

    target_version: str  # the engine's model name, or --version
    draft_version: str = UNKNOWN  # no engine telemetry names its draft model
    request_type: str = UNKNOWN  # no engine reports one; --request-type when a whole source is one type
    buckets: BucketConfig = field(default=DEFAULT_BUCKETS)  # context edges for records that report their context

    def __post_init__(self) -> None:
        check_label(self.target_version, "target version (the model name; pass --version for a shorter one)")
        check_label(self.draft_version, "draft version")
        check_label(self.request_type, "request type")

    def with_target(self, target_version: str) -> SourceLabels:
        return SourceLabels(target_version, self.draft_version, self.request_type, self.buckets)


@dataclass(frozen=True)
class Parsed:
    """What one record of a source yields."""

    acceptance: tuple[AcceptanceWindow, ...] = ()
    cost: tuple[CostWindow, ...] = ()
    skipped: str | None = None  # a valid record that yields no window, and why (a countable label)
    detail: str = ""  # the skip's explanation, for the rejects file
    notes: tuple[str, ...] = ()  # flags worth a warning (e.g. ``mixed_draft_lengths``), counted in the summary
    totals: dict[str, float] = field(default_factory=dict)  # drafts / draft_tokens / accepted, stored or not
    observation: dict[str, Any] | None = None  # what the record said that has no window (gauges, latency)


def load_json(line: str) -> Any:
    """The JSON value of one line of a JSON-lines source.

    Raises:
        SourceError: ``bad_json`` when the line is not JSON.
    """
    try:
        return json.loads(line)
    except ValueError as e:
        raise SourceError("bad_json", f"not JSON: {e}") from None


def load_json_object(line: str) -> dict[str, Any] | None:
    """The JSON object of one line of a JSON-lines source; None for a blank line (no record).

    Raises:
        SourceError: ``bad_json`` when the line is not JSON or not an object.
    """
    if not line.strip():
        return None
    obj = load_json(line)
    if not isinstance(obj, dict):
        raise SourceError("bad_json", "a line must be a JSON object")
    return obj


def stable_seq(*parts: object) -> int:
    """A 63-bit id from ``parts``: the same record ingested twice gets the same ``(engine_id, seq)``, so the
    store keeps it once."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") & SEQ_MASK


def as_int(v: Any, what: str, lo: int = 0) -> int:
    """A non-negative integer field (JSON ints, or floats that are whole numbers, as Prometheus writes them)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SourceError("bad_field", f"{what} must be a number, got {type(v).__name__}")
    if isinstance(v, float) and not (v == v and v not in (float("inf"), float("-inf")) and v.is_integer()):
        raise SourceError("bad_field", f"{what}={v} is not a whole number")
    if v < lo:
        raise SourceError("bad_field", f"{what}={v} < {lo}")
    return int(v)


def as_float(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v in (float("inf"), float("-inf")):
        raise SourceError("bad_field", f"{what} must be a finite number, got {v!r}")
    if v < 0:
        raise SourceError("bad_field", f"{what}={v} is negative")
    return float(v)


def hist_from_tail(drafts: int, at_least: list[int]) -> list[int]:
    """The histogram of accepted drafts from "accepted >= i + 1" counts at one draft length.

    Args:
        drafts: rows that drafted (vLLM ``num_drafts``).
        at_least: ``[k]`` rows that accepted at least i + 1 drafts (vLLM ``num_accepted_tokens_per_pos``).

    Returns:
        ``[k + 1]`` rows that accepted exactly 0..k drafts.

    Raises:
        SourceError: ``per_position_exceeds_drafts`` when a count exceeds ``drafts``, ``per_position_rising``
            when the counts rise with the position.
    """
    if any(c > drafts for c in at_least):
        raise SourceError("per_position_exceeds_drafts", f"per-position counts {at_least} exceed drafts={drafts}")
    tail = [drafts, *at_least, 0]
    hist = [tail[i] - tail[i + 1] for i in range(len(at_least))] + [at_least[-1] if at_least else drafts]
    if any(h < 0 for h in hist):
        raise SourceError("per_position_rising", f"per-position counts {at_least} rise with the position")
    return hist


def acceptance_window(labels: SourceLabels, context_bucket: str, hist: list[int]) -> AcceptanceWindow:
    """The acceptance window of rows that all drafted ``k = len(hist) - 1`` tokens.

    Args:
        labels: the source's labels.
        context_bucket: a context bucket label or :data:`UNKNOWN`.
        hist: ``[k + 1]`` rows that accepted exactly 0..k drafts.
    """
    k = len(hist) - 1
    if not 0 <= k <= MAX_DRAFT_LEN:
        raise SourceError("bad_draft_length", f"draft length {k} outside [0, {MAX_DRAFT_LEN}]")
    if any(h < 0 for h in hist):
        raise SourceError("bad_histogram", f"negative count in {hist}")
    rows = sum(hist)
    accepted = sum(i * h for i, h in enumerate(hist))
    return AcceptanceWindow(
        target_version=labels.target_version, draft_version=labels.draft_version,
        request_type=labels.request_type, context_bucket=context_bucket, k=k, rows=rows, drafted=rows * k,
        accepted=accepted, emitted=accepted + rows, hist=tuple(hist),
    )


def context_bucket_of(buckets: BucketConfig, prompt_tokens: Any, completion_tokens: Any) -> str:
    """The context bucket of a request whose context grew from ``prompt_tokens`` to ``prompt_tokens +
    completion_tokens``, when both ends fall in one bucket; :data:`UNKNOWN` otherwise (which bucket its rounds
    were in is not recorded), and when either count is missing or not an integer."""
    start = prompt_tokens
    end = (prompt_tokens + completion_tokens
           if isinstance(prompt_tokens, int) and isinstance(completion_tokens, int) else None)
    if isinstance(start, int) and isinstance(end, int) and not isinstance(start, bool) and 0 <= start <= end:
        a, b = buckets.context_bucket(start), buckets.context_bucket(end)
        if a == b:
            return a
    return UNKNOWN
