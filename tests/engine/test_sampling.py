"""Sampling: the acceptance rule (edge cases, seeded determinism, the distribution it preserves) and draws."""

from __future__ import annotations

import torch

from engine.sampling import RowSampling, process_logits, rejection_sample, sample


def _dists(v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(v, generator=g) * 1.5, -1)
    return p, q


def test_identical_distributions_accept_everything() -> None:
    p, _ = _dists(6, 0)
    n, k = 500, 3
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(p.expand(n, -1), k, replacement=True, generator=g)
    probs = p.expand(n, k, -1)
    acc, _ = rejection_sample(drafts, probs, p.expand(n, k + 1, -1), torch.full((n,), k), g)
    assert bool((acc == k).all())


def test_zero_target_mass_always_rejects() -> None:
    # The target gives the drafted token probability 0: it must be rejected and never emitted.
    p = torch.tensor([0.0, 0.5, 0.5])
    q = torch.tensor([1.0, 0.0, 0.0])
    n = 200
    drafts = torch.zeros(n, 1, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    acc, nxt = rejection_sample(drafts, q.expand(n, 1, -1), p.expand(n, 2, -1), torch.ones(n, dtype=torch.long), g)
    assert bool((acc == 0).all())
    assert bool((nxt != 0).all())


def test_row_k_masks_longer_drafts() -> None:
    p, _ = _dists(5, 2)
    n, kmax = 100, 4
    drafts = torch.multinomial(p.expand(n, -1), kmax, replacement=True)
    k = torch.tensor([0, 1, 2, 4] * 25)
    acc, _ = rejection_sample(drafts, p.expand(n, kmax, -1), p.expand(n, kmax + 1, -1), k, None)
    assert bool((acc == k).all())


def test_greedy_is_one_hot() -> None:
    logits = torch.randn(2, 3, 7)
    probs = process_logits(logits, torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]))
    assert torch.equal(probs[0].argmax(-1), logits[0].argmax(-1))
    assert torch.allclose(probs[0].sum(-1), torch.ones(3))
    assert bool((probs[0].max(-1).values == 1.0).all())
    assert torch.allclose(probs[1], torch.softmax(logits[1], -1))


def test_top_p_keeps_nucleus() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    probs = process_logits(logits, torch.tensor([1.0]), torch.tensor([0.7]))
    assert torch.allclose(probs[0, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_seeded_determinism() -> None:
    p, q = _dists(8, 3)
    n, k = 64, 4
    drafts = torch.multinomial(q.expand(n, -1), k, replacement=True, generator=torch.Generator().manual_seed(5))
    args = (drafts, q.expand(n, k, -1), p.expand(n, k + 1, -1), torch.full((n,), k))
    a1 = rejection_sample(*args, torch.Generator().manual_seed(9))
    a2 = rejection_sample(*args, torch.Generator().manual_seed(9))
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])


def _first_token_tv(rule_accepts_everything: bool) -> float:
    """TV distance between the first emitted token's empirical distribution and the target's."""
    v, n, k = 6, 60_000, 3
    p, q = _dists(v, 4)
    g = torch.Generator().manual_seed(11)
    drafts = torch.multinomial(q.expand(n, -1), k, replacement=True, generator=g)  # d_i ~ q, i.i.d. per slot
    k_t = torch.full((n,), k)
    if rule_accepts_everything:  # a deliberately wrong rule: keep every draft
        first = drafts[:, 0]
    else:
        acc, nxt = rejection_sample(drafts, q.expand(n, k, -1), p.expand(n, k + 1, -1), k_t, g)
        first = torch.where(acc > 0, drafts[:, 0], nxt)
    emp = torch.bincount(first, minlength=v).double() / n
    return float(0.5 * (emp - p.double()).abs().sum())


def test_speculative_sampling_preserves_target_distribution() -> None:
    # With 60k samples over 6 outcomes the sampling error of TV is ~0.004; the wrong rule is off by TV(p, q).
    assert _first_token_tv(False) < 0.012


def test_wrong_rule_fails_the_same_test() -> None:
    assert _first_token_tv(True) > 0.05


def test_sample_follows_the_distribution_and_never_picks_zero_mass() -> None:
    p = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0], dtype=torch.float64)
    n = 200_000
    x = sample(p.expand(n, -1).contiguous(), torch.Generator().manual_seed(1))
    freq = torch.bincount(x, minlength=5).double() / n
    assert freq[1] == 0 and freq[4] == 0  # zero-probability tokens, also the last one, are never drawn
    assert 0.5 * (freq - p).abs().sum() < 0.005
    # unnormalised rows and a row whose only mass is its first token
    q = torch.tensor([[2.0, 0.0, 2.0], [1.0, 0.0, 0.0]])
    y = sample(q.repeat(1000, 1), torch.Generator().manual_seed(2)).view(1000, 2)
    assert set(y[:, 0].tolist()) == {0, 2} and set(y[:, 1].tolist()) == {0}


def test_row_sampling_prepared_once_equals_per_row_processing_and_selects_rows() -> None:
    # A round prepares its rows' sampling once; every draft step and the verify reuse it, and a draft step over
    # the rows still drafting selects theirs. Each row must get exactly what processing it alone would give.
    torch.manual_seed(5)
    temps, top_ps = [0.0, 1.0, 0.7, 1.3], [1.0, 0.9, 1.0, 0.5]
    logits = torch.randn(4, 3, 11)
    prepared = RowSampling.of(temps, top_ps)
    alone = torch.cat(
        [process_logits(logits[i : i + 1], torch.tensor([temps[i]]), torch.tensor([top_ps[i]])) for i in range(4)]
    )
    assert torch.allclose(prepared.probs(logits), alone, atol=1e-6)
    idx = torch.tensor([3, 1])
    assert torch.allclose(prepared.select(idx).probs(logits[idx]), alone[idx], atol=1e-6)
    assert prepared.greedy is not None and prepared.nucleus
    plain = RowSampling.of([1.0, 0.5], [1.0, 1.0])
    assert plain.greedy is None and not plain.nucleus  # nothing to filter: softmax of the scaled logits only
    scaled = logits[:2] * torch.tensor([1.0, 2.0])[:, None, None]  # 1 / temperature
    assert torch.allclose(plain.probs(logits[:2]), torch.softmax(scaled, -1))
