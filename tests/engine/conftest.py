"""Tiny random models in float64: exactness tests need no trained weights, and float64 keeps argmax ties away."""

from __future__ import annotations

import pytest
import torch

from engine.model import MODEL_PRESETS, Transformer


def make_pair(noise: float = 0.05, seed: int = 0, sharpen: float = 4.0) -> tuple[Transformer, Transformer]:
    """A target and a draft that is a perturbed copy of it (so acceptance is neither 0 nor 1)."""
    torch.manual_seed(seed)
    target = Transformer(MODEL_PRESETS["tiny"]).double()
    with torch.no_grad():
        target.head.weight.mul_(sharpen)  # peakier distributions, like a trained model's
    draft = Transformer(MODEL_PRESETS["tiny"]).double()
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return target.eval(), draft.eval()


@pytest.fixture(scope="session")
def pair() -> tuple[Transformer, Transformer]:
    return make_pair()
