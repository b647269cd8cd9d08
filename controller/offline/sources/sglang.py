"""SGLang: per-request ``meta_info`` (JSON lines) and the ``/metrics`` gauges.

Sources: ``python/sglang/srt/managers/schedule_batch.py`` (the ``Req`` counters), the tokenizer manager that copies
them into ``meta_info``, and ``python/sglang/srt/metrics/collector.py`` (the gauges). Per request:

- ``spec_verify_ct``: verify steps (rows, in spectune's words);
- ``spec_num_proposed_drafts``: draft tokens proposed (``spec_verify_ct * draft length`` at one length);
- ``spec_num_correct_drafts``: draft tokens accepted;
- ``spec_correct_drafts_histogram[j]``: steps that accepted exactly j drafts (sums to ``spec_verify_ct``);
- ``spec_accept_length = completion_tokens / spec_verify_ct`` (the prefill's first token included) and
  ``spec_accept_rate = correct / proposed``: derived, cross-checked only.

A line is a ``/generate`` response (``{"meta_info": {...}}``), an OpenAI choice carrying ``meta_info``, or the bare
object. With adaptive speculation (``--speculative-adaptive``) a request's steps mix draft lengths: proposed is
then not ``verify_ct * k`` for one k and the line is skipped as ``mixed_draft_lengths``.

The gauges ``sglang:spec_accept_length`` and ``sglang:spec_accept_rate`` are means over SGLang's last logging
interval without a count of steps, so no window can be made from them (rows unknown); each scrape's values and
``sglang:num_running_reqs`` are reported in the summary, per (``model_name``, ``tp_rank``, ``dp_rank``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from controller.offline.sources.common import (
    Parsed,
    SourceError,
    SourceLabels,
    acceptance_window,
    as_int,
    context_bucket_of,
    load_json_object,
)

GAUGES = ("sglang:spec_accept_length", "sglang:spec_accept_rate", "sglang:num_running_reqs")
ACCEPT_LENGTH_TOLERANCE = 0.01  # relative; spec_accept_length counts the prefill's token too


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    if isinstance(obj.get("meta_info"), dict):
        return dict(obj["meta_info"])
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict) and isinstance(
            choices[0].get("meta_info"), dict):
        return dict(choices[0]["meta_info"])
    return obj


def parse_line(line: str, labels: SourceLabels) -> Parsed | None:
    """The acceptance window of one ``meta_info`` JSON line; None for a blank line.

    Raises:
        SourceError: the line is not JSON, lacks the spec counters, or they contradict each other.
    """
    obj = load_json_object(line)
    if obj is None:
        return None
    meta = _meta(obj)
    if "spec_verify_ct" not in meta:
        raise SourceError("missing_field", "no spec_verify_ct in meta_info (is speculative decoding on?)")
    steps = as_int(meta.get("spec_verify_ct"), "spec_verify_ct")
    correct = as_int(meta.get("spec_num_correct_drafts"), "spec_num_correct_drafts")
    totals = {"drafts": float(steps), "accepted": float(correct)}
    if steps == 0:
        return Parsed(skipped="idle", detail="no verify steps in this request", totals=totals)
    if "spec_num_proposed_drafts" not in meta:
        return Parsed(skipped="draft_length_unknown", totals=totals,
                      detail="no spec_num_proposed_drafts (older SGLang): the draft length is not recorded")
    proposed = as_int(meta.get("spec_num_proposed_drafts"), "spec_num_proposed_drafts")
    totals["draft_tokens"] = float(proposed)
    if correct > proposed:
        raise SourceError("inconsistent_counts", f"spec_num_correct_drafts {correct} > proposed {proposed}")
    _cross_check(meta, steps, correct, proposed)
    raw = meta.get("spec_correct_drafts_histogram")
    if not isinstance(raw, list) or not raw:
        return Parsed(skipped="histogram_missing", totals=totals,
                      detail="no spec_correct_drafts_histogram: totals only, the acceptance curve is unknown")
    hist = [as_int(x, f"spec_correct_drafts_histogram[{i}]") for i, x in enumerate(raw)]
    if sum(hist) != steps or sum(i * h for i, h in enumerate(hist)) != correct:
        raise SourceError("inconsistent_counts", "spec_correct_drafts_histogram does not add up to spec_verify_ct "
                                                 "and spec_num_correct_drafts")
    if proposed % steps:
        return Parsed(skipped="mixed_draft_lengths", notes=("mixed_draft_lengths",), totals=totals,
                      detail=f"proposed {proposed} over {steps} steps: several draft lengths (adaptive steps?)")
    k = proposed // steps
    if len(hist) > k + 1:
        if any(hist[k + 1:]):
            return Parsed(skipped="mixed_draft_lengths", notes=("mixed_draft_lengths",), totals=totals,
                          detail=f"steps accepted more than the mean draft length {k}: several draft lengths")
        hist = hist[: k + 1]
    hist += [0] * (k + 1 - len(hist))  # the histogram grows as counts arrive; absent bins are zero
    ctx = context_bucket_of(labels.buckets, meta.get("prompt_tokens"), meta.get("completion_tokens"))
    return Parsed(acceptance=(acceptance_window(labels, ctx, hist),), totals=totals)


def _cross_check(meta: dict[str, Any], steps: int, correct: int, proposed: int) -> None:
    rate = meta.get("spec_accept_rate")
    if isinstance(rate, int | float) and proposed and abs(rate - correct / proposed) > ACCEPT_LENGTH_TOLERANCE:
        raise SourceError("inconsistent_counts", f"spec_accept_rate {rate} != correct / proposed "
                                                 f"{correct / proposed:.4f}")
    completion, length = meta.get("completion_tokens"), meta.get("spec_accept_length")
    if (isinstance(completion, int) and isinstance(length, int | float) and completion
            and abs(length - completion / steps) > ACCEPT_LENGTH_TOLERANCE * max(1.0, length)):
        raise SourceError("inconsistent_counts", f"spec_accept_length {length} != completion_tokens / "
                                                 f"spec_verify_ct {completion / steps:.4f}")


def parse_gauges(text: str) -> list[dict[str, Any]]:
    """The spec gauges of one SGLang scrape, one dict per (model_name, tp_rank, dp_rank) series.

    Raises:
        SourceError: ``bad_exposition`` when the text is not Prometheus text format.
    """
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name not in GAUGES:
                    continue
                lab = s.labels
                key = (lab.get("model_name", "unknown"), lab.get("tp_rank", "0"), lab.get("dp_rank", "0"))
                row = rows.setdefault(key, {"model_name": key[0], "tp_rank": key[1], "dp_rank": key[2]})
                row[s.name.removeprefix("sglang:")] = float(s.value)
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise SourceError("bad_exposition", f"not Prometheus text format: {e}") from e
    return [rows[k] for k in sorted(rows)]
