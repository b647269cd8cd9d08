"""goodput: the cost model it plans with, and borrowing the shared cost slope instead of probing."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from policies import DecisionKind, GoodputPolicy
from policies._cost import CostModel
from policies.base import Decision
from policies.goodput import _Estimate
from telemetry.records import AcceptanceWindow, Bucket, CostWindow, Stat


def _cost(bb: int, k: int, secs: float) -> CostWindow:
    st = Stat(10, 10 * secs, 10 * secs * secs, secs)
    zero = Stat(10, 0.0, 0.0, 0.0)
    return CostWindow(target_version="t1", draft_version="d1", batch_bucket=bb, context_bucket="<=512", max_k=k,
                      rounds=10, tokens_verified=10 * bb * (k + 1), emitted=10 * bb, batch_rows=10 * bb,
                      draft_s=zero, verify_s=st, other_s=zero, latency_p50=secs, latency_p95=secs,
                      latency_p99=secs)


def _fed(slope_cells: int, known: tuple[int, int] = (1, 16), new: int = 4) -> GoodputPolicy:
    p = GoodputPolicy(k_max=4, seed=0, slope_cells=slope_cells)
    p.observe(AcceptanceWindow(target_version="t1", draft_version="d1", request_type="code", context_bucket="<=512",
                               k=2, rows=50, drafted=100, accepted=60, emitted=110, hist=(10, 20, 20)))
    for bb in known:  # two cells seen at two ks each
        base = 0.01 * (1 + bb / 4)
        p.observe(_cost(bb, 0, base))
        p.observe(_cost(bb, 2, base * 1.5))
    p.observe(_cost(new, 0, 0.01 * (1 + new / 4)))  # the new cell: seen at k = 0 only
    return p


def test_cells_with_slope_counts_cells_seen_at_two_ks() -> None:
    m = CostModel(k_max=4)
    m.observe(1, "<=512", 0, 5, 5, 0.0, 0.05, 0.0)
    assert m.cells_with_slope() == 0
    m.observe(1, "<=512", 3, 5, 5, 0.01, 0.06, 0.0)
    m.observe(4, "<=512", 0, 5, 20, 0.0, 0.1, 0.0)
    assert m.cells_with_slope() == 1


def test_new_cell_borrows_the_shared_slope() -> None:
    b = Bucket("t1", "d1", "code", 4, "<=512")
    assert _fed(slope_cells=2).decide(b).kind is not DecisionKind.PROBE
    assert _fed(slope_cells=99).decide(b).kind is DecisionKind.PROBE  # nothing to borrow from: probe


def test_without_exploration_the_incumbent_is_returned_not_the_probe() -> None:
    # What the sidecar asks for a bucket without traffic: a probe served there would measure nothing.
    b = Bucket("t1", "d1", "code", 8, "<=512")
    p = _fed(slope_cells=99)
    p.observe(_cost(8, 3, 0.03 * 1.5))  # a cell seen at k = 3 only: probed at a second k (1)
    probe = p.decide(b)
    assert probe.exploring and probe.kind is DecisionKind.PROBE
    quiet = p.decide(b, explore=False)
    assert not quiet.exploring and quiet.kind is DecisionKind.BEST and quiet.k != probe.k
    assert p.decide(b).k == probe.k  # the probe is still what this epoch serves to traffic


def test_cell_beyond_the_measured_batches_is_probed() -> None:
    # Batches 1 and 4 cannot say whether a cost is fixed or per row; batch 64 is measured, not extrapolated.
    b = Bucket("t1", "d1", "code", 64, "<=512")
    assert _fed(slope_cells=2, known=(1, 4), new=64).decide(b).kind is DecisionKind.PROBE


# Seconds per round (draft, verify, other) measured on the reference engine (bench/results/engine.json, sample
# mode, code, short context; CPU, 2 threads).
ENGINE_MS = {(1, 0): (0.0, 2.00, 0.04), (1, 3): (1.35, 2.01, 0.044), (4, 0): (0.0, 2.16, 0.069),
             (4, 3): (1.74, 2.60, 0.073), (16, 0): (0.0, 4.03, 0.197), (16, 3): (3.04, 5.77, 0.21),
             (64, 0): (0.0, 9.64, 0.61), (64, 3): (7.13, 13.90, 0.63)}


def test_cost_model_extrapolates_to_a_larger_batch() -> None:
    # Fitted on batches 1 and 4 (two ks each) and batch 64 seen at k = 3 only, the model must put plain
    # decoding at batch 64 and both ks at the unseen batch 16 near what the engine measured. A model linear in
    # log batch puts batch-64 plain rounds at a third of their cost and turns speculation off where it wins.
    m = CostModel(k_max=8)
    for (b, k), (d, v, o) in ENGINE_MS.items():
        if b in (1, 4) or (b, k) == (64, 3):
            m.observe(b, "<=512", k, 10, 10 * b, 10 * d / 1e3, 10 * v / 1e3, 10 * o / 1e3)
    for b, k in ((64, 0), (16, 0), (16, 3)):
        pred = float(m.predict(b, "<=512")[k].sum()) * 1e3
        truth = sum(ENGINE_MS[(b, k)])
        assert 0.6 < pred / truth < 1.5, (b, k, pred, truth)
    tot = m.predict(64, "<=512").sum(axis=1)
    assert (np.diff(tot) > 0).all()  # every extra draft token costs something


def _acc(rtype: str, k: int, hist: tuple[int, ...]) -> AcceptanceWindow:
    rows = sum(hist)
    acc = sum(i * n for i, n in enumerate(hist))
    return AcceptanceWindow(target_version="t1", draft_version="d1", request_type=rtype, context_bucket="<=512",
                            k=k, rows=rows, drafted=rows * k, accepted=acc, emitted=acc + rows, hist=hist)


def _turned_off(hold_decisions: int = 0, probe_every: int = 50) -> tuple[GoodputPolicy, Bucket]:
    """A cell whose draft stopped agreeing: k = 0 is measured there first, so the next decision may turn it off."""
    p = GoodputPolicy(k_max=2, seed=0, hold_decisions=hold_decisions, probe_every=probe_every)
    for bb in (1, 16):  # the shared cost model knows k = 0 and k = 2 elsewhere: k = 2 costs twice k = 0
        base = 0.01 * (1 + bb / 4)
        p.observe(_cost(bb, 0, base))
        p.observe(_cost(bb, 2, base * 2.0))
    b = Bucket("t1", "d1", "code", 4, "<=512")
    p.observe(_acc("code", 2, (0, 0, 500)))  # every draft accepted: k = 2 wins
    p.observe(_cost(4, 2, 0.02 * 2.0))
    d = p.decide(b)
    assert (d.k, d.kind) == (2, DecisionKind.FIRST)
    for _ in range(40):  # the draft stops agreeing: nothing is accepted any more
        p.observe(_acc("code", 2, (500, 0, 0)))
    d = p.decide(b)
    assert (d.k, d.exploring, d.kind) == (0, True, DecisionKind.PROBE_OFF)  # measured first, not switched
    p.observe(_cost(4, 0, 0.02))
    return p, b


def test_speculation_is_turned_off_only_after_measuring_k0_in_the_cell() -> None:
    p, b = _turned_off()
    p.observe(_acc("code", 2, (500, 0, 0)))
    d = p.decide(b)
    assert (d.k, d.exploring, d.kind) == (0, False, DecisionKind.OFF)


def test_a_cell_within_the_measured_range_is_not_turned_off_at_first_sight() -> None:
    # Batches 1 and 16 pin the shared slope, and there k = 2 costs three times a plain round; batch 4 lies between
    # them and has only run plain rounds. The fit calls k = 0 best there, but off is decided on the cell's own
    # measurements of both: the first decision serves speculation, and k = 0 is then measured before going off.
    p = GoodputPolicy(k_max=2, seed=0)
    for bb in (1, 16):
        base = 0.01 * (1 + bb / 4)
        p.observe(_cost(bb, 0, base))
        p.observe(_cost(bb, 2, base * 3.0))
    p.observe(_acc("code", 2, (30, 15, 5)))  # 0.35 drafts accepted per row: off wins on the fit
    b = Bucket("t1", "d1", "code", 4, "<=512")
    assert not p._cost.extrapolating(4, "<=512")
    d = p.decide(b)
    assert (d.kind, d.reason) == (DecisionKind.FIRST, "first decision (on until measured)") and d.k > 0
    p.observe(_cost(4, d.k, 0.02 * 3.0))
    p.observe(_acc("code", 2, (30, 15, 5)))
    d = p.decide(b)
    assert (d.k, d.kind) == (0, DecisionKind.PROBE_OFF)


def test_an_off_cell_holds_then_is_reprobed() -> None:
    p, b = _turned_off(hold_decisions=1, probe_every=4)
    kinds = []
    for _ in range(4):
        p.observe(_acc("code", 2, (500, 0, 0)))  # a new window: a new decision for the cell
        d = p.decide(b)
        kinds.append((d.kind, d.k))
        if d.kind is DecisionKind.REPROBE:
            assert p.decide(b) == d  # the same epoch serves the same choice
    # Served off by the k = 0 probe, the switch and the hold: the fourth decision off serves speculation once,
    # and the next one is off again (the re-probe measured nothing that moved the mean).
    assert kinds == [(DecisionKind.OFF, 0), (DecisionKind.HOLD, 0), (DecisionKind.REPROBE, 1), (DecisionKind.BEST, 0)]


def test_snapshot_keeps_the_rule_that_chose() -> None:
    p, b = _turned_off(hold_decisions=3, probe_every=50)
    p.observe(_acc("code", 2, (500, 0, 0)))
    assert p.decide(b).kind is DecisionKind.OFF
    q = GoodputPolicy(k_max=2, seed=1, hold_decisions=3, probe_every=50)
    q.restore(p.snapshot())
    assert q.decide(b) == p.decide(b)  # cached for this epoch, kind and reason included
    p.observe(_acc("code", 2, (500, 0, 0)))
    q.observe(_acc("code", 2, (500, 0, 0)))
    assert q.decide(b) == p.decide(b) and p.decide(b).kind is DecisionKind.HOLD


def test_cost_model_learns_per_token_cost_from_mixed_rounds() -> None:
    """Windows of rounds whose rows draft different k: the fit recovers what one drafted token costs."""
    step, per_tok, plain, per_row = 0.002, 0.0004, 0.02, 0.0001  # the ground truth of this synthetic engine
    cm = CostModel(k_max=8)
    rng = np.random.default_rng(0)
    for _ in range(40):
        for bb, b in ((1, 1.0), (16, 16.0), (64, 64.0)):
            m = int(rng.integers(0, 9))
            d = b * m * float(rng.uniform(0.3, 1.0)) if m else 0.0  # rows below the largest k draft less
            draft = step * m + per_tok * 0.5 * d
            verify = plain + per_row * b + per_tok * 0.5 * d
            cm.observe(bb, "short", m, 10, int(b * 10), 10 * draft, 10 * verify, 0.0, drafted=10 * d)
    cm.refit()
    assert cm.per_token(64, "short") == pytest.approx(per_tok, rel=0.05)
    # The uniform-k prediction answers for every row drafting k, though the windows drafted less.
    want = step * 4 + plain + per_row * 64 + per_tok * 64 * 4
    assert cm.predict(64, "short", 64.0)[4].sum() == pytest.approx(want, rel=0.05)


def test_cost_model_slow_spell_does_not_make_its_k_dear() -> None:
    """A busy neighbour slows every round 1.6x while only k=4 is served: k=4's cost must not absorb it."""

    def window(cm: CostModel, k: int, slow: float) -> None:
        secs = (0.010 + 0.002 * k) * slow  # per round, all in verify for simplicity
        cm.observe(16, "short", k, 10, 160, 0.0, 10 * secs, 0.0)

    robust, raw = CostModel(k_max=8), CostModel(k_max=8, speed_memory=0)
    for cm in (robust, raw):
        for _ in range(10):  # a quiet stretch measuring both ks
            window(cm, 2, 1.0)
            window(cm, 4, 1.0)
        for _ in range(20):  # a slow spell serving k=4 only
            window(cm, 4, 1.6)
        cm.refit()
    ratio = {name: cm.predict(16, "short", 16.0)[4].sum() / cm.predict(16, "short", 16.0)[2].sum()
             for name, cm in (("robust", robust), ("raw", raw))}
    quiet = (0.010 + 0.008) / (0.010 + 0.004)
    # The median of 3 needs two slow votes to move: the spell's first window lands raw (about 5% here).
    assert ratio["robust"] == pytest.approx(quiet, rel=0.08)
    assert ratio["raw"] > 1.2 * quiet  # what the robust estimate prevents


