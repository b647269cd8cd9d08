"""vLLM's per-request spec-decode metrics (``--per-request-spec-decode-metrics summary|detailed``), as JSON lines.

Source: vLLM PR #48915 (merged) puts ``metrics.speculative_decoding`` in each OpenAI response::

    {"mean_acceptance_length": 1.23, "draft_acceptance_rate": 0.078, "acceptance_histogram": [39, 1, 0, 3],
     "num_spec_steps": 43, "num_accepted_draft_tokens": 10, "num_draft_tokens": 129, "num_spec_tokens": 3}

``acceptance_histogram[j]`` counts the request's verify steps that accepted exactly j drafts. One line is a whole
response (``{"metrics": {"speculative_decoding": ...}, "usage": ...}``) or the bare object. Its steps drafted one
length when ``num_draft_tokens == num_spec_steps * num_spec_tokens``; otherwise (a batch-size schedule) the
histogram mixes lengths, and only ``acceptance_histogram_by_draft_length`` (vLLM PR #56278, still open:
``{"k": [k + 1 counts], ...}``) splits it. Without it such a line is skipped as ``mixed_draft_lengths``.

The context bucket is known when the line carries ``usage`` and the prompt and the finished context fall in one
bucket.
"""

from __future__ import annotations

from typing import Any

from controller.offline.sources.common import (
    Parsed,
    SourceError,
    SourceLabels,
    acceptance_window,
    as_int,
    context_bucket_of,
    load_json_object,
)
from telemetry.records import AcceptanceWindow


def parse_line(line: str, labels: SourceLabels) -> Parsed | None:
    """The acceptance windows of one JSON line; None for a blank line.

    Raises:
        SourceError: the line is not JSON or its ``speculative_decoding`` object breaks vLLM's invariants.
    """
    obj = load_json_object(line)
    if obj is None:
        return None
    metrics = obj.get("metrics")
    sd = metrics.get("speculative_decoding") if isinstance(metrics, dict) else obj.get("speculative_decoding", obj)
    if not isinstance(sd, dict) or "acceptance_histogram" not in sd:
        raise SourceError("missing_field", "no metrics.speculative_decoding.acceptance_histogram (is vLLM run with "
                                           "--per-request-spec-decode-metrics summary?)")
    hist = _hist(sd.get("acceptance_histogram"), "acceptance_histogram")
    steps = as_int(sd.get("num_spec_steps"), "num_spec_steps")
    accepted = as_int(sd.get("num_accepted_draft_tokens"), "num_accepted_draft_tokens")
    drafted = as_int(sd.get("num_draft_tokens"), "num_draft_tokens")
    k_max = as_int(sd.get("num_spec_tokens"), "num_spec_tokens", 1)
    if sum(hist) != steps:
        raise SourceError("inconsistent_counts", f"acceptance_histogram sums to {sum(hist)}, not num_spec_steps "
                                                 f"{steps}")
    if sum(i * h for i, h in enumerate(hist)) != accepted:
        raise SourceError("inconsistent_counts", "acceptance_histogram does not add up to num_accepted_draft_tokens")
    if len(hist) > k_max + 1 or accepted > drafted:
        raise SourceError("inconsistent_counts", f"{len(hist)} histogram bins for num_spec_tokens={k_max}, or "
                                                 f"accepted {accepted} > drafted {drafted}")
    raw_usage = obj.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    ctx = context_bucket_of(labels.buckets, usage.get("prompt_tokens"), usage.get("completion_tokens"))
    totals = {"drafts": float(steps), "draft_tokens": float(drafted), "accepted": float(accepted)}
    if steps == 0:
        return Parsed(skipped="idle", detail="no spec steps in this request", totals=totals)
    by_len = sd.get("acceptance_histogram_by_draft_length")
    if by_len is not None:
        windows = _by_draft_length(by_len, labels, ctx, steps, accepted, drafted)
        return Parsed(acceptance=windows, totals=totals)
    if drafted != steps * k_max:
        return Parsed(skipped="mixed_draft_lengths", notes=("mixed_draft_lengths",), totals=totals,
                      detail=(f"num_draft_tokens {drafted} != num_spec_steps {steps} x num_spec_tokens {k_max}: "
                              "steps of several draft lengths and no acceptance_histogram_by_draft_length"))
    hist = hist + [0] * (k_max + 1 - len(hist))
    return Parsed(acceptance=(acceptance_window(labels, ctx, hist),), totals=totals)


def _hist(raw: Any, what: str) -> list[int]:
    if not isinstance(raw, list) or not raw:
        raise SourceError("bad_field", f"{what} must be a non-empty list")
    return [as_int(x, f"{what}[{i}]") for i, x in enumerate(raw)]


def _by_draft_length(raw: Any, labels: SourceLabels, ctx: str, steps: int, accepted: int,
                     drafted: int) -> tuple[AcceptanceWindow, ...]:
    if not isinstance(raw, dict):
        raise SourceError("bad_field", "acceptance_histogram_by_draft_length must be an object {k: histogram}")
    out, plain = [], 0  # plain: steps scheduled at K = 0 (whether vLLM counts them as spec steps is open)
    for key, h in sorted(raw.items(), key=lambda kv: str(kv[0])):
        try:
            k = int(key)
        except ValueError:
            raise SourceError("bad_field", f"draft length key {key!r} is not an integer") from None
        hist = _hist(h, f"acceptance_histogram_by_draft_length[{key}]")
        if len(hist) != k + 1:
            raise SourceError("inconsistent_counts", f"draft length {k} has {len(hist)} bins, expected {k + 1}")
        if k == 0:
            plain += sum(hist)
        elif sum(hist):
            out.append(acceptance_window(labels, ctx, hist))
    rows = sum(w.rows for w in out)
    if steps not in (rows, rows + plain) or (sum(w.accepted for w in out), sum(w.drafted for w in out)) != (
            accepted, drafted):
        raise SourceError("inconsistent_counts", "acceptance_histogram_by_draft_length does not add up to the "
                                                 "request's steps, accepted and draft tokens")
    return tuple(out)
