"""``spectune ingest`` on log lines and JSON lines: vLLM v1 and v0 log lines (mixed draft lengths, contradictions,
each with its own reason), the summary's mean, the rejects file, argument checks, TensorRT-LLM at k > 1, and a
real vLLM 0.32 log."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from controller.cli import main as spectune
from controller.offline.ingest import IngestConfig, Ingestor, ingest_paths
from controller.offline.sources import trtllm, vllm_log
from controller.offline.sources.common import MISSING, SourceError, SourceLabels, missing_text

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LABELS = SourceLabels("m")
PREFIX = "(APIServer pid=1) INFO 12-03 13:32:08 [metrics.py:120] "


def vllm_v1_line(rows: list[tuple[int, int]], num_spec_tokens: int) -> str:
    """The line vLLM's ``SpecDecodingLogging.log`` prints for rows ``(draft length, accepted)`` (same formats)."""
    n = len(rows)
    drafted = sum(k for k, _ in rows)
    accepted = sum(a for _, a in rows)
    per_pos = [sum(1 for _, a in rows if a > i) for i in range(num_spec_tokens)]
    rates = ", ".join(f"{c / n:.3f}" for c in per_pos)
    return (PREFIX + "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance "
            "rate: %s, Avg Draft acceptance rate: %.1f%%") % (
        1 + accepted / n, accepted / 3, drafted / 3, accepted, drafted, rates, 100 * accepted / drafted)


# Intervals as a batch-size schedule makes them: (draft length, accepted) per row.
SINGLE = [(3, 3)] * 20 + [(3, 1)] * 15 + [(3, 0)] * 10  # every row k=3
MIXED = [(3, 3)] * 5 + [(3, 2)] * 4 + [(1, 1)] * 30 + [(1, 0)] * 25 + [(2, 2)] * 6 + [(2, 0)] * 3  # k 1, 2, 3


def truth(*intervals: list[tuple[int, int]]) -> float:
    rows = [r for it in intervals for r in it]
    return 1 + sum(a for _, a in rows) / len(rows)


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = spectune(args)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def printed_mean(out: str) -> float:
    m = re.search(r"records with a draft count: .* mean acceptance length ([0-9.]+)", out)
    assert m is not None, out
    return float(m.group(1))


# ------------------------------------------------------------------------------------- mixed draft lengths
def test_mixed_line_stores_position_one_and_the_mean_counts_both_sides(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("\n".join([vllm_v1_line(SINGLE, 3), vllm_v1_line(MIXED, 3)]) + "\n")
    rc, out, _ = run(["ingest", "vllm-log", str(log), "--model", "m", "--dry-run",
                      "--rejects", str(tmp_path / "r.jsonl")], capsys)
    assert rc == 0
    assert printed_mean(out) == pytest.approx(truth(SINGLE, MIXED), abs=5e-4)  # not only the stored line's drafts
    assert "partly stored (kept): mixed_draft_lengths 1" in out
    p = vllm_log.parse_line(vllm_v1_line(MIXED, 3), LABELS)
    assert p is not None
    (w,) = p.acceptance
    first_kept = sum(1 for _, a in MIXED if a >= 1)
    assert (w.k, w.hist) == (1, (len(MIXED) - first_kept, first_kept))  # position 1: every row drafted it
    assert p.totals["drafts"] == len(MIXED)
    kept = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["reason"]) for r in kept] == [("partial", "mixed_draft_lengths")]


