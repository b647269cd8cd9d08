"""vLLM's Prometheus ``/metrics`` text: spec-decode counters become acceptance windows, scrape to scrape.

Source: ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingProm``). Per engine (labels ``model_name`` and
``engine``, matched by name) vLLM counts, since start-up:

- ``vllm:spec_decode_num_drafts_total``: rows that drafted (one per request per verify step);
- ``vllm:spec_decode_num_draft_tokens_total``: draft tokens proposed;
- ``vllm:spec_decode_num_accepted_tokens_total``: draft tokens accepted;
- ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: rows that accepted at least i + 1 drafts,
  for i = 0 .. num_speculative_tokens - 1.

Between two scrapes the deltas give ``per_pos[i] / num_drafts = P(accepted >= i + 1)`` and the mean acceptance
length ``1 + accepted / drafts``. The histogram an acceptance window needs follows exactly when every draft of
the interval had one length k: ``draft_tokens == drafts * k`` and no row accepted past position k. With a
batch-size schedule (``num_speculative_tokens_per_batch_size``) an interval can mix draft lengths; the counters
then cannot be split by length, so the interval is skipped as ``mixed_draft_lengths`` (its totals are kept in the
summary). Scrape more often, or ingest vLLM's per-request metrics, which carry a histogram per draft length.

A counter that goes down means the engine restarted: the new values count from zero, so they are the delta.

Also read, for the summary (vLLM's ``/metrics`` has no per-round cost, so no cost window is made from them):
``vllm:num_requests_running`` (the batch size) and the per-token latency histogram
``vllm:inter_token_latency_seconds`` (``vllm:time_per_output_token_seconds`` before it was renamed).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from controller.offline.sources.common import (
    UNKNOWN,
    Parsed,
    SourceError,
    SourceLabels,
    acceptance_window,
    hist_from_tail,
)
from telemetry.records import MAX_DRAFT_LEN

PREFIX = "vllm:spec_decode_"
DRAFTS = PREFIX + "num_drafts_total"
DRAFT_TOKENS = PREFIX + "num_draft_tokens_total"
ACCEPTED = PREFIX + "num_accepted_tokens_total"
PER_POS = PREFIX + "num_accepted_tokens_per_pos_total"
RUNNING = "vllm:num_requests_running"
LATENCY_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")  # new, old
SCRAPE_MARK = "# SCRAPE"  # a line starting a scrape in a file of several (optionally followed by unix seconds)
QUANTILES = (0.5, 0.95, 0.99)

SeriesKey = tuple[str, str]  # (model_name, engine)


@dataclass
class Series:
    """One engine's values in one scrape."""

    drafts: float | None = None
    draft_tokens: float | None = None
    accepted: float | None = None
    per_pos: dict[int, float] = field(default_factory=dict)
    running: float | None = None
    latency: dict[str, Histogram] = field(default_factory=dict)  # histogram name -> its values

    def latency_histogram(self) -> Histogram | None:
        """The per-token latency histogram: the current name when present, else the pre-rename one."""
        return next((self.latency[n] for n in LATENCY_NAMES if n in self.latency), None)


@dataclass
class Histogram:
    """A Prometheus histogram's cumulative buckets ``{le: count}``, sum and count."""

    buckets: dict[float, float] = field(default_factory=dict)
    total: float = 0.0
    count: float = 0.0


@dataclass(frozen=True)
class Scrape:
    """One parsed exposition: every (model_name, engine) series it holds."""

    timestamp: float | None  # unix seconds, when the file recorded it
    series: dict[SeriesKey, Series]


def split_scrapes(text: str) -> list[tuple[int, float | None, str]]:
    """Split a file of several scrapes at lines ``# SCRAPE [unix seconds]``; a file without them is one scrape.

    Returns:
        ``(line number of the scrape's first line, timestamp or None, text)`` per scrape.
    """
    lines = text.splitlines()
    out: list[tuple[int, float | None, list[str]]] = []
    for i, line in enumerate(lines, 1):
        if line.startswith(SCRAPE_MARK):
            if len(out) == 1 and out[0][1] is None and all(not x.strip() or x.startswith("#") for x in out[0][2]):
                out.clear()  # a preamble of comments before the first mark is no scrape
            rest = line[len(SCRAPE_MARK):].strip()
            try:
                ts: float | None = float(rest) if rest else None
            except ValueError:
                ts = None
            out.append((i + 1, ts, []))
        elif out:
            out[-1][2].append(line)
        elif line.strip():
            out.append((i, None, [line]))
    return [(n, ts, "\n".join(body) + "\n") for n, ts, body in out]


