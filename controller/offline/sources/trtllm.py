"""TensorRT-LLM iteration stats (``llm.get_stats()`` or ``trtllm-serve``'s ``/metrics``), as JSON lines.

Source: ``cpp/include/tensorrt_llm/executor/types.h`` (``SpecDecodingStats``, ``IterationStats``). One iteration::

    {"iter": 12, "iterLatencyMS": 21.4, "numActiveRequests": 8, ...,
     "specDecodingStats": {"numDraftTokens": 24, "numAcceptedTokens": 13, "numRequestsWithDraftTokens": 8,
                           "acceptanceLength": 2.625, "iterLatencyMS": 3.1, "draftOverhead": 0.145}}

- ``numRequestsWithDraftTokens``: rows that drafted; ``numDraftTokens`` / ``numAcceptedTokens``: their totals;
- ``acceptanceLength = (accepted + rows) / rows`` (bonus token included, as vLLM counts it);
- ``specDecodingStats.iterLatencyMS``: the time spent drafting only; ``draftOverhead`` = that / the iteration's.

An iteration is one round: it becomes a **cost window** (rounds 1, the drafting rows' batch, draft seconds from
``specDecodingStats.iterLatencyMS``, everything else in the iteration, the target's verify and bookkeeping, in
``verify_s``; TensorRT-LLM does not split them, so ``other_s`` is zero). Draft lengths per row are not reported:
the iteration counts as one k only when ``numDraftTokens == rows * k``.

It carries totals, not a histogram, so an **acceptance window** follows only from iterations whose totals fix
the histogram *whatever the outcome*: one drafting request (``numRequestsWithDraftTokens == 1``: its accepted
count is the histogram) or k = 1 (``[rows - accepted, accepted]``). Keeping only the iterations where
everything or nothing was accepted would also fix a histogram, but choosing iterations by their outcome biases the
curve toward both extremes, so they are not kept as windows. Other iterations are skipped as
``histogram_unknown``, their totals in the summary's mean (note ``totals_only``). To tune k > 1 from TensorRT-LLM
alone, capture iterations at low load (one request drafting at a time), where every iteration is determined;
:data:`~controller.offline.sources.common.MISSING` says so to ``spectune tune``.
A line may also hold a JSON list of iterations (what ``/metrics`` returns).
"""

from __future__ import annotations

import json
from typing import Any

from controller.offline.sources.common import (
    UNKNOWN,
    Parsed,
    SourceError,
    SourceLabels,
    acceptance_window,
    as_float,
    as_int,
    load_json,
)
from telemetry.records import MAX_DRAFT_LEN, CostWindow, Stat

MS = 1e-3
ACCEPTANCE_LENGTH_TOLERANCE = 1e-3


def parse_line(line: str, labels: SourceLabels) -> list[Parsed] | None:
    """The windows of one line (one iteration, or a list of them); None for a blank line.

    Raises:
        SourceError: not JSON, or an iteration's fields are missing or contradict each other.
    """
    if not line.strip():
        return None
    obj = load_json(line)
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for it in items:
        if isinstance(it, str):  # get_stats() may hand out each iteration as a JSON string
            try:
                it = json.loads(it)
            except ValueError as e:
                raise SourceError("bad_json", f"an iteration string is not JSON: {e}") from None
        if not isinstance(it, dict):
            raise SourceError("bad_json", "an iteration must be a JSON object")
        out.append(parse_iteration(it, labels))
    return out


