"""vLLM's Prometheus ``/metrics`` text: scrape to scrape, spec-decode counters become acceptance windows and the
inter-token latency histogram with the step counter becomes cost windows.

Source: ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingProm``) and ``vllm/v1/metrics/loggers.py``
(``PrometheusStatLogger``), vLLM 0.32. Per engine (labels ``model_name`` and ``engine``, matched by name) vLLM
counts, since start-up:

- ``vllm:spec_decode_num_drafts_total``: rows that drafted (one per request per verify step);
- ``vllm:spec_decode_num_draft_tokens_total``: draft tokens proposed;
- ``vllm:spec_decode_num_accepted_tokens_total``: draft tokens accepted;
- ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: rows that accepted at least i + 1 drafts,
  for i = 0 .. num_speculative_tokens - 1;
- ``vllm:spec_decode_num_drafts_created``: prometheus_client's gauge beside each counter, the unix time the
  counter was created, i.e. when this engine instance started. A different value is a restart.

Between two scrapes the deltas give ``per_pos[i] / num_drafts = P(accepted >= i + 1)`` and the mean acceptance
length ``1 + accepted / drafts``. The histogram an acceptance window needs follows exactly when every draft of
the interval had one length k: ``draft_tokens == drafts * k`` and no row accepted past position k. With a
batch-size schedule (``num_speculative_tokens_per_batch_size``) an interval can mix draft lengths; the counters
then cannot be split by length past position 1. Every draft has a position 1, and whether it was kept does not
depend on how many tokens followed it, so such an interval stores position 1 as a k = 1 window
``[drafts - per_pos[0], per_pos[0]]`` (as the log parser does), is kept in the rejects file as partly stored
(``mixed_draft_lengths``), and gives no cost window (its steps had several largest ks). Scrape more often, or
ingest vLLM's per-request metrics, which carry a histogram per draft length.

**Cost.** ``vllm/v1/metrics/stats.py`` (``IterationStats.update_from_output``) appends one inter-token latency
per request per engine step that is not the request's prefill: ``engine_core_timestamp - last_token_ts``, the
step's duration as that request saw it (with speculation a step emits 1..k+1 tokens of the request, still one
observation); ``loggers.py`` observes each into ``vllm:inter_token_latency_seconds``
(``vllm:time_per_output_token_seconds`` before the rename). ``vllm:iteration_tokens_total`` is observed once per
engine step with outputs (one ``IterationStats`` per ``EngineCoreOutputs`` in ``v1/engine/async_llm.py``). Over
an interval at one draft length k:

- ``batch_rows`` (rows summed over rounds) = the latency histogram's count delta (equal to the drafts delta in the
  captured 0.32 scrapes: every decode row drafted);
- ``rounds`` = the ``iteration_tokens_total`` count delta (engine steps); without that histogram,
  ``batch_rows / mean batch`` with the mean batch taken as the mean of ``vllm:num_requests_running`` at the two
  ends. The step counter is preferred: the gauge is a point sample, and in the captured scrapes, where the load
  stepped between 1, 4 and 12 requests, the mean of the two ends was off by up to 3x at each step change;
- seconds per round = latency sum delta / count delta (the mean step duration, each row's view of its step);
- ``max_k`` = k, ``tokens_verified`` = rows + draft tokens (packed verify), ``emitted`` = rows + accepted.

vLLM's ``/metrics`` does not split a step into drafting and verifying, so the whole step goes to ``verify_s``
(``draft_s`` and ``other_s`` are zero), as TensorRT-LLM's rest-of-iteration does: the cost model
(``policies/_cost.py``) then fits the step as one target forward over ``B + D`` tokens with a jump at k > 0,
and :class:`controller.offline.replay.ModelCost` sums the three parts per round, so the per-round total is
right; what a draft step costs by itself cannot be told from these metrics. Per-token latency percentiles are
the latency histogram's quantiles over the interval divided by the mean tokens a row emitted per step.
An interval without drafts but with decode steps (the schedule turned speculation off) is a k = 0 cost window.

A counter that goes down means the engine restarted when the ``_created`` gauge changed too (or, without it,
when every counter went down): the new values count from zero, so they are the delta. Counters below the
previous scrape's of the same engine instance are an older scrape (``out_of_order``): no interval is formed.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from controller.offline.sources.common import (
    UNKNOWN,
    Parsed,
    SourceError,
    SourceLabels,
    acceptance_window,
    hist_from_tail,
    stable_seq,
)
from telemetry.records import MAX_DRAFT_LEN, CostWindow, Stat

PREFIX = "vllm:spec_decode_"
DRAFTS = PREFIX + "num_drafts_total"
DRAFTS_CREATED = PREFIX + "num_drafts_created"  # the counter's creation time: the engine instance's start
DRAFT_TOKENS = PREFIX + "num_draft_tokens_total"
ACCEPTED = PREFIX + "num_accepted_tokens_total"
PER_POS = PREFIX + "num_accepted_tokens_per_pos_total"
RUNNING = "vllm:num_requests_running"
STEPS = "vllm:iteration_tokens_total_count"  # one observation per engine step with outputs
LATENCY_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")  # new, old
SCRAPE_MARK = "# SCRAPE"  # a line starting a scrape in a file of several (optionally followed by unix seconds)
QUANTILES = (0.5, 0.95, 0.99)

SeriesKey = tuple[str, str]  # (model_name, engine)


@dataclass
class Histogram:
    """A Prometheus histogram's cumulative buckets ``{le: count}``, sum and count."""

    buckets: dict[float, float] = field(default_factory=dict)
    total: float = 0.0
    count: float = 0.0


