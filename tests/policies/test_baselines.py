"""Each baseline replays a worked trace written by hand from its source's rule (cited per test)."""

from __future__ import annotations

import pytest

from policies import (
    BatchTablePolicy,
    DecisionKind,
    HFHeuristicPolicy,
    SGLangAdaptiveBSPolicy,
    SGLangAdaptivePolicy,
    TRTLLMSchedulePolicy,
    UCBPolicy,
)
from policies.hf_heuristic import heuristic_step
from policies.sglang_adaptive import PRESETS, SGLangAdaptiveConfig, SlotConfig, recompute_steps
from telemetry.records import AcceptanceWindow, Bucket, CostWindow, Stat

T, D = "target-v1", "draft-v1"


def _bucket(batch: int = 1, ctx: str = "<=512", rtype: str = "code") -> Bucket:
    return Bucket(T, D, rtype, batch, ctx)


def _round(k: int, accepted: int) -> AcceptanceWindow:
    """One row in one round: the unit transformers' rule updates on."""
    hist = tuple(int(i == accepted) for i in range(k + 1))
    return AcceptanceWindow(T, D, "code", "<=512", k=k, rows=1, drafted=k, accepted=accepted, emitted=accepted + 1,
                            hist=hist)


def _batches(steps: int, accepted_per_row: int, rounds: int = 1, batch: int = 1, rows: int = 1) -> CostWindow:
    """``rounds`` verified batches of ``rows`` rows, each row accepting ``accepted_per_row`` drafts."""
    st = Stat(rounds, 0.01 * rounds, 0.0001 * rounds, 0.01)
    n = rounds * rows
    return CostWindow(T, D, batch_bucket=batch, context_bucket="<=512", max_k=steps, rounds=rounds,
                      tokens_verified=n * (steps + 1), emitted=n * (accepted_per_row + 1), batch_rows=n,
                      draft_s=st, verify_s=st, other_s=st, latency_p50=0.01, latency_p95=0.01, latency_p99=0.01)


# ----------------------------------------------------------------------------------------------- transformers
def test_hf_heuristic_replays_a_round_by_round_trace() -> None:
    """transformers ``AssistedCandidateGenerator.update_candidate_strategy`` (schedule "heuristic"):
    ``num_matches == num_assistant_tokens`` -> +2, else ``max(1, num_assistant_tokens - 1)``; here capped at
    k_max = 8. Trace from 5: (k run, drafts accepted) -> next k."""
    trace = [
        (5, 5, 7),  # all accepted: +2
        (7, 7, 8),  # all accepted: +2, capped at k_max
        (8, 3, 7),  # one rejected: -1
        (7, 0, 6),
        (6, 6, 8),  # all accepted again
        (8, 7, 7),  # 7 of 8 is not all: -1
        (7, 6, 6),
        (6, 1, 5),
        (5, 0, 4),
        (4, 0, 3),
        (3, 0, 2),
        (2, 1, 1),
        (1, 0, 1),  # max(1, 0): never off
        (1, 1, 3),  # one of one accepted: +2
    ]
    p = HFHeuristicPolicy(initial_k=5, k_max=8)
    for k, accepted, k_next in trace:
        assert p.decide(_bucket()).k == k
        assert heuristic_step(k, accepted, k_max=8) == k_next
        p.observe(_round(k, accepted))
        assert p.decide(_bucket()).k == k_next


def test_hf_heuristic_window_of_many_rows_follows_the_rule_s_drift() -> None:
    """A window of rows at one k moves once, up iff the +2/-1 rule drifts up: 2p - (1 - p) > 0, i.e. p > 1/3."""
    def window(full: int, rows: int) -> AcceptanceWindow:
        hist = (rows - full, 0, 0, full)
        return AcceptanceWindow(T, D, "code", "<=512", k=3, rows=rows, drafted=3 * rows, accepted=3 * full,
                                emitted=3 * full + rows, hist=hist)

    for full, expected in ((1, 2), (2, 5)):  # p = 1/3: no drift up, -1; p = 2/3: +2
        p = HFHeuristicPolicy(initial_k=3, k_max=8)
        p.observe(window(full, 3))
        assert p.decide(_bucket()).k == expected
    p = HFHeuristicPolicy(initial_k=3, k_max=8)
    p.observe(_round(5, 5))  # run at another k than the state's 3: says nothing about this step
    assert p.decide(_bucket()).k == 3


