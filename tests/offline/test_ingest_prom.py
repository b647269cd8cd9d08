"""``spectune ingest vllm-prom`` on a real vLLM 0.32 capture: cost from the latency histogram, the scrapes' own
time, content-derived interval ids, one scrape per run, and a follower that survives bad scrapes.

``fixtures/vllm032_real.prom`` holds ten scrapes of a real vLLM 0.32 server (k up to 3 under a batch-size
schedule, load stepped through 1, 4, 12 and 1 requests), each after a ``# SCRAPE <unix s>`` mark
(``fixtures/capture_vllm032.py`` says how it was captured).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from scrape_server import Scrapes

from controller.cli import main as spectune
from controller.offline.ingest import IngestConfig, Ingestor, follow, ingest_paths
from controller.offline.sources import vllm_prom
from controller.offline.sources.common import SourceLabels
from telemetry.records import DEFAULT_BUCKETS
from telemetry.store import Store

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REAL = FIXTURES / "vllm032_real.prom"
LABELS = SourceLabels("unknown")


def real_scrapes() -> list[tuple[int, float | None, str]]:
    return vllm_prom.split_scrapes(REAL.read_text())


def value(text: str, name: str) -> float:
    """One sample's value, read off the exposition by hand (the test's own arithmetic, not the parser's)."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m is not None, name
    return float(m.group(1))


def delta(a: str, b: str, name: str) -> float:
    return value(b, name) - value(a, name)


# ------------------------------------------------------------------------------------------ parsing, cost
def test_real_scrapes_parse_with_created_gauges_and_give_windows_at_one_draft_length() -> None:
    scrapes = real_scrapes()
    assert len(scrapes) >= 3 and all(ts is not None for _, ts, _ in scrapes)
    assert "vllm:spec_decode_num_drafts_created" in scrapes[0][2]  # the gauges that crashed the parser
    f = vllm_prom.PromFollower(LABELS)
    results = [f.feed(vllm_prom.parse_scrape(text, ts))[0] for _, ts, text in scrapes]
    created = {vllm_prom.parse_scrape(text).series[("target-v1", "0")].created for _, _, text in scrapes}
    assert len(created) == 1 and None not in created  # one engine instance: no restart in the capture
    assert results[0].parsed.skipped == "first_scrape"
    single = [r for r in results[1:] if r.parsed.acceptance]
    assert single, "the capture has intervals at one draft length"
    for (_, _, a), (_, _, b), r in zip(scrapes[:-1], scrapes[1:], results[1:], strict=True):
        drafts = delta(a, b, "vllm:spec_decode_num_drafts_total")
        tokens = delta(a, b, "vllm:spec_decode_num_draft_tokens_total")
        if r.parsed.skipped == "mixed_draft_lengths":  # position 1 only, as a k = 1 window of every draft
            (w,) = r.parsed.acceptance
            assert tokens % drafts or tokens // drafts not in (1, 2, 3) or w.k == 1
            assert (w.k, w.rows) == (1, drafts)
            assert w.accepted == delta(a, b, 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",'
                                             'model_name="target-v1",position="0"}')
        elif r.parsed.acceptance:
            (w,) = r.parsed.acceptance
            assert w.k * drafts == tokens and w.rows == drafts
            assert w.accepted == delta(a, b, "vllm:spec_decode_num_accepted_tokens_total")


def test_cost_window_matches_the_histogram_and_step_arithmetic() -> None:
    scrapes = real_scrapes()
    f = vllm_prom.PromFollower(LABELS)
    checked = 0
    for i, (_, ts, text) in enumerate(scrapes):
        (r,) = f.feed(vllm_prom.parse_scrape(text, ts))
        if not r.parsed.cost:
            continue
        a, b = scrapes[i - 1][2], text
        (c,) = r.parsed.cost
        rows = delta(a, b, "vllm:inter_token_latency_seconds_count")  # one per decode row per engine step
        seconds = delta(a, b, "vllm:inter_token_latency_seconds_sum")
        steps = delta(a, b, "vllm:iteration_tokens_total_count")  # one per engine step
        drafts = delta(a, b, "vllm:spec_decode_num_drafts_total")
        accepted = delta(a, b, "vllm:spec_decode_num_accepted_tokens_total")
        assert c.batch_rows == rows and c.rounds == min(steps, rows)
        assert c.batch_bucket == DEFAULT_BUCKETS.batch_bucket(round(rows / c.rounds))
        per_round = (c.draft_s.total + c.verify_s.total + c.other_s.total) / c.rounds
        assert per_round == pytest.approx(seconds / rows)  # the mean step time each row saw
        assert c.draft_s.total == 0 and c.other_s.total == 0  # vLLM does not split a step: all in verify
        assert c.emitted == rows + accepted
        assert c.tokens_verified == rows + delta(a, b, "vllm:spec_decode_num_draft_tokens_total")
        if drafts:
            assert c.max_k == r.parsed.acceptance[0].k
        checked += 1
    assert checked >= 2