def parse_scrape(text: str, timestamp: float | None = None) -> Scrape:
    """Parse one exposition with prometheus_client's text parser.

    Raises:
        SourceError: ``bad_exposition`` when the text is not Prometheus text format.
    """
    series: dict[SeriesKey, Series] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name, lab, value = s.name, s.labels, float(s.value)
                if not (name.startswith(PREFIX) or name == RUNNING or name.startswith(LATENCY_NAMES)):
                    continue
                key = (lab.get("model_name", UNKNOWN), lab.get("engine", "0"))
                sr = series.setdefault(key, Series())
                if name == DRAFTS:
                    sr.drafts = value
                elif name == DRAFT_TOKENS:
                    sr.draft_tokens = value
                elif name == ACCEPTED:
                    sr.accepted = value
                elif name == PER_POS:
                    try:
                        pos = int(lab["position"])
                    except (KeyError, ValueError):
                        raise SourceError("bad_exposition", f"{PER_POS} without an integer position label") from None
                    sr.per_pos[pos] = value
                elif name == RUNNING:
                    sr.running = value
                elif name.startswith(LATENCY_NAMES):
                    _latency(sr, name, lab, value)
                # else: prometheus_client's ``*_created`` gauge beside each counter (the counter's start time)
    except SourceError:
        raise
    except (ValueError, TypeError, IndexError, KeyError) as e:  # what the text parser raises on bad input
        raise SourceError("bad_exposition", f"not Prometheus text format: {e}") from e
    return Scrape(timestamp, series)


def _latency(sr: Series, name: str, lab: dict[str, str], value: float) -> None:
    base = next(n for n in LATENCY_NAMES if name.startswith(n))
    h = sr.latency.setdefault(base, Histogram())
    suffix = name[len(base):]
    if suffix == "_bucket":
        le = lab.get("le", "+Inf")
        h.buckets[math.inf if le in ("+Inf", "Inf") else float(le)] = value
    elif suffix == "_sum":
        h.total = value
    elif suffix == "_count":
        h.count = value


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile`` (linear within a bucket) over cumulative counts ``{le: count}``."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return None
    rank = q * buckets[edges[-1]]
    lo_edge, lo_count = 0.0, 0.0
    for e in edges:
        c = buckets[e]
        if c >= rank:
            if math.isinf(e):
                return lo_edge  # the open bucket: its lower edge, as Prometheus does
            return lo_edge + (e - lo_edge) * ((rank - lo_count) / (c - lo_count) if c > lo_count else 0.0)
        lo_edge, lo_count = e, c
    return lo_edge


def interval(prev: Series | None, cur: Series, labels: SourceLabels) -> Parsed:
    """The acceptance window (or the reason there is none) of the interval between two scrapes of one engine.

    Args:
        prev: the engine's previous scrape (None: the first scrape, which has no interval).
        cur: its current scrape.
        labels: the labels of the engine's windows.
    """
    if cur.drafts is None or cur.accepted is None:
        return Parsed(skipped="no_spec_decode_counters",
                      detail="no vllm:spec_decode_* counters for this engine (speculative decoding off?)")
    if prev is None or prev.drafts is None or prev.accepted is None:
        return Parsed(skipped="first_scrape", detail="counters are cumulative: the first scrape is the baseline")
    notes: tuple[str, ...] = ()
    base = prev
    if _went_down(prev, cur):
        base, notes = Series(), ("counter_reset",)  # the engine restarted: its counters count from zero again
    n = _delta(cur.drafts, base.drafts)
    acc = _delta(cur.accepted, base.accepted)
    tokens = _delta(cur.draft_tokens, base.draft_tokens) if cur.draft_tokens is not None else None
    per_pos = [_delta(cur.per_pos.get(i), base.per_pos.get(i)) for i in range(len(cur.per_pos))]
    totals = {"drafts": float(n), "accepted": float(acc)}
    if tokens is not None:
        totals["draft_tokens"] = float(tokens)
    obs = _observation(prev if base is prev else None, cur)
    if n == 0:
        return Parsed(skipped="idle", detail="no drafts in the interval", notes=notes, totals=totals,
                      observation=obs)
    if sorted(cur.per_pos) != list(range(len(cur.per_pos))) or not per_pos:
        raise SourceError("bad_exposition", f"{PER_POS} positions {sorted(cur.per_pos)} are not 0..K-1")
    k = _single_draft_length(n, tokens, acc, per_pos)
    if k is None:
        mal = 1 + acc / n
        return Parsed(
            skipped="mixed_draft_lengths", notes=(*notes, "mixed_draft_lengths"), totals=totals, observation=obs,
            detail=(f"drafts of several lengths in one interval (a batch-size schedule?): drafts={n}, "
                    f"draft_tokens={tokens}, accepted={acc}, mean acceptance length {mal:.3f}; per-position "
                    "counters cannot be split by length. Scrape more often or ingest per-request metrics."),
        )
    hist = hist_from_tail(n, per_pos[:k])
    return Parsed(acceptance=(acceptance_window(labels, UNKNOWN, hist),), notes=notes, totals=totals,
                  observation=obs)