def test_line_whose_mean_contradicts_its_counts_counts_on_neither_side(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = vllm_v1_line(SINGLE, 3).replace("Mean acceptance length: 2.67", "Mean acceptance length: 3.90")
    assert bad != vllm_v1_line(SINGLE, 3)
    log = tmp_path / "vllm.log"
    log.write_text("\n".join([vllm_v1_line(SINGLE, 3), bad]) + "\n")
    rc, out, _ = run(["ingest", "vllm-log", str(log), "--model", "m", "--dry-run",
                      "--rejects", str(tmp_path / "r.jsonl")], capsys)
    assert rc == 0
    assert printed_mean(out) == pytest.approx(truth(SINGLE), abs=5e-4)
    assert "rejected (malformed): mean_contradicts_counts 1" in out


def test_drafts_candidates_hold_the_true_count_at_every_size() -> None:
    for scale in (1, 7, 40, 300):
        rows = MIXED * scale + SINGLE * scale
        line = vllm_v1_line(rows, 3)
        m = vllm_log.LINE_RE.search(line)
        assert m is not None
        mal, _, _, acc, drafted, rates, _ = m.groups()
        cands = vllm_log.drafts_candidates(int(acc), int(drafted), [float(x) for x in rates.split(", ")],
                                           float(mal))
        assert len(rows) in cands
        assert cands[-1] - cands[0] <= 0.01 * len(rows)  # the printed precision pins N within 1 %


# ------------------------------------------------------------------------------------------------ reasons
@pytest.mark.parametrize(("line", "reason"), [
    (vllm_v1_line(SINGLE, 3)[:-30], "truncated"),  # cut off mid-write
    (vllm_v1_line(SINGLE, 3).replace("rate: 0.778", "rate: 1.778"), "per_position_exceeds_drafts"),
    (vllm_v1_line(SINGLE, 3).replace("0.444, 0.444", "0.444, 0.544"), "per_position_rising"),
    (vllm_v1_line(SINGLE, 3).replace("Accepted: 75 tokens", "Accepted: 975 tokens"), "accepted_exceeds_drafted"),
    (vllm_v1_line(SINGLE, 3).replace("Mean acceptance length: 2.67", "Mean acceptance length: x"), "bad_log_line"),
])
def test_each_contradiction_has_its_own_reason(line: str, reason: str) -> None:
    assert line != vllm_v1_line(SINGLE, 3)
    with pytest.raises(SourceError) as e:
        vllm_log.parse_line(line, LABELS)
    assert e.value.reason == reason


def test_reasons_are_counted_and_explained_in_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = vllm_v1_line(SINGLE, 3)
    log = tmp_path / "vllm.log"
    log.write_text("\n".join([good, good[:-30], good.replace("rate: 0.778", "rate: 1.778"),
                              good.replace("0.444, 0.444", "0.444, 0.544")]) + "\n")
    rc, out, _ = run(["ingest", "vllm-log", str(log), "--model", "m", "--dry-run",
                      "--rejects", str(tmp_path / "r.jsonl")], capsys)
    assert rc == 0
    assert "rejected (malformed): per_position_exceeds_drafts 1, per_position_rising 1, truncated 1" in out
    assert "  truncated: the record ends before its last field" in out
    assert "restart" not in out and "mixed" not in out


# ---------------------------------------------------------------------------------------------- vLLM v0
def v0_line(k: int, accepted: int, drafted: int, emitted: int, tokens_tokens: bool = False) -> str:
    """vLLM v0's ``_format_spec_decode_metrics_str`` (``tokens tokens`` as v0.4 printed it)."""
    t = " tokens" if tokens_tokens else ""
    return ("INFO 02-11 14:50:38 metrics.py:477] Speculative metrics: "
            f"Draft acceptance rate: {accepted / drafted if drafted else float('nan'):.3f}, "
            f"System efficiency: {emitted / (drafted // k * (k + 1)) if drafted else float('nan'):.3f}, "
            f"Number of speculative tokens: {k}, Number of accepted tokens: {accepted}, "
            f"Number of draft tokens{t}: {drafted}, Number of emitted tokens{t}: {emitted}.")


def test_v0_lines_are_read_as_cumulative_counters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "v0.log"
    log.write_text("\n".join([
        v0_line(1, 40, 100, 140),  # baseline
        v0_line(1, 100, 200, 300, tokens_tokens=True),  # +100 rows, 60 accepted
        v0_line(1, 10, 50, 60),  # every counter down: a restart, counted from zero
        v0_line(1, 5, 80, 90),  # accepted down alone: not a restart
    ]) + "\n")
    rc, out, _ = run(["ingest", "vllm-log", str(log), "--model", "m", "--dry-run",
                      "--rejects", str(tmp_path / "r.jsonl")], capsys)
    assert rc == 0
    assert "3 records: 2 acceptance" in out
    assert "rejected (malformed): counter_went_down 1" in out and "1 counter resets" in out
    # rows 100 + 50, accepted in prefix (emitted - rows) 60 + 10
    assert printed_mean(out) == pytest.approx(1 + 70 / 150, abs=5e-4)
    p = vllm_log.LogParser()
    p.parse(v0_line(1, 40, 100, 140), LABELS)
    w = p.parse(v0_line(1, 100, 200, 300), LABELS)
    assert w is not None and w.acceptance[0].hist == (40, 60)


def test_v0_lines_beyond_k1_are_totals_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "v0.log"
    log.write_text(v0_line(5, 0, 0, 0) + "\n" + v0_line(5, 1234, 1890, 1700) + "\n")
    rc, out, _ = run(["ingest", "vllm-log", str(log), "--model", "m", "--dry-run",
                      "--rejects", str(tmp_path / "r.jsonl")], capsys)
    assert rc == 0
    assert "no window (kept): " in out and "histogram_unknown 1" in out
    assert "warning: 1 records: totals without a histogram" in out
    assert printed_mean(out) == pytest.approx(1700 / (1890 / 5), abs=5e-4)  # emitted per row, bonus counted
    assert missing_text("vllm-log", "acceptance") is not None


# ------------------------------------------------------------------------------------------ argument checks
def test_sources_without_model_names_need_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rejects = tmp_path / "r.jsonl"
    for source, name in (("vllm-log", "vllm_spec.log"), ("trtllm", "trtllm_iterations.jsonl")):
        rc, _, err = run(["ingest", source, str(FIXTURES / name), "--dry-run", "--rejects", str(rejects)], capsys)
        assert rc == 2 and "--model" in err
    assert not rejects.exists()


def test_every_record_rejected_exits_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n{\"meta_info\": {}}\n")
    rc, _, err = run(["ingest", "sglang", str(bad), "--dry-run", "--version", "v", "--rejects",
                      str(tmp_path / "r.jsonl")], capsys)
    assert rc == 1 and "every record was rejected" in err


# ---------------------------------------------------------------------------------------------- rejects file
def test_rejects_path_is_never_removed_or_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.log"
    good.write_text(vllm_v1_line(SINGLE, 3) + "\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so that opening it for writing cannot block
    try:
        mine = tmp_path / "mine.jsonl"
        mine.touch()  # the operator's own empty file
        link = tmp_path / "link.jsonl"
        link.symlink_to(mine)
        for path in (fifo, mine, link):
            rc, _, _ = run(["ingest", "vllm-log", str(good), "--model", "m", "--dry-run", "--rejects", str(path)],
                           capsys)
            assert rc == 0
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
        assert mine.is_file() and link.is_symlink() and link.resolve() == mine.resolve()
        new = tmp_path / "new.jsonl"
        run(["ingest", "vllm-log", str(good), "--model", "m", "--dry-run", "--rejects", str(new)], capsys)
        assert not new.exists()  # nothing to keep: nothing created
        mine.write_text("kept\n")
        bad = tmp_path / "bad.log"
        bad.write_text(vllm_v1_line(SINGLE, 3)[:-30] + "\n")
        run(["ingest", "vllm-log", str(bad), "--model", "m", "--dry-run", "--rejects", str(link)], capsys)
        lines = mine.read_text().splitlines()
        assert lines[0] == "kept" and json.loads(lines[1])["reason"] == "truncated"  # appended through the link
    finally:
        os.close(reader)


# ----------------------------------------------------------------------------------------------- TRT-LLM
def _iteration(rows: int, drafted: int, accepted: int) -> str:
    return json.dumps({"iter": 1, "iterLatencyMS": 20.0, "specDecodingStats": {
        "numDraftTokens": drafted, "numAcceptedTokens": accepted, "numRequestsWithDraftTokens": rows,
        "acceptanceLength": (accepted + rows) / rows, "iterLatencyMS": 2.0}})


def test_trtllm_k3_windows_from_single_request_iterations() -> None:
    ps = [trtllm.parse_line(_iteration(1, 3, a), LABELS) for a in (0, 1, 2, 3)]
    assert [p[0].acceptance[0].hist for p in ps if p] == [(1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1)]
    (many,) = trtllm.parse_line(_iteration(4, 12, 12), LABELS) or []
    assert not many.acceptance and many.cost and "totals_only" in many.notes  # all accepted: chosen by outcome
    assert "numRequestsWithDraftTokens == 1" in MISSING["trtllm"]["acceptance"]


def test_sglang_cost_gap_is_stated() -> None:
    text = missing_text("sglang", "cost")
    assert text is not None and "--calibration" in text


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.mark.parametrize(("source", "name", "windows"), [
    ("vllm-log", "vllm_spec.log", 2), ("vllm-request", "vllm_requests.jsonl", 3),
    ("sglang", "sglang_meta.jsonl", 2), ("trtllm", "trtllm_iterations.jsonl", 1),
])
def test_every_line_fixture_still_parses(source: str, name: str, windows: int) -> None:
    ing = Ingestor(IngestConfig(source=source, model="m"), None)
    ingest_paths(ing, [str(FIXTURES / name)])
    assert ing.summary.acceptance_windows == windows


def test_real_vllm032_log(tmp_path: Path) -> None:
    """A real vLLM 0.32 log under a batch-size schedule (k 3 / 2 / 1): every stored window agrees with its line,
    and the drafts over all lines add up to the /metrics drafts counter of the same run."""
    text = (FIXTURES / "vllm032_real.log").read_text()
    spec = [x for x in text.splitlines() if vllm_log.MARKER in x]
    assert spec
    n_total = 0
    for line in spec:
        m = vllm_log.LINE_RE.search(line)
        assert m is not None
        mal, _, _, acc, drafted, rates_s, _ = m.groups()
        rates = [float(x) for x in rates_s.split(", ")]
        p = vllm_log.parse_line(line, LABELS)
        assert p is not None
        (w,) = p.acceptance
        n = int(p.totals["drafts"])
        n_total += n
        assert f"{1 + int(acc) / n:.2f}" == mal  # the stored draft count reproduces the printed mean
        if p.skipped is None:  # one draft length: the whole line
            assert (w.rows * w.k, w.accepted) == (int(drafted), int(acc))
            assert w.acceptance_curve() == pytest.approx(rates[:w.k], abs=5e-4)
        else:
            assert p.skipped == "mixed_draft_lengths" and w.k == 1 and w.rows == n
            assert w.hist[1] / n == pytest.approx(rates[0], abs=5e-4)
    drafts_counter = re.findall(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} ([0-9.]+)$",
                                (FIXTURES / "vllm032_real.prom").read_text(), re.M)
    assert n_total == int(float(drafts_counter[-1])) - int(float(drafts_counter[0]))
    ing = Ingestor(IngestConfig(source="vllm-log", model="target-v1"), None)
    ingest_paths(ing, [str(FIXTURES / "vllm032_real.log")])
    assert ing.summary.acceptance_windows == len(spec) and not ing.summary.malformed
