"""The decoder's decode-time fast paths compute what the general paths compute."""

from __future__ import annotations

import pytest
import torch

from engine import model as M
from engine.model import (
    MODEL_PRESETS,
    AttentionGroup,
    Transformer,
    apply_rope,
    attention_groups,
    rope_table,
)


def test_rope_rotates_first_and_second_half_pairs() -> None:
    # The reference formula: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on the halves of the head dimension.
    torch.manual_seed(0)
    d, n = 16, 12
    x = torch.randn(2, 3, 4, n, d, dtype=torch.float64)  # [2, B, H, T, D]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    x1, x2 = x.chunk(2, dim=-1)
    ref = torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), dim=-1)
    cos, sin = rope_table(d, n, 10000.0)
    assert torch.allclose(apply_rope(x, cos.double(), sin.double()), ref, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
@pytest.mark.parametrize("rows", [None, [2, 0], [1]])
def test_one_token_step_matches_the_full_forward(rows: list[int] | None, preset: str) -> None:
    # Rows of different lengths (the mask path), scattered rows (a gather) and a single row (no mask): the
    # one-token context must give each row the logits a full forward over its whole sequence gives.
    torch.manual_seed(2)
    m = Transformer(MODEL_PRESETS[preset]).double().eval()
    lens = [7, 3, 5]
    seqs = [torch.randint(0, 256, (n + 1,)) for n in lens]  # each row's prefix plus the token the step appends
    cache = m.new_cache(3, 32)
    buf = torch.zeros(3, max(lens), dtype=torch.long)
    for r, s in enumerate(seqs):
        buf[r, : lens[r]] = s[:-1]
    m.forward_cached(buf, cache, real_lens=torch.tensor(lens))
    chosen = list(range(3)) if rows is None else rows
    step = torch.stack([seqs[r][-1:] for r in chosen])  # [R, 1]
    out = m.forward_cached(step, cache, None if rows is None else torch.tensor(rows))
    for j, r in enumerate(chosen):
        ref = m(seqs[r][None])[0, -1].float()
        assert torch.allclose(out[j, 0], ref, atol=1e-5)
        assert int(cache.lengths[r]) == lens[r] + 1


def test_one_token_context_equals_the_ragged_context_for_one_token() -> None:
    torch.manual_seed(3)
    m = Transformer(MODEL_PRESETS["tiny"]).eval()
    cache = m.new_cache(4, 32)
    m.forward_cached(torch.randint(0, 256, (4, 6)), cache, real_lens=torch.tensor([6, 2, 4, 6]))
    dev = torch.device("cpu")
    # Scattered rows, and contiguous rows (whose lengths the fast path reads as a slice of the cache's).
    for rows, span in ((torch.tensor([3, 1, 2]), None), (torch.tensor([1, 2, 3]), (1, 4))):
        fast, fast_lens = m._one_token_context(cache, rows, rows.tolist(), span, dev)
        slow, slow_lens = m._ragged_context(cache, rows, span, None, 1, dev)
        assert torch.equal(fast_lens, slow_lens)
        for name in ("cos", "sin", "mask", "rows", "flat"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name
        assert (fast.attend_len, fast.padded_shape, fast.real) == (slow.attend_len, slow.padded_shape, slow.real)
    assert cache.lengths.tolist() == [6, 2, 4, 6]  # building a context changes no length


def test_attention_groups_are_runs_of_consecutive_cache_rows_with_equal_token_count() -> None:
    g = attention_groups([0, 1, 2, 3, 4, 5], [3, 3, 9, 9, 9, 1], [40, 42, 50, 51, 49, 30])
    assert g == (AttentionGroup(0, 2, 0, 3, 42), AttentionGroup(2, 5, 2, 9, 51), AttentionGroup(5, 6, 5, 1, 30))
    # A hole in the batch (cache row 3 empty) splits a run: each group must be a view of consecutive cache rows.
    assert attention_groups([0, 1, 2, 4, 5], [1] * 5, [7] * 5) == (AttentionGroup(0, 3, 0, 1, 7),
                                                                   AttentionGroup(3, 5, 4, 1, 7))
    assert attention_groups([2, 3, 4], [4, 4, 4], [10, 11, 12]) is None  # one run: the single attention is the same
    assert attention_groups(list(range(10)), [1, 2] * 5, [5] * 10) is None  # interleaved: too many runs to split


@pytest.mark.parametrize("max_groups", [0, 4])
def test_grouped_attention_matches_the_full_forward(monkeypatch: pytest.MonkeyPatch, max_groups: int) -> None:
    # Rows appending 3, 3, 7 and 1 tokens after prefixes of different lengths: attention per run of equal count
    # (max_groups = 4) and one padded attention (0) both give each row the logits of a full forward, and the
    # grouped one gives padded queries to no row.
    monkeypatch.setattr(M, "MAX_ATTENTION_GROUPS", max_groups)
    queries: list[int] = []
    real_sdpa = M.F.scaled_dot_product_attention

    def counting(q: torch.Tensor, *a: object, **kw: object) -> torch.Tensor:
        queries.append(q.shape[0] * q.shape[2])
        return real_sdpa(q, *a, **kw)  # type: ignore[arg-type]

    torch.manual_seed(2)
    m = Transformer(MODEL_PRESETS["tiny"]).double().eval()
    seqs = [torch.randint(0, 256, (n,)) for n in (9, 12, 10, 15)]
    new = [3, 3, 7, 1]
    cache = m.new_cache(4, 32)
    pre = [len(s) - n for s, n in zip(seqs, new, strict=True)]
    buf = torch.zeros(4, max(pre), dtype=torch.long)
    for r, (s, p) in enumerate(zip(seqs, pre, strict=True)):
        buf[r, :p] = s[:p]
    m.forward_cached(buf, cache, real_lens=torch.tensor(pre))
    buf = torch.zeros(4, max(new), dtype=torch.long)
    for r, (s, n) in enumerate(zip(seqs, new, strict=True)):
        buf[r, :n] = s[-n:]
    monkeypatch.setattr(M.F, "scaled_dot_product_attention", counting)
    out = m.forward_cached(buf, cache, real_lens=torch.tensor(new))
    monkeypatch.setattr(M.F, "scaled_dot_product_attention", real_sdpa)
    for r, (s, n) in enumerate(zip(seqs, new, strict=True)):
        assert torch.allclose(out[r, :n], m(s[None])[0, -n:].float(), atol=1e-5)
    assert len(queries) == m.cfg.n_layers * (3 if max_groups else 1)
    assert sum(queries) == m.cfg.n_layers * (sum(new) if max_groups else 4 * max(new))


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
@pytest.mark.parametrize("new", [[2, 2, 1, 3], [1, 1, 1, 1]])
def test_scattered_rows_attend_over_views_of_their_runs(
    monkeypatch: pytest.MonkeyPatch, new: list[int], preset: str
) -> None:
    # Cache rows 0, 2, 3 and 5 of 6 (holes where requests retired): the forward splits at the holes and at
    # token-count changes, reads each run's keys from a view (no gather), and every row gets its full-forward
    # logits; the one-token path (all counts 1) splits at the holes only.
    torch.manual_seed(3)
    m = Transformer(MODEL_PRESETS[preset]).double().eval()
    rows = torch.tensor([0, 2, 3, 5])
    seqs = [torch.randint(0, 256, (n,)) for n in (8, 11, 9, 12)]
    cache = m.new_cache(6, 32)
    pre = [len(s) - n for s, n in zip(seqs, new, strict=True)]
    buf = torch.zeros(4, max(pre), dtype=torch.long)
    for r, (s, p) in enumerate(zip(seqs, pre, strict=True)):
        buf[r, :p] = s[:p]
    m.forward_cached(buf, cache, rows, torch.tensor(pre))
    gathers: list[object] = []
    real_index = torch.Tensor.__getitem__

    def watching(self: torch.Tensor, idx: object) -> torch.Tensor:
        if self is cache.k[0] and isinstance(idx, tuple) and isinstance(idx[0], torch.Tensor):
            gathers.append(idx)
        return real_index(self, idx)

    monkeypatch.setattr(torch.Tensor, "__getitem__", watching)
    buf = torch.zeros(4, max(new), dtype=torch.long)
    for r, (s, n) in enumerate(zip(seqs, new, strict=True)):
        buf[r, :n] = s[-n:]
    out = m.forward_cached(buf, cache, rows, torch.tensor(new))
    monkeypatch.undo()
    assert gathers == []
    for r, (s, n) in enumerate(zip(seqs, new, strict=True)):
        assert torch.allclose(out[r, :n], m(s[None])[0, -n:].float(), atol=1e-5)
    assert cache.lengths[rows].tolist() == [len(s) for s in seqs]


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_attention_reads_each_kv_head_for_its_query_heads(t: int, masked: bool) -> None:
    # 6 query heads over 2 key/value heads: query head h reads kv head h // 3, exactly as repeating every kv
    # head 3 times (the multi-head model grouped-query attention stands for) would.
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 6, t, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 11, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = None
    if masked:  # rows see 11, 7 and 9 keys
        visible = torch.arange(11)[None, :] < torch.tensor([11, 7, 9])[:, None]
        mask = torch.zeros(3, 1, t, 11, dtype=torch.float64).masked_fill_(~visible[:, None, None], float("-inf"))
    ref = M.F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask)
    assert torch.allclose(M.grouped_attention(q, k, v, mask), ref, atol=1e-12)
