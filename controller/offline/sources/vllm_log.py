"""vLLM's periodic log line ``SpecDecoding metrics: ...``, after any logger prefix.

Source: ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingLogging.log``), which prints over its interval::

    SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s,
    Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens,
    Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%

with the per-position rates ``per_pos[i] / num_drafts`` to three decimals, one per position up to
``num_speculative_tokens`` (K). The line does not print ``num_drafts``; with one draft length it is
``Drafted / K``, and the mean acceptance length ``1 + Accepted / num_drafts`` must agree (to its two decimals).
Where they disagree the interval mixed draft lengths and is skipped (``mixed_draft_lengths``).

The per-position counts are ``rate * num_drafts`` rounded, so they are exact while ``num_drafts < 1000`` and
within 0.05 % of ``num_drafts`` per position beyond; the rounding left over is put where the rates' rounding
was largest, so the histogram adds up to ``Accepted`` exactly.
"""

from __future__ import annotations

import re

from controller.offline.sources.common import (
    UNKNOWN,
    Parsed,
    SourceError,
    SourceLabels,
    acceptance_window,
    hist_from_tail,
)

MARKER = "SpecDecoding metrics:"
_NUM = r"(nan|[0-9]+(?:\.[0-9]+)?)"
LINE_RE = re.compile(
    r"SpecDecoding metrics:\s*Mean acceptance length:\s*" + _NUM + r",\s*"
    r"Accepted throughput:\s*" + _NUM + r" tokens/s,\s*"
    r"Drafted throughput:\s*" + _NUM + r" tokens/s,\s*"
    r"Accepted:\s*([0-9]+) tokens,\s*"
    r"Drafted:\s*([0-9]+) tokens,\s*"
    r"Per-position acceptance rate:\s*((?:[0-9.]+(?:,\s*)?)*?),\s*"
    r"Avg Draft acceptance rate:\s*" + _NUM + r"%"
)
RATE_DECIMALS = 3  # vLLM prints per-position rates with %.3f
MAL_TOLERANCE = 0.0051  # mean acceptance length is printed with %.2f


def parse_line(line: str, labels: SourceLabels) -> Parsed | None:
    """The acceptance window of one log line; None for a line without the marker (other log output).

    Raises:
        SourceError: ``bad_log_line`` when the marker is there but the rest is not vLLM's format.
    """
    if MARKER not in line:
        return None
    m = LINE_RE.search(line)
    if m is None:
        raise SourceError("bad_log_line", f"{MARKER!r} present but the fields do not match vLLM's format")
    mal_s, _acc_tp, _draft_tp, acc_s, drafted_s, rates_s, _rate = m.groups()
    accepted, drafted = int(acc_s), int(drafted_s)
    rates = [float(x) for x in rates_s.replace(" ", "").split(",") if x]
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise SourceError("bad_log_line", f"per-position rates {rates_s!r} must be numbers in [0, 1]")
    totals = {"draft_tokens": float(drafted), "accepted": float(accepted)}
    if drafted == 0:
        return Parsed(skipped="idle", detail="no drafts in the interval", totals=totals)
    if accepted > drafted:
        raise SourceError("bad_log_line", f"Accepted {accepted} > Drafted {drafted}")
    mal = float(mal_s) if mal_s != "nan" else None
    k = _draft_length(rates, drafted, accepted, mal)
    if k is None:
        return Parsed(skipped="mixed_draft_lengths", notes=("mixed_draft_lengths",), totals=totals,
                      detail=(f"Drafted {drafted} is not k positions x drafts consistent with mean acceptance "
                              f"length {mal_s} for any single k <= {len(rates)}: drafts of several lengths (a "
                              "batch-size schedule?)"))
    n = drafted // k
    totals["drafts"] = float(n)
    counts = _counts(rates[:k], n, accepted)
    return Parsed(acceptance=(acceptance_window(labels, UNKNOWN, hist_from_tail(n, counts)),), totals=totals)


def _draft_length(rates: list[float], drafted: int, accepted: int, mal: float | None) -> int | None:
    """The one draft length k every draft of the interval had, or None when no single k explains the line.

    The line prints a rate for each of vLLM's ``num_speculative_tokens`` positions, but under a per-step k
    (``num_speculative_tokens_per_batch_size``, or spectune's scheduler) every draft may be shorter: positions
    past k then read 0. A k explains the line when no position past it accepted anything, ``Drafted`` is a
    multiple of it, and the mean acceptance length ``1 + Accepted / (Drafted / k)`` agrees with the printed one;
    the mean decides between the candidates, since the draft count differs for each. Without a printed mean
    (``nan``) only k = all positions is taken, as vLLM's static setting.
    """
    top = len(rates)
    while top > 1 and rates[top - 1] == 0.0:
        top -= 1  # positions past the last nonzero rate may lie beyond every draft
    candidates = range(len(rates), top - 1, -1) if mal is not None else (len(rates),)
    fits = [k for k in candidates if drafted % k == 0
            and (mal is None or abs(1 + accepted / (drafted // k) - mal) <= MAL_TOLERANCE)]
    return fits[0] if len(fits) == 1 else None


def _counts(rates: list[float], n: int, accepted: int) -> list[int]:
    """Per-position counts ``round(rate * n)``, corrected to add up to ``accepted`` within the rates' rounding."""
    raw = [r * n for r in rates]
    counts = [min(n, round(x)) for x in raw]
    slack = 0.5 * 10**-RATE_DECIMALS * n + 0.5  # what printing to 3 decimals can hide, per position
    diff = accepted - sum(counts)
    if abs(diff) > slack * len(rates):
        raise SourceError("bad_log_line", f"per-position rates x drafts add up to {sum(counts)}, not Accepted "
                                          f"{accepted}")
    step = 1 if diff > 0 else -1
    # Move the remainder one count at a time to the position whose rounding went furthest the other way,
    # keeping the counts non-increasing (rows accepting >= i + 1 are a subset of those accepting >= i).
    while diff:
        order = sorted(range(len(counts)), key=lambda i: (counts[i] - raw[i]) * step)
        for i in order:
            c = counts[i] + step
            if 0 <= c <= n and (i == 0 or c <= counts[i - 1]) and (i == len(counts) - 1 or c >= counts[i + 1]):
                counts[i] = c
                diff -= step
                break
        else:
            raise SourceError("bad_log_line", "per-position rates cannot add up to Accepted")
    return counts