def test_a_k_measured_at_a_smaller_batch_is_not_cheaper_for_it() -> None:
    """Within one batch bucket the batch moves: k = 4 served while 12 rows ran, k = 3 while 16 did.

    A round costs the same at either k per row here, so at the cell's batch k = 4 must come out dearer than k = 3
    (it drafts more), not cheaper because it happened to run beside fewer rows (``bench vllm`` at 35545ee: batch
    bucket 16, k = 3 at 14.8 rows, k = 4 at 13.6).
    """

    def secs(b: float, k: int) -> float:  # the truth: fixed + per row verified token
        return 0.02 + 0.001 * b * (k + 1)

    cm = CostModel(k_max=5, speed_memory=0)
    for bb, b in ((1, 1), (4, 4), (16, 16)):  # the shared fit sees the batch slope at k = 0 and 3
        for k in (0, 3):
            cm.observe(bb, "short", k, 10, 10 * b, 0.0, 10 * secs(b, k), 0.0)
    for b, k in ((16, 3), (12, 4)) * 10:
        cm.observe(16, "short", k, 10, 10 * b, 0.0, 10 * secs(b, k), 0.0)
    cm.refit()
    at = cm.mean_batch(16, "short")
    pred = cm.predict(16, "short", at).sum(axis=1)
    assert pred[4] > pred[3]
    for k in (3, 4):
        assert pred[k] == pytest.approx(secs(at, k), rel=0.03)
    # A batch asked about moves every measured k with it.
    assert cm.predict(16, "short", 16.0)[4].sum() == pytest.approx(secs(16, 4), rel=0.03)


