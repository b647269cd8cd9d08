"""The decoder's decode-time fast paths compute what the general paths compute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import model as M
from engine.model import MODEL_PRESETS, Linear, Transformer, apply_rope, rope_table


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


@pytest.mark.parametrize("rows", [None, [2, 0], [1]])
def test_one_token_step_matches_the_full_forward(rows: list[int] | None) -> None:
    # Rows of different lengths (the mask path), scattered rows (a gather) and a single row (no mask): the
    # one-token context must give each row the logits a full forward over its whole sequence gives.
    torch.manual_seed(2)
    m = Transformer(MODEL_PRESETS["tiny"]).double().eval()
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
    rows = torch.tensor([3, 1, 2])
    dev = torch.device("cpu")
    fast, fast_lens = m._one_token_context(cache, rows, None, dev)
    slow, slow_lens = m._ragged_context(cache, rows, None, None, 1, dev)
    assert torch.equal(fast_lens, slow_lens)
    for name in ("cos", "sin", "mask", "rows", "flat"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert (fast.attend_len, fast.padded_shape, fast.real) == (slow.attend_len, slow.padded_shape, slow.real)


def test_kernel_crossover_is_the_first_token_count_where_onednn_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    if not M._onednn_linear_available():
        pytest.skip("this torch build has no oneDNN linear")
    calls: list[str] = []

    def fake_median(fn):  # type: ignore[no-untyped-def]
        # Identify the kernel by its name and the token count by its default argument; oneDNN wins from 4 tokens.
        tokens = fn.__defaults__[0].shape[0]
        calls.append(fn.__name__)
        return (1.0 if tokens < 4 else 0.5) if fn.__name__ == "onednn" else 0.75

    monkeypatch.setattr(M, "_median_seconds", fake_median)
    monkeypatch.setattr(M, "KERNEL_CROSSOVER", {})
    lin = Linear(24, 40, bias=False).eval()
    lin.pack()
    assert lin._onednn_from == 4
    assert calls.count("onednn") == M.CROSSOVER_PROBES.index(4) + 1  # the probing stops at the crossover

    monkeypatch.setattr(M, "KERNEL_CROSSOVER", {})
    monkeypatch.setattr(M, "_median_seconds", lambda fn: 1.0 if fn.__name__ == "onednn" else 0.5)
    never = Linear(24, 40, bias=False).eval()
    never.pack()
    assert never._onednn_from == M.NEVER


@pytest.mark.parametrize("crossover", [1, 3, M.NEVER])
def test_inputs_below_the_crossover_take_blas_and_both_kernels_agree(
    crossover: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not M._onednn_linear_available():
        pytest.skip("this torch build has no oneDNN linear")
    torch.manual_seed(4)
    lin = Linear(32, 48, bias=False).eval()
    lin.pack()
    lin._onednn_from = crossover
    onednn = torch.ops.mkldnn._linear_pointwise
    seen: list[int] = []

    def spy(x, *args):  # type: ignore[no-untyped-def]
        seen.append(x.shape[0])
        return onednn(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    with torch.no_grad():
        for tokens in (1, 2, 3, 9):
            x = torch.randn(tokens, 32)
            assert torch.allclose(lin(x), F.linear(x, lin.weight), atol=1e-5)
    assert seen == [t for t in (1, 2, 3, 9) if t >= crossover]
