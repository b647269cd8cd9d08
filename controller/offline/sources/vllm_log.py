"""vLLM's periodic spec-decode log lines, after any logger prefix: v1's ``SpecDecoding metrics:`` and v0's
``Speculative metrics:``.

**v1** (``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingLogging.log``) prints over its interval::

    SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s,
    Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens,
    Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%

with the mean acceptance length ``1 + Accepted / num_drafts`` (bonus token counted) and one rate
``per_pos[i] / num_drafts`` to three decimals per position up to ``num_speculative_tokens`` (K). The line does
not print ``num_drafts`` (N, the rows that drafted); two of its fields fix it: the mean, and the rates, whose
counts add up to ``Accepted`` (``SpecDecodingStats.observe_draft`` counts a row that kept a drafts once at each of
positions 0..a-1). :func:`drafts_candidates` returns every N both allow, within their printed precision.

- **One draft length** (``Drafted == N * k`` for a candidate N and a k no shorter than the last position that
  accepted anything): the histogram at k follows from the rates (:func:`hist_from_tail`), exact while
  N < 1000 and within 0.05 % of N per position beyond; the rounding left over is put where the rates' rounding
  was largest, so the histogram adds up to ``Accepted`` exactly.
- **Mixed draft lengths** (vLLM's ``num_speculative_tokens_per_batch_size`` schedule; ``Drafted`` is no
  multiple): the rates are over all N rows, but a row that drafted j tokens cannot accept at positions past j,
  and how many rows drafted past each position is not printed. So past position 1 the counts mix acceptance with
  draft length. Position 1 does not: every row drafted it, and whether the first draft token is kept does not
  depend on how many follow it. The line is stored as what it determines, a **k = 1 window** ``[N - c0, c0]``
  (c0 = rows that accepted position 1), and kept in the rejects file as partly stored (``mixed_draft_lengths``).
  When the printed precision leaves several N, the middle one is taken and the window is within that precision.
  Its totals (N, ``Drafted``, ``Accepted``) all count in the summary's mean acceptance length.
- **Contradictions** are rejected with their own reason: no N agrees with both the mean and the rates
  (``mean_contradicts_counts``), a rate above 1 (``per_position_exceeds_drafts``), rates that rise with the
  position (``per_position_rising``), ``Accepted > Drafted`` (``accepted_exceeds_drafted``), and a line that ends
  before its last field (``truncated``).

**v0** (``vllm/engine/metrics.py``, ``LoggingStatLogger._format_spec_decode_metrics_str``)::

    Speculative metrics: Draft acceptance rate: %.3f, System efficiency: %.3f,
    Number of speculative tokens: %d, Number of accepted tokens: %d, Number of draft tokens: %d,
    Number of emitted tokens: %d.

(v0.4 printed ``Number of draft tokens tokens:`` and ``Number of emitted tokens tokens:``; both are read.) Its
counts are cumulative since the engine started (``vllm/model_executor/layers/spec_decode_base_sampler.py``
adds to them every step and never resets), so a line's interval is its difference from the previous line: the
first line is the baseline, and counters that all went down mean a restart. Every row drafts k tokens
(``num_draft_tokens += batch_size * k``), so rows = drafted / k. ``accepted`` counts every draft token the
verifier accepted, also past a rejected one (``vllm/spec_decode/metrics.py``, ``SpecDecodeWorkerMetrics``), so
the accepted prefix is ``emitted - rows`` (the bonus or recovered token is one per row). Totals only: the
histogram is determined at k = 1 (``[rows - accepted, accepted]``), otherwise the interval is skipped as
``histogram_unknown`` with its totals in the summary and a warning.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import NoReturn

from controller.offline.sources.common import (
    UNKNOWN,
    Parsed,
    SourceError,
    SourceLabels,
    acceptance_window,
    hist_from_tail,
)

MARKER = "SpecDecoding metrics:"
V0_MARKER = "Speculative metrics:"
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
V0_RE = re.compile(
    r"Speculative metrics:\s*Draft acceptance rate:\s*" + _NUM + r",\s*"
    r"(?:System efficiency:\s*" + _NUM + r",\s*)?"
    r"Number of speculative tokens:\s*([0-9]+),\s*"
    r"Number of accepted tokens:\s*([0-9]+),\s*"
    r"Number of draft tokens(?: tokens)?:\s*([0-9]+),\s*"
    r"Number of emitted tokens(?: tokens)?:\s*([0-9]+)\."
)
# What a line cut off mid-write can end with: field labels, numbers, separators and units, nothing else.
_PARTIAL_RE = re.compile(r"[A-Za-z /-]*:?\s*(?:nan|[0-9.,\s]*)\s*(?:t|to|tok|toke|token|tokens(?:/s?)?)?%?\s*")
RATE_HALF_STEP = 0.0005  # vLLM prints per-position rates with %.3f
MAL_HALF_STEP = 0.005  # and the mean acceptance length with %.2f
EPS = 1e-9  # float slack on the printed-precision bounds
RATE_DECIMALS = 3


def parse_line(line: str, labels: SourceLabels) -> Parsed | None:
    """The windows of one v1 log line; None for a line without the marker (other log output).

    v0 lines need the previous line (their counters are cumulative): use :class:`LogParser`.

    Raises:
        SourceError: the marker is there but the line is cut off (``truncated``), not vLLM's format
            (``bad_log_line``), or its fields contradict each other (see the module doc for each reason).
    """
    if MARKER not in line:
        return None
    m = LINE_RE.search(line)
    if m is None:
        _raise_unparsed(line, MARKER)
    mal_s, _acc_tp, _draft_tp, acc_s, drafted_s, rates_s, _rate = m.groups()
    accepted, drafted = int(acc_s), int(drafted_s)
    rates = [float(x) for x in rates_s.replace(" ", "").split(",") if x]
    if not rates:
        raise SourceError("bad_log_line", "no per-position acceptance rates")
    if any(r > 1.0 for r in rates):
        raise SourceError("per_position_exceeds_drafts", f"per-position rate above 1 in {rates_s!r}: more rows "
                                                         "accepted a position than drafted")
    if any(b > a for a, b in itertools.pairwise(rates)):
        raise SourceError("per_position_rising", f"per-position rates {rates_s!r} rise with the position")
    if drafted == 0:
        return Parsed(skipped="idle", detail="no drafts in the interval", totals={"draft_tokens": 0.0})
    if accepted > drafted:
        raise SourceError("accepted_exceeds_drafted", f"Accepted {accepted} > Drafted {drafted}")
    mal = float(mal_s) if mal_s != "nan" else None
    if accepted == 0 and drafted > len(rates):
        return Parsed(skipped="draft_count_unknown", totals={"draft_tokens": float(drafted), "accepted": 0.0},
                      detail=(f"nothing accepted of {drafted} draft tokens: the number of drafts lies anywhere in "
                              f"{math.ceil(drafted / len(rates))}..{drafted}; not stored"))
    cands = drafts_candidates(accepted, drafted, rates, mal)
    if not cands:
        raise SourceError("mean_contradicts_counts", (
            f"no number of drafts agrees with mean acceptance length {mal_s}, Accepted {accepted}, Drafted "
            f"{drafted} and the per-position rates {rates_s!r} (their counts add up to Accepted)"))
    totals = {"draft_tokens": float(drafted), "accepted": float(accepted)}
    single = _single_length(cands, drafted, rates)
    if single is not None:
        n, k = single
        totals["drafts"] = float(n)
        counts = _counts(rates[:k], n, accepted)
        return Parsed(acceptance=(acceptance_window(labels, UNKNOWN, hist_from_tail(n, counts)),), totals=totals)
    n = cands[len(cands) // 2]
    totals["drafts"] = float(n)
    c0 = min(n, round(rates[0] * n))
    exact = "exact" if len(cands) == 1 else f"drafts within {cands[0]}..{cands[-1]}, middle taken"
    return Parsed(
        acceptance=(acceptance_window(labels, UNKNOWN, [n - c0, c0]),), skipped="mixed_draft_lengths",
        notes=("mixed_draft_lengths",), totals=totals,
        detail=(f"Drafted {drafted} over {n} drafts is no single draft length up to {len(rates)}: rows of "
                f"several lengths (a batch-size schedule?). Stored: position 1 as a k=1 window [{n - c0}, {c0}] "
                f"({exact}); later positions mix acceptance with draft length and are not stored"),
    )


def drafts_candidates(accepted: int, drafted: int, rates: list[float], mal: float | None) -> list[int]:
    """Every number of drafts N (rows) a v1 line allows, ascending.

    N must give the printed mean ``1 + accepted / N`` (to ``%.2f``), per-position counts ``c_i`` whose rates
    ``c_i / N`` print as ``rates`` (``%.3f``) and that add up to ``accepted``, and ``drafted`` between N (every
    row drafted one token) and N * K.
    """
    k_all = len(rates)
    lo, hi = math.ceil(drafted / k_all), drafted
    if accepted == 0:  # nothing accepted: no field fixes N beyond what Drafted allows
        return [lo] if lo == hi else []
    if mal is not None:
        lo = max(lo, math.ceil(accepted / (mal - 1 + MAL_HALF_STEP) - EPS))
        if mal - 1 - MAL_HALF_STEP > 0:
            hi = min(hi, math.floor(accepted / (mal - 1 - MAL_HALF_STEP) + EPS))
    rate_sum = sum(rates)
    lo = max(lo, math.ceil(accepted / (rate_sum + k_all * RATE_HALF_STEP) - EPS))
    if rate_sum - k_all * RATE_HALF_STEP > 0:
        hi = min(hi, math.floor(accepted / (rate_sum - k_all * RATE_HALF_STEP) + EPS))
    out = []
    for n in range(lo, hi + 1):
        c_lo = [max(0, math.ceil((r - RATE_HALF_STEP) * n - EPS)) for r in rates]
        c_hi = [min(n, math.floor((r + RATE_HALF_STEP) * n + EPS)) for r in rates]
        if all(a <= b for a, b in zip(c_lo, c_hi, strict=True)) and sum(c_lo) <= accepted <= sum(c_hi):
            out.append(n)
    return out


def _single_length(cands: list[int], drafted: int, rates: list[float]) -> tuple[int, int] | None:
    """``(N, k)`` when exactly one candidate N makes every row draft one length k: ``drafted == N * k``, with no
    position past k accepting anything. A mix that averages to a whole k and never accepts past it looks the
    same; the counts cannot tell them apart."""
    top = max((i + 1 for i, r in enumerate(rates) if r > 0), default=1)
    fits = [(n, drafted // n) for n in cands if drafted % n == 0 and top <= drafted // n <= len(rates)]
    return fits[0] if len(fits) == 1 else None


def _raise_unparsed(line: str, marker: str) -> NoReturn:
    """Raise ``truncated`` when the text after ``marker`` is a cut-off rendering, else ``bad_log_line``."""
    rest = line[line.index(marker) + len(marker):].rstrip("\n")
    fields = [f.strip() for f in rest.split(",")]
    last = fields[-1] if fields else ""
    complete = fields[:-1]
    cut = not rest.rstrip().endswith("%" if marker == MARKER else ".")  # each format's last character
    if cut and all(_PARTIAL_RE.fullmatch(f) for f in complete) and _PARTIAL_RE.fullmatch(last):
        raise SourceError("truncated", f"the line ends before its last field: ...{rest[-60:]!r}")
    raise SourceError("bad_log_line", f"{marker!r} present but the fields do not match vLLM's format")


def _counts(rates: list[float], n: int, accepted: int) -> list[int]:
    """Per-position counts ``round(rate * n)``, corrected to add up to ``accepted`` within the rates' rounding."""
    raw = [r * n for r in rates]
    counts = [min(n, round(x)) for x in raw]
    slack = 0.5 * 10**-RATE_DECIMALS * n + 0.5  # what printing to 3 decimals can hide, per position
    diff = accepted - sum(counts)
    if abs(diff) > slack * len(rates):
        raise SourceError("mean_contradicts_counts", f"per-position rates x drafts add up to {sum(counts)}, not "
                                                     f"Accepted {accepted}")
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
            raise SourceError("mean_contradicts_counts", "per-position rates cannot add up to Accepted")
    return counts


