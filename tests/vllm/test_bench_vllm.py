"""``spectune bench vllm``'s arithmetic on hand-made measurements: phase figures, medians, the ceiling, targets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.vllm import (
    K3_STEERED,
    PHASE_REQUEST_STRIDE,
    median_runs,
    overall,
    phase_stream,
    slot_order,
    verdict,
)
from bench.vllm_load import LoadPhase, _Request, summarise
from controller.reference.workload import PromptPool


def test_a_phase_counts_tokens_inside_its_window_and_tpot_of_finished_requests() -> None:
    a = _Request(started=0.0, first=0.5, end=2.5, tokens=5, arrivals=[(0.5, 1), (1.0, 3), (2.5, 5)])
    b = _Request(started=1.0, first=1.5, end=12.0, tokens=9, arrivals=[(1.5, 2), (9.0, 6), (12.0, 9)])  # spills over
    c = _Request(started=2.0, error="HTTP 500")
    r = summarise(LoadPhase("p", 2, 10.0), [a, b, c], 0.0, 10.0)
    assert r.tokens == 5 + 6  # b's last 3 tokens arrived after the window
    assert (r.requests, r.completed, r.errors) == (3, 2, 1)
    assert r.tok_s == pytest.approx(1.1)
    assert r.tpot_p50 == pytest.approx((0.5 + 10.5 / 8) / 2)  # TPOT = (end - first) / (tokens - 1)
    assert r.to_dict()["tpots"] == pytest.approx([0.5, 10.5 / 8])  # kept, for percentiles pooled over repeats
    assert r.ttft_p50 == pytest.approx(0.5)  # first token - sent: 0.5 for a and b; c failed and has none
    assert r.to_dict()["ttft_p99"] == pytest.approx(0.5)


def test_ttft_is_the_wait_for_the_first_token_and_its_median_over_repeats() -> None:
    slow = _Request(started=0.0, first=2.0, end=3.0, tokens=3, arrivals=[(2.0, 1), (3.0, 3)])
    fast = _Request(started=1.0, first=1.1, end=2.1, tokens=3, arrivals=[(1.1, 1), (2.1, 3)])
    r = summarise(LoadPhase("p", 2, 10.0), [slow, fast], 0.0, 10.0)
    assert r.ttfts == pytest.approx((2.0, 0.1))
    assert r.tpot_p50 == pytest.approx(0.5)  # the same TPOT for both: the wait is all before the first token
    runs = [[{**ph(10, 0.1), "ttft_p50": t, "ttft_p99": 2 * t}] for t in (0.3, 0.1, 0.2)]
    m = median_runs(runs)[0]
    assert (m["ttft_p50"], m["ttft_p99"]) == (0.2, 0.4)
    assert median_runs([[ph(10, 0.1)]])[0]["ttft_p50"] is None  # results from before TTFT was kept


def test_pooled_p99_and_the_repeat_spread_of_each_phase() -> None:
    # Three repeats of one phase: the pooled p99 is taken over all 30 requests, not the median of three p99s.
    runs = [[{**ph(10, 0.10), "tpots": [0.01] * 9 + [0.10]}], [{**ph(10, 0.02), "tpots": [0.01] * 9 + [0.02]}],
            [{**ph(10, 0.05), "tpots": [0.01] * 9 + [0.05]}]]
    m = median_runs(runs)[0]
    assert m["tpot_p99"] == 0.05
    assert m["tpot_p99_pooled"] == pytest.approx(float(np.percentile([0.01] * 27 + [0.10, 0.02, 0.05], 99)))
    assert m["tpot_p99_repeat_spread"] == pytest.approx(0.10 / 0.02)
    assert median_runs([[ph(10, 0.1)]])[0]["tpot_p99_pooled"] is None  # results from before tpots were kept
    # The verdict reports spectune's pooled p99 over the phase's best static, and that static's own spread.
    per = {"k3": [{**ph(80, 0.02), "tpot_p99_pooled": 0.030, "tpot_p99_repeat_spread": 1.5}], "k5": [ph(70, 0.02)],
           "spectune": [{**ph(85, 0.02), "tpot_p99_pooled": 0.033}]}
    v = verdict(_configs(per))
    assert v["spectune"]["tpot_p99_pooled_over_best_static_by_phase"] == pytest.approx([1.1])
    assert v["best_static_tpot_p99_repeat_spread_by_phase"] == [1.5]


def ph(tok_s: float, p99: float, secs: float = 10.0) -> dict[str, Any]:
    return {"name": "p", "concurrency": 1, "tok_s": tok_s, "tokens": tok_s * secs, "seconds": secs,
            "tpot_p50": p99 / 2, "tpot_p99": p99}


def _configs(per: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration, its phases and overall tok/s, as ``run`` hands them to ``verdict``."""
    return {c: {"phases": p, "overall_tok_s": overall(p)} for c, p in per.items()}


def test_medians_over_repeats_per_phase() -> None:
    runs = [[ph(10, 0.1), ph(50, 0.3)], [ph(12, 0.2), ph(40, 0.1)], [ph(11, 0.4), ph(45, 0.2)]]
    m = median_runs(runs)
    assert [x["tok_s"] for x in m] == [11, 45]
    assert [x["tpot_p99"] for x in m] == [0.2, 0.2]
    assert overall(runs[0]) == pytest.approx(30.0)