def parse_iteration(it: dict[str, Any], labels: SourceLabels) -> Parsed:
    spec = it.get("specDecodingStats")
    if not isinstance(spec, dict):
        return Parsed(skipped="no_spec_stats", detail="no specDecodingStats (speculative decoding off?)")
    drafted = as_int(spec.get("numDraftTokens"), "numDraftTokens")
    accepted = as_int(spec.get("numAcceptedTokens"), "numAcceptedTokens")
    rows = as_int(spec.get("numRequestsWithDraftTokens"), "numRequestsWithDraftTokens")
    total_ms = as_float(it.get("iterLatencyMS"), "iterLatencyMS")
    totals = {"drafts": float(rows), "draft_tokens": float(drafted), "accepted": float(accepted)}
    if drafted == 0 or rows == 0:
        return Parsed(skipped="idle", detail="no draft tokens in this iteration", totals=totals)
    if accepted > drafted:
        raise SourceError("inconsistent_counts", f"numAcceptedTokens {accepted} > numDraftTokens {drafted}")
    length = spec.get("acceptanceLength")
    if isinstance(length, int | float) and abs(length - (accepted + rows) / rows) > ACCEPTANCE_LENGTH_TOLERANCE:
        raise SourceError("inconsistent_counts", f"acceptanceLength {length} != (accepted + rows) / rows "
                                                 f"{(accepted + rows) / rows:.4f}")
    if drafted % rows or not 0 < drafted // rows <= MAX_DRAFT_LEN:
        return Parsed(skipped="mixed_draft_lengths", notes=("mixed_draft_lengths",), totals=totals,
                      detail=f"{drafted} draft tokens over {rows} rows: rows drafted different lengths")
    k = drafted // rows
    draft_ms = _draft_ms(spec, total_ms)
    if draft_ms > total_ms:
        raise SourceError("inconsistent_counts", f"drafting {draft_ms} ms > the iteration's {total_ms} ms")
    cost = _cost_window(labels, rows, k, accepted, draft_ms * MS, (total_ms - draft_ms) * MS)
    hist = _determined_hist(rows, k, accepted)
    if hist is None:
        return Parsed(cost=(cost,), skipped="histogram_unknown", notes=("totals_only",), totals=totals,
                      detail=(f"totals only (rows {rows}, k {k}, accepted {accepted}): which rows accepted how "
                              "many is not reported; cost window stored, acceptance not"),
                      observation={"acceptance_length": (accepted + rows) / rows})
    return Parsed(acceptance=(acceptance_window(labels, UNKNOWN, hist),), cost=(cost,), totals=totals)


def _draft_ms(spec: dict[str, Any], total_ms: float) -> float:
    if spec.get("iterLatencyMS") is not None:
        return as_float(spec.get("iterLatencyMS"), "specDecodingStats.iterLatencyMS")
    if spec.get("draftOverhead") is not None:
        overhead = as_float(spec.get("draftOverhead"), "draftOverhead")
        if overhead > 1:
            raise SourceError("bad_field", f"draftOverhead {overhead} > 1")
        return overhead * total_ms
    raise SourceError("missing_field", "specDecodingStats has neither iterLatencyMS nor draftOverhead")


def _determined_hist(rows: int, k: int, accepted: int) -> list[int] | None:
    """The histogram when the totals fix it for every outcome (one drafting row, or k = 1); None otherwise."""
    hist = [0] * (k + 1)
    if rows == 1:
        hist[accepted] = 1
    elif k == 1:
        hist[0], hist[1] = rows - accepted, accepted
    else:
        return None  # e.g. all-accepted iterations also fix it, but keeping them by outcome would bias the curve
    return hist


def _cost_window(labels: SourceLabels, rows: int, k: int, accepted: int, draft_s: float,
                 rest_s: float) -> CostWindow:
    """One iteration as one round of ``rows`` rows at draft length k (packed verify: rows * (k + 1) tokens)."""
    emitted = accepted + rows
    per_token = (draft_s + rest_s) / (emitted / rows)  # a row's wait per token it got this round
    return CostWindow(
        target_version=labels.target_version, draft_version=labels.draft_version,
        batch_bucket=labels.buckets.batch_bucket(rows), context_bucket=UNKNOWN, max_k=k, rounds=1,
        tokens_verified=rows * (k + 1), emitted=emitted, batch_rows=rows,
        draft_s=Stat().add(draft_s), verify_s=Stat().add(rest_s), other_s=Stat().add(0.0),
        latency_p50=per_token, latency_p95=per_token, latency_p99=per_token,
    )
