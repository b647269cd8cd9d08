"""The per-step logic of spectune inside vLLM, without vLLM: config, the batch rule, request types, round records."""

from __future__ import annotations

import json

import pytest

from controller.engines.vllm.steps import (
    PrefillCost,
    RowAtSchedule,
    RowOutcome,
    VllmSpectuneConfig,
    VllmStepBridge,
    batch_k,
)
from telemetry.records import PolicyTable, RoundRecord
from telemetry.wire import check_round

V = {"target_version": "target-v1", "draft_version": "draft-v1"}


def bridge(**kw: object) -> VllmStepBridge:
    return VllmStepBridge(VllmSpectuneConfig(**(V | {"k_max": 8} | kw)))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ config
def test_config_from_additional_config_takes_k_max_from_vllm() -> None:
    cfg = VllmSpectuneConfig.from_mapping(V | {"redis_url": "redis://127.0.0.1:6379/0"}, k_max=5)
    assert cfg.k_max == 5 and cfg.start_k == 5  # fail-static at vLLM's own static setting
    assert VllmSpectuneConfig.from_mapping(json.loads(cfg.to_json()), k_max=5) == cfg


@pytest.mark.parametrize(("raw", "words"), [
    (V | {"k_maxx": 3}, "unknown spectune settings ['k_maxx']"),
    ({"target_version": "t"}, "missing: ['draft_version']"),
    (V | {"k_max": 3}, "disagrees with vLLM's num_speculative_tokens=5"),
    (V | {"fixed_k": 6}, "fixed_k must be in [0, k_max=5]"),
    (V | {"target_version": "a|b"}, "must not contain '|'"),
    ([1, 2], "must be an object"),
])
def test_bad_settings_are_refused_with_the_reason(raw: object, words: str) -> None:
    with pytest.raises(ValueError) as e:
        VllmSpectuneConfig.from_mapping(raw, k_max=5)  # type: ignore[arg-type]
    assert words in str(e.value)


# ------------------------------------------------------------------------------------------ batch rule
@pytest.mark.parametrize(("ks", "k"), [
    ([4], 4),
    ([0, 5], 0),  # between two middle values the smaller: a larger k costs every row
    ([0, 3, 5], 3),
    ([5, 5, 5, 0, 0], 5),  # the dominant type's k when it holds more than half of the rows
    ([0, 0, 5, 5, 5, 2], 2),
    ([2, 2, 0, 0], 0),
])
def test_batch_k_is_the_lower_median(ks: list[int], k: int) -> None:
    assert batch_k(ks) == k


def test_choose_k_asks_the_table_per_row_and_applies_the_batch_rule() -> None:
    b = bridge(default_k=1)
    rows = [RowAtSchedule("code", 100, True, 10)] * 3 + [RowAtSchedule("prose", 3000, True, 10)] * 2
    assert b.choose_k(rows, 5) == 1  # fail-static: every row answers default_k
    b.client.apply(PolicyTable(version=1, default_k=1, k_max=8, entries={
        "target-v1|draft-v1|code|8|<=8192": 6, "target-v1|draft-v1|prose|*|*": 0}))
    assert b.choose_k(rows, 5) == 6  # code holds 3 of 5 rows at batch bucket 8
    assert b.choose_k(rows[:2] + rows[3:], 4) == 0  # 2 code rows at bucket 4 (default 1), 2 prose rows (0)
    assert b.counters.k_counts == {1: 1, 6: 1, 0: 1}


def test_every_row_asks_at_the_steps_longest_context_the_cell_its_round_is_costed_in() -> None:
    """A round's cost lands in the cell of its longest context, so that cell chooses the batch's k: short rows
    beside one long prompt do not run the short cell's k."""
    b = bridge(default_k=2)
    b.client.apply(PolicyTable(version=1, default_k=2, k_max=8, entries={
        "target-v1|draft-v1|code|16|<=512": 0, "target-v1|draft-v1|code|16|<=2048": 4}))
    short = [RowAtSchedule("code", 300, True, 40)] * 15
    assert b.choose_k(short, 15) == 0  # every row short: the short cell
    assert b.choose_k([*short, RowAtSchedule("code", 1400, False, 0)], 16) == 4  # one long prompt: the long cell


def test_fixed_k_follows_no_table_and_k_never_exceeds_k_max() -> None:
    b = bridge(fixed_k=3)
    b.client.apply(PolicyTable(version=1, default_k=8, k_max=8))
    assert b.choose_k([RowAtSchedule("code", 10, True, 0)], 1) == 3