def test_hf_heuristic_starts_at_transformers_default_capped() -> None:
    """``GenerationConfig.num_assistant_tokens`` defaults to 20; the state is kept within k_max."""
    p = HFHeuristicPolicy(k_max=6)
    assert p.decide(_bucket()).k == 6
    p.observe(_round(6, 6))
    assert p.decide(_bucket()).k == 6  # +2, capped


# ----------------------------------------------------------------------------------------------------- SGLang
def test_sglang_thresholds_with_hysteresis() -> None:
    """sglang ``AdaptiveStepSlot._recompute_params`` on [1, 3, 7], down -0.25, up 0.0: down while
    ``ema <= prev - 0.5 - 0.25``, up (only if not down) while ``ema > current - 0.5``."""
    steps = (1, 3, 7)
    cases = [
        (3, 0.30, 3),  # 0.30 > 1 - 0.5 - 0.25 = 0.25: stays
        (3, 0.25, 1),  # at the drop threshold: down
        (3, 2.50, 3),  # rise needs ema > 3 - 0.5 = 2.5
        (3, 2.51, 7),
        (7, 2.30, 7),  # 2.30 > 3 - 0.5 - 0.25 = 2.25: stays
        (7, 2.25, 3),  # down one; 2.25 > 0.25: not two
        (7, 0.10, 1),  # down two in one recompute
        (1, 0.50, 1),  # rise from 1 needs ema > 0.5
        (1, 2.60, 7),  # up two in one recompute
    ]
    for current, ema, expected in cases:
        assert recompute_steps(steps, current, ema, -0.25, 0.0) == expected, (current, ema)
    # a zero-step floor: the drop threshold to 0 is 0.5 + hysteresis; from 0 the rule probes the next step
    assert recompute_steps((0, 1, 3), 1, 0.5, 0.0, 0.0) == 0
    assert recompute_steps((0, 1, 3), 0, 5.0, 0.0, 0.0) == 1


def test_sglang_replays_a_batch_by_batch_trace() -> None:
    """sglang ``AdaptiveStepSlot.update``: EMA (alpha 0.2) of mean accepted drafts per request, started at
    steps - 1 = 2.0; recompute at batch 15, 20, 25, ... (after 10 warm-up batches, every 5th).
    Hand trace, one batch of one request per cost window:
    batches 1-15 accept 3: ema = 3 - 0.8**15 = 2.964816 > 2.5 -> 7 at batch 15 (not before);
    batches 16-20 accept 1: ema = 1 + 1.964816 * 0.8**5 = 1.643831 <= 2.25 -> 3 (> 0.25: not 1);
    batches 21-25 accept 0: ema = 0.538650 -> stays 3; batches 26-30: ema = 0.176505 <= 0.25 -> 1."""
    p = SGLangAdaptivePolicy()
    assert p.decide(_bucket()).k == 3
    trace = [(1, 3, 3), (14, 3, 3), (15, 3, 7), (19, 1, 7), (20, 1, 3), (25, 0, 3), (29, 0, 3), (30, 0, 1)]
    batch = 0
    for upto, accepted, k_after in trace:
        while batch < upto:
            p.observe(_batches(p.decide(_bucket()).k, accepted))
            batch += 1
        assert p.decide(_bucket()).k == k_after, batch
    emas = {15: 2.964815627911169, 20: 1.6438307849539322, 25: 0.5386504716137046, 30: 0.17650498653837876}
    q = SGLangAdaptivePolicy()
    for n in range(1, 31):
        q.observe(_batches(q.decide(_bucket()).k, 3 if n <= 15 else 1 if n <= 20 else 0))
        if n in emas:
            (st,) = q._state.values()
            assert st.ema == pytest.approx(emas[n], abs=1e-9) and st.batches == n


