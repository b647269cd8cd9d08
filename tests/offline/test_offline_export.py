"""``spectune export``: each engine's documented rules (tables violating each one), the traffic-weighted
projection, and the command end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controller.cli import main as spectune
from controller.offline import export as ex
from controller.offline import project as pj
from telemetry.policy_table import table_to_json
from telemetry.records import AcceptanceWindow, CostWindow, PolicyTable, Stat, WindowBatch
from telemetry.store import Store

T, D = "target-v1", "draft-v1"
DRAFT = "/models/draft-v1"  # a draft model path, as an operator passes it
TABLE = PolicyTable(version=7, default_k=1, k_max=8, entries={
    f"{T}|{D}|code|*|*": 4, f"{T}|{D}|prose|*|*": 1, f"{T}|{D}|*|64|*": 0, f"{T}|{D}|*|128|*": 0,
    f"{T}|{D}|*|256|*": 0,
})


def acc(rt: str, rows: int, alpha: float, k: int = 4, ctx: str = "<=512") -> AcceptanceWindow:
    """Rows of one type whose acceptance is geometric with ``alpha`` (rounded to counts)."""
    tail = [round(rows * alpha**i) for i in range(k + 1)] + [0]
    hist = tuple(tail[i] - tail[i + 1] for i in range(k + 1))
    accepted = sum(i * h for i, h in enumerate(hist))
    return AcceptanceWindow(T, D, rt, ctx, k, rows, rows * k, accepted, accepted + rows, hist)


def cost(batch: int, k: int, rounds: int = 10, ctx: str = "<=512") -> CostWindow:
    verify = rounds * 0.02
    draft = rounds * 0.002 * k
    return CostWindow(T, D, batch, ctx, k, rounds, rounds * batch * (k + 1), rounds * batch * 2, rounds * batch,
                      Stat(rounds, draft, draft * draft, draft), Stat(rounds, verify, verify * verify, verify),
                      Stat(rounds, 0.0, 0.0, 0.0), 0.01, 0.02, 0.03)


def traffic(code_rows: int, prose_rows: int) -> pj.Traffic:
    windows = [acc("code", code_rows, 0.9), acc("prose", prose_rows, 0.3)]
    costs = [cost(b, 4) for b in (1, 8, 64)]
    return pj.traffic_from_windows(windows, costs, TABLE)


# -------------------------------------------------------------------------------------------- projection
def test_projection_follows_the_traffic_mix() -> None:
    mostly_code, mostly_prose = traffic(900, 100), traffic(100, 900)
    a = pj.project_batches(mostly_code, pj.table_k(TABLE, mostly_code))
    b = pj.project_batches(mostly_prose, pj.table_k(TABLE, mostly_prose))
    assert (a[1], a[8], a[64], a[256]) == (4, 4, 0, 0)
    assert (b[1], b[8], b[64]) == (1, 1, 0)  # same table, other traffic: prose's k
    full = pj.table_k(TABLE, mostly_code)
    assert pj.predicted(mostly_code, full) >= pj.predicted(mostly_code, lambda rt, bb, c: a[bb])
    assert mostly_code.has_seconds and mostly_code.versions == (T, D)


def test_projection_without_windows_votes_and_says_so() -> None:
    t = pj.traffic_from_windows([], [], TABLE)
    assert not t.observed and any("no acceptance windows" in n for n in t.notes)
    sched = pj.project_batches(t, pj.table_k(TABLE, t))
    assert sched[1] == 1  # code 4 vs prose 1 tie: the smaller k
    assert sched[256] == 0


def non_increasing_schedules(buckets: list[int], ks: list[int]) -> list[dict[int, int]]:
    """Every schedule over ``buckets`` whose k (from ``ks``) never rises with batch (brute force for the tests)."""
    out: list[dict[int, int]] = [{}]
    for b in sorted(buckets):
        out = [{**s, b: k} for s in out for k in ks if not s or k <= s[max(s)]]
    return out


def test_the_schedule_is_the_best_one_that_never_drafts_deeper_at_a_larger_batch() -> None:
    # Against brute force: no schedule whose k never rises with batch scores more, and ties keep the smaller ks.
    rng = np.random.default_rng(0)
    buckets, ks = [1, 2, 4, 8, 16], [0, 1, 3, 5]
    for _ in range(50):
        scores = {b: {k: float(rng.integers(0, 6)) for k in ks} for b in buckets}
        got = pj.non_increasing(scores)
        assert [got[b] for b in buckets] == sorted((got[b] for b in buckets), reverse=True)

        def total(s: dict[int, int], scores: dict[int, dict[int, float]] = scores) -> float:
            return sum(scores[b][s[b]] for b in s)

        best = max(total(s) for s in non_increasing_schedules(buckets, ks))
        assert total(got) == best
        assert sum(got.values()) == min(sum(s.values()) for s in non_increasing_schedules(buckets, ks)
                                        if total(s) == best)
    # a noisy middle bucket (k = 2 at 5-8, then 3 at 9-16 with little to gain) does not make k rise again
    assert pj.non_increasing({4: {5: 10.0, 2: 6.0}, 8: {2: 5.0, 3: 4.9}, 16: {3: 3.05, 2: 3.0}}) == {4: 5, 8: 2,
                                                                                                     16: 2}


def test_buckets_nothing_measured_are_held_between_their_measured_neighbours() -> None:
    # The table's default (k = 5) past the largest batch measured, and a guess above its smaller neighbour's k
    sched = {1: 5, 2: 5, 4: 3, 8: 4, 16: 1, 64: 5, 256: 5}
    assert pj.within_measured(sched, [2, 4, 16]) == {1: 5, 2: 5, 4: 3, 8: 3, 16: 1, 64: 1, 256: 1}
    assert pj.within_measured({1: 0, 4: 3}, [4]) == {1: 3, 4: 3}  # below the smallest measured: no shallower
    assert pj.within_measured(sched, []) == sched


def test_projection_never_drafts_at_a_large_batch_deeper_than_the_largest_batch_measured() -> None:
    # Traffic at batch 1 and 8 only; the table says 4 for code everywhere up to 64: the schedule at 16-32 (no
    # traffic) keeps batch 8's k, and a table that drafts less at 8 than at 1 keeps that order.
    table = PolicyTable(version=3, default_k=5, k_max=8, entries={
        f"{T}|{D}|code|1|*": 5, f"{T}|{D}|code|8|*": 2, f"{T}|{D}|code|16|*": 4, f"{T}|{D}|code|32|*": 4})
    t = pj.traffic_from_windows([acc("code", 900, 0.9)], [cost(1, 4), cost(8, 4)], table)
    sched = pj.project_batches(t, pj.table_k(table, t))
    assert sched[1] == 5 and sched[8] == 2
    assert all(sched[b] <= 2 for b in t.batches if b > 8), sched
    ks = [sched[b] for b in sorted(sched)]
    assert ks == sorted(ks, reverse=True)


# -------------------------------------------------------------------------------------------------- vLLM
def test_vllm_export_merges_ranges_and_notes_k0() -> None:
    out = ex.vllm_export({1: 4, 2: 4, 8: 2, 64: 0, 256: 0}, draft_model=DRAFT)
    assert out.config["num_speculative_tokens"] == 4
    assert (out.config["method"], out.config["model"]) == ("draft_model", DRAFT)
    assert out.config["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 8, 2], [9, 256, 0]]
    assert any("#49548" in n for n in out.notes)
    assert (out.k_of("x", 2, "<=512"), out.k_of("x", 8, "<=512"), out.k_of("x", 512, "<=512")) == (4, 2, 0)


def test_vllm_context_grid_is_rectangular() -> None:
    ctxs = ["<=512", ">512"]
    out = ex.vllm_export({1: 4, 8: 2}, {(1, "<=512"): 4, (1, ">512"): 3, (8, "<=512"): 2, (8, ">512"): 0}, ctxs,
                         draft_model=DRAFT)
    assert out.config["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 1, 512, 4], [1, 1, 513, ex.CTX_INFINITY, 3], [2, 8, 1, 512, 2], [2, 8, 513, ex.CTX_INFINITY, 0]]
    assert out.k_of("x", 1, ">512") == 3 and out.k_of("x", 8, "<=512") == 2


@pytest.mark.parametrize(("cfg", "rule"), [
    ({"num_speculative_tokens": 0, "num_speculative_tokens_per_batch_size": [[1, 4, 0]]}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": []}, "non-empty"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": {"1-4": 3}}, "non-empty list"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 8, 1, 9, 2]]}, "mix"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, "3"]]}, "integers"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [9, 8, 1]]}, "lo <= hi"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[0, 4, 3]]}, "lo <= hi"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, 5]]}, "K must be"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, "K must be"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[2, 4, 3]]}, "start at 1"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [4, 8, 1]]}, "overlap"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [
        [1, 4, 1, 512, 3], [5, 8, 1, 512, 1], [1, 8, 513, 9999, 0]]}, "rectangular"),
    ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [
        [1, 4, 1, 512, 3], [1, 4, 500, 9999, 1]]}, "context ranges overlap"),
])
def test_vllm_rules(cfg: dict[str, Any], rule: str) -> None:
    with pytest.raises(ex.ExportError, match=rule):
        ex.validate_vllm(cfg)


def test_vllm_all_off_is_refused() -> None:
    with pytest.raises(ex.ExportError, match="without --speculative-config"):
        ex.vllm_export({1: 0, 8: 0}, draft_model=DRAFT)


# ------------------------------------------------------------------------------------------------ TRT-LLM
def test_trtllm_export_up_to_key() -> None:
    out = ex.trtllm_export({1: 4, 2: 4, 8: 2, 64: 0, 256: 0}, draft_model=DRAFT)
    spec = out.config["speculative_config"]
    assert spec == {"decoding_type": "Draft_Target", "max_draft_len": 4, "speculative_model_dir": DRAFT,
                    "draft_len_schedule": {2: 4, 8: 2}}  # trailing off keys dropped
    assert [out.k_of("x", b, "") for b in (1, 2, 3, 8, 9)] == [4, 4, 2, 2, 0]  # above the largest key: off
    clamped = ex.trtllm_export({1: 2, 8: 3, 64: 1}, max_batch_size=512, draft_model=DRAFT)
    assert clamped.config["speculative_config"]["draft_len_schedule"] == {8: 2, 512: 1}
    assert any("clamped" in n for n in clamped.notes)
    with pytest.raises(ex.ExportError, match="smallest batch"):
        ex.trtllm_export({1: 0, 8: 2}, draft_model=DRAFT)


@pytest.mark.parametrize(("spec", "rule"), [
    ({"max_draft_len": 0, "draft_len_schedule": {"1": 0}}, "max_draft_len must be"),
    ({"max_draft_len": 3, "draft_len_schedule": {}}, "non-empty"),
    ({"max_draft_len": 3, "draft_len_schedule": {"0": 3}}, ">= 1"),
    ({"max_draft_len": 3, "draft_len_schedule": {"one": 3}}, "not an integer"),
    ({"max_draft_len": 3, "draft_len_schedule": {"1": 3, "8": -1}}, "draft length must be"),
    ({"max_draft_len": 3, "draft_len_schedule": {"1": 3, "8": 4}}, "exceeds max_draft_len"),
    ({"max_draft_len": 3, "draft_len_schedule": {"1": 2, "8": 1}}, "must equal max_draft_len"),
])
def test_trtllm_rules(spec: dict[str, Any], rule: str) -> None:
    with pytest.raises(ex.ExportError, match=rule):
        ex.validate_trtllm({"speculative_config": {"decoding_type": "Draft_Target", "speculative_model_dir": DRAFT,
                                                   **spec}})


# ------------------------------------------------------------------------------------------- SGLang / HF
def test_sglang_and_hf_exports() -> None:
    s = ex.sglang_export(3)
    assert s.args == ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                      "--speculative-num-draft-tokens", "4")
    a = ex.sglang_adaptive_export({1: [1, 4], 8: [0, 1], 64: [0]}, {1: 4, 8: 1, 64: 0}, "cfg.json")
    assert a.config == {"1": {"candidate_steps": [1, 4]}, "2": {"candidate_steps": [0, 1]},
                        "9": {"candidate_steps": [0]}}  # SGLang keys a slot by its smallest batch size
    assert a.args[:3] == ("--speculative-adaptive", "--speculative-adaptive-config", "cfg.json")
    assert a.args[a.args.index("--speculative-num-steps") + 1] == "4"
    h = ex.hf_export(5)
    assert h.config == {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "constant"} and h.batches == (1,)


@pytest.mark.parametrize(("check", "rule"), [
    (lambda: ex.validate_sglang({"speculative_num_steps": 0, "speculative_eagle_topk": 1,
                                 "speculative_num_draft_tokens": 1}), "num-steps must be"),
    (lambda: ex.validate_sglang({"speculative_num_steps": 3, "speculative_eagle_topk": 4,
                                 "speculative_num_draft_tokens": 4}), "topk must be 1"),
    (lambda: ex.validate_sglang({"speculative_num_steps": 3, "speculative_eagle_topk": 1,
                                 "speculative_num_draft_tokens": 8}), "num_steps \\+ 1"),
    (lambda: ex.validate_sglang_adaptive({"strategy": "ema"}, 3), "integer-string"),
    (lambda: ex.validate_sglang_adaptive({"1": {"candidate_steps": []}}, 3), "non-empty list"),
    (lambda: ex.validate_sglang_adaptive({"1": {"candidate_steps": [-1, 3]}}, 3), "ints >= 0"),
    (lambda: ex.validate_sglang_adaptive({"1": {"candidate_steps": [1, 2]}}, 3), "one of the candidate"),
    (lambda: ex.validate_hf({"num_assistant_tokens": 0, "num_assistant_tokens_schedule": "constant"}), ">= 1"),
    (lambda: ex.validate_hf({"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "heuristic"}), "constant"),
])
def test_sglang_and_hf_rules(check: Any, rule: str) -> None:
    with pytest.raises(ex.ExportError, match=rule):
        check()


def test_off_tables_are_refused_by_sglang_and_hf() -> None:
    for fn in (ex.sglang_export, ex.hf_export):
        with pytest.raises(ex.ExportError, match="off"):
            fn(0)


# ----------------------------------------------------------------------------------------------- the CLI
def test_cli_export_from_the_store(db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Store(db_url, auto_upgrade=True) as store:
        store.save_policy_version(TABLE)
        store.ingest([WindowBatch("e", 1, 0.0, 1.0, acceptance=(acc("code", 900, 0.9), acc("prose", 100, 0.3)),
                                  cost=tuple(cost(b, 4) for b in (1, 8, 64)))])
    assert spectune(["export", "vllm", "--db-url", db_url, "--base", f'{{"method": "eagle3", "model": "{DRAFT}"}}']
                    ) == 0
    out, err = capsys.readouterr()
    cfg = json.loads(out)
    assert cfg["method"] == "eagle3" and cfg["num_speculative_tokens"] == 4
    assert cfg["num_speculative_tokens_per_batch_size"][0] == [1, 32, 4]
    assert "flags: --speculative-config" in err and "#49548" in err
    assert "predicted goodput" in err and "tok/s" in err and "lost to the projection" in err
    path = tmp_path / "adaptive.json"
    assert spectune(["export", "sglang-adaptive", "--db-url", db_url, "--out", str(path)]) == 0
    assert json.loads(path.read_text())["1"] == {"candidate_steps": [1, 4]}
    assert str(path) in capsys.readouterr().err


def test_cli_export_from_a_table_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "table.json"
    path.write_text(table_to_json(TABLE))
    for engine in ("trtllm", "hf"):
        assert spectune(["export", engine, "--table", str(path), "--draft-model", DRAFT]) == 0
    out, err = capsys.readouterr()
    assert "draft_len_schedule:" in out and '"num_assistant_tokens": 1' in out
    assert "x plain decoding" in err and "no acceptance windows stored" in err
    # one k for every batch size, by uniform vote without traffic: 0 (off at 64+) ties 1 and 4 and wins
    assert spectune(["export", "sglang", "--table", str(path)]) == 2
    assert "run SGLang without speculative flags" in capsys.readouterr().err
    assert spectune(["export", "vllm"]) == 2  # no table anywhere: one error line
    assert "no policy table" in capsys.readouterr().err
    path.write_text('{"version": 1}')
    assert spectune(["export", "vllm", "--table", str(path)]) == 2