# ---------------------------------------------------------------------------------------- request type
def test_request_type_from_extra_args_absent_is_wildcard() -> None:
    b = bridge()
    assert b.request_type(None) == "*"
    assert b.request_type({}) == "*"
    assert b.request_type({"other": 1}) == "*"
    assert b.request_type({"request_type": "code"}) == "code"


@pytest.mark.parametrize("bad", ["a|b", "", "x" * 65, "nul\x00", 7, ["code"]])
def test_a_bad_request_type_is_counted_and_reported_as_wildcard(bad: object) -> None:
    b = bridge()
    assert b.request_type({"request_type": bad}) == "*"
    assert b.counters.bad_request_types == 1
    assert b.status()["last_bad_request_type"] == repr(bad)[:80]


def test_request_types_past_the_cap_fold_into_the_wildcard() -> None:
    b = bridge(max_request_types=2)
    assert [b.request_type({"request_type": t}) for t in ("a", "b", "c", "a")] == ["a", "b", "*", "a"]
    assert b.counters.folded_request_types == 1


# -------------------------------------------------------------------------------------------- records
def test_a_step_becomes_a_valid_round_with_packed_tokens_and_prefill_apart() -> None:
    b = bridge()
    rows = [
        (RowAtSchedule("code", 120, True, 20), RowOutcome(drafts=3, sampled=4, outputs_after=24)),  # all kept
        (RowAtSchedule("prose", 80, True, 5), RowOutcome(drafts=3, sampled=1, outputs_after=6)),  # first rejected
        (RowAtSchedule("code", 60, True, 7), RowOutcome(drafts=3, sampled=3, outputs_after=8)),  # stopped at EOS
        (RowAtSchedule("*", 500, False, 0), RowOutcome(drafts=0, sampled=1, outputs_after=1)),  # last prompt chunk
        (RowAtSchedule("code", 90, True, 3), None),  # aborted mid-step
    ]
    r = b.round_record(rows, schedule_s=0.001, model_s=0.040, update_s=0.002, prefill_tokens=500,
                       total_tokens=512, timestamp=1.0e9)
    assert r is not None
    check_round(r)
    assert [(x.request_type, x.context_len, x.k, x.accepted, x.emitted) for x in r.rows] == [
        ("code", 120, 3, 3, 4), ("prose", 80, 3, 0, 1), ("code", 60, 3, 2, 1)]
    assert (r.batch_size, r.max_k, r.tokens_verified) == (3, 3, 12)
    assert r.prefill_s == pytest.approx(0.040 * 500 / 512)
    assert r.verify_s == pytest.approx(0.040 * 12 / 512)
    assert r.draft_s == 0.0 and r.other_s == pytest.approx(0.003)
    assert b.counters.rows_skipped == 1


def test_a_prefill_only_step_is_no_round() -> None:
    b = bridge()
    rows = [(RowAtSchedule("code", 300, False, 0), None)]
    assert b.round_record(rows, schedule_s=0.001, model_s=0.01, update_s=0.001, prefill_tokens=300,
                          total_tokens=300, timestamp=1.0e9) is None
    assert b.counters.steps == 1 and b.counters.rounds == 0


def test_prefill_cost_fits_the_marginal_seconds_per_prompt_token() -> None:
    c = PrefillCost(decay=1.0, min_samples=4)
    for n in (100, 1400, 300, 900):
        assert c.per_token() is None  # not before min_steps
        c.add(n, 0.030 + 2e-4 * n)  # 30 ms fixed (weights read, drafter passes) + 0.2 ms per prompt token
    assert c.per_token() == pytest.approx(2e-4)
    assert c.split(0.100, 10, 14) == pytest.approx(2e-3)  # a 10-token chunk beside 4 decode tokens: 2 ms, not 71 ms
    assert c.split(0.010, 1400, 1404) == pytest.approx(0.010 * 1400 / 1404)  # never above the token share
    assert c.split(0.100, 0, 4) == 0.0


@pytest.mark.parametrize("lengths", [(500, 500, 500, 500), (500, 400, 300, 200)])
def test_prefill_cost_without_a_slope_falls_back_to_the_token_share(lengths: tuple[int, ...]) -> None:
    c = PrefillCost(decay=1.0, min_samples=4)
    for i, n in enumerate(lengths):
        c.add(n, 0.1 + 0.001 * i)  # one length, or longer prompts no slower: nothing to fit
    assert c.per_token() is None
    assert c.split(0.040, 500, 512) == pytest.approx(0.040 * 500 / 512)