def test_sglang_window_of_many_batches_is_the_same_batches_one_by_one() -> None:
    """A cost window of n rounds is n batches at its mean accepted; batches after a recompute that changed the
    steps ran at the old steps and are not fed."""
    one = SGLangAdaptivePolicy()
    for _ in range(15):
        one.observe(_batches(one.decide(_bucket()).k, 3, rows=4))
    many = SGLangAdaptivePolicy()
    many.observe(_batches(3, 3, rounds=15, rows=4))
    ((key_one, st_one),), ((key_many, st_many),) = one._state.items(), many._state.items()
    assert key_many == key_one and (st_many.steps, st_many.batches) == (st_one.steps, st_one.batches) == (7, 15)
    assert st_many.ema == pytest.approx(st_one.ema, abs=1e-12)  # closed form vs. 15 steps of the EMA
    longer = SGLangAdaptivePolicy()
    longer.observe(_batches(3, 3, rounds=20))  # switches to 7 at batch 15; batches 16-20 ran at 3
    (st,) = longer._state.values()
    assert (st.steps, st.batches) == (7, 15) and st.ema == pytest.approx(2.964815627911169)
    longer.observe(_batches(3, 0, rounds=5))  # run at the old steps: ignored
    assert longer._state == {(T, D, 1): st}


def test_sglang_probe_from_zero_steps() -> None:
    """From 0 steps the recompute probes the next candidate and starts a negative EMA at its steps - 1."""
    cfg = SGLangAdaptiveConfig(slots={1: SlotConfig((0, 1, 3), down_hysteresis=0.0)}, initial_steps=0)
    p = SGLangAdaptivePolicy(cfg)
    for _ in range(14):
        p.observe(_batches(0, 0))
    (st,) = p._state.values()
    assert (st.steps, st.ema) == (0, -1.0)  # the EMA does not move without drafts
    p.observe(_batches(0, 0))
    (st,) = p._state.values()
    assert (st.steps, st.ema, st.batches) == (1, 0.0, 15)


def test_sglang_batch_size_aware_slots() -> None:
    """Slots keyed by their lowest batch size, a batch routed to the largest key <= it (``_find_closest_bs``):
    [1, 64) -> [1, 3, 7], [64, 128) -> [1, 2, 5], >= 128 -> [1, 2, 6]; initial steps 3, else the middle one."""
    p = SGLangAdaptiveBSPolicy()
    assert p.config == PRESETS["bs_aware"]
    assert [p.slot_of(b) for b in (1, 2, 63, 64, 127, 128, 256)] == [1, 1, 1, 64, 64, 128, 128]
    assert [p.decide(_bucket(b)).k for b in (1, 32, 64, 128, 256)] == [3, 3, 2, 2, 2]
    for _ in range(15):  # accept everything at batch 64: its slot rises to 5; the others do not move
        p.observe(_batches(p.decide(_bucket(64)).k, 2, batch=64))
    assert [p.decide(_bucket(b)).k for b in (32, 64, 128)] == [3, 5, 2]
    single = SGLangAdaptivePolicy()
    assert [single.decide(_bucket(b)).k for b in (1, 64, 256)] == [3, 3, 3]  # one slot for every batch size


# ------------------------------------------------------------------------------------------------------- vLLM
def test_vllm_schedule_inclusive_ranges_and_gaps() -> None:
    """vLLM ``build_dynamic_sd_schedule_lookup``: inclusive [lo, hi, K] ranges from 1; a gap takes the previous
    range's K, past the last range the last K; K is capped by num_speculative_tokens (k_max)."""
    p = BatchTablePolicy(schedule=[[1, 4, 4], [9, 16, 2], [33, 64, 1]], k_max=8)
    expected = {1: 4, 4: 4, 5: 4, 8: 4, 9: 2, 16: 2, 17: 2, 32: 2, 33: 1, 64: 1, 65: 1, 256: 1}
    assert {b: p.decide(_bucket(b)).k for b in expected} == expected
    capped = BatchTablePolicy(schedule=[[1, 4, 6], [5, 8, 0]], k_max=3)
    assert [capped.decide(_bucket(b)).k for b in (1, 4, 5)] == [3, 3, 0]


