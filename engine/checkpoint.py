"""The shipped checkpoints, and the profiles (target/draft pairs) built from them.

Two profiles:
- ``small``: the trained pair as shipped, target-v1 (2.8M parameters) and draft-v1 (0.40M, distilled from it).
- ``xl``: **a stand-in for a large target**, not a separately trained model. Its target is target-v1 widened
  four times function-preservingly (:mod:`engine.widen`): 6 layers x 768, 12 heads of 64, FFN 2048, 42.9M
  parameters, 107x the draft. It computes target-v1's function (largest logit difference about 3e-5 in fp32),
  so its acceptance is target-v1's, while every forward does the work of a 43M-parameter model: at high batch
  its token-wise layers become compute-bound, as a real target's do. Its version ids say so (``target-v1-xl4``:
  target-v1, widened 4x). It is built at load time in about a second; no widened weights are shipped.
The model update (target-v2) gets the same treatment in each profile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.model import ModelConfig, Transformer
from engine.widen import WIDEN_FACTOR_XL, widen, widened_config

CHECKPOINT_DIR = Path(__file__).resolve().parent.parent / "checkpoints"
MANIFEST = "manifest.json"
TARGET_V1, TARGET_V2, DRAFT_V1 = "target-v1", "target-v2", "draft-v1"


def load_checkpoint(name: str, directory: Path = CHECKPOINT_DIR, dtype: torch.dtype = torch.float32) -> Transformer:
    """Load a shipped checkpoint by name (``target-v1``, ``draft-v1``, ``target-v2``)."""
    path = directory / f"{name}.safetensors"
    meta_path = directory / MANIFEST
    if not path.exists() or not meta_path.exists():
        raise FileNotFoundError(
            f"checkpoint {path} or {meta_path} is missing; run `spectune train` to reproduce the checkpoints"
        )
    meta = json.loads(meta_path.read_text())["checkpoints"][name]
    model = Transformer(ModelConfig(**meta["config"]))
    state = load_file(str(path))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(dtype).eval()


@dataclass(frozen=True)
class Profile:
    """Which target/draft pair runs, and how its target is derived from the shipped checkpoint."""

    name: str
    widen: int  # 1 = the trained target as shipped; r > 1 = widened r times (same function, r^2 the work)
    summary: str  # what the profile is, in one line, for manifests, reports and --help

    def target_version(self, checkpoint: str) -> str:
        """The version id of ``checkpoint`` in this profile: widened targets carry the factor in their name."""
        return checkpoint if self.widen == 1 else f"{checkpoint}-xl{self.widen}"

    def build_target(self, checkpoint: str, directory: Path, dtype: torch.dtype) -> Transformer:
        # Widen in fp32, then cast: the widened weights are exact copies of the fp32 values divided by r.
        base = load_checkpoint(checkpoint, directory, torch.float32)
        return (widen(base, self.widen) if self.widen > 1 else base).to(dtype).eval()


PROFILES: dict[str, Profile] = {
    "small": Profile("small", 1, "target-v1 (2.8M parameters, trained) with draft-v1 (0.40M, distilled from it)"),
    "xl": Profile(
        "xl",
        WIDEN_FACTOR_XL,
        "target-v1 widened 4x function-preservingly (Net2WiderNet): a 42.9M-parameter stand-in for a large "
        "target with target-v1's exact predictions, so target-v1's acceptance at a 43M model's cost; draft-v1",
    ),
}
DEFAULT_PROFILE = "xl"  # the demo, `spectune engine` and `bench policies` run the physics of a large target


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}") from None


def describe_profiles(checkpoint_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Manifest entries for the derived models: what each profile's target is, its shape and parameter count.

    Args:
        checkpoint_config: target-v1's ``ModelConfig`` fields, as the manifest stores them.
    """
    base = ModelConfig(**checkpoint_config)
    out: dict[str, dict[str, Any]] = {}
    for p in PROFILES.values():
        if p.widen == 1:
            continue
        cfg = widened_config(base, p.widen)
        with torch.device("meta"):
            params = Transformer(cfg).num_params()
        out[p.target_version(TARGET_V1)] = {
            "profile": p.name,
            "derived_from": TARGET_V1,
            "construction": f"Net2WiderNet widening x{p.widen} (engine/widen.py), built at load time, not shipped",
            "same_function_as": TARGET_V1,
            "what_it_is": p.summary,
            "config": cfg.to_dict(),
            "params": params,
        }
    return out
