"""The shipped checkpoints, and the profiles' targets built from them (see :mod:`engine.profiles`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.model import ModelConfig, Transformer
from engine.profiles import PROFILES, Profile
from engine.widen import widen, widened_config

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


def build_target(profile: Profile, checkpoint: str, directory: Path, dtype: torch.dtype) -> Transformer:
    """``checkpoint`` as ``profile`` runs it: as shipped, or widened function-preservingly."""
    # Widen in fp32, then cast: the widened weights are exact copies of the fp32 values divided by r.
    base = load_checkpoint(checkpoint, directory, torch.float32)
    return (widen(base, profile.widen) if profile.widen > 1 else base).to(dtype).eval()


def profile_model(profile: Profile, checkpoint: str, directory: Path = CHECKPOINT_DIR,
                  dtype: torch.dtype = torch.float32) -> Transformer:
    """A profile's model by checkpoint name: the draft as trained (every profile shares it), a target as
    :func:`build_target` makes it."""
    if checkpoint == DRAFT_V1:
        return load_checkpoint(checkpoint, directory, dtype).eval()
    return build_target(profile, checkpoint, directory, dtype)


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
            "construction": f"Net2WiderNet widening x{p.widen} (engine/widen.py): query heads repeated, key/value "
            "heads shared (grouped-query attention); built at load time, not shipped",
            "same_function_as": TARGET_V1,
            "what_it_is": p.summary,
            "config": cfg.to_dict(),
            "params": params,
        }
    return out