@dataclass
class Series:
    """One engine's values in one scrape."""

    drafts: float | None = None
    draft_tokens: float | None = None
    accepted: float | None = None
    per_pos: dict[int, float] = field(default_factory=dict)
    running: float | None = None
    steps: float | None = None  # engine steps with outputs (``vllm:iteration_tokens_total`` count)
    created: float | None = None  # unix time the spec-decode counters were created (None: not exposed)
    latency: dict[str, Histogram] = field(default_factory=dict)  # histogram name -> its values

    def latency_histogram(self) -> Histogram | None:
        """The per-token latency histogram: the current name when present, else the pre-rename one."""
        return next((self.latency[n] for n in LATENCY_NAMES if n in self.latency), None)

    def fingerprint(self) -> tuple[Any, ...]:
        """What identifies these counter values (an interval's id is its two ends' fingerprints)."""
        return (self.created, self.drafts, self.draft_tokens, self.accepted, tuple(sorted(self.per_pos.items())))

    def to_state(self) -> dict[str, Any]:
        """JSON-safe values (what the store keeps as the next run's baseline)."""
        d = asdict(self)
        d["per_pos"] = {str(k): v for k, v in self.per_pos.items()}
        d["latency"] = {n: {"buckets": [[_le_text(le), c] for le, c in sorted(h.buckets.items())],
                            "total": h.total, "count": h.count} for n, h in self.latency.items()}
        return d

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> Series:
        """Inverse of :meth:`to_state`. Raises ``ValueError``/``KeyError``/``TypeError`` on a damaged state."""
        lat = {n: Histogram({_le_value(le): float(c) for le, c in h["buckets"]}, float(h["total"]),
                            float(h["count"])) for n, h in d.get("latency", {}).items()}
        opt = {k: (None if d.get(k) is None else float(d[k]))
               for k in ("drafts", "draft_tokens", "accepted", "running", "steps", "created")}
        return cls(per_pos={int(k): float(v) for k, v in d.get("per_pos", {}).items()}, latency=lat, **opt)


def _le_text(le: float) -> str:
    return "+Inf" if math.isinf(le) else repr(le)


def _le_value(le: str) -> float:
    return math.inf if le in ("+Inf", "Inf") else float(le)


