"""The CPU kernel choice of a linear layer: what is timed, what is kept, and that both kernels compute the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels as K
from engine.kernels import KernelChoices, Linear, onednn_linear_available

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")


@pytest.fixture
def choices(monkeypatch: pytest.MonkeyPatch) -> KernelChoices:
    """An empty set of choices for the test, so fake timings never reach the process's real ones."""
    fresh = KernelChoices()
    monkeypatch.setattr(K, "KERNEL_CHOICES", fresh)
    return fresh


def test_kernel_crossover_is_the_first_token_count_where_onednn_wins(
    choices: KernelChoices, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def fake_median(fn):  # type: ignore[no-untyped-def]
        # Identify the kernel by its name and the token count by its default argument; oneDNN wins from 4 tokens.
        tokens = fn.__defaults__[0].shape[0]
        calls.append(fn.__name__)
        return (1.0 if tokens < 4 else 0.5) if fn.__name__ == "onednn" else 0.75

    monkeypatch.setattr(K, "_median_seconds", fake_median)
    lin = Linear(24, 40, bias=False).eval()
    lin.pack()
    assert lin._onednn_from == 4
    # Alternating rounds at each probe, and the probing stops at the crossover.
    assert calls.count("onednn") == K.KERNEL_TIMING_ROUNDS * (K.CROSSOVER_PROBES.index(4) + 1)
    assert calls[:2] == ["onednn", "blas"]

    choices.clear()
    monkeypatch.setattr(K, "_median_seconds", lambda fn: 1.0 if fn.__name__ == "onednn" else 0.5)
    never = Linear(24, 40, bias=False).eval()
    never.pack()
    assert never._onednn_from == K.NEVER


def test_each_shape_is_timed_once_until_the_choices_are_cleared(
    choices: KernelChoices, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[str] = []

    def fake_median(fn):  # type: ignore[no-untyped-def]
        timed.append(fn.__name__)
        return 0.5 if fn.__name__ == "onednn" else 1.0  # oneDNN wins at the first probe

    monkeypatch.setattr(K, "_median_seconds", fake_median)
    Linear(24, 40, bias=False).eval().pack()
    n = len(timed)
    assert n == 2 * K.KERNEL_TIMING_ROUNDS  # one probe, both kernels, every round
    second = Linear(24, 40, bias=False).eval()
    second.pack()  # the same shape: the kept choice, no timing
    assert len(timed) == n and second._onednn_from == 1
    assert choices.snapshot() == {(24, 40, False, torch.get_num_threads(), 1): 1}

    Linear(24, 41, bias=False).eval().pack()  # another shape is timed
    assert len(timed) == 2 * n and len(choices.snapshot()) == 2

    choices.clear()
    assert choices.snapshot() == {}
    Linear(24, 40, bias=False).eval().pack()
    assert len(timed) == 3 * n


def test_kernels_are_timed_on_cold_weights_covering_the_models_footprint(
    choices: KernelChoices, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward reads each weight once after the rest of the model: the timing cycles through as many distinct
    weights as the model's bytes hold (capped), so a large model's kernels are timed from DRAM, not from cache."""
    onednn = torch.ops.mkldnn._linear_pointwise
    read: set[int] = set()

    def spy(x, w, *args):  # type: ignore[no-untyped-def]
        read.add(id(w))  # packed oneDNN weights have no storage pointer; each copy is its own tensor
        return onednn(x, w, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    lin = Linear(24, 40, bias=False).eval()
    weight_bytes = 24 * 40 * 4
    lin.pack(footprint_bytes=5 * weight_bytes - 1)  # rounds up: five copies
    assert len(read) == 5
    assert [key[-1] for key in choices.snapshot()] == [5]  # the choice is kept per number of copies

    read.clear()
    Linear(24, 40, bias=False).eval().pack(footprint_bytes=10**12)
    assert len(read) == K.MAX_TIMING_COPIES
    read.clear()
    Linear(24, 40, bias=False).eval().pack()  # no footprint: the weight itself, hot
    assert len(read) == 1


def test_blas_reads_a_transposed_copy_kept_only_where_blas_runs(
    choices: KernelChoices, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(5)
    monkeypatch.setattr(K, "_median_seconds", lambda fn: 1.0 if fn.__name__ == "onednn" else 0.5)
    blas = Linear(32, 48, bias=True).eval()
    blas.pack()
    assert blas._wt is not None and blas._wt.shape == (32, 48) and blas._wt.is_contiguous()
    with torch.no_grad():
        for shape in ((1, 32), (3, 32), (2, 5, 32)):
            x = torch.randn(shape)
            assert torch.allclose(blas(x), F.linear(x, blas.weight, blas.bias), atol=1e-5)

    choices.clear()
    monkeypatch.setattr(K, "_median_seconds", lambda fn: 0.5 if fn.__name__ == "onednn" else 1.0)
    always = Linear(32, 48, bias=False).eval()
    always.pack()
    assert always._onednn_from == 1 and always._wt is None  # oneDNN takes every input: no copy is kept


@pytest.mark.parametrize("crossover", [1, 3, K.NEVER])
def test_inputs_below_the_crossover_take_blas_and_both_kernels_agree(
    crossover: int, monkeypatch: pytest.MonkeyPatch
) -> None:
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