def test_mean_batch_from_the_running_gauge_when_the_step_histogram_is_absent() -> None:
    _, _, a = real_scrapes()[5]
    _, _, b = real_scrapes()[6]
    strip = re.compile(r"^vllm:iteration_tokens_total.*\n", re.MULTILINE)
    f = vllm_prom.PromFollower(LABELS)
    f.feed(vllm_prom.parse_scrape(strip.sub("", a), 1.0))
    (r,) = f.feed(vllm_prom.parse_scrape(strip.sub("", b), 2.0))
    if not r.parsed.cost:
        pytest.skip("this pair of the capture mixes draft lengths")
    (c,) = r.parsed.cost
    mean_running = (value(a, "vllm:num_requests_running") + value(b, "vllm:num_requests_running")) / 2
    rows = delta(a, b, "vllm:inter_token_latency_seconds_count")
    assert c.rounds == max(1, round(rows / mean_running))  # the mean of the gauge at the interval's two ends


# ------------------------------------------------------------------------------------- time and identity
def test_windows_carry_the_scrape_marks_time(db_url: str) -> None:
    marks = [ts for _, ts, _ in real_scrapes()]
    with Store(db_url, auto_upgrade=True) as store:
        ing = Ingestor(IngestConfig(source="vllm-prom"), store)
        ingest_paths(ing, [str(REAL)])
        ends = {w.window_end for w in store.acceptance_windows()} | {w.window_end for w in store.cost_windows()}
    assert ends and ends <= set(marks)
    assert ing.summary.untimed_windows == 0 and ing.summary.untimed_scrapes == 0


def write_single_scrapes(tmp_path: Path) -> list[Path]:
    """Each real scrape in its own file without a mark, as `curl > one.prom` writes it."""
    out = []
    for i, (_, _, text) in enumerate(real_scrapes()):
        p = tmp_path / f"scrape{i}.prom"
        p.write_text(text)
        out.append(p)
    return out


def test_reingesting_unmarked_scrapes_stores_each_interval_once(db_url: str, tmp_path: Path) -> None:
    files = write_single_scrapes(tmp_path)
    pair = [str(p) for p in files[5:7]]
    with Store(db_url, auto_upgrade=True) as store:
        first = Ingestor(IngestConfig(source="vllm-prom"), store)
        ingest_paths(first, pair)
        again = Ingestor(IngestConfig(source="vllm-prom"), store)
        ingest_paths(again, pair)
        stored = store.batch_count()
    assert first.summary.batches_new == 1 and first.summary.untimed_scrapes == 2
    assert again.summary.batches_new == 0 and again.summary.batches_duplicate == 1  # counted, not stored
    assert stored == 1


def test_one_scrape_per_run_forms_the_same_intervals_as_one_file(db_url: str, tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'whole.sqlite'}", auto_upgrade=True) as store:
        whole = Ingestor(IngestConfig(source="vllm-prom"), store)
        ingest_paths(whole, [str(REAL)])
        want = sorted(w.window.hist for w in store.acceptance_windows())
    assert want
    files = write_single_scrapes(tmp_path)
    with Store(db_url, auto_upgrade=True) as store:
        runs = []
        for p in files:  # a cron job: curl, then ingest the one scrape
            ing = Ingestor(IngestConfig(source="vllm-prom"), store)
            ingest_paths(ing, [str(p)])
            runs.append(ing.summary)
        got = sorted(w.window.hist for w in store.acceptance_windows())
        again = Ingestor(IngestConfig(source="vllm-prom"), store)
        ingest_paths(again, [str(files[-1])])  # the same last scrape once more: nothing new
        assert store.batch_count() == sum(s.batches_new for s in runs)
    assert got == want
    assert runs[0].skipped["first_scrape"] == 1  # the very first run has no baseline
    assert again.summary.batches_new == 0 and again.summary.acceptance_windows == 0