@dataclass(frozen=True)
class Scrape:
    """One parsed exposition: every (model_name, engine) series it holds."""

    timestamp: float | None  # unix seconds: the file's mark, else the newest sample timestamp, else None
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

    Args:
        text: the exposition.
        timestamp: the scrape's time (a ``# SCRAPE`` mark, the fetch time); None takes the newest sample
            timestamp of the spec-decode series when the exposition has any (vLLM writes none).

    Raises:
        SourceError: ``bad_exposition`` when the text is not Prometheus text format.
    """
    series: dict[SeriesKey, Series] = {}
    sample_ts: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name, lab, value = s.name, s.labels, float(s.value)
                if not (name.startswith(PREFIX) or name in (RUNNING, STEPS) or name.startswith(LATENCY_NAMES)):
                    continue
                key = (lab.get("model_name", UNKNOWN), lab.get("engine", "0"))
                sr = series.setdefault(key, Series())
                if s.timestamp is not None and name.startswith(PREFIX):
                    sample_ts = max(float(s.timestamp), sample_ts or 0.0)
                if name == DRAFTS:
                    sr.drafts = value
                elif name == DRAFTS_CREATED:
                    sr.created = value
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
                elif name == STEPS:
                    sr.steps = value
                elif name.startswith(LATENCY_NAMES):
                    _latency(sr, name, lab, value)
                # else: the other ``*_created`` gauges prometheus_client writes beside each counter
    except SourceError:
        raise
    except (ValueError, TypeError, IndexError, KeyError) as e:  # what the text parser raises on bad input
        raise SourceError("bad_exposition", f"not Prometheus text format: {e}") from e
    return Scrape(timestamp if timestamp is not None else sample_ts, series)


def _latency(sr: Series, name: str, lab: dict[str, str], value: float) -> None:
    base = next((n for n in LATENCY_NAMES if name.startswith(n)), None)
    if base is None:
        return
    h = sr.latency.setdefault(base, Histogram())
    suffix = name[len(base):]
    if suffix == "_bucket":
        h.buckets[_le_value(lab.get("le", "+Inf"))] = value
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
    """The acceptance and cost windows (or the reason there are none) of the interval between two scrapes.

    Args:
        prev: the engine's previous scrape (None: the first scrape, which has no interval).
        cur: its current scrape.
        labels: the labels of the engine's windows.

    Raises:
        SourceError: ``counter_went_down`` (some counters went down, others not, with no restart to explain it),
            or the per-position counters are not a tail of the drafts.
    """
    if cur.drafts is None or cur.accepted is None:
        return Parsed(skipped="no_spec_decode_counters",
                      detail="no vllm:spec_decode_* counters for this engine (speculative decoding off?)")
    if prev is None or prev.drafts is None or prev.accepted is None:
        return Parsed(skipped="first_scrape", detail="counters are cumulative: the first scrape is the baseline")
    notes: tuple[str, ...] = ()
    base = prev
    if restarted(prev, cur):
        base, notes = Series(), ("counter_reset",)  # the engine restarted: its counters count from zero again
    elif _went_down(prev, cur):
        if prev.created is not None and prev.created == cur.created:
            return Parsed(skipped="out_of_order", detail=(
                "counters below the previous scrape's of the same engine instance (same _created time): an older "
                "scrape, no interval formed"))
        raise SourceError("counter_went_down", "some counters went down and others did not, and no _created "
                                               "gauge tells of a restart: a truncated or edited value?")
    n = _delta(cur.drafts, base.drafts)
    acc = _delta(cur.accepted, base.accepted)
    tokens = _delta(cur.draft_tokens, base.draft_tokens) if cur.draft_tokens is not None else None
    per_pos = [_delta(cur.per_pos.get(i), base.per_pos.get(i)) for i in range(len(cur.per_pos))]
    totals = {"drafts": float(n), "accepted": float(acc)}
    if tokens is not None:
        totals["draft_tokens"] = float(tokens)
    obs = _observation(base if base is prev else None, cur)
    if n == 0:
        idle_cost = _cost_window(base, cur, labels, 0, 0, 0, 0)
        if idle_cost is not None:  # decode steps without drafts: speculation was off (k = 0)
            return Parsed(cost=(idle_cost,), notes=notes, totals=totals, observation=obs)
        return Parsed(skipped="idle", detail="no drafts in the interval", notes=notes, totals=totals,
                      observation=obs)
    if sorted(cur.per_pos) != list(range(len(cur.per_pos))) or not per_pos:
        raise SourceError("bad_exposition", f"{PER_POS} positions {sorted(cur.per_pos)} are not 0..K-1")
    k = _single_draft_length(n, tokens, acc, per_pos)
    if k is None:
        mal = 1 + acc / n
        first = (acceptance_window(labels, UNKNOWN, [n - per_pos[0], per_pos[0]]),) if per_pos[0] <= n else ()
        return Parsed(
            acceptance=first, skipped="mixed_draft_lengths", notes=(*notes, "mixed_draft_lengths"), totals=totals,
            observation=obs,
            detail=(f"drafts of several lengths in one interval (a batch-size schedule?): drafts={n}, "
                    f"draft_tokens={tokens}, accepted={acc}, mean acceptance length {mal:.3f}; stored: position 1 "
                    "as a k=1 window; later positions cannot be split by length, nor steps by their largest k. "
                    "Scrape more often or ingest per-request metrics."),
        )
    hist = hist_from_tail(n, per_pos[:k])
    cost = _cost_window(base, cur, labels, k, n, n * k, acc)
    return Parsed(acceptance=(acceptance_window(labels, UNKNOWN, hist),), cost=() if cost is None else (cost,),
                  notes=notes, totals=totals, observation=obs)


def _cost_window(base: Series, cur: Series, labels: SourceLabels, k: int, drafts: int, draft_tokens: int,
                 accepted: int) -> CostWindow | None:
    """The cost window of an interval at draft length ``k`` (see the module docstring); None when the scrapes
    lack the latency histogram or a batch size."""
    h, p = cur.latency_histogram(), base.latency_histogram() or Histogram()
    if h is None:
        return None
    rows = max(round(h.count - p.count), drafts)  # row-steps: one latency observation per decode row per step
    seconds = h.total - p.total
    if rows <= 0 or seconds <= 0:
        return None
    steps = None if cur.steps is None else cur.steps - (base.steps or 0.0)
    if steps is not None and steps >= 1:
        rounds = min(round(steps), rows)  # a round holds at least one row
    else:
        running = [s.running for s in (base, cur) if s.running is not None and s is not None]
        mean_batch = sum(running) / len(running) if running else 0.0
        if mean_batch <= 0:
            return None
        rounds = max(1, round(rows / mean_batch))
    per_round = seconds / rows  # the mean step duration, as each row saw its step
    emitted = rows + accepted
    buckets = {le: c - p.buckets.get(le, 0.0) for le, c in (h.buckets.items())}
    per_token = {q: (histogram_quantile(q, buckets) or per_round) / (emitted / rows) for q in QUANTILES}
    step = Stat(count=rounds, total=per_round * rounds, sumsq=per_round * per_round * rounds, max=per_round)
    return CostWindow(
        target_version=labels.target_version, draft_version=labels.draft_version,
        batch_bucket=labels.buckets.batch_bucket(max(1, round(rows / rounds))), context_bucket=UNKNOWN, max_k=k,
        rounds=rounds, tokens_verified=rows + draft_tokens, emitted=emitted, batch_rows=rows,
        draft_s=Stat(count=rounds), verify_s=step, other_s=Stat(count=rounds),  # vLLM does not split a step
        latency_p50=per_token[0.5], latency_p95=per_token[0.95], latency_p99=per_token[0.99],
    )


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


def _pairs(prev: Series, cur: Series) -> list[tuple[float | None, float | None]]:
    pairs = [(prev.drafts, cur.drafts), (prev.accepted, cur.accepted), (prev.draft_tokens, cur.draft_tokens)]
    return pairs + [(v, cur.per_pos.get(i)) for i, v in prev.per_pos.items()]


def _went_down(prev: Series, cur: Series) -> bool:
    return any(a is not None and b is not None and b < a for a, b in _pairs(prev, cur))


def restarted(prev: Series, cur: Series) -> bool:
    """The engine restarted between the two scrapes: its counters' ``_created`` time changed, or (when vLLM does
    not expose it) every counter that moved went down."""
    if prev.created is not None and cur.created is not None:
        return prev.created != cur.created
    moved = [(a, b) for a, b in _pairs(prev, cur) if a is not None and b is not None and a != b]
    return bool(moved) and all(b < a for a, b in moved)


def is_after(cur: Series, cur_ts: float, cur_own: bool, prev: Series, prev_ts: float, prev_own: bool) -> bool:
    """Whether scrape ``cur`` was taken after ``prev`` (so they bound an interval).

    Their own times decide when both have one; else a restart between them (a later ``_created``); else the
    counters: not lower anywhere and higher somewhere.
    """
    if cur_own and prev_own:
        return cur_ts > prev_ts
    if prev.created is not None and cur.created is not None and prev.created != cur.created:
        return cur.created > prev.created
    return not _went_down(prev, cur) and cur.fingerprint() != prev.fingerprint()


def _delta(cur: float | None, prev: float | None) -> int:
    c = 0.0 if cur is None else cur
    p = 0.0 if prev is None else prev
    d = c - p
    if d < 0 or not float(d).is_integer():
        raise SourceError("bad_counter", f"counter delta {d} is not a whole number >= 0")
    return int(d)


def _observation(prev: Series | None, cur: Series) -> dict[str, float | None]:
    """Batch size and per-token latency of the interval, as read (reported in the summary)."""
    h, p = cur.latency_histogram() or Histogram(), (prev.latency_histogram() if prev else None) or Histogram()
    buckets = {le: c - p.buckets.get(le, 0.0) for le, c in h.buckets.items()}
    count, total = h.count - p.count, h.total - p.total
    running = [s.running for s in (prev, cur) if s is not None and s.running is not None]
    out: dict[str, float | None] = {"batch_size": sum(running) / len(running) if running else None,
                                    "latency_mean_s": total / count if count > 0 else None}
    for q in QUANTILES:
        out[f"latency_p{round(q * 100)}_s"] = histogram_quantile(q, buckets)
    return out


@dataclass
class Baseline:
    """The last scrape of one engine series: the start of its next interval.

    ``own_time`` says whether ``timestamp`` is the scrape's own time (a mark, a sample timestamp, the fetch time)
    or the time it was ingested (a file without marks).
    """

    series: Series
    timestamp: float
    own_time: bool
    stored: bool = False  # loaded from the store (a previous run), not read in this run


@dataclass(frozen=True)
class IntervalResult:
    """One engine series' result for one scrape."""

    key: SeriesKey
    start: float
    end: float
    parsed: Parsed
    interval_id: int  # derived from the source and both ends' counters: the same interval gets the same id

    def _parts(self) -> tuple[SeriesKey, float, float, Parsed]:
        return (self.key, self.start, self.end, self.parsed)

    def __iter__(self) -> Any:  # reads as the tuple (key, start, end, parsed)
        return iter(self._parts())

    def __getitem__(self, i: int) -> Any:
        return self._parts()[i]