def test_under_constant_load_the_slope_comes_from_mixed_steps_over_decode_only_ones() -> None:
    c = PrefillCost(decay=1.0, min_samples=4, baseline_alpha=0.5)
    for rows, k, base in ((4, 3, 0.060), (4, 0, 0.040), (16, 3, 0.150)):
        c.add_step(rows, k, 0, base)  # decode-only steps set each (rows, k) baseline
    c.add_step(8, 3, 500, 1.0)  # no baseline for (8, 3): not a sample
    for rows, k, base, n in ((4, 3, 0.060, 100), (4, 0, 0.040, 1400), (16, 3, 0.150, 300), (4, 3, 0.060, 900)):
        assert c.per_token() is None
        c.add_step(rows, k, n, base + 0.005 + 2e-4 * n)  # the new row's first drafts (5 ms) + 0.2 ms per token
    assert c.mixed.samples == 4 and c.prefill_only.samples == 0
    assert c.per_token() == pytest.approx(2e-4)
    for n in (100, 1400, 300, 900):
        c.add(n, 0.030 + 3e-4 * n)
    assert c.per_token() == pytest.approx(3e-4)  # prefill-only steps, once there are enough, are preferred


def test_prefill_only_steps_teach_the_bridge_what_a_prompt_token_costs_in_a_mixed_step() -> None:
    b = bridge()
    for n in (100, 1400, 300, 900, 200, 600, 1200, 50):
        assert b.round_record([(RowAtSchedule("code", n, False, 0), None)], schedule_s=1e-4,
                              model_s=0.030 + 2e-4 * n, update_s=1e-4, prefill_tokens=n, total_tokens=n,
                              timestamp=1.0e9) is None
    rows = [(RowAtSchedule("code", 100 + i, True, 5), RowOutcome(3, 4, 9)) for i in range(4)]
    rows.append((RowAtSchedule("prose", 1400, False, 0), RowOutcome(0, 1, 1)))
    r = b.round_record(rows, schedule_s=1e-4, model_s=0.400, update_s=1e-4, prefill_tokens=1400,
                       total_tokens=1416, timestamp=1.0e9)
    assert r is not None
    check_round(r)
    assert r.prefill_s == pytest.approx(0.280)  # 1400 x 0.2 ms; the token split would say 0.396 s
    assert r.verify_s == pytest.approx(0.120)  # the decoding rows keep the step's fixed cost and their own
    assert b.status()["prefill_s_per_token"] == pytest.approx(2e-4)


@pytest.mark.parametrize("cost_mixed_steps", [False, True])
def test_only_decode_only_steps_teach_cost(cost_mixed_steps: bool) -> None:
    # A step with prompt tokens keeps its rows (acceptance) but, by default, leaves the cost windows: its prompt
    # part is an estimate that moved its k's seconds by 0.2-1.9x on bench vllm (module docstring).
    from telemetry.aggregate import aggregate

    b = bridge(cost_mixed_steps=cost_mixed_steps)
    rows = [(RowAtSchedule("code", 100 + i, True, 5), RowOutcome(3, 4, 9)) for i in range(4)]
    plain = b.round_record(rows, schedule_s=1e-4, model_s=0.060, update_s=1e-4, prefill_tokens=0,
                           total_tokens=16, timestamp=1.0e9)
    mixed = b.round_record([*rows, (RowAtSchedule("prose", 300, False, 0), RowOutcome(0, 1, 1))], schedule_s=1e-4,
                           model_s=0.200, update_s=1e-4, prefill_tokens=300, total_tokens=316, timestamp=1.0e9)
    assert plain is not None and mixed is not None
    assert plain.costed and mixed.costed is cost_mixed_steps
    assert b.status()["uncosted_rounds"] == (0 if cost_mixed_steps else 1)
    agg = aggregate([plain, mixed])
    assert sum(a.rows for a in agg.acceptance) == 8  # every decoding row of both steps
    assert sum(c.rounds for c in agg.cost) == (2 if cost_mixed_steps else 1)


def test_k_zero_rows_are_plain_decoding_rounds() -> None:
    b = bridge()
    r = b.round_record([(RowAtSchedule("code", 10, True, 1), RowOutcome(0, 1, 2))], schedule_s=1e-4,
                       model_s=0.01, update_s=1e-4, prefill_tokens=0, total_tokens=1, timestamp=1.0e9)
    assert r is not None and (r.max_k, r.tokens_verified, r.rows[0].accepted, r.rows[0].emitted) == (0, 1, 0, 1)
    check_round(r)


