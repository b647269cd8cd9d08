"""The engine on a GPU: the shipped models in bf16, CUDA-event timing, and what bf16 does to greedy speculation.

These need a CUDA GPU, which CI machines do not have; ``bench/device_check.sh`` runs them where one is lent,
together with the loop's exactness tests on the GPU (``SPECTUNE_TEST_DEVICE=cuda``, float64 pairs). The fp32 CPU
path is what every other test covers.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.corpus import held_out_prompts
from engine.loader import load_models, pick_device
from engine.loop import EngineConfig, Request, SpecEngine
from engine.model import BOS_ID, Transformer
from telemetry.records import RoundRecord

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/device_check.sh)")

TYPES = ("code", "prose", "structured")


@pytest.fixture(scope="module")
def small_bf16():  # type: ignore[no-untyped-def]
    return load_models(device="cuda", with_update=False, profile="small")


def _decode(
    target: Transformer, draft: Transformer, k: int, n_new: int = 48
) -> tuple[list[list[int]], list[RoundRecord]]:
    cfg = EngineConfig(max_batch=6, max_context=512, k_max=8, seed=0)
    eng = SpecEngine(target, draft, cfg, "t1", "d1")
    reqs = []
    for t in TYPES:
        for j, p in enumerate(held_out_prompts(t, 2, 128, seed=3)):
            reqs.append(f"{t}-{j}")
            assert eng.submit(Request(reqs[-1], t, p, n_new, temperature=0.0, stop_at_eos=False))
    records = []
    while not eng.idle():
        rec = eng.step(lambda t, b, c: k)
        assert rec is not None
        records.append(rec)
    out = {c.request_id: c.output for c in eng.pop_finished()}
    return [out[r] for r in reqs], records


def test_cuda_is_picked_by_default_with_bf16() -> None:
    choice = pick_device()
    assert choice.device.type == "cuda" and choice.dtype == torch.bfloat16
    assert choice.label.startswith("cuda:") and choice.label.endswith("bfloat16")


def test_shipped_models_load_onto_the_gpu_in_bf16(small_bf16) -> None:  # type: ignore[no-untyped-def]
    for model in (small_bf16.target, small_bf16.draft):
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_rounds_are_timed_by_cuda_events(small_bf16) -> None:  # type: ignore[no-untyped-def]
    _, recs = _decode(small_bf16.target, small_bf16.draft, k=4, n_new=16)
    assert recs and all(r.max_k == 4 for r in recs)
    for r in recs:
        for s in (r.draft_s, r.verify_s, r.other_s):
            assert math.isfinite(s) and s >= 0.0
        assert r.draft_s > 0.0 and r.verify_s > 0.0
    assert sum(row.accepted for r in recs for row in r.rows) > 0


def test_bf16_greedy_speculation_emits_the_targets_choice_within_bf16_rounding(small_bf16) -> None:  # type: ignore[no-untyped-def]
    """Greedy speculation is exact in float64 (the loop tests, on this GPU too). In bf16 a verify over k + 1
    tokens and a one-token step may round differently, so a near tie can break the other way; what must hold is
    that every emitted token is the target's argmax up to bf16 rounding. Checked against the target in fp32."""
    target, draft = small_bf16.target, small_bf16.draft
    spec, recs = _decode(target, draft, k=4)
    plain, _ = _decode(target, draft, k=0)
    ref = Transformer(target.cfg).to("cuda")
    ref.load_state_dict({n: p.float() for n, p in target.state_dict().items()})
    ref.eval()
    prompts = [p for t in TYPES for p in held_out_prompts(t, 2, 128, seed=3)]
    gaps, agree = [], 0
    for prompt, s_out, p_out in zip(prompts, spec, plain, strict=True):
        agree += sum(1 for a, b in zip(s_out, p_out, strict=True) if a == b)
        toks = torch.tensor([[BOS_ID, *prompt, *s_out]], device="cuda")
        with torch.no_grad():
            logits = ref(toks)[0, len(prompt) : len(prompt) + len(s_out)].float()  # [n_new, V]
        chosen = logits.gather(1, torch.tensor(s_out, device="cuda")[:, None])[:, 0]
        gaps.append((logits.max(-1).values - chosen).max().item())
    total = sum(len(o) for o in plain)
    accept_len = sum(row.accepted + 1 for r in recs for row in r.rows if row.k) / sum(
        1 for r in recs for row in r.rows if row.k
    )
    print(f"bf16: spec/plain token agreement {agree}/{total}; largest fp32 logit gap of an emitted token "
          f"{max(gaps):.3f}; mean acceptance length at k=4 {accept_len:.2f}")
    assert max(gaps) < 0.5  # bf16 keeps 8 bits: a flip happens only between logits this close
    assert agree / total > 0.8
    assert accept_len > 2.0  # the draft still predicts the target in bf16
