"""vllm_dynamic replays vLLM Dynamic SD's choice of K on its own example sweep, by hand.

Source: ``vllm/v1/spec_decode/dynamic/manager.py`` (``DynamicSpeculativeDecodingManager``) and the example
``_DYNAMIC_STATS`` of ``vllm/v1/spec_decode/dynamic/dynamic.py`` (PR #32374): K* = argmax_K
(1 + sum_{i<K} acc_i) / ITL(bs, K), ITL linear in batch size between swept sizes and in K between swept Ks.
"""

from __future__ import annotations

import pytest

from policies import DecisionKind, VLLMDynamicPolicy
from policies.vllm_dynamic import (
    VLLM_E1_ACCEPTANCE,
    VLLMDynamicConfig,
    acceptance_rates,
    interpolate_batch_stats,
    itl_of,
    optimal_k,
)
from telemetry.records import AcceptanceWindow, Bucket, CostWindow, Stat

T, D = "target-v1", "draft-v1"
# vLLM's example sweep (median ITL in ms per batch size and K), here in seconds
EXAMPLE_MS = {
    1: {0: 6.87, 1: 7.97, 3: 9.41, 4: 9.91, 5: 10.8, 7: 12.29},
    4: {0: 6.87, 1: 7.97, 3: 9.41, 4: 9.91, 5: 10.8, 7: 12.29},
    16: {0: 7.3, 1: 8.39, 3: 9.95, 4: 10.8, 5: 11.59, 7: 13.11},
    32: {0: 7.64, 1: 8.97, 3: 10.78, 4: 11.79, 5: 12.81, 7: 14.86},
    64: {0: 8.53, 1: 10.44, 3: 13.16, 4: 15.7, 5: 17.54, 7: 120.57},
    128: {0: 8.53, 1: 15.44, 3: 25.16, 4: 30.7, 5: 37.54, 7: 220.57},
}
EXAMPLE = {bs: {k: ms / 1000.0 for k, ms in s.items()} for bs, s in EXAMPLE_MS.items()}


def _bucket(batch: int, ctx: str = "<=512") -> Bucket:
    return Bucket(T, D, "code", batch, ctx)


def _cost(batch: int, k: int, round_s: float, rounds: int = 1, ctx: str = "<=512") -> CostWindow:
    st = Stat(rounds, round_s * rounds, round_s * round_s * rounds, round_s)
    zero = Stat(rounds, 0.0, 0.0, 0.0)
    return CostWindow(T, D, batch_bucket=batch, context_bucket=ctx, max_k=k, rounds=rounds,
                      tokens_verified=rounds * batch * (k + 1), emitted=rounds * batch, batch_rows=rounds * batch,
                      draft_s=zero, verify_s=st, other_s=zero, latency_p50=round_s, latency_p95=round_s,
                      latency_p99=round_s)


def test_interpolation_over_batch_size_and_k() -> None:
    """``_get_batch_stats``: bs 48 is halfway between 32 and 64; beyond the sweep, the end one.
    ``_get_itl``: K = 2 is halfway between the swept K = 1 and K = 3; nothing past the largest swept K."""
    at48 = interpolate_batch_stats(EXAMPLE, 48)
    assert at48[0] == pytest.approx(8.085e-3) and at48[3] == pytest.approx(11.97e-3)
    assert interpolate_batch_stats(EXAMPLE, 256) == EXAMPLE[128]
    assert itl_of(EXAMPLE[1], 2) == pytest.approx(8.69e-3)
    assert itl_of(EXAMPLE[1], 6) == pytest.approx(11.545e-3)
    assert itl_of(EXAMPLE[1], 8) is None


def test_example_sweep_with_the_prior_acceptance() -> None:
    """With vLLM's prior E1 = [0.68, 0.39, 0.20, 0.10, 0.06, 0.03, 0.02] the expected tokens per step are
    1, 1.68, 2.07, 2.27, 2.37, 2.43, 2.46, 2.48 for K = 0..7. By hand (tokens per ms):
    bs 1:   0.1456 0.2108 0.2382 [0.2412] 0.2392 0.2250 0.2131 0.2018 -> K* = 3
    bs 48:  0.1237 0.1731 [0.1910] 0.1896 0.1724 ...                  -> K* = 2 (ITL halfway 32..64)
    bs 64:  0.1172 0.1609 [0.1754] 0.1725 0.1510 ...                  -> K* = 2
    bs 128: [0.1172] 0.1088 0.1020 0.0902 ...                         -> K* = 0 (speculation off)"""
    p = VLLMDynamicPolicy(VLLMDynamicConfig(batch_stats=EXAMPLE), k_max=7)
    assert {bs: p.decide(_bucket(bs)).k for bs in (1, 48, 64, 128, 256)} == {1: 3, 48: 2, 64: 2, 128: 0, 256: 0}
    k, rates = optimal_k(VLLM_E1_ACCEPTANCE, EXAMPLE[1], 7)
    assert k == 3 and rates[3] == pytest.approx(2.27 / 9.41e-3) and sorted(rates) == list(range(8))