def test_status_reports_counters_policy_and_overhead_share(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "status.jsonl"
    b = bridge(status_path=str(path))
    b.counters.added_s, b.counters.step_s = 0.001, 0.1
    b.write_status()
    b.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["overhead_share"] == pytest.approx(0.01)
    assert lines[0]["policy"]["fail_static"] is True
    assert lines[-1]["final"] is True


def test_a_failure_of_spectunes_own_code_is_counted_and_shown_never_raised() -> None:
    b = bridge()
    b.step_failed("record", KeyError("req-7"))
    st = b.status()
    assert st["step_errors"] == 1 and st["last_step_error"] == "record: KeyError: 'req-7'"


def test_the_step_trace_is_written_in_blocks_and_at_close(tmp_path: object) -> None:
    from pathlib import Path

    from controller.engines.vllm.steps import TRACE_FLUSH_STEPS

    path = Path(str(tmp_path)) / "trace.jsonl"
    b = bridge(trace_path=str(path))
    for i in range(TRACE_FLUSH_STEPS + 3):
        b.trace({"step": i})
    assert len(path.read_text().splitlines()) == TRACE_FLUSH_STEPS  # one block written, three lines held
    b.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == list(range(TRACE_FLUSH_STEPS + 3))


def test_a_trace_that_cannot_be_written_is_counted_and_the_steps_go_on(tmp_path: object) -> None:
    from pathlib import Path

    b = bridge(trace_path=str(Path(str(tmp_path)) / "no-such-dir" / "trace.jsonl"))
    b.trace({"step": 0})
    b.close()
    st = b.status()
    assert st["trace_errors"] == 1 and st["last_step_error"].startswith("trace: FileNotFoundError")


def test_without_a_trace_path_nothing_is_kept() -> None:
    b = bridge()
    b.trace({"step": 0})
    assert b._trace == []


def _decode_step(b: VllmStepBridge, k: int, model_s: float, propose_s: float | None) -> RoundRecord:
    r = b.round_record([(RowAtSchedule("code", 100, True, 10), RowOutcome(k, 1, 11))], schedule_s=1e-4,
                          model_s=model_s, update_s=1e-4, prefill_tokens=0, total_tokens=k + 1, timestamp=1.0e9,
                          propose_s=propose_s)
    assert r is not None
    return r


def test_each_round_is_charged_the_proposal_that_made_its_drafts() -> None:
    b = bridge()
    first = _decode_step(b, 3, 0.050, 0.030)  # verifies 3 drafts, proposes 5 (30 ms)
    second = _decode_step(b, 5, 0.060, 0.018)  # verifies those 5, proposes 3 (18 ms)
    third = _decode_step(b, 3, 0.045, 0.018)
    # the first round's own drafts were proposed before anything was timed: no draft time for it
    assert (first.draft_s, first.verify_s) == pytest.approx((0.0, 0.020))
    assert (second.draft_s, second.verify_s) == pytest.approx((0.030, 0.042))
    assert (third.draft_s, third.verify_s) == pytest.approx((0.018, 0.027))
    for r in (first, second, third):
        check_round(r)
    st = b.status()
    assert st["draft_timed_steps"] == 3 and st["propose_s"] == pytest.approx(0.066)


def test_a_prefill_only_steps_proposal_is_charged_to_the_round_that_verifies_it() -> None:
    b = bridge()
    assert b.round_record([(RowAtSchedule("code", 0, False, 0), RowOutcome(0, 1, 1))], schedule_s=1e-4,
                          model_s=0.2, update_s=1e-4, prefill_tokens=300, total_tokens=300, timestamp=1.0e9,
                          propose_s=0.025) is None
    r = _decode_step(b, 3, 0.05, 0.02)
    assert r.draft_s == pytest.approx(0.025)
    assert b.prefill_cost.prefill_only.samples == 1  # fitted on the target's part: 0.175 s for 300 tokens


def test_without_the_timer_the_whole_call_is_verification_as_before() -> None:
    b = bridge()
    for _ in range(2):
        r = _decode_step(b, 3, 0.05, None)
        assert (r.draft_s, r.verify_s) == pytest.approx((0.0, 0.05))
    assert b.status()["draft_timed_steps"] == 0
