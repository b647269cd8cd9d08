"""``spectune ingest``: run a source's parser over files, stdin or a ``/metrics`` URL and store the windows.

Nothing is lost: a malformed record is rejected with its line number and reason, a valid record that yields no
window (totals without a histogram) is skipped with its reason, one that yields only part of what it holds (mixed
draft lengths) is partly stored with its reason, and all are counted in the summary and written, with the raw
text, to the rejects file (JSON lines). Every other record is still ingested. The rejects file is opened at the
first record written to it: a run without rejects creates nothing, and nothing is ever removed or replaced.

Each record becomes one :class:`~telemetry.records.WindowBatch` whose ``(engine_id, seq)`` is derived from the
record itself (its origin, line number and text, or its scrape interval), so ingesting the same file twice
stores it once.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from controller.offline.sources import sglang, timing, trtllm, vllm_log, vllm_prom, vllm_request
from controller.offline.sources.common import REASONS, UNKNOWN, Parsed, SourceError, SourceLabels, stable_seq
from telemetry.errors import SpectuneError, StoreError
from telemetry.records import MAX_NAME_LEN, WindowBatch
from telemetry.store import ScrapeBaseline, Store
from telemetry.wire import check_label

LINE_SOURCES = ("vllm-log", "vllm-request", "sglang", "trtllm")  # one record per line
SCRAPE_SOURCES = ("vllm-prom", "sglang-prom")  # Prometheus text, one scrape at a time
SOURCES = SCRAPE_SOURCES[:1] + LINE_SOURCES + SCRAPE_SOURCES[1:]
FLUSH_EVERY = 500  # window batches per store transaction
MAX_RAW_KEPT = 4000  # characters of a rejected record kept in the rejects file
MIXED_WARNING = ("per-position counters mix draft lengths (a batch-size schedule such as vLLM's "
                 "num_speculative_tokens_per_batch_size?): only what they determine is stored (log lines: position "
                 "1 as a k=1 window); scrape more often or ingest per-request metrics for the full curve")
TOTALS_WARNING = ("totals without a histogram (vLLM v0 `Speculative metrics:` lines at k > 1, TensorRT-LLM "
                  "iterations of several drafting requests): counted in the mean, no acceptance window stored")
MODEL_FREE_SOURCES = ("vllm-log", "trtllm")  # their records name no model: --model or --version is required
QUIET_SKIPS = ("first_scrape", "idle")  # no window and nothing worth keeping: a baseline, or nothing drafted


class IngestError(SpectuneError):
    """A source cannot be ingested at all (unknown source, no model name, unreadable file)."""


@dataclass(frozen=True)
class IngestConfig:
    """One ``spectune ingest`` run.

    Raises:
        ValueError: an unknown source or a label that breaks the bucket-key rules.
    """

    source: str  # one of SOURCES
    version: str | None = None  # --version: the target version of every window (else the engine's model name)
    model: str | None = None  # the model name for records that carry none (log lines, TensorRT-LLM stats)
    draft_version: str = UNKNOWN  # no engine names its draft model in its telemetry
    request_type: str = UNKNOWN  # when the whole source is known to be one request type
    engine_id: str | None = None  # the store's engine id (default: derived from the source)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown source {self.source!r}; choose one of: {', '.join(SOURCES)}")
        for v, what in ((self.version, "--version"), (self.model, "--model")):
            if v is not None:
                check_label(v, what)
        check_label(self.draft_version, "--draft-version")
        check_label(self.request_type, "--request-type")
        if self.engine_id is not None and not 0 < len(self.engine_id) <= MAX_NAME_LEN:
            raise ValueError(f"--engine-id must be 1..{MAX_NAME_LEN} characters")

    def labels(self, model: str | None = None) -> SourceLabels:
        """The labels of a record whose own model name is ``model`` (None: it names none)."""
        target = self.version or model or self.model
        if target is None:
            raise SourceError("no_model_name", "the record names no model; pass --model NAME or --version V")
        return SourceLabels(target_version=target, draft_version=self.draft_version, request_type=self.request_type)


@dataclass(frozen=True)
class Reject:
    """A record that yielded no window: where it was, why, and its text."""

    origin: str
    line: int
    kind: str  # "malformed" (rejected), "skipped" (valid, no window) or "partial" (valid, part of it stored)
    reason: str
    detail: str
    raw: str


@dataclass
class IngestSummary:
    """What one run did (counts, for the command's output and the tests)."""

    records: int = 0
    acceptance_windows: int = 0
    cost_windows: int = 0
    batches_new: int = 0
    batches_duplicate: int = 0
    malformed: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    partial: Counter[str] = field(default_factory=Counter)  # stored in part (e.g. a mixed line's position 1)
    notes: Counter[str] = field(default_factory=Counter)
    totals: Counter[str] = field(default_factory=Counter)  # drafts / draft_tokens / accepted over every record
    # drafts and accepted of the records that determine both: the mean acceptance length is taken over these only
    mean_totals: Counter[str] = field(default_factory=Counter)
    stored_totals: Counter[str] = field(default_factory=Counter)  # rows / accepted of the acceptance windows
    observations: list[dict[str, Any]] = field(default_factory=list)  # reported, not stored (gauges, latency)
    store_failures: int = 0
    last_error: str | None = None
    untimed_scrapes: int = 0  # scrapes without a time of their own (no mark, no sample timestamp, not fetched)
    untimed_windows: int = 0  # window batches stamped with the ingest time: their record carried no time
    restarts: list[dict[str, Any]] = field(default_factory=list)  # engine restarts seen between two scrapes

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k in ("malformed", "skipped", "partial", "notes", "totals", "mean_totals", "stored_totals"):
            d[k] = dict(d[k])
        return d


class Writable(Protocol):
    """Where rejects go: an open text file or a :class:`RejectsFile`."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class RejectsFile:
    """The rejects file, opened for appending at the first write: a run without rejects creates nothing.

    Whatever ``path`` is (a FIFO, ``/dev/null``, a link, an operator's own file), it is only ever opened for
    appending, never truncated, removed or replaced.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.written = 0  # records written this run
        self._f: IO[str] | None = None

    def write(self, text: str, /) -> int:
        if self._f is None:
            try:
                self._f = self.path.open("a", encoding="utf-8")
            except OSError as e:
                raise IngestError(f"cannot write the rejects file {self.path}: {e}; pass --rejects PATH") from e
        self.written += 1
        return self._f.write(text)

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class Ingestor:
    """Parses records of one source and stores their windows.

    Args:
        config: the run's configuration.
        store: where the windows go (None: parse and count only, ``--dry-run``).
        rejects: where rejected and skipped records are written as JSON lines (None: kept in memory only).
    """

    def __init__(self, config: IngestConfig, store: Store | None, rejects: Writable | None = None) -> None:
        self.config = config
        self._store = store
        self._rejects_out = rejects
        self._pending: list[WindowBatch] = []
        self._prom: vllm_prom.PromFollower | None = None
        self._baselines: dict[vllm_prom.SeriesKey, vllm_prom.Baseline] = {}  # as stored before this run
        self._saved: dict[vllm_prom.SeriesKey, vllm_prom.Baseline] = {}  # what this run stored as baselines
        self._last_time: dict[str, float] = {}  # origin -> time of its last timed line record
        self._log = vllm_log.LogParser()  # v0 log lines are cumulative: each is read against the previous one
        self.rejects: list[Reject] = []
        self.summary = IngestSummary()

    # ------------------------------------------------------------------------------------------- records
    def line(self, text: str, line_no: int, origin: str) -> None:
        """Parse and queue one line of a line source."""
        src = self.config.source
        try:
            try:
                named = _model_of(text) if src in ("vllm-request", "sglang") else None
                labels, unnamed = self.config.labels(named), None
            except SourceError as e:  # parse anyway: a malformed line is reported as malformed first
                labels, unnamed = self.config.labels(UNKNOWN), e
            if src == "vllm-log":
                res: Parsed | list[Parsed] | None = self._log.parse(text, labels, origin)
            elif src == "vllm-request":
                res = vllm_request.parse_line(text, labels)
            elif src == "sglang":
                res = sglang.parse_line(text, labels)
            else:
                res = trtllm.parse_line(text, labels)
        except (SourceError, ValueError) as e:
            self._reject(origin, line_no, "malformed", getattr(e, "reason", "bad_label"), str(e), text)
            return
        if res is None:
            return
        if unnamed is not None:
            self._reject(origin, line_no, "malformed", unnamed.reason, str(unnamed), text)
            return
        times = timing.record_times(src, text)
        for i, p in enumerate(res if isinstance(res, list) else [res]):
            eid = self.config.engine_id or f"{src}:{labels.target_version}"[:MAX_NAME_LEN]
            self._record(p, eid, stable_seq(src, origin, line_no, i, text), origin, line_no, text,
                         self._span(origin, times[i] if i < len(times) else None))

    def _span(self, origin: str, t: float | None) -> tuple[float, float] | None:
        """A line record's window: from the previous timed record of the same file (a vLLM log line covers the
        logging interval since the previous one) or its own time, to its own time; None when it has no time."""
        if t is None:
            return None
        prev = self._last_time.get(origin)
        self._last_time[origin] = t
        start = prev if self.config.source == "vllm-log" and prev is not None and prev <= t else t
        return (start, t)

    def scrape(self, text: str, line_no: int, origin: str, timestamp: float | None = None) -> None:
        """Parse and queue one Prometheus scrape (``vllm-prom``: one interval per engine; ``sglang-prom``: gauges)."""
        try:
            if self.config.source == "sglang-prom":
                for row in sglang.parse_gauges(text):
                    self.summary.records += 1
                    self.summary.observations.append({"origin": origin, "line": line_no, "timestamp": timestamp,
                                                      **row})
                    self.summary.skipped["gauges_only"] += 1
                return
            scrape = vllm_prom.parse_scrape(text, timestamp)
        except SourceError as e:
            self._reject(origin, line_no, "malformed", e.reason, str(e), text)
            return
        if scrape.timestamp is None:
            self.summary.untimed_scrapes += 1  # stamped with the ingest time: see summary_lines
        if self._prom is None:
            self._baselines = self._load_baselines()
            self._prom = vllm_prom.PromFollower(
                SourceLabels(self.config.version or self.config.model or UNKNOWN, self.config.draft_version,
                             self.config.request_type),
                version=self.config.version, model_name=None,
                baselines={k: vllm_prom.Baseline(b.series, b.timestamp, b.own_time, stored=True)
                           for k, b in self._baselines.items()})
        try:
            results = self._prom.feed(scrape, fallback_time=time.time())
        except (SourceError, ValueError) as e:
            self._reject(origin, line_no, "malformed", getattr(e, "reason", "bad_label"), str(e), text)
            return
        for res in results:
            model, engine = res.key
            if res.parsed.notes and "counter_reset" in res.parsed.notes:
                self.summary.restarts.append({"series": f"{model}|{engine}", "between": [res.start, res.end]})
            # the interval's id comes from its two ends' counters: re-ingesting it, or the same scrapes in
            # other files, stores it once
            self._record(res.parsed, self._engine_id(engine), res.interval_id, origin, line_no,
                         f"[model_name={model} engine={engine}]", (res.start, res.end))

    def _engine_id(self, engine: str) -> str:
        """The store's engine id of a vLLM engine series (``--engine-id`` for every series when given)."""
        return self.config.engine_id or f"vllm:{engine}"[:MAX_NAME_LEN]

    def _load_baselines(self) -> dict[vllm_prom.SeriesKey, vllm_prom.Baseline]:
        """Each series' last scrape stored by a previous run (none with ``--dry-run`` or a store failure)."""
        if self._store is None:
            return {}
        try:
            stored = self._store.scrape_baselines(self.config.source)
        except StoreError as e:
            self.summary.store_failures += 1
            self.summary.last_error = f"store (reading the last scrapes of earlier runs): {e}"
            return {}
        out = {}
        for b in stored:
            model, _, engine = b.series.rpartition("|")
            if b.engine_id != self._engine_id(engine):
                continue
            try:
                out[(model, engine)] = vllm_prom.Baseline(vllm_prom.Series.from_state(b.state), b.scraped_at,
                                                          b.own_time, stored=True)
            except (ValueError, KeyError, TypeError) as e:  # a damaged row: this run starts a new baseline
                self._reject("store", 0, "malformed", "bad_baseline", f"stored scrape of {b.series}: {e}", "")
        return out

    def _save_baselines(self) -> None:
        """Store each series' newest scrape of this run as the next run's baseline (once its windows are stored),
        unless it is not after the one already stored (a re-ingested older file)."""
        if self._store is None or self._prom is None:
            return
        todo = []
        for key, last in self._prom.last.items():
            old = self._baselines.get(key)
            if last.stored or self._saved.get(key) is last:
                continue
            if old is not None and not vllm_prom.is_after(last.series, last.timestamp, last.own_time, old.series,
                                                          old.timestamp, old.own_time):
                continue
            todo.append((key, last))
        if not todo:
            return
        try:
            self._store.save_scrape_baselines([
                ScrapeBaseline(self.config.source, self._engine_id(k[1]), f"{k[0]}|{k[1]}", b.timestamp, b.own_time,
                               b.series.to_state()) for k, b in todo])
        except StoreError as e:
            self.summary.store_failures += 1
            self.summary.last_error = f"store (saving the last scrapes for the next run): {e}"
            return
        for key, last in todo:
            self._saved[key] = last
            self._baselines[key] = last

    def _record(self, p: Parsed, engine_id: str, seq: int, origin: str, line_no: int, raw: str,
                span: tuple[float, float] | None) -> None:
        s = self.summary
        s.records += 1
        s.totals.update({k: int(v) for k, v in p.totals.items()})
        if "drafts" in p.totals and "accepted" in p.totals:  # both sides of the mean, or neither
            s.mean_totals.update({k: int(p.totals[k]) for k in ("drafts", "accepted")})
        s.stored_totals.update({"rows": sum(w.rows for w in p.acceptance),
                                "accepted": sum(w.accepted for w in p.acceptance)})
        s.notes.update(p.notes)
        if p.observation is not None:
            s.observations.append({"origin": origin, "line": line_no, **p.observation})
        if p.skipped is not None and p.skipped not in QUIET_SKIPS:
            kind = "partial" if p.acceptance else "skipped"
            self._reject(origin, line_no, kind, p.skipped, p.detail, raw)
        elif p.skipped is not None:
            s.skipped[p.skipped] += 1  # nothing to keep: a baseline scrape or an interval without drafts
        if not p.acceptance and not p.cost:
            return
        if span is None:  # the record carries no time of its own: the ingest time, counted and reported
            s.untimed_windows += 1
            now = time.time()
            span = (now, now)
        start, end = span
        self._pending.append(WindowBatch(engine_id=engine_id, seq=seq, window_start=min(start, end),
                                         window_end=end, acceptance=p.acceptance, cost=p.cost))
        s.acceptance_windows += len(p.acceptance)
        s.cost_windows += len(p.cost)
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def _reject(self, origin: str, line_no: int, kind: str, reason: str, detail: str, raw: str) -> None:
        s = self.summary
        (s.malformed if kind == "malformed" else s.partial if kind == "partial" else s.skipped)[reason] += 1
        r = Reject(origin, line_no, kind, reason, detail, raw[:MAX_RAW_KEPT])
        self.rejects.append(r)
        if self._rejects_out is not None:
            self._rejects_out.write(json.dumps(r.__dict__) + "\n")
            self._rejects_out.flush()

    # --------------------------------------------------------------------------------------------- store
    def flush(self) -> bool:
        """Store the queued windows; on a store failure keep them queued (a follower retries) and count it."""
        if self._store is None:  # --dry-run: parsed and counted, not stored
            self._pending.clear()
            return True
        if self._pending:
            try:
                fresh = self._store.ingest_new(self._pending)
            except StoreError as e:  # the store translates every database error
                self.summary.store_failures += 1
                self.summary.last_error = f"store: {e}"
                return False
            self.summary.batches_new += len(fresh)
            self.summary.batches_duplicate += len(self._pending) - len(fresh)
            self._pending.clear()
        self._save_baselines()  # only once every window before it is stored
        return True


def _model_of(line: str) -> str | None:
    """The ``model`` an OpenAI-style response names, if the line is one (checked as a label later)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    m = obj.get("model") if isinstance(obj, dict) else None
    return m if isinstance(m, str) and m else None


# ------------------------------------------------------------------------------------------------ inputs
def read_text(path: str) -> str:
    """A file's text (``-`` is stdin). Raises :class:`IngestError` when it cannot be read."""
    import sys

    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise IngestError(f"cannot read {path}: {e}") from e


def ingest_paths(ing: Ingestor, paths: Iterable[str]) -> None:
    """Feed files (or stdin) to ``ing``: lines for line sources, ``# SCRAPE``-separated scrapes otherwise."""
    for path in paths:
        text = read_text(path)
        if ing.config.source in SCRAPE_SOURCES:
            for line_no, ts, chunk in vllm_prom.split_scrapes(text):
                ing.scrape(chunk, line_no, path, ts)
        else:
            for n, line in enumerate(text.splitlines(), 1):
                ing.line(line, n, path)
    ing.flush()


def fetch(url: str, timeout_s: float) -> str:
    """One scrape of ``url``. Raises :class:`IngestError` naming the URL when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return str(resp.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise IngestError(f"cannot scrape {url}: {e}") from e


def follow(ing: Ingestor, url: str, interval_s: float, stop: threading.Event, max_scrapes: int | None = None,
           timeout_s: float = 5.0, on_scrape: Callable[[int], None] | None = None) -> int:
    """Poll ``url`` every ``interval_s`` seconds until ``stop`` is set (or ``max_scrapes`` scrapes).

    A failed scrape is rejected (``scrape_failed``, kept with its error) and polling goes on; a store failure keeps
    the windows queued for the next poll. Returns the number of scrapes attempted.
    """
    n = 0
    try:
        while not stop.is_set() and (max_scrapes is None or n < max_scrapes):
            n += 1
            t0 = time.monotonic()
            try:
                text = fetch(url, timeout_s)
            except IngestError as e:
                ing._reject(url, n, "malformed", "scrape_failed", str(e), "")
            else:
                fetched_at = time.time()  # the scrape's own time: vLLM's exposition carries no sample timestamps
                try:
                    ing.scrape(text, n, url, fetched_at)
                except Exception as e:  # a long-running follower rejects what it cannot read, and goes on
                    ing._reject(url, n, "malformed", "scrape_error", f"{type(e).__name__}: {e}", text)
            ing.flush()
            if on_scrape is not None:
                on_scrape(n)
            if max_scrapes is not None and n >= max_scrapes:
                break
            stop.wait(max(0.0, interval_s - (time.monotonic() - t0)))
    finally:
        ing.flush()  # what this run read is stored whatever stopped it
    return n


def summary_lines(s: IngestSummary, rejects_path: str | None) -> Iterator[str]:
    """The human-readable summary of a run.

    The mean acceptance length (bonus token counted, as vLLM counts it) is ``1 + accepted / drafts`` over the
    records that determine both; a record's accepted tokens never count without its drafts.
    """
    yield (f"{s.records} records: {s.acceptance_windows} acceptance and {s.cost_windows} cost windows, "
           f"{s.batches_new} new window batches stored ({s.batches_duplicate} already stored)")
    drafts, accepted = s.mean_totals.get("drafts", 0), s.mean_totals.get("accepted", 0)
    if drafts:
        yield (f"records with a draft count: {drafts} drafts, {accepted} accepted, mean acceptance length "
               f"{1 + accepted / drafts:.3f}")
    uncounted = s.totals.get("accepted", 0) - accepted
    if uncounted:
        yield f"{uncounted} accepted tokens of records without a draft count are not in that mean"
    rows = s.stored_totals.get("rows", 0)
    if rows:
        yield (f"stored acceptance windows: {rows} rows, mean acceptance length "
               f"{1 + s.stored_totals.get('accepted', 0) / rows:.3f}")
    if s.malformed:
        yield "rejected (malformed): " + ", ".join(f"{k} {v}" for k, v in sorted(s.malformed.items()))
    if s.partial:
        yield "partly stored (kept): " + ", ".join(f"{k} {v}" for k, v in sorted(s.partial.items()))
    if s.skipped:
        yield "no window (kept): " + ", ".join(f"{k} {v}" for k, v in sorted(s.skipped.items()))
    for reason in sorted({*s.malformed, *s.partial, *s.skipped} - set(QUIET_SKIPS)):
        if reason in REASONS:
            yield f"  {reason}: {REASONS[reason]}"
    if s.notes.get("mixed_draft_lengths"):
        yield f"warning: {s.notes['mixed_draft_lengths']} records: {MIXED_WARNING}"
    if s.notes.get("totals_only"):
        yield f"warning: {s.notes['totals_only']} records: {TOTALS_WARNING}"
    if s.notes.get("counter_reset"):
        yield f"note: {s.notes['counter_reset']} counter resets (engine restarts): counted from zero after each"
    if s.observations:
        yield (f"{len(s.observations)} observations without a window (gauges, batch size, latency) are in the "
               "--summary-json output")
    if s.untimed_scrapes:
        yield (f"note: {s.untimed_scrapes} scrapes had no time of their own (no '# SCRAPE <unix s>' mark, no sample "
               "timestamp): they carry the ingest time. Write a mark before each, e.g. `{ echo \"# SCRAPE $(date "
               "+%s)\"; curl -s URL; } >> scrapes.prom`, or use --follow URL")
    if s.untimed_windows:
        yield (f"note: {s.untimed_windows} window batches carry the ingest time: their records hold no time of "
               "their own")
    if s.store_failures:
        yield f"warning: {s.store_failures} store failures; last: {s.last_error}"
    if rejects_path and (s.malformed or s.partial or any(k not in QUIET_SKIPS for k in s.skipped)):
        yield f"rejected, partly stored and skipped records, with line numbers and text: {rejects_path}"


def all_rejected(s: IngestSummary) -> bool:
    """True when the run read records and every one was malformed (nothing valid, nothing stored)."""
    return bool(s.malformed) and s.records == 0