class PromFollower:
    """Turns a sequence of scrapes into per-interval results, one engine series at a time.

    Args:
        labels: labels of the windows; the target version is each series' ``model_name`` unless
            ``version`` is given.
        version: ``--version``: the target version for every series.
        model_name: only series with this ``model_name`` label (None: all).
        baselines: each series' last scrape from a previous run (the store's), the start of its first interval.
    """

    def __init__(self, labels: SourceLabels, version: str | None = None, model_name: str | None = None,
                 baselines: dict[SeriesKey, Baseline] | None = None) -> None:
        self._labels = labels
        self._version = version
        self._model = model_name
        self.last: dict[SeriesKey, Baseline] = dict(baselines or {})  # each series' newest scrape so far

    def feed(self, scrape: Scrape, fallback_time: float | None = None) -> list[IntervalResult]:
        """Results for every series in ``scrape`` (see :class:`IntervalResult`).

        Args:
            scrape: the parsed scrape.
            fallback_time: its time when it has none of its own (default: now).
        """
        own = scrape.timestamp is not None
        now = scrape.timestamp if scrape.timestamp is not None else (
            fallback_time if fallback_time is not None else time.time())
        out = []
        for key, cur in sorted(scrape.series.items()):
            if self._model is not None and key[0] != self._model:
                continue
            labels = self._labels.with_target(self._version or key[0])
            last = self.last.get(key)
            prev = last.series if last is not None else None
            if last is not None and last.stored and not is_after(cur, now, own, last.series, last.timestamp,
                                                                 last.own_time):
                parsed = Parsed(skipped="before_baseline", detail=(
                    "not after the last scrape stored by a previous run (re-ingested?): it starts this run's "
                    "intervals instead"))
                prev = None
            else:
                parsed = interval(prev, cur, labels)
            start = last.timestamp if last is not None and prev is not None else now
            iid = stable_seq("vllm-prom", key, None if prev is None else prev.fingerprint(), cur.fingerprint())
            out.append(IntervalResult(key, min(start, now), now, parsed, iid))
            if parsed.skipped != "out_of_order":
                self.last[key] = Baseline(cur, now, own)
        return out
