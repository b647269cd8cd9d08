"""The policy benchmark's pieces: calibration gaps, the operator's schedule, and the engine replay (tiny models)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bench.policies import (
    EnginePlan,
    _EngineRun,
    bucket_metrics,
    early_regret,
    first_update_window,
    lineup,
    main,
    median_of_repeats,
    replay_interleaved,
    schedule_from_best,
    target_of,
)
from controller.offline.simulator import Calibration, SimResult, WindowSpec, workload
from policies import GoodputPolicy, StaticPolicy

FIXTURE = Path(__file__).with_name("fixture_engine.json")


def test_calibration_with_gaps_extrapolates_and_says_so(tmp_path: Path) -> None:
    # A quick engine plan: short context only, batch 1 and 16 only.
    doc = json.loads(FIXTURE.read_text())
    doc["cells"] = [c for c in doc["cells"] if c["context"] == "short" and c["batch_size"] in (1, 16)]
    path = tmp_path / "quick.json"
    path.write_text(json.dumps(doc))
    cal = Calibration(path)
    cal.note_batches([1, 4, 16, 64])
    assert cal.measured_contexts == ["short"]
    assert any("'long' not measured" in g for g in cal.gaps)
    assert any("batch 64 not measured" in g and "extrapolated" in g for g in cal.gaps)
    assert any("batch 4 not measured" in g and "interpolated" in g for g in cal.gaps)
    # long context: short's cost and acceptance, but its own (longer) bucket
    assert np.allclose(cal.round_s(16, "long"), cal.round_s(16, "short"))
    assert np.allclose(cal.pmf("target-v2", "code", "long", 4), cal.pmf("target-v2", "code", "short", 4))
    assert cal.bucket_label("long") != cal.bucket_label("short")
    # batch 64 follows the power law through 1 and 16; smoothed cost is linear in k
    v = [cal.round_s(b, "short")[4, 1] for b in (1, 4, 16, 64)]
    assert all(np.diff(v) > 0)
    verify = cal.round_s(16, "short")[:, 1]
    assert np.allclose(np.diff(verify, 2), 0.0, atol=1e-12)
    with pytest.raises(ValueError):
        Calibration(path, smooth="spline")


def test_batch_measured_at_one_context_only(tmp_path: Path) -> None:
    doc = json.loads(FIXTURE.read_text())
    doc["cells"] = [c for c in doc["cells"] if not (c["context"] == "long" and c["batch_size"] == 64)]
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(doc))
    cal = Calibration(path)
    assert any("batch 64 not measured at 'long'" in g for g in cal.gaps)
    assert np.allclose(cal.round_s(64, "long"), cal.round_s(64, "short"))


def test_raw_costs_kept_when_not_smoothed() -> None:
    cal = Calibration(FIXTURE, smooth="none")
    assert np.array_equal(cal.cost, cal.raw_cost)


def test_schedule_from_best_fills_gaps_and_merges() -> None:
    sched = schedule_from_best({1: 4, 4: 4, 16: 2, 64: 0})
    assert sched == [[1, 8, 4], [9, 32, 2], [33, 256, 0]]
    assert schedule_from_best({4: 3}) == [[1, 256, 3]]


def test_median_of_repeats_takes_ratios_within_each_repeat() -> None:
    # Repeat 2 ran on a machine twice as fast: every tok/s doubled, no ratio changed.
    def rep(scale: float, g: float) -> dict[str, object]:
        pol = {"static": 100.0, "goodput": g}
        return {"oracle_tok_s": 110.0 * scale, "rounds": 7,
                "policies": {n: {"tok_s": v * scale, "ratio_to_oracle": v / 110.0, "k_changes_per_1000": v}
                             for n, v in pol.items()}}

    out = median_of_repeats([rep(1.0, 99.0), rep(2.0, 88.0), rep(1.0, 110.0)])
    assert out["goodput_over"]["static"] == pytest.approx(0.99)  # median of 0.99, 0.88, 1.10
    assert out["oracle_over_static"] == pytest.approx(1.1)
    g = out["policies"]["goodput"]
    assert g["ratio_to_oracle"] == pytest.approx(0.9) and g["k_changes_per_1000"] == 99.0  # the median repeat
    assert g["ratio_to_oracle_repeats"] == pytest.approx([0.9, 0.8, 1.0])
    assert len(out["repeats"]) == 3


def test_workload_caps_batch_sizes() -> None:
    specs = workload(["code", "prose", "structured"], 20_000, seed=0, batch_cap=32, long_batch_cap=4)
    assert max(s.batch_size for s in specs) <= 32
    assert all(s.batch_size <= 4 for s in specs if s.context == "long")
    assert {s.version for s in specs} == {"target-v1", "target-v2"}
    short = workload(["code", "prose", "structured"], 48 * 20, seed=0, stretch=(2, 3))
    assert {1, 4, 16, 64} <= {s.batch_size for s in short}  # a short run still visits every load


@pytest.fixture(scope="module")
def tiny_models() -> object:
    import torch

    from engine.loader import DeviceChoice, Models
    from engine.model import MODEL_PRESETS, Transformer

    torch.manual_seed(0)
    target, draft, v2 = (Transformer(MODEL_PRESETS["tiny"]).eval() for _ in range(3))
    return Models(target, draft, v2, DeviceChoice(torch.device("cpu"), torch.float32), {})


def test_engine_replay_is_closed_loop_and_seeded(tiny_models: object) -> None:
    plan = EnginePlan(windows=4, window_s=0.01, sweep_ks=(0, 2), batch_cap=4, long_batch_cap=2, stretch=(1, 2),
                      repeats=1, prompt_bytes=(("short", 16), ("long", 64)), max_new_tokens=8)
    prompts = {(t, cx): [bytes([65 + i]) * n for i in range(4)]
               for t in ("code", "prose", "structured") for cx, n in plan.prompt_bytes}
    mix = (0.4, 0.4, 0.2)
    specs = [WindowSpec(4, "short", mix, "target-v1"), WindowSpec(2, "long", mix, "target-v1"),
             WindowSpec(4, "short", mix, "target-v2"), WindowSpec(1, "short", mix, "target-v2")]
    pols = {"static": StaticPolicy(k=2), "goodput": GoodputPolicy(seed=1)}
    out = replay_interleaved(tiny_models, plan, prompts, 3, pols, specs)
    a = out["static"]
    assert (a.rounds > 0).all() and (a.tokens >= a.rounds).all() and (a.seconds >= plan.window_s).all()
    assert all(set(ks.values()) == {2} for ks in a.ks)
    assert all(key.startswith("target-v2|") for ks in a.ks[2:] for key in ks)  # the model update happened
    assert all(0 <= k <= 8 for ks in out["goodput"].ks for k in ks.values())


def test_engine_windows_decode_with_the_target_their_version_names(tiny_models: object) -> None:
    """The xl profile's ids are target-v1-xl4 / target-v2-xl4: its workload must carry them, and a window whose id
    names no loaded target is refused (it once decoded the whole xl workload with target-v2)."""
    from engine.loader import Models

    assert isinstance(tiny_models, Models)
    xl = dataclasses.replace(tiny_models, target_version="target-v1-xl4", target_v2_version="target-v2-xl4")
    assert target_of(xl, "target-v1-xl4") is xl.target and target_of(xl, "target-v2-xl4") is xl.target_v2
    with pytest.raises(ValueError, match="no loaded target has version 'target-v1'"):
        target_of(xl, "target-v1")
    specs = workload(["code", "prose", "structured"], 48 * 20, seed=0, base_version=xl.target_version,
                     update_version=xl.target_v2_version)
    assert specs[0].version == "target-v1-xl4" and specs[-1].version == "target-v2-xl4"
    assert {s.version for s in specs} == {"target-v1-xl4", "target-v2-xl4"}
    plan = EnginePlan(windows=2, window_s=0.01, sweep_ks=(0,), batch_cap=4, long_batch_cap=2, stretch=(1, 1),
                      repeats=1, prompt_bytes=(("short", 16), ("long", 64)), max_new_tokens=8)
    prompts = {(t, cx): [b"x" * n] for t in ("code", "prose", "structured") for cx, n in plan.prompt_bytes}
    run = _EngineRun(xl, plan, prompts, seed=3)
    mix = (0.4, 0.4, 0.2)
    run.window(StaticPolicy(k=2), WindowSpec(4, "short", mix, "target-v1-xl4"))
    assert run.engines[(4, "short")].target is xl.target
    run.window(StaticPolicy(k=2), WindowSpec(4, "short", mix, "target-v2-xl4"))
    assert run.engines[(4, "short")].target is xl.target_v2  # the model update swapped the target


def test_rounds_to_90_split_cold_and_after_update_by_the_workloads_first_version() -> None:
    mix = (0.4, 0.4, 0.2)
    specs = [WindowSpec(1, "short", mix, "target-v1-xl4"), WindowSpec(1, "short", mix, "target-v2-xl4")]
    ks = [{"target-v1-xl4|draft-v1|code|1|<=512": 2}, {"target-v2-xl4|draft-v1|code|1|<=512": 2}]
    res = SimResult(np.ones(2), np.ones(2), np.full(2, 10.0), np.ones(2), ks)
    out = bucket_metrics(res, res, specs)
    assert out["rounds_to_90_cold"]["buckets"] == 1 and out["rounds_to_90_after_update"]["buckets"] == 1


def test_early_regret_counts_the_first_rounds_cold_and_after_the_update() -> None:
    mix = (0.4, 0.4, 0.2)
    specs = [WindowSpec(1, "short", mix, v) for v in ("a", "a", "a", "b", "b", "b")]
    rounds = np.array([150.0, 100.0, 100.0, 100.0, 100.0, 100.0])
    oracle = SimResult(np.ones(6), np.ones(6), rounds, np.full(6, 100.0))
    # the policy loses half in its first window and 20% in the second; after the update, 10% in one window
    res = SimResult(np.ones(6), np.ones(6), rounds, np.array([50.0, 80.0, 100.0, 90.0, 100.0, 100.0]))
    assert first_update_window(specs) == 3
    # first 200 rounds: all of window 0 (150) and half of window 1 (50 of 100)
    assert early_regret(res, oracle, 0) == pytest.approx(1.0 - (50.0 + 0.5 * 80.0) / (100.0 + 0.5 * 100.0))
    assert early_regret(res, oracle, 3) == pytest.approx(1.0 - (90.0 + 100.0) / 200.0)
    assert early_regret(res, oracle, None) is None
    assert early_regret(res, oracle, 5) is None  # the workload ends before 200 rounds
    out = bucket_metrics(res, oracle, specs)["early_regret"]
    assert out["rounds"] == 200 and out["after_update"] == pytest.approx(0.05)
    assert first_update_window(specs[:3]) is None


def test_a_narrowed_lineup_keeps_static_and_goodput() -> None:
    schedule = schedule_from_best({1: 4, 64: 1})
    pols = lineup(3, schedule, seed=0, only=["vllm_dynamic"])
    assert set(pols) == {"static", "vllm_dynamic", "goodput"}
    assert isinstance(pols["static"], StaticPolicy) and pols["static"].k == 3
    assert {"batch_table", "hf_heuristic"} <= set(lineup(3, schedule, seed=0))


def test_cli_refuses_an_unknown_policy_and_an_empty_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--no-sim", "--policies", "goodput,nosuch"])
    assert "unknown policies ['nosuch']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--no-sim", "--no-engine"])
    assert "leave nothing to run" in capsys.readouterr().err