def test_observed_acceptance_replaces_the_prior_after_warm_up() -> None:
    """``compute_acceptance_rate_per_pos``: rows at k = 4 with hist (0, 1, 1, 0, 8) give acc = [10/10, 9/10,
    8/10, 8/10] and 0 for positions 4..6 (never drafted). They replace the prior only after more than
    ``warmup_steps`` = 10 engine steps (rounds). Then by hand:
    bs 1:   AL 1, 2.0, 2.9, 3.7, 4.5, 4.5, ... -> 0.1456 0.2509 0.3337 0.3932 [0.4541] 0.4167 -> K* = 4
    bs 128: 0.1172 0.1295 0.1429 [0.1471] 0.1466 -> K* = 3"""
    p = VLLMDynamicPolicy(VLLMDynamicConfig(batch_stats=EXAMPLE), k_max=7)
    p.observe(AcceptanceWindow(T, D, "code", "<=512", k=4, rows=10, drafted=40, accepted=35, emitted=45,
                               hist=(0, 1, 1, 0, 8)))
    assert acceptance_rates(p._counts[(T, D)].drafted, p._counts[(T, D)].accepted) == [1.0, 0.9, 0.8, 0.8, 0, 0, 0]
    p.observe(_cost(1, 4, 0.01, rounds=10))
    assert [p.decide(_bucket(bs)).k for bs in (1, 128)] == [3, 0]  # 10 steps: still the prior
    p.observe(_cost(1, 4, 0.01, rounds=1))
    assert [p.decide(_bucket(bs)).k for bs in (1, 128)] == [4, 3]
    assert p.decide(Bucket("target-v2", D, "code", 1, "<=512")).k == 3  # new versions: the prior again


def test_online_sweep_from_cost_windows() -> None:
    """Without a sweep table the policy sweeps K = 0..k_max per batch bucket (one K for the cell at a time),
    then picks K* from mean round seconds. k_max = 2, prior AL 1, 1.68, 2.07; ITL 1.0, 1.2, 1.5 s ->
    rates 1.0, 1.4, 1.38 -> K* = 1."""
    p = VLLMDynamicPolicy(VLLMDynamicConfig(sweep_rounds=2), k_max=2)
    b1 = _bucket(1)
    assert p.decide(b1, explore=False).kind is DecisionKind.FIRST  # nothing swept: never sweeps on a table
    for k, secs in ((0, 1.0), (1, 1.2), (2, 1.5)):
        d = p.decide(b1)
        assert (d.k, d.kind, d.exploring) == (k, DecisionKind.EXPLORE, True)
        p.observe(_cost(1, k, secs, rounds=1))
        assert p.decide(b1).k == k  # one round of the two a K needs
        p.observe(_cost(1, k, secs, rounds=1))
    d = p.decide(b1)
    assert (d.k, d.kind) == (1, DecisionKind.BEST)
    assert d.expected_goodput[1] == pytest.approx(1.68 / 1.2)
    # batch 4 unswept: with traffic it is swept; a table interpolates from what is swept (batch 1 only)
    assert p.decide(_bucket(4)).kind is DecisionKind.EXPLORE
    assert p.decide(_bucket(4), explore=False).k == 1
    assert p.decide(_bucket(1, "<=2048"), explore=False).kind is DecisionKind.FIRST  # each context sweeps apart


def test_config_rejects_what_vllm_rejects() -> None:
    for stats in ({4: {0: 1.0, 1: 1.0}}, {1: {0: 1.0}}, {1: {0: 1.0, 1: 0.0}},
                  {1: {0: 1.0, 1: 1.0}, 4: {0: 1.0, 1: 1.0, 3: 2.0}}):
        with pytest.raises(ValueError):
            VLLMDynamicConfig(batch_stats=stats)
    with pytest.raises(ValueError):
        VLLMDynamicConfig(acceptance_prior=(1.2,))
