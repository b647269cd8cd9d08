"""Tiny random models in float64: exactness tests need no trained weights, and float64 keeps argmax ties away.

``SPECTUNE_TEST_DEVICE=cuda`` puts the shared pair on the GPU, so the loop's exactness tests run there too (the
device check in ``bench/device_check.sh`` does this); the default is the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.model import MODEL_PRESETS, Transformer


def make_pair(
    noise: float = 0.05, seed: int = 0, sharpen: float = 4.0, preset: str = "tiny"
) -> tuple[Transformer, Transformer]:
    """A target and a draft that is a perturbed copy of it (so acceptance is neither 0 nor 1)."""
    torch.manual_seed(seed)
    target = Transformer(MODEL_PRESETS[preset]).double()
    with torch.no_grad():
        target.head.weight.mul_(sharpen)  # peakier distributions, like a trained model's
    draft = Transformer(MODEL_PRESETS[preset]).double()
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    dev = torch.device(os.environ.get("SPECTUNE_TEST_DEVICE", "cpu"))
    return target.to(dev).eval(), draft.to(dev).eval()


@pytest.fixture(scope="session", params=["tiny", "tiny-gqa"])
def pair(request: pytest.FixtureRequest) -> tuple[Transformer, Transformer]:
    """Every loop test runs on a multi-head pair and on a grouped-query one (the xl target's attention)."""
    return make_pair(preset=request.param)
