"""Which CPU kernel runs a linear layer: oneDNN with a pre-packed weight, or BLAS on a transposed copy.

The model (:mod:`engine.model`) builds its projections from :class:`Linear` and calls :meth:`Linear.pack` once
when it is prepared for inference; everything about choosing and timing the kernels lives here. The choice is
timed once per weight shape and process and kept in :data:`KERNEL_CHOICES` (see :class:`KernelChoices`).

Both kernels compute ``x @ W^T (+ b)`` and differ only in the order of their sums, so the choice changes speed,
never the model's maths (within float rounding).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

PACK_BATCH_HINT = 64  # oneDNN's packing takes a typical row count; measured equally fast from 2 to 576 rows
# Token counts a pack() times: a decode step (1), one row's verify window (2-9), a small batch (16), a batch of
# 64 decode steps. A weight where BLAS won at every probe keeps BLAS for every input.
CROSSOVER_PROBES = (1, 2, 3, 4, 6, 9, 16, 64)
NEVER = 1 << 62  # the crossover of a weight where oneDNN never won
KERNEL_TIMING_CALLS = 15  # per kernel, weight shape, token count and timing round at pack time: a median of 15 calls
# Alternating rounds of the two kernels; the majority decides. A VM's speed moves in spells of seconds: timed once
# each, one after the other, the xl target's 768 x 768 projection once chose BLAS at one token (200 us cold)
# over oneDNN (65 us).
KERNEL_TIMING_ROUNDS = 3
# Most weight copies a timing cycles through (a 768 x 4096 weight of the 150 MB xl target needs 12 to read it
# from DRAM, as a forward does); the copies live only while pack() times.
MAX_TIMING_COPIES = 32

# (in features, out features, has bias, torch threads, timing copies): what a timed choice holds for.
CrossoverKey = tuple[int, int, bool, int, int]


class KernelChoices:
    """The kernel choices timed so far in this process: per :data:`CrossoverKey`, the smallest token count from
    which oneDNN was faster than BLAS (``NEVER``: it never was).

    Timing one weight shape takes tens of milliseconds, and a model has a handful of shapes used by many layers
    (and by every model of the same preset a process loads), so each shape is timed once and the answer kept here.
    """

    def __init__(self) -> None:
        self._crossover: dict[CrossoverKey, int] = {}

    def get(self, key: CrossoverKey) -> int | None:
        """The crossover timed for ``key``, or None when it has not been timed yet."""
        return self._crossover.get(key)

    def record(self, key: CrossoverKey, crossover: int) -> None:
        self._crossover[key] = crossover

    def snapshot(self) -> dict[CrossoverKey, int]:
        """Every choice made so far (a copy), in the order they were timed."""
        return dict(self._crossover)

    def clear(self) -> None:
        """Forget every choice: the next :meth:`Linear.pack` of each shape times the kernels again (after the
        machine's load has changed, say, or between benchmark phases that must not share timings)."""
        self._crossover.clear()


KERNEL_CHOICES = KernelChoices()  # the process's choices; Linear.pack reads and fills it


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's linear kernel (the ops :meth:`Linear.pack` needs)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """``nn.Linear`` that, on the CPU in fp32 at inference, runs each input through the faster of oneDNN and BLAS.

    Why: the BLAS behind fp32 ``F.linear`` on CPU builds is 2-6x slower than oneDNN with a pre-packed weight for
    large enough inputs (measured: 9 tokens x 768 x 4096 takes 4.3 ms vs 0.8 ms), while oneDNN has a floor of
    about 15-40 us a call that BLAS does not: for the draft's 160 x 160 projection BLAS takes 5 us for one token.
    Where the two cross depends on the machine and the weight's shape, so :meth:`pack` times both kernels once per
    weight shape at ``CROSSOVER_PROBES`` token counts and keeps the smallest count from which oneDNN is faster
    (:data:`KERNEL_CHOICES` keeps it per process). A plain decoding baseline on the slower kernel would flatter
    speculation, and a draft step on it would hide what speculation gains.

    Two things make the timing say what a forward sees (both measured on a 2-core AMD EPYC VM):

    - **Cold weights.** A forward reads each weight once, after every other weight of the model, so a small
      model's weights come from L2/L3 and a large one's from DRAM. Timed hot (one weight called again and again)
      BLAS looked as fast as oneDNN for one token of the xl target's 768 x 1152 projection, and the choice flipped
      between processes; read cold it takes 324 us against oneDNN's 104. :meth:`pack` is told the model's weight
      bytes and times each kernel over enough copies of the weight to cover them (``footprint_bytes``).
    - **BLAS reads the weight transposed once, ahead of time** (``_wt``, ``[in, out]``, kept only where BLAS is
      used): ``x @ W^T`` on the ``[out, in]`` layout took 134 us for one cold token of the small target's 192 x 1024
      MLP projection, on ``[in, out]`` 58 us (160 x 896: 78 vs 31 us). The two kernels differ only in the order
      of their sums.
    """

    _packed: torch.Tensor | None = None
    _packed_version: int = -1
    _onednn_from: int = 1  # token counts from this one up take oneDNN, smaller ones BLAS
    _wt: torch.Tensor | None = None  # [in, out] contiguous copy of the weight for BLAS; None where oneDNN always runs

    def pack(self, footprint_bytes: int = 0) -> None:
        """Pre-pack the weight for oneDNN (CPU, fp32, when available) and pick each token count's kernel.

        Args:
            footprint_bytes: the weight bytes of the whole model this layer belongs to: the kernels are timed with
                their weights read from as far down the memory hierarchy as a forward of that model reads them.
        """
        w = self.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and onednn_linear_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)
            wt = w.detach().t().contiguous()
            self._packed, self._packed_version = packed, w._version
            self._onednn_from = self._kernel_crossover(packed, wt, footprint_bytes)
            self._wt = None if self._onednn_from <= 1 else wt  # oneDNN takes every input: no BLAS copy to keep
        else:
            self._packed = self._wt = None

    @torch.no_grad()
    def _kernel_crossover(self, packed_w: torch.Tensor, wt: torch.Tensor, footprint_bytes: int) -> int:
        """The smallest probed token count at which oneDNN beats BLAS on this weight (a large number: never).

        Args:
            packed_w, wt: the weight packed for oneDNN and transposed for BLAS (the first of the timed copies).
        """
        w = self.weight.detach()
        copies = max(1, min(MAX_TIMING_COPIES, -(-footprint_bytes // (w.numel() * w.element_size()))))
        key = (self.in_features, self.out_features, self.bias is not None, torch.get_num_threads(), copies)
        choices = KERNEL_CHOICES
        known = choices.get(key)
        if known is not None:
            return known
        # ``copies`` distinct weights, each read in turn: the last one read is the farthest from the core.
        others = [w.clone() for _ in range(copies - 1)]  # a copy's values do not matter to its timing
        packed = [packed_w, *(torch.ops.mkldnn._reorder_linear_weight(v, PACK_BATCH_HINT) for v in others)]
        wts = [wt, *(v.t().contiguous() for v in others)]
        one = torch.zeros(1, self.in_features)
        for p, v in zip(packed, wts, strict=True):  # first touches of every copy (page faults) are not timed
            torch.ops.mkldnn._linear_pointwise(one, p, self.bias, "none", [], "")
            _blas_linear(one, v, self.bias)
        turn_o, turn_b = itertools.cycle(range(copies)), itertools.cycle(range(copies))  # one turn each kernel
        crossover = NEVER
        for tokens in CROSSOVER_PROBES:
            x = torch.randn(tokens, self.in_features, generator=torch.Generator().manual_seed(tokens))

            def onednn(x: torch.Tensor = x) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, packed[next(turn_o)], self.bias, "none", [], "")

            def blas(x: torch.Tensor = x) -> torch.Tensor:
                return _blas_linear(x, wts[next(turn_b)], self.bias)

            if _onednn_faster(onednn, blas):
                crossover = tokens
                break
        choices.record(key, crossover)
        return crossover

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed
        if (
            packed is not None
            and not self.training
            and self.weight._version == self._packed_version  # weights unchanged since packing
            and x.dtype == torch.float32
            and not torch.is_grad_enabled()
        ):
            if x.numel() >= self._onednn_from * x.shape[-1]:  # enough tokens that oneDNN was timed faster
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
            if self._wt is not None:
                return _blas_linear(x, self._wt, self.bias)
        return F.linear(x, self.weight, self.bias)


def _blas_linear(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ b)`` on the transposed weight ``wt = W^T`` (``[in, out]``, contiguous).

    Args:
        x: ``[..., in]``.
    Returns:
        ``[..., out]``.
    """
    y = x @ wt  # matmul folds any leading dimensions into one matrix product with a 2-D right operand
    return y if bias is None else y + bias


def _onednn_faster(onednn: Callable[[], torch.Tensor], blas: Callable[[], torch.Tensor]) -> bool:
    """Whether oneDNN won most of ``KERNEL_TIMING_ROUNDS`` alternating rounds of median timings."""
    wins = sum(_median_seconds(onednn) < _median_seconds(blas) for _ in range(KERNEL_TIMING_ROUNDS))
    return 2 * wins > KERNEL_TIMING_ROUNDS


def _median_seconds(fn: Callable[[], torch.Tensor]) -> float:
    fn()  # warm-up: first calls allocate
    times = []
    for _ in range(KERNEL_TIMING_CALLS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