def test_a_restart_between_runs_starts_a_new_baseline(sqlite_url: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    scrapes = real_scrapes()
    last, early = scrapes[-1][2], scrapes[1][2]  # scrape 1: 268 drafts since the start, all at k = 3
    later = value(early, "vllm:spec_decode_num_drafts_created") + 3600.0  # a new engine instance started
    a, b = tmp_path / "a.prom", tmp_path / "b.prom"
    a.write_text(last)
    b.write_text(re.sub(r"^(vllm:spec_decode_num_\w+_created\{[^}]*\}) \S+$", rf"\1 {later!r}", early,
                        flags=re.MULTILINE))
    rejects = ["--rejects", str(tmp_path / "rejects.jsonl")]
    assert spectune(["ingest", "vllm-prom", str(a), "--db-url", sqlite_url, "--auto-upgrade", *rejects]) == 0
    capsys.readouterr()
    summary = tmp_path / "s.json"
    assert spectune(["ingest", "vllm-prom", str(b), "--db-url", sqlite_url, "--summary-json", str(summary),
                     *rejects]) == 0
    out = capsys.readouterr().out
    assert "counter resets (engine restarts)" in out and "ingest time" in out
    s = json.loads(summary.read_text())
    assert s["notes"]["counter_reset"] == 1 and len(s["restarts"]) == 1
    drafts = value(early, "vllm:spec_decode_num_drafts_total")
    with Store(sqlite_url) as store:
        rows = [w.window.rows for w in store.acceptance_windows()]
        (bl,) = store.scrape_baselines("vllm-prom")
    assert rows in ([], [drafts])  # the restarted engine's counters since its start are the interval
    assert bl.state["drafts"] == drafts  # the new instance is the next run's baseline


# ------------------------------------------------------------------------------------------------ follow
def test_follow_rejects_bad_scrapes_counts_them_and_keeps_going(scrape_url: str, sqlite_url: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    scrapes = [text for _, _, text in real_scrapes()]
    poison = "# a body the parser chokes on in a way nobody foresaw\n"
    Scrapes.bodies = [scrapes[5], "garbage{ 12\n", None, poison, scrapes[6]]
    real_parse = vllm_prom.parse_scrape

    def parse(text: str, timestamp: float | None = None) -> vllm_prom.Scrape:
        if text == poison:
            raise RuntimeError("unforeseen")
        return real_parse(text, timestamp)

    monkeypatch.setattr(vllm_prom, "parse_scrape", parse)
    url = scrape_url
    with Store(sqlite_url, auto_upgrade=True) as store:
        ing = Ingestor(IngestConfig(source="vllm-prom"), store)
        n = follow(ing, url, interval_s=0.01, stop=threading.Event(), max_scrapes=6, timeout_s=2)
        stored = store.batch_count()
    assert n == 6
    s = ing.summary
    assert s.malformed["bad_exposition"] == 1 and s.malformed["scrape_error"] == 1
    assert s.malformed["scrape_failed"] == 2  # the 500 and the final 404
    assert s.batches_new == stored == 1  # the interval around the bad scrapes is still formed and stored
    assert s.untimed_windows == 0  # the fetch time is each scrape's time


def test_follow_leaves_its_last_scrape_for_the_next_run(scrape_url: str, sqlite_url: str,
                                                         tmp_path: Path) -> None:
    scrapes = [text for _, _, text in real_scrapes()]
    Scrapes.bodies = [scrapes[4], scrapes[5]]
    url = scrape_url
    with Store(sqlite_url, auto_upgrade=True) as store:
        ing = Ingestor(IngestConfig(source="vllm-prom"), store)
        follow(ing, url, interval_s=0.01, stop=threading.Event(), max_scrapes=2, timeout_s=2)
        (b,) = store.scrape_baselines("vllm-prom")
        assert b.series == "target-v1|0" and b.own_time and b.state["drafts"] == value(scrapes[5],
                                                                                       "vllm:spec_decode_num_drafts_total")
        nxt = tmp_path / "next.prom"
        nxt.write_text(scrapes[6])
        later = Ingestor(IngestConfig(source="vllm-prom"), store)
        ingest_paths(later, [str(nxt)])
    assert later.summary.records == 1 and "first_scrape" not in later.summary.skipped  # 5 -> 6 formed
    assert later.summary.acceptance_windows + later.summary.skipped["mixed_draft_lengths"] == 1


# ------------------------------------------------------------------------------------ line sources' time
def test_line_windows_carry_the_records_own_time(sqlite_url: str) -> None:
    from datetime import datetime

    from controller.offline.sources import timing

    with Store(sqlite_url, auto_upgrade=True) as store:
        runs = {}
        for source, name in (("vllm-log", "vllm_spec.log"), ("trtllm", "trtllm_iterations.jsonl")):
            ing = Ingestor(IngestConfig(source=source, model="m"), store)
            ingest_paths(ing, [str(FIXTURES / name)])
            runs[source] = ing.summary
        ends: dict[str, set[float]] = {"vllm-log": set(), "trtllm": set()}
        for eid, end in [(w.engine_id, w.window_end) for w in store.acceptance_windows()] + [
                (w.engine_id, w.window_end) for w in store.cost_windows()]:
            ends[eid.split(":")[0]].add(end)
    log_times = {timing.vllm_log_time(x, datetime.now().timestamp())
                 for x in (FIXTURES / "vllm_spec.log").read_text().splitlines()} - {None}
    assert ends["vllm-log"] and ends["vllm-log"] <= log_times  # the log lines' own prefix times
    assert runs["vllm-log"].untimed_windows == 0
    stamped = datetime(2026, 9, 1, 12, 0, 0).timestamp()  # the iterations' timestamp field
    assert stamped in ends["trtllm"]
    # iterations without a timestamp carry the ingest time, counted for the summary
    assert runs["trtllm"].untimed_windows == len(ends["trtllm"] - {stamped}) > 0