def _single_draft_length(n: int, tokens: int | None, acc: int, per_pos: list[int]) -> int | None:
    """k when every draft of the interval had length k, as far as the counters can tell; None when mixed.

    The draft-token counter decides: ``tokens == n * k``. Without it (older vLLM) only k = num_speculative_tokens
    (every position counted) can be assumed, and only when the per-position counts add up to ``acc``.
    """
    if tokens is None:
        k = len(per_pos)
    elif tokens % n:
        return None
    else:
        k = tokens // n
    if not 0 < k <= min(len(per_pos), MAX_DRAFT_LEN):
        return None
    if any(per_pos[k:]) or sum(per_pos[:k]) != acc:
        return None  # a row accepted past k, or the positions do not add up: drafts of other lengths
    return k


def _went_down(prev: Series, cur: Series) -> bool:
    pairs = [(prev.drafts, cur.drafts), (prev.accepted, cur.accepted), (prev.draft_tokens, cur.draft_tokens)]
    pairs += [(v, cur.per_pos.get(i)) for i, v in prev.per_pos.items()]
    return any(a is not None and b is not None and b < a for a, b in pairs)


def _delta(cur: float | None, prev: float | None) -> int:
    c = 0.0 if cur is None else cur
    p = 0.0 if prev is None else prev
    d = c - p
    if d < 0 or not float(d).is_integer():
        raise SourceError("bad_counter", f"counter delta {d} is not a whole number >= 0")
    return int(d)


def _observation(prev: Series | None, cur: Series) -> dict[str, float | None]:
    """Batch size and per-token latency of the interval (reported, not stored)."""
    h, p = cur.latency_histogram() or Histogram(), (prev.latency_histogram() if prev else None) or Histogram()
    buckets = {le: c - p.buckets.get(le, 0.0) for le, c in h.buckets.items()}
    count, total = h.count - p.count, h.total - p.total
    running = [s.running for s in (prev, cur) if s is not None and s.running is not None]
    out: dict[str, float | None] = {"batch_size": sum(running) / len(running) if running else None,
                                    "latency_mean_s": total / count if count > 0 else None}
    for q in QUANTILES:
        out[f"latency_p{round(q * 100)}_s"] = histogram_quantile(q, buckets)
    return out


class PromFollower:
    """Turns a sequence of scrapes into per-interval results, one engine series at a time.

    Args:
        labels: labels of the windows; the target version is each series' ``model_name`` unless
            ``version`` is given.
        version: ``--version``: the target version for every series.
        model_name: only series with this ``model_name`` label (None: all).
    """

    def __init__(self, labels: SourceLabels, version: str | None = None, model_name: str | None = None) -> None:
        self._labels = labels
        self._version = version
        self._model = model_name
        self._prev: dict[SeriesKey, Series] = {}
        self._prev_ts: dict[SeriesKey, float] = {}

    def feed(self, scrape: Scrape) -> list[tuple[SeriesKey, float, float, Parsed]]:
        """Results for every series in ``scrape``: ``(series, interval start, interval end, parsed)``."""
        now = scrape.timestamp if scrape.timestamp is not None else time.time()
        out = []
        for key, cur in sorted(scrape.series.items()):
            if self._model is not None and key[0] != self._model:
                continue
            labels = self._labels.with_target(self._version or key[0])
            parsed = interval(self._prev.get(key), cur, labels)
            out.append((key, self._prev_ts.get(key, now), now, parsed))
            self._prev[key], self._prev_ts[key] = cur, now
        return out
