"""The parsers on fixtures recorded in each engine's format, and on malformed input."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.offline.sources import sglang, trtllm, vllm_log, vllm_prom, vllm_request
from controller.offline.sources.common import UNKNOWN, SourceError, SourceLabels, hist_from_tail

FIXTURES = Path(__file__).resolve().parent / "fixtures"

LABELS = SourceLabels("llama-3.1-8b")


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


# --------------------------------------------------------------------------------------------- vLLM prom
def test_prom_intervals_counter_deltas_mixed_and_reset() -> None:
    scrapes = vllm_prom.split_scrapes((FIXTURES / "vllm_metrics.prom").read_text())
    assert [ts for _, ts, _ in scrapes] == [1000.0, 1010.0, 1020.0, 1030.0]
    f = vllm_prom.PromFollower(LABELS)
    results = [f.feed(vllm_prom.parse_scrape(text, ts)) for _, ts, text in scrapes]
    assert all(len(r) == 1 for r in results)  # one engine, its labels matched by name in either order
    first, second, mixed, reset = (r[0][3] for r in results)
    assert first.skipped == "first_scrape"
    (w,) = second.acceptance
    # deltas: drafts 200, draft tokens 600 (k = 3), per position 160 / 120 / 70
    assert (w.k, w.rows, w.accepted, w.hist) == (3, 200, 350, (40, 40, 50, 70))
    assert w.target_version == "meta-llama/Llama-3.1-8B-Instruct"
    assert (w.request_type, w.context_bucket, w.draft_version) == (UNKNOWN, UNKNOWN, UNKNOWN)
    assert w.acceptance_curve() == pytest.approx([160 / 200, 120 / 200, 70 / 200])  # per_pos[i] / drafts
    assert w.mean_acceptance_length == pytest.approx(1 + 350 / 200)
    assert second.observation is not None and second.observation["batch_size"] == 5.0
    # latency deltas: 200 / 400 / 480 / 500 tokens under 10 / 25 / 50 ms / +Inf; the median is the 250th
    assert second.observation["latency_p50_s"] == pytest.approx(0.01 + 0.015 * (250 - 200) / (400 - 200))
    assert mixed.skipped == "mixed_draft_lengths" and "mixed_draft_lengths" in mixed.notes
    (first_pos,) = mixed.acceptance  # position 1 is drafted by every row, whatever its length: 60 of 100 kept
    assert (first_pos.k, first_pos.hist) == (1, (40, 60)) and mixed.totals["drafts"] == 100
    assert reset.notes == ("counter_reset",)
    assert reset.acceptance[0].hist == (20, 10, 10, 10)  # the restarted engine's counters are the delta


def test_prom_version_overrides_model_name_and_older_latency_name() -> None:
    text = (
        'vllm:spec_decode_num_drafts_total{model_name="m",engine="1"} 10\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="m",engine="1"} 20\n'
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m",engine="1"} 5\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="1",position="0"} 4\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="1",position="1"} 1\n'
        'vllm:time_per_output_token_seconds_bucket{model_name="m",engine="1",le="0.1"} 3\n'
        'vllm:time_per_output_token_seconds_bucket{model_name="m",engine="1",le="+Inf"} 4\n'
    )
    f = vllm_prom.PromFollower(LABELS, version="v7")
    f.feed(vllm_prom.parse_scrape(text, 1.0))
    doubled = text.replace(" 10\n", " 30\n").replace(" 20\n", " 60\n").replace("} 5\n", "} 15\n")
    doubled = doubled.replace('"0"} 4\n', '"0"} 12\n').replace('"1"} 1\n', '"1"} 3\n').replace('"+Inf"} 4', '"+Inf"} 8')
    ((key, _, _, parsed),) = f.feed(vllm_prom.parse_scrape(doubled, 2.0))
    assert key == ("m", "1")
    (w,) = parsed.acceptance
    assert (w.target_version, w.k, w.hist) == ("v7", 2, (12, 6, 2))
    assert parsed.observation is not None and parsed.observation["latency_p50_s"] is not None


def test_prom_malformed_exposition_is_a_clear_error() -> None:
    with pytest.raises(SourceError, match="bad_exposition"):
        vllm_prom.parse_scrape('vllm:spec_decode_num_drafts_total{engine="0" 12\n')


def test_hist_from_tail_rejects_rising_counts() -> None:
    assert hist_from_tail(10, [6, 3]) == [4, 3, 3]
    with pytest.raises(SourceError, match="per_position_rising"):
        hist_from_tail(10, [3, 6])


# ---------------------------------------------------------------------------------------------- vLLM log
def test_vllm_log_lines() -> None:
    ls = lines("vllm_spec.log")
    out = [vllm_log.parse_line(line, LABELS) if i not in (4, 5) else None for i, line in enumerate(ls)]
    assert out[0] is None and out[1] is None and out[6] is None  # other log output
    first, rounded = out[2], out[3]
    assert first is not None and first.acceptance[0].hist == (40, 40, 50, 70)
    assert rounded is not None
    (w,) = rounded.acceptance
    assert (w.k, w.rows, w.accepted) == (4, 1234, 2443)  # Drafted / K; rates to 3 decimals, adding up exactly
    assert w.acceptance_curve() == pytest.approx([0.800, 0.567, 0.369, 0.244], abs=5e-4)
    with pytest.raises(SourceError, match="mean_contradicts_counts"):  # rates add up to 1.5 N, the mean to 0.75 N
        vllm_log.parse_line(ls[4], LABELS)
    with pytest.raises(SourceError, match="bad_log_line"):
        vllm_log.parse_line(lines("vllm_spec.log")[5], LABELS)


# --------------------------------------------------------------------------------------- vLLM per-request
def test_vllm_request_lines() -> None:
    ls = lines("vllm_requests.jsonl")
    one = vllm_request.parse_line(ls[0], LABELS)
    assert one is not None
    (w,) = one.acceptance
    assert (w.k, w.rows, w.accepted, w.hist, w.context_bucket) == (3, 43, 10, (39, 1, 0, 3), "<=512")
    by_len = vllm_request.parse_line(ls[1], LABELS)
    assert by_len is not None
    assert sorted((w.k, w.hist) for w in by_len.acceptance) == [(1, (2, 3)), (3, (1, 1, 1, 2))]
    assert by_len.acceptance[0].context_bucket == UNKNOWN  # 400 .. 700 tokens spans two buckets: not guessed
    mixed = vllm_request.parse_line(ls[2], LABELS)
    assert mixed is not None and mixed.skipped == "mixed_draft_lengths" and not mixed.acceptance
    with pytest.raises(SourceError, match="bad_json"):
        vllm_request.parse_line(ls[3], LABELS)
    with pytest.raises(SourceError, match="inconsistent_counts"):
        vllm_request.parse_line(ls[4], LABELS)


# ------------------------------------------------------------------------------------------------- SGLang
def test_sglang_meta_info_lines() -> None:
    ls = lines("sglang_meta.jsonl")
    one = sglang.parse_line(ls[0], LABELS)
    assert one is not None
    (w,) = one.acceptance
    assert (w.k, w.rows, w.accepted, w.hist) == (5, 43, 63, (11, 14, 11, 4, 0, 3))
    assert w.context_bucket == "<=512"
    choice = sglang.parse_line(ls[1], LABELS)
    assert choice is not None and choice.acceptance[0].hist == (0, 1, 0)  # the histogram grows: bins padded
    mixed = sglang.parse_line(ls[2], LABELS)
    assert mixed is not None and mixed.skipped == "mixed_draft_lengths"
    with pytest.raises(SourceError, match="inconsistent_counts"):
        sglang.parse_line(ls[3], LABELS)
    with pytest.raises(SourceError, match="bad_json"):
        sglang.parse_line(ls[4], LABELS)


def test_sglang_gauges_are_reported_not_windows() -> None:
    (row,) = sglang.parse_gauges((FIXTURES / "sglang_metrics.prom").read_text())
    assert row["spec_accept_length"] == 1.55 and row["spec_accept_rate"] == 0.55 and row["num_running_reqs"] == 12


# ---------------------------------------------------------------------------------------------- TRT-LLM
def test_trtllm_iterations() -> None:
    ls = lines("trtllm_iterations.jsonl")
    p = trtllm.parse_line(ls[0], LABELS)
    assert p is not None and p[0].skipped == "no_spec_stats"
    p = trtllm.parse_line(ls[1], LABELS)
    assert p is not None
    unknown = p[0]
    assert unknown.skipped == "histogram_unknown" and not unknown.acceptance  # totals fix no histogram at k = 3
    (c,) = unknown.cost
    assert (c.max_k, c.rounds, c.batch_rows, c.batch_bucket, c.tokens_verified) == (3, 1, 8, 8, 32)
    assert c.draft_s.total == pytest.approx(0.0031) and c.verify_s.total == pytest.approx(0.0183)
    pair = trtllm.parse_line(ls[2], LABELS)  # a JSON list of iterations, as /metrics returns
    assert pair is not None and len(pair) == 2
    assert pair[0].acceptance[0].hist == (1, 3)  # k = 1: the totals fix it
    assert not pair[1].acceptance and pair[1].skipped == "histogram_unknown"  # all accepted: chosen by outcome
    assert pair[1].cost[0].draft_s.total == pytest.approx(0.2 * 0.015)  # from draftOverhead
    with pytest.raises(SourceError, match="bad_field"):
        trtllm.parse_line(ls[3], LABELS)
    p = trtllm.parse_line(ls[4], LABELS)
    assert p is not None and p[0].skipped == "mixed_draft_lengths"