def test_a_cell_that_grows_past_the_joint_grid_keeps_deciding() -> None:
    # Three types learn per-type incumbents (e.g. 6, 0, 6); three more arrive while the cell is quiet. With six
    # types the joint grid is one shared k per row, so the mixed incumbent is no row of it: deciding raised
    # IndexError on every later decision (the sidecar published nothing after a flood of new request types).
    from telemetry.aggregate import aggregate
    from telemetry.synthetic import SyntheticConfig, synthetic_rounds

    p = GoodputPolicy(k_max=8, seed=0)

    def learn(alpha: dict[str, float], seed: int) -> None:
        cfg = SyntheticConfig(batch_sizes=(8,), max_context=400, alpha=alpha)
        agg = aggregate(synthetic_rounds(4000, seed=seed, config=cfg))
        for w in (*agg.acceptance, *agg.cost):
            p.observe(w)

    def b(rt: str) -> Bucket:
        return Bucket("target-v1", "draft-v1", rt, 8, "<=512")

    three = {"code": 0.95, "prose": 0.3, "structured": 0.9}
    for i in range(6):
        learn(three, i)
        for rt in three:
            p.decide(b(rt), explore=True)
    more = {**three, **{f"new{j}": 0.7 for j in range(3)}}
    learn(more, 99)
    quiet = {rt: p.decide(b(rt), explore=False).k for rt in more}
    assert len(set(quiet.values())) > 1  # per-type incumbents next to shared-k ones: not a row of the grid
    for _ in range(3):
        learn(more, 100)
        ks = {rt: p.decide(b(rt), explore=True).k for rt in more}
        assert all(0 <= k <= 8 for k in ks.values())


def test_reprobes_of_a_cell_that_stays_off_thin_out() -> None:
    """Each re-probe that leaves the cell off doubles the wait before the next: 4, 8, 16 decisions."""
    p, b = _turned_off(hold_decisions=0, probe_every=4)
    at = []
    for i in range(4 + 1 + 8 + 1 + 16 + 1 + 2):
        p.observe(_acc("code", 2, (500, 0, 0)))
        if p.decide(b).kind is DecisionKind.REPROBE:
            at.append(i)
    assert np.diff(at).tolist() == [8, 16]  # the wait doubles after each re-probe that left the cell off
    p.reopen("t1", "d1", "code", "<=512")  # an acceptance drift: the wait starts over
    off_since = 0
    for _ in range(10):
        p.observe(_acc("code", 2, (500, 0, 0)))
        d = p.decide(b)
        if d.kind is DecisionKind.REPROBE:
            break
        off_since += 1
    assert d.kind is DecisionKind.REPROBE and off_since <= 4


def _structured_keeps_all_prose_none(p: GoodputPolicy) -> None:
    """20 windows each: structured output accepts every draft of k = 4, prose none."""
    for _ in range(20):
        p.observe(_acc("structured", 4, (0, 0, 0, 0, 100)))
        p.observe(_acc("prose", 4, (100, 0, 0, 0, 0)))


def _two_types(one_k_per_batch: bool, batch_bucket: int = 8,
               tail_weight: float = 0.0) -> tuple[GoodputPolicy, dict[str, int]]:
    """Structured output accepts every draft, prose none: packed verification lets each draft its own k."""
    p = GoodputPolicy(k_max=4, seed=0, one_k_per_batch=one_k_per_batch, tail_weight=tail_weight)
    for bb in (1, 8):
        for k in (0, 2, 4):
            p.observe(_cost(bb, k, 0.01 * (1 + bb / 4) * (1 + 0.15 * k)))
    _structured_keeps_all_prose_none(p)
    ks = {t: p.decide(Bucket("t1", "d1", t, batch_bucket, "<=512")).k for t in ("structured", "prose")}
    return p, ks


def test_one_k_per_batch_gives_every_type_of_a_cell_the_same_k() -> None:
    _, packed = _two_types(one_k_per_batch=False)
    assert packed["structured"] > packed["prose"]  # a packed engine drafts per row
    p, one = _two_types(one_k_per_batch=True)
    assert one["structured"] == one["prose"]  # vLLM runs one k per step: the policy chooses one
    q = GoodputPolicy(k_max=4, seed=0, one_k_per_batch=True)
    q.restore(p.snapshot())
    assert q.decide(Bucket("t1", "d1", "prose", 8, "<=512")).k == one["prose"]