def test_vllm_schedule_with_context_ranges() -> None:
    """5-item entries: a rectangular grid; the first context range whose end >= the context, the last open."""
    p = BatchTablePolicy(schedule=[[1, 8, 1, 2048, 4], [1, 8, 2049, 8192, 2], [9, 64, 1, 2048, 2],
                                   [9, 64, 2049, 8192, 0]], k_max=8)
    assert [p.decide(_bucket(4, c)).k for c in ("<=512", "<=2048", "<=8192", ">8192")] == [4, 4, 2, 2]
    assert [p.decide(_bucket(64, c)).k for c in ("<=512", ">8192")] == [2, 0]


@pytest.mark.parametrize("schedule", [
    [[2, 4, 1]],  # does not start at 1
    [[1, 4, 2], [4, 8, 1]],  # overlapping
    [[1, 4, 2], [5, 8, 1, 100, 1]],  # mixed 3- and 5-item
    [[1, 4, 1, 100, 2], [5, 8, 1, 100, 1], [5, 8, 101, 200, 1]],  # not rectangular
    [[1, 4, 1, 100, 2], [1, 4, 200, 300, 1]],  # context gap
    [[1, 4, -1]],
    [],
])
def test_vllm_schedule_rejects_what_vllm_rejects(schedule: list[list[int]]) -> None:
    with pytest.raises(ValueError):
        BatchTablePolicy(schedule=schedule)


# ------------------------------------------------------------------------------------------------ TensorRT-LLM
def test_trtllm_schedule_keys_are_upper_bounds() -> None:
    """TensorRT-LLM ``get_draft_len_for_batch_size`` docstring example {4: 4, 8: 2, 32: 1}: batch 1-4 -> 4,
    5-8 -> 2, 9-32 -> 1, 33+ -> 0 (speculation off above the largest key)."""
    p = TRTLLMSchedulePolicy(draft_len_schedule={32: 1, 4: 4, 8: 2}, k_max=8)
    expected = {1: 4, 4: 4, 5: 2, 8: 2, 9: 1, 32: 1, 33: 0, 256: 0}
    assert {b: p.decide(_bucket(b)).k for b in expected} == expected


def test_trtllm_max_concurrency_and_validation() -> None:
    """``max_concurrency`` alone is ``{max_concurrency: max_draft_len}``; it excludes a schedule; the smallest
    key must carry max_draft_len; keys >= 1, draft lengths >= 0 (``validate_draft_len_schedule_and_sort``)."""
    p = TRTLLMSchedulePolicy(max_concurrency=16, k_max=6)
    assert [p.decide(_bucket(b)).k for b in (1, 16, 17)] == [6, 6, 0]
    for kwargs in ({"draft_len_schedule": {4: 4}, "max_concurrency": 8}, {"draft_len_schedule": {4: 2, 8: 4}},
                   {"draft_len_schedule": {0: 4}}, {"draft_len_schedule": {4: -1}}, {"draft_len_schedule": {}}):
        with pytest.raises(ValueError):
            TRTLLMSchedulePolicy(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- learned state: typed, snapshot as rows
def test_learned_state_is_typed_and_snapshots_as_rows() -> None:
    """Learned state keeps tuple keys and frozen records; JSON rows exist only in snapshot()/restore()."""
    s = SGLangAdaptivePolicy()
    s.observe(_batches(3, 3))
    u = UCBPolicy(k_max=2)
    u.observe(_batches(2, 1, batch=4))
    h = HFHeuristicPolicy(initial_k=3)
    h.observe(_round(3, 3))
    for p in (s, u, h):
        state = getattr(p, "_state", None) or getattr(p, "_cells", None) or p._k  # type: ignore[attr-defined]
        assert all(isinstance(key, tuple) for key in state)
        snap = p.snapshot()
        rows = next(iter(snap["state"].values()))
        assert isinstance(rows, list) and all(isinstance(r, list) for r in rows)
        q = type(p)(k_max=p.k_max)
        q.restore(snap)
        assert q.snapshot() == snap
    assert (T, D, 4, "<=512") in u._cells and u._cells[(T, D, 4, "<=512")].n == (0, 0, 1)
    assert DecisionKind.RULE is s.decide(_bucket()).kind