def test_the_ceiling_and_spectunes_share_of_it() -> None:
    # Two phases of equal length: k5 wins the first (batch 1), k0 the second (high batch).
    per = {
        "k0": [ph(40, 0.02), ph(400, 0.08)],
        "k3": [ph(80, 0.02), ph(380, 0.09)],
        "k5": [ph(100, 0.02), ph(300, 0.12)],
        "spectune": [ph(95, 0.021), ph(395, 0.085)],
    }
    v = verdict(_configs(per))
    assert v["best_static_per_phase"] == ["k5", "k0"]
    assert v["best_single_static"] == "k3"  # 230 tok/s over both phases, k0 220, k5 200
    assert v["ceiling_over_best_static"] == pytest.approx(250 / 230)
    assert v["ceiling_over_k3"] == pytest.approx(250 / 230)
    s = v["spectune"]
    assert s["over_best_static"] == pytest.approx(245 / 230)
    assert s["over_k5"] == pytest.approx(245 / 200)
    assert s["share_of_k3_headroom"] == pytest.approx(15 / 20)
    assert s["tpot_p99_over_best_static_by_phase"] == pytest.approx([1.05, 0.085 / 0.08])
    need = min(1.05, 1 + 0.6 * (250 / 230 - 1))
    assert v["targets"] == {"spectune_over_best_static >= 1.0": True, f"spectune_over_k3 >= {need:.4f}": True,
                            "spectune_over_k5 >= 1.15": True,
                            "tpot_p99 <= 1.10 x phase's best static in every phase": True}


def test_the_floor_of_a_server_with_the_draft_loaded() -> None:
    # k0_draft: the draft loaded, k = 0 each step. Slower than k0 (no draft) where speculation does not pay, it
    # bounds what any server that can speculate reaches there.
    per = {
        "k0": [ph(40, 0.02), ph(400, 0.08)],
        "k3": [ph(80, 0.02), ph(380, 0.09)],
        "k0_draft": [ph(38, 0.02), ph(360, 0.09)],
        "spectune": [ph(78, 0.021), ph(358, 0.085)],
    }
    v = verdict(_configs(per))
    assert v["best_static_per_phase"] == ["k3", "k0"]  # k0_draft is not a static baseline
    assert v["k0_draft_over_k0_by_phase"] == pytest.approx([38 / 40, 360 / 400])
    assert v["spectune_over_k0_draft_by_phase"] == pytest.approx([78 / 38, 358 / 360])
    # per phase the best of k3 and k0_draft: 80 and 380, over the best single static (k3, 230)
    assert v["ceiling_with_the_draft_loaded_over_best_static"] == pytest.approx(230 / 230)


def test_every_configuration_takes_every_place_in_the_phase_order() -> None:
    configs = ["k0", "k3", "k5", "tuned", "spectune"]
    orders = [slot_order(configs, rep, i) for rep in range(3) for i in range(7)]
    assert all(sorted(o) == sorted(configs) for o in orders)  # each slot runs every configuration once
    firsts = {o[0] for o in orders}
    assert firsts == set(configs)  # no configuration always runs first, after another server's load
    assert slot_order(configs, 0, 0) == configs
    assert slot_order(configs, 1, 0) != slot_order(configs, 0, 0)  # the next repeat starts elsewhere


def test_each_phase_draws_the_same_requests_whatever_the_earlier_phases_consumed(tmp_path: Path) -> None:
    pool = PromptPool(0, tmp_path)
    phase = LoadPhase("p", 4, 1.0).as_workload_phase()
    fast, slow = phase_stream(pool, 0, 0), phase_stream(pool, 0, 0)
    for _ in range(30):  # a fast server drew 30 requests in phase 0, a slow one 5
        fast.next(phase)
    for _ in range(5):
        slow.next(phase)
    a, b = phase_stream(pool, 0, 1).next(phase), phase_stream(pool, 0, 1).next(phase)
    assert (a.request_id, a.request_type, a.prompt) == (b.request_id, b.request_type, b.prompt)
    assert a.request_id == f"r{PHASE_REQUEST_STRIDE}"
    assert phase_stream(pool, 0, 0).next(phase).request_id == "r0"  # phase 0 starts where the stream always did


def test_the_price_of_spectunes_path_at_k3_and_the_cpu_beside_it() -> None:
    per = {"k3": [ph(100, 0.02), ph(300, 0.05)], "k5": [ph(90, 0.02), ph(250, 0.06)],
           K3_STEERED: [ph(95, 0.02), ph(300, 0.05)]}
    v = verdict(_configs(per))
    assert v["k3_steered_over_k3_by_phase"] == pytest.approx([0.95, 1.0])
    assert v["k3_steered_over_k3"] == pytest.approx(395 / 400)
    # CPU shares: medians over repeats, phases without a reading (an older result, a dead sidecar) left out
    runs = [[{**ph(10, 0.1), "sidecar_cpu_share": 0.02}], [{**ph(10, 0.1), "sidecar_cpu_share": 0.04}],
            [{**ph(10, 0.1), "sidecar_cpu_share": None}]]
    m = median_runs(runs)[0]
    assert m["sidecar_cpu_share"] == pytest.approx(0.03)
    assert m["redis_cpu_share"] is None