def test_one_k_per_batch_leaves_each_type_its_own_k_in_rounds_of_one_row() -> None:
    # Batch bucket 1: a step holds one request and vLLM runs that request's k, so the types never share a k.
    _, one = _two_types(one_k_per_batch=True, batch_bucket=1)
    _, packed = _two_types(one_k_per_batch=False, batch_bucket=1)
    assert one == packed
    assert one["structured"] > one["prose"]


def _shared_round_cell(tail_weight: float) -> tuple[GoodputPolicy, Bucket]:
    """Batch 8, one k per step: structured keeps every draft, prose none; each k measured in the cell, a round
    at k costing 1 + 0.2 k plain rounds, and the rounds emitting what the mix predicts."""
    p = GoodputPolicy(k_max=4, seed=0, one_k_per_batch=True, tail_weight=tail_weight)
    _structured_keeps_all_prose_none(p)
    for _ in range(4):
        for k in range(5):
            w = _cost(8, k, 0.03 * (1 + 0.2 * k))
            p.observe(replace(w, emitted=w.batch_rows * (k + 2) // 2))  # half the rows emit k + 1, half 1
    return p, Bucket("t1", "d1", "prose", 8, "<=512")


def test_tail_weight_keeps_a_shared_k_from_starving_the_type_that_accepts_least() -> None:
    # Goodput grows with k (structured emits k + 1 for a round of 1 + 0.2 k), while prose keeps one token a round
    # and its TPOT grows as the round's seconds do: scored by goodput x prose's rate relative to its best, k = 1
    # ((1 + 2) / 2 / 1.2 ** 2 = 1.04 against 1.0 off and 0.93 at k = 4).
    p, b = _shared_round_cell(tail_weight=0.0)
    q, _ = _shared_round_cell(tail_weight=1.0)
    plain, tail = p.decide(b), q.decide(b)
    assert (plain.k, tail.k) == (4, 1)
    # the score moves the choice; what the decision reports as expected goodput is still tokens per second
    assert tail.expected_goodput == pytest.approx(plain.expected_goodput)
    assert max(tail.expected_goodput, key=tail.expected_goodput.__getitem__) == 4
    # rounds of one row: each type at its own k, and the weight's reference is the slowest type's own best
    _, solo = _two_types(one_k_per_batch=True, batch_bucket=1)
    assert _two_types(one_k_per_batch=True, batch_bucket=1, tail_weight=1.0)[1] == solo
    with pytest.raises(ValueError, match="tail_weight"):
        GoodputPolicy(tail_weight=-1.0)


def test_batch_one_keeps_a_type_on_whose_own_rate_is_best_on() -> None:
    """Run 2 of ``bench vllm`` at 61751bd: at batch 1 the sidecar turned prose off beside code and structured
    output that accept well. vLLM runs the draft at k = 0 too, so a one-row round costs 21 ms at k = 0 and 26 ms
    at k = 1, where prose emits 1.52 tokens: 58 against 48 tok/s for prose's requests, which need their tokens
    whatever k is. Scored at fixed round shares (tokens pooled over seconds) off won by 0.6%."""
    p = GoodputPolicy(k_max=5, seed=0, one_k_per_batch=True)
    for k in (0, 1, 3, 5):
        p.observe(_cost(1, k, 0.021 + (0.002 + 0.003 * k if k else 0.0)))  # 21, 26, 32, 38 ms
    for _ in range(20):
        p.observe(_acc("code", 5, (5, 5, 5, 10, 15, 60)))
        p.observe(_acc("structured", 5, (2, 3, 5, 5, 15, 70)))
        p.observe(_acc("prose", 1, (24, 26)))
        p.observe(_acc("prose", 3, (24, 13, 7, 6)))
    ks = {t: p.decide(Bucket("t1", "d1", t, 1, "<=512"), explore=False).k for t in ("code", "structured", "prose")}
    assert ks["code"] >= 4 and ks["structured"] >= 4
    # prose's own emitted per second: k = 2 (1.78 tokens in 29 ms) beats k = 1 (1.52 in 26 ms) and off (1 in 21 ms)
    assert ks["prose"] == 2


def _memory_bound(bb: int, k: int) -> CostWindow:
    """Batch 1 on a memory-bound target: verifying k + 1 tokens costs little more than one (ENGINE_MS, batch 1)."""
    return _cost(bb, k, 0.002 + 0.0003 * k)


def _second_decision(accept_hist: tuple[int, ...]) -> Decision:
    """A batch-1 cell after one window at k = 3 with ``accept_hist`` (rows by accepted count): its next decision."""
    p = GoodputPolicy(k_max=8, seed=0)
    p.observe(_acc("code", 3, accept_hist))
    p.observe(_memory_bound(1, 3))
    return p.decide(Bucket("t1", "d1", "code", 1, "<=512"))


def test_the_jump_at_k_above_0_is_not_probed_where_off_is_far_behind() -> None:
    # Batch 1, every draft accepted so far: k = 0 is far behind any k > 0, so the cell's second k is another k > 0
    # (a window at k = 0 would cost half its tokens and change no choice).
    d = _second_decision((0, 0, 5, 45))
    assert d.kind is DecisionKind.PROBE and d.k > 0


def test_the_jump_is_probed_where_off_is_a_contender() -> None:
    # Nothing accepted: k = 0 is level with or ahead of the best k > 0, and the cell measures it.
    d = _second_decision((50, 0, 0, 0))
    assert d.kind in (DecisionKind.PROBE, DecisionKind.PROBE_OFF) and d.k == 0



def _served_full_acceptance(p: GoodputPolicy, rtype: str, k: int) -> None:
    """One window of a batch-1 cell at k: every draft accepted once the cell drafts, memory-bound cost."""
    p.observe(_acc(rtype, k, (0,) * k + (50,)))
    p.observe(_memory_bound(1, k))


def test_a_switch_to_an_unmeasured_k_is_tried_before_it_is_adopted() -> None:
    # A cell learns that its drafts are all accepted: the mean's best climbs to ks the cell never ran. Each is
    # served once (explore), and adopted (switch, then held) only once its cost was measured in the cell.
    p = GoodputPolicy(k_max=8, seed=0, hold_decisions=0)
    b = Bucket("t1", "d1", "code", 1, "<=512")
    for _ in range(3):
        p.observe(_acc("code", 2, (30, 10, 10)))
        p.observe(_memory_bound(1, 2))
    tried = []
    for _ in range(12):
        seen = p._cost.ks_seen(1, "<=512")
        incumbent = p.decide(b, explore=False).k
        d = p.decide(b)
        if d.kind is DecisionKind.SWITCH:
            assert d.k in seen, f"switched to k={d.k}, never measured in the cell ({sorted(seen)})"
        if d.k not in seen and d.kind is DecisionKind.EXPLORE:
            tried.append(d.k)
            assert p.decide(b, explore=False).k == incumbent  # tried, not adopted
        _served_full_acceptance(p, "code", d.k)
    assert tried, "the climb went through no unmeasured k"
    assert p.decide(b, explore=False).k >= 6  # and it got there


def test_exploration_moves_each_type_within_the_radius_of_its_own_k() -> None:
    # Types that accept differently hold different ks; a Thompson draw moves each within explore_radius of its
    # own incumbent (never turning one off), instead of one shared k that would serve both badly. A 1% exploration
    # margin, so that draws are served often enough to check where they move.
    p = GoodputPolicy(k_max=8, seed=1, hold_decisions=0, explore_margin=0.01)
    buckets = {t: Bucket("t1", "d1", t, 4, "<=512") for t in ("code", "structured")}
    hists = {"code": lambda k: (25, 15) + (10,) * (k - 1), "structured": lambda k: (0,) * k + (50,)}
    for t in buckets:
        p.observe(_acc(t, 3, hists[t](3)))
    p.observe(_cost(4, 3, 0.004))
    explored = 0
    for _ in range(30):
        before = {t: p.decide(b, explore=False).k for t, b in buckets.items()}
        served = {t: p.decide(b) for t, b in buckets.items()}
        if served["code"].kind is DecisionKind.EXPLORE and served["code"].reason.startswith("explore"):
            explored += 1
            for t, d in served.items():
                assert abs(d.k - before[t]) <= p.explore_radius
                assert d.k >= 1 or before[t] == 0
        for t, d in served.items():
            p.observe(_acc(t, d.k, hists[t](d.k)) if d.k > 0 else _acc(t, 0, (50,)))
        top = max(d.k for d in served.values())
        p.observe(_cost(4, top, 0.004 + 0.0004 * top))
    assert explored > 0


def test_a_first_decision_stays_within_the_ks_its_cell_ran() -> None:
    # The engine ran the cell at its default k = 3 before any table; every draft was accepted, so the mean wants
    # the deepest k. The first decision's incumbent is the best within k = 3 (measured there), whatever a
    # measurement serves meanwhile (here the cell's cost probe); a deeper k is adopted only once measured, as any
    # switch to an unmeasured k is.
    p = GoodputPolicy(k_max=8, seed=0, hold_decisions=0)
    b = Bucket("t1", "d1", "code", 1, "<=512")
    p.observe(_acc("code", 3, (0, 0, 0, 50)))
    p.observe(_memory_bound(1, 3))
    d = p.decide(b)
    assert p.decide(b, explore=False).k == 3
    for _ in range(6):
        _served_full_acceptance(p, "code", d.k)
        d = p.decide(b)
        incumbent = p.decide(b, explore=False).k
        assert incumbent in p._cost.ks_seen(1, "<=512"), f"k={incumbent} adopted before it was measured"
    assert p.decide(b, explore=False).k > 3  # and the climb went on from there


def _stationary_window(k: int, rng: np.random.Generator, bb: int = 4,
                       noise: float = 0.03) -> tuple[AcceptanceWindow, CostWindow]:
    """One window of a steady batch-4 cell at k: per-position acceptance 0.8, 0.7, 0.6, ... (k = 3 is best, k = 2 and
    k = 4 within 2-4% of it) and round seconds affine in k with ``noise`` (log-normal sigma) of scatter."""
    hist = [0] * (k + 1)
    for _ in range(40):
        n = 0
        while n < k and rng.random() < 0.8 - 0.1 * n:
            n += 1
        hist[n] += 1
    acc = _acc("code", k, tuple(hist))
    cost = _cost(bb, k, (0.004 + 0.0006 * k) * float(np.exp(noise * rng.standard_normal())))
    return acc, replace(cost, emitted=round(cost.batch_rows * (1 + acc.accepted / acc.rows)))


STEADY = Bucket("t1", "d1", "code", 4, "<=512")


def _decide_steady(p: GoodputPolicy, rng: np.random.Generator, decisions: int, noise: float = 0.03) -> list[Decision]:
    """``decisions`` decisions of :data:`STEADY`, each followed by its windows (:func:`_stationary_window`)."""
    served = []
    for _ in range(decisions):
        served.append(d := p.decide(STEADY))
        for w in _stationary_window(d.k, rng, noise=noise):
            p.observe(w)
    return served


def _steady_cell(seed: int, decisions: int, noise: float = 0.03, **policy: Any) -> tuple[list[Decision], int]:
    """A steady batch-4 cell decided ``decisions`` times from cold: every decision, and the k its incumbent ends at."""
    p = GoodputPolicy(k_max=8, seed=seed, **policy)
    served = _decide_steady(p, np.random.default_rng(seed), decisions, noise)
    return served, p.decide(STEADY, explore=False).k


def _explorations(seed: int, decisions: int, late_from: int, **policy: Any) -> int:
    """Thompson explorations from decision ``late_from`` on, in a steady cell that settles near its best."""
    served, k = _steady_cell(seed, decisions, **policy)
    assert k in (2, 3, 4)  # it settled near the best either way
    return sum(d.reason == "explore: Thompson draw" for d in served[late_from:])


def _draw_explorations(explore_margin: float, seed: int, decisions: int = 80) -> int:
    """Thompson explorations in the second half of a steady cell's decisions, at a fixed draw margin."""
    return _explorations(seed, decisions, decisions // 2, explore_margin=explore_margin, explore_doublings=0)


def test_a_settled_cell_stops_chasing_small_draws() -> None:
    # Neighbours within a few percent of the best: at a 1% margin a draw's noise alone keeps serving them (15-50%
    # of the late decisions, each at a k the mean puts behind); at explore_margin's default only draws
    # that promise a real gain are served.
    small = sum(_draw_explorations(0.01, s) for s in range(3))
    default = sum(_draw_explorations(GoodputPolicy().explore_margin, s) for s in range(3))
    assert small >= 20
    assert default <= small / 2


def test_explore_margin_is_validated() -> None:
    with pytest.raises(ValueError, match="explore_margin"):
        GoodputPolicy(explore_margin=-0.01)


def _late_explorations(seed: int, **policy: Any) -> int:
    """Thompson explorations in the last third of 240 decisions of a steady cell."""
    return _explorations(seed, 240, 160, **policy)


def test_exploration_stops_in_a_settled_cell() -> None:
    # With a fixed draw margin a steady cell whose neighbours lie 2-4% behind keeps serving them on its draws' noise
    # (each a table change and the return from it on an engine); once those neighbours are measured (the cost
    # model's prior_windows of evidence each), each exploration the mean did not follow doubles the next draw's
    # margin, so late in the run the cell serves its incumbent.
    fixed = sum(_late_explorations(s, explore_doublings=0) for s in range(6))
    stopping = sum(_late_explorations(s) for s in range(6))
    assert fixed >= 12
    assert stopping <= fixed / 6, (fixed, stopping)


def test_a_k_the_cell_has_barely_run_or_not_resolved_is_explored_at_the_plain_margin() -> None:
    # A cell that has already doubled its draw margin three times (8x), measured at k = 2 and 3 but never at k = 5:
    # a draw promising 6% at k = 5 is measuring it, not doubting the incumbent, so the plain 5% margin applies and
    # the exploration does not count. The same draw at the measured k = 2 is not served when the mean puts k = 2
    # well behind (beyond a standard error of the measured difference), and is served when the gap is inside it.
    rng = np.random.default_rng(0)
    p = GoodputPolicy(k_max=8, seed=0)
    b = STEADY
    for k in (2, 3) * 10:
        for w in _stationary_window(k, rng):
            p.observe(w)
    p.decide(b)
    cell = p._cells[b.cell]
    cell.incumbent, cell.explored, cell.hold = {"code": 3}, 3, 0
    n = p._cost.windows(4, "<=512")
    assert n.get(2, 0.0) >= p._cost.prior_windows and n.get(5, 0.0) == 0.0
    se = p._diff_se(b, 3, 2)
    assert 0.0 < se < 0.2
    combos = np.arange(9)[:, None]  # [C, T]: one type, k = 0..8
    served = {}
    for label, k, mean_k in (("unmeasured", 5, 1.0), ("well behind", 2, 1 / (1 + 2 * se)),
                             ("inside the error", 2, 1 / (1 + se / 2))):
        g_draw, g_mean = np.ones(9), np.ones(9)
        g_draw[k], g_mean[k] = 1.06, mean_k
        est = _Estimate(b, ("code",), combos, g_mean, np.ones(9), g_draw, g_draw)
        d = p._explore(cell, est)
        served[label] = None if d is None else d.ks
    assert served == {"unmeasured": (5,), "well behind": None, "inside the error": (2,)}
    assert cell.explored == 3  # neither served draw counted: one unmeasured, one unresolved


def test_a_measured_ks_seconds_are_drawn_within_their_standard_error() -> None:
    # Thompson draws of a measured k's seconds scatter by about spread / sqrt(windows + prior_windows): wide after a
    # few windows, narrow after many, never wider than a k nothing measured (explore_spread), and not at all with
    # draw_measured off.
    rng = np.random.default_rng(1)

    def scatter(windows_at_2: int, draw: bool, window_sigma: float = 0.1, explore_spread: float = 0.1) -> float:
        cost = CostModel(8, draw_measured=draw, explore_spread=explore_spread)
        for k, reps in ((3, 40), (2, windows_at_2)):
            for _ in range(reps):
                secs = 0.02 * (1 + 0.1 * k) * float(np.exp(window_sigma * rng.standard_normal()))
                cost.observe(4, "<=512", k, 10, 40, 0.1 * secs * 10, 0.9 * secs * 10, 0.0, drafted=40.0 * k)
        cost.refit()
        mean = cost.predict(4, "<=512").sum(axis=1)[2]
        draws = [cost.predict(4, "<=512", rng=np.random.default_rng(s)).sum(axis=1)[2] / mean for s in range(300)]
        return float(np.std(np.log(draws)))

    # windows scattering by 10%: the standard error after 2 windows is about 0.07, after 60 about 0.013
    few, many = scatter(2, True), scatter(60, True)
    assert 0.04 < few < 0.1 * 1.15
    assert many < few / 3
    # windows scattering by 60%: the standard error (about 0.35 after 2) is capped at explore_spread
    assert 0.085 < scatter(2, True, window_sigma=0.6) < 0.1 * 1.15
    assert 0.17 < scatter(2, True, window_sigma=0.6, explore_spread=0.2) < 0.2 * 1.15
    assert scatter(2, False) == 0.0


def test_an_acceptance_drift_reopens_exploration() -> None:
    # A settled cell, then the same 40 decisions twice from its snapshot: as it was, and after an acceptance
    # drift in its bucket. The drift, not the clock, starts exploration over.
    settled = GoodputPolicy(k_max=8, seed=0)
    _decide_steady(settled, np.random.default_rng(0), 120)
    cell = STEADY.cell
    assert settled._cells[cell].explored >= 1
    counts = []
    for drift in (False, True):
        p = GoodputPolicy(k_max=8, seed=0)
        p.restore(settled.snapshot())
        assert p._cells[cell].explored == settled._cells[cell].explored  # kept in the state
        if drift:
            p.reopen("t1", "d1", "code", "<=512")
            assert p._cells[cell].explored == 0
        served = _decide_steady(p, np.random.default_rng(1), 40)
        counts.append(sum(d.kind == DecisionKind.EXPLORE for d in served))
    assert counts[1] > counts[0], counts


def test_explore_doublings_is_validated() -> None:
    with pytest.raises(ValueError, match="explore_doublings"):
        GoodputPolicy(explore_doublings=-1)


def _switches(noise_z: float, seed: int, decisions: int = 160) -> tuple[int, int]:
    """Switches of a steady cell whose windows scatter by 20% (a shared 2-core VM), and its final k (draws at a fixed
    margin and of acceptance only: the term is measured on its own)."""
    served, k = _steady_cell(seed, decisions, noise=0.2, noise_z=noise_z, explore_doublings=0, cost_draws=False)
    return sum(d.kind == DecisionKind.SWITCH for d in served), k


def test_a_gain_inside_the_windows_scatter_is_not_followed() -> None:
    # k = 2, 3 and 4 lie within 2-4% of each other; each window's seconds scatter by 20%. Switching on the 1%
    # margin alone follows that scatter (the cell flaps); weighed against the measured spread it stays put.
    plain = [_switches(0.0, s) for s in range(4)]
    weighed = [_switches(GoodputPolicy().noise_z, s) for s in range(4)]
    assert sum(n for n, _ in plain) >= 8
    assert sum(n for n, _ in weighed) <= sum(n for n, _ in plain) / 3
    assert all(k in (2, 3, 4) for _, k in weighed)


def test_the_cost_model_measures_the_scatter_of_a_cells_windows() -> None:
    rng = np.random.default_rng(0)
    m = CostModel(k_max=4)
    assert m.spread(4, "<=512") == pytest.approx(0.1)  # nothing measured: the prior
    for _ in range(400):
        for k in (2, 4):  # two ks of different cost, each scattering by 20% around its own mean
            m.observe(4, "<=512", k, 10, 40, 0.0, (0.004 + 0.001 * k) * (1.0 + 0.2 * rng.standard_normal()), 0.0)
    assert m.spread(4, "<=512") == pytest.approx(0.2, rel=0.15)
    assert m.spread(16, "<=512") == pytest.approx(0.1)  # another cell: still the prior
    state = m.get_state()
    for rec in state["agg"]:  # a state saved before the spread existed loads, with the spread unmeasured
        del rec["window_s"], rec["window_s2"]
    old = CostModel(k_max=4)
    old.set_state(state)
    assert old.spread(4, "<=512") == pytest.approx(0.1)


def test_noise_z_is_validated() -> None:
    with pytest.raises(ValueError, match="noise_z"):
        GoodputPolicy(noise_z=-1.0)


# Per row emitted at k = 0..4 by a type whose rows accept (5, 5, 10, 10, 70) of 100 at k = 4.
DEEP_EMIT = (1.0, 1.95, 2.85, 3.65, 4.35)
B4, B16 = Bucket("t1", "d1", "code", 4, "<=512"), Bucket("t1", "d1", "code", 16, "<=512")


def _deep_window(bb: int, k: int) -> CostWindow:
    """Batch 4: each draft step is dear, k = 2 best (2.85 / 20 ms against 3.65 / 27 ms). Batch 16: its windows read
    k = 4 best (4.35 / 55 ms against 2.85 / 50 ms), what a few scattered windows can say against the physics."""
    secs = {4: (0.010, 0.016, 0.020, 0.027, 0.034), 16: (0.040, 0.046, 0.050, 0.053, 0.055)}[bb][k]
    c = _cost(bb, k, secs)
    return replace(c, emitted=round(c.batch_rows * DEEP_EMIT[k]))


def _batch_capped(batch_cap: bool, small_windows: int = 10, small_ks: int = 5) -> GoodputPolicy:
    """Batch 4 measured at k < ``small_ks`` in ``small_windows`` windows (10 rounds: about 0.45 windows of evidence
    each), batch 16 at 0, 2 and 4 in 10."""
    p = GoodputPolicy(k_max=4, seed=0, one_k_per_batch=True, batch_cap=batch_cap, hold_decisions=0)
    for _ in range(20):
        p.observe(_acc("code", 4, (5, 5, 10, 10, 70)))
    for i in range(10):
        for k in range(small_ks):
            if i < small_windows:
                p.observe(_deep_window(4, k))
        for k in (0, 2, 4):
            p.observe(_deep_window(16, k))
    return p


def test_a_larger_batch_never_drafts_deeper_than_a_settled_smaller_one() -> None:
    free = _batch_capped(batch_cap=False)
    assert free.decide(B4, explore=False).k == 2 and free.decide(B16, explore=False).k == 4
    p = _batch_capped(batch_cap=True)
    assert p.decide(B4, explore=False).k == 2 and p.decide(B16, explore=False).k == 2
    served4 = []
    for _ in range(40):  # draws, probes and switches of either cell: batch 16 never serves past batch 4's incumbent
        d4, d16 = p.decide(B4), p.decide(B16)
        assert d16.k <= p.decide(B4, explore=False).k <= 2
        served4.append(d4.k)
        p.observe(_deep_window(4, d4.k))
        p.observe(_deep_window(16, d16.k))
    assert max(served4) > 2  # batch 4 explored deeper meanwhile, and that did not lift the cap


def test_a_smaller_batch_caps_only_once_its_k_is_measured_against_a_deeper_one_and_not_holding() -> None:
    # Batch 4's k = 2 measured in 3 windows of 10 rounds (1.4 windows of evidence): not settled, no cap.
    p = _batch_capped(batch_cap=True, small_windows=3)
    assert p.decide(B4, explore=False).k == 2 and p.decide(B16, explore=False).k == 4
    # Batch 4 never measured k = 3: its k = 2 is not a choice against deeper ks, so it caps nothing.
    r = _batch_capped(batch_cap=True, small_ks=3)
    r.decide(B4)  # a first decision adopts the best k the cell has run
    assert r.decide(B4, explore=False).k == 2 and r.decide(B16, explore=False).k == 4
    q = _batch_capped(batch_cap=True)
    assert q.decide(B4, explore=False).k == 2
    q._cells[B4.cell].hold = 2  # just switched: its new k is not yet held as settled
    assert q.decide(B16, explore=False).k == 4
    q._cells[B4.cell].hold = 0
    assert q.decide(B16, explore=False).k == 2  # and an incumbent above the cap comes down to it at once


def test_the_batch_cap_leaves_other_context_buckets_and_versions_alone() -> None:
    p = _batch_capped(batch_cap=True)
    assert p.decide(B4, explore=False).k == 2
    for other in (replace(B16, context_bucket="<=2048"), replace(B16, target_version="t2")):
        assert p._cap(other) == p.k_max
    assert p._cap(B16) == 2 and p._cap(B4) == p.k_max


def test_one_k_per_batch_a_type_new_to_a_quiet_cell_joins_the_cells_k() -> None:
    """``bench vllm`` at 5e61327: types that reached a cell at different times held different ks in it (batch 16 at
    <=2048: code 1, prose 3, structured 1), though vLLM runs one k per step and the batch cap reads the deepest."""
    p = GoodputPolicy(k_max=4, seed=0, one_k_per_batch=True)
    for k in (0, 2, 4):
        p.observe(_cost(8, k, 0.01 * 3 * (1 + 0.15 * k)))

    def bucket(t: str) -> Bucket:
        return Bucket("t1", "d1", t, 8, "<=512")

    for _ in range(20):
        p.observe(_acc("structured", 4, (0, 0, 0, 0, 100)))  # accepts every draft
    deep = p.decide(bucket("structured"), explore=False).k
    for _ in range(40):
        p.observe(_acc("prose", 4, (100, 0, 0, 0, 0)))  # accepts none, and now most of the cell's rows
    q = GoodputPolicy(k_max=4, seed=0, one_k_per_batch=True)
    q.restore(p.snapshot())
    assert deep > 0
    # the mean's best of the moment is shallower: a first decision in a fresh cell takes it
    assert q.decide(Bucket("t1", "d1", "prose", 16, "<=512"), explore=False).k < deep
    # in the cell the structured rows already run, prose joins their k (a switch, if any, moves both), though the
    # mean's best shared k there is now shallower too
    d = p.decide(bucket("prose"), explore=False)
    assert d.k == deep
    assert max(d.expected_goodput, key=lambda k: d.expected_goodput[k]) < deep
    assert p.decide(bucket("structured"), explore=False).k == deep


def _on_with_thin_off(explore_off: bool) -> tuple[GoodputPolicy, Bucket]:
    """A cell on whose k = 0 was measured once, in a slow window: the mean puts k = 0 about 5% behind k = 1, where
    it runs 4% ahead (see _cost_at)."""
    p = GoodputPolicy(k_max=2, seed=0, hold_decisions=0, probe_every=4, explore_off=explore_off, off_margin=0.03)
    for bb in (1, 16):  # the shared cost model: k = 2 costs 1.6x k = 0
        base = 0.01 * (1 + bb / 4)
        p.observe(_cost(bb, 0, base))
        p.observe(_cost(bb, 2, base * 1.6))
    b = Bucket("t1", "d1", "code", 4, "<=512")
    p.observe(_acc("code", 2, (300, 150, 50)))  # 1.5 tokens a round at k = 2
    p.observe(_cost(4, 0, 0.026))  # k = 0 caught in a slow spell (it costs 0.02)
    for _ in range(3):
        p.observe(_cost_at(4, 2))
    return p, b


def _cost_at(bb: int, k: int) -> CostWindow:
    """What k really costs in the cell of _on_with_thin_off: tokens a row over seconds a round are 1 / 0.02 at k = 0,
    1.25 / 0.026 at k = 1 and 1.5 / 0.032 at k = 2 (k = 0 is 4-7% ahead)."""
    w = _cost(bb, k, (0.02, 0.026, 0.032)[k])
    return replace(w, emitted=w.batch_rows * (4, 5, 6)[k] // 4)


def test_a_thinly_measured_off_is_rechecked_until_measured() -> None:
    """explore_off: a cell that is on re-measures k = 0 every probe_every decisions, the wait doubling, while k = 0
    has under OFF_EVIDENCE_WINDOWS windows. Without it k = 0 keeps its one slow window for good."""
    runs = {}
    for explore_off in (False, True):
        p, b = _on_with_thin_off(explore_off)
        served = []
        for _ in range(40):
            p.observe(_acc("code", 2, (300, 150, 50)))
            d = p.decide(b)
            served.append((d.kind, d.k))
            p.observe(_cost_at(4, d.k))
        runs[explore_off] = (served, d.expected_goodput[0], p._cost.windows(4, "<=512")[0])
    served, g0, n0 = runs[False]
    assert all(k > 0 for _, k in served) and n0 < 0.5  # never measured again: the slow window stands
    served, g0_rechecked, n0 = runs[True]
    at = [i for i, (kind, k) in enumerate(served) if k == 0]
    assert all(served[i][0] is DecisionKind.PROBE for i in at) and len(at) == 3
    assert at[0] == 3 and at[2] - at[1] > at[1] - at[0] > 4  # after probe_every decisions on, then waits doubling
    assert n0 > 1.5  # each re-check added a window of evidence
    assert g0_rechecked > g0 * 1.02  # k = 0's estimate moved toward what it costs (200 tokens/s)


def _walk(speed_memory: int, seed: int) -> tuple[float, np.ndarray]:
    """2,000 windows of one true cost per k (k = 2 and 4 in alternating runs of 20) with log-normal noise of 0.25,
    the spread of vLLM's windows beside prompt steps: the worst factor by which the predictions strayed from the
    truth (checked every 100 windows), and the final predictions over the truth."""
    rng = np.random.default_rng(seed)
    cm = CostModel(k_max=5, speed_memory=speed_memory)
    truth = {2: 0.14, 4: 0.18}
    worst = 0.0
    for i in range(2000):
        k = (2, 4)[(i // 20) % 2]
        secs = truth[k] * float(np.exp(0.25 * rng.standard_normal()))
        cm.observe(16, "short", k, 10, 160, 0.0, 10 * secs, 0.0)
        if i % 100 == 99:
            p = cm.predict(16, "short", 16.0).sum(axis=1)
            worst = max(worst, *(abs(math.log(p[kk] / truth[kk])) for kk in truth))
    p = cm.predict(16, "short", 16.0).sum(axis=1)
    return math.exp(worst), np.array([p[2] / truth[2], p[4] / truth[4]])


def test_raw_seconds_stay_on_the_truth_where_the_speed_normalisation_walks() -> None:
    """The speed normalisation divides each window by a slowness measured against predictions built from windows
    already divided: nothing anchors it, so under noisy windows it walks. vLLM's sidecar learns raw seconds."""
    normalised = [_walk(3, seed) for seed in range(4)]
    raw = [_walk(0, seed) for seed in range(4)]
    for _, final in raw:
        assert final == pytest.approx([1.0, 1.0], rel=0.06)
        assert final[1] / final[0] == pytest.approx(1.0, rel=0.03)  # the ks' ratio, what a decision reads
    assert statistics.median(w for w, _ in normalised) > 1.15 > max(w for w, _ in raw)
    assert GoodputPolicy(k_max=5, cost_speed_memory=0)._cost.speed_memory == 0