# --------------------------------------------------------------------------------------------------- v0
@dataclass(frozen=True)
class V0Counts:
    """One v0 line's cumulative counters."""

    k: int
    accepted: int
    drafted: int
    emitted: int


def parse_v0(line: str) -> V0Counts | None:
    """The counters of one v0 ``Speculative metrics:`` line; None for a line without the marker.

    Raises:
        SourceError: ``truncated`` or ``bad_log_line``.
    """
    if V0_MARKER not in line:
        return None
    m = V0_RE.search(line)
    if m is None:
        _raise_unparsed(line, V0_MARKER)
    _rate, _eff, k_s, acc_s, drafted_s, emitted_s = m.groups()
    k = int(k_s)
    if k <= 0:
        raise SourceError("bad_field", f"Number of speculative tokens {k} must be > 0")
    return V0Counts(k, int(acc_s), int(drafted_s), int(emitted_s))


def v0_interval(prev: V0Counts | None, cur: V0Counts, labels: SourceLabels) -> Parsed:
    """The window (or the reason there is none) between two v0 lines of one engine (see the module doc)."""
    if prev is None:
        return Parsed(skipped="first_scrape", detail="cumulative counters: the first line is the baseline")
    pairs = [(prev.accepted, cur.accepted), (prev.drafted, cur.drafted), (prev.emitted, cur.emitted)]
    down = [b < a for a, b in pairs]
    notes: tuple[str, ...] = ()
    if all(down) or cur.k != prev.k:
        prev, notes = V0Counts(cur.k, 0, 0, 0), ("counter_reset",)  # a restart: counts start from zero again
    elif any(down):
        raise SourceError("counter_went_down", f"some counters went down, others did not ({prev} -> {cur})")
    k = cur.k
    d_acc, d_draft, d_emit = cur.accepted - prev.accepted, cur.drafted - prev.drafted, cur.emitted - prev.emitted
    if d_draft == 0:
        return Parsed(skipped="idle", detail="no drafts in the interval", notes=notes, totals={"draft_tokens": 0.0})
    if d_draft % k:
        raise SourceError("inconsistent_counts", f"draft tokens {d_draft} are not rows x k={k}")
    rows = d_draft // k
    if d_acc > d_draft:
        raise SourceError("accepted_exceeds_drafted", f"accepted {d_acc} > drafted {d_draft}")
    if not rows <= d_emit <= rows * (k + 1):
        raise SourceError("inconsistent_counts", f"emitted {d_emit} outside rows {rows} .. rows x (k + 1)")
    totals = {"drafts": float(rows), "draft_tokens": float(d_draft), "accepted": float(d_emit - rows)}
    if k == 1:
        return Parsed(acceptance=(acceptance_window(labels, UNKNOWN, [rows - d_acc, d_acc]),), notes=notes,
                      totals=totals)
    return Parsed(skipped="histogram_unknown", notes=(*notes, "totals_only"), totals=totals,
                  detail=(f"vLLM v0 totals at k={k}: {rows} rows, {d_emit - rows} accepted in prefix; which rows "
                          "accepted how many is not logged"))


class LogParser:
    """Parses a vLLM log line by line: v1 lines on their own, v0 lines against the previous v0 line of the same
    origin (their counters are cumulative)."""

    def __init__(self) -> None:
        self._prev: dict[str, V0Counts] = {}

    def parse(self, line: str, labels: SourceLabels, origin: str = "") -> Parsed | None:
        """The result of one line; None for other log output.

        Raises:
            SourceError: a malformed spec-decode line (see :func:`parse_line`, :func:`v0_interval`).
        """
        if MARKER in line:
            return parse_line(line, labels)
        cur = parse_v0(line)
        if cur is None:
            return None
        prev = self._prev.get(origin)
        self._prev[origin] = cur  # the next line's baseline, even when this one is refused
        return v0_interval(prev, cur, labels)
