"""Load a profile's models onto the best device: CUDA with bf16 when a GPU is present, else the CPU (fp32).

A profile (``small`` or ``xl``, see :mod:`engine.profiles`) names the target/draft pair; the draft is draft-v1
in both, the target is target-v1 as trained (``small``) or widened function-preservingly (``xl``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import CHECKPOINT_DIR, DRAFT_V1, MANIFEST, TARGET_V1, TARGET_V2, build_target, load_checkpoint
from engine.model import Transformer
from engine.profiles import DEFAULT_PROFILE, get_profile


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    dtype: torch.dtype

    @property
    def label(self) -> str:
        if self.device.type == "cuda":
            return f"cuda:{torch.cuda.get_device_name(self.device)} {str(self.dtype).removeprefix('torch.')}"
        return f"cpu ({torch.get_num_threads()} threads) {str(self.dtype).removeprefix('torch.')}"


def pick_device(device: str | None = None) -> DeviceChoice:
    """``device`` None picks CUDA (bf16) when available, else CPU (fp32: bf16 matmuls are slow on most CPUs)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA was requested but torch sees no GPU; use --device cpu")
    return DeviceChoice(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)


@dataclass
class Models:
    """A profile's models on one device, with their version ids."""

    target: Transformer  # target-v1 in this profile (widened in xl)
    draft: Transformer  # draft-v1, distilled from target-v1
    target_v2: Transformer | None  # the "model update" in this profile; None when not loaded
    device: DeviceChoice
    manifest: dict[str, Any]
    profile: str = DEFAULT_PROFILE

    target_version: str = TARGET_V1
    draft_version: str = DRAFT_V1
    target_v2_version: str = TARGET_V2


def load_models(
    checkpoint_dir: Path | str | None = None,
    device: str | None = None,
    with_update: bool = True,
    profile: str = DEFAULT_PROFILE,
) -> Models:
    """Load ``profile``'s target-v1, draft-v1 and (optionally) target-v2 from ``checkpoint_dir`` (default: shipped)."""
    d = Path(checkpoint_dir) if checkpoint_dir else CHECKPOINT_DIR
    prof = get_profile(profile)
    choice = pick_device(device)
    manifest_path = d / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(
            f"no checkpoint manifest at {manifest_path}; the repository ships one under checkpoints/ — "
            "run `spectune train` to reproduce it"
        )

    def target(name: str) -> Transformer:
        return build_target(prof, name, d, choice.dtype).to(choice.device)

    return Models(
        target=target(TARGET_V1),
        draft=load_checkpoint(DRAFT_V1, d).to(device=choice.device, dtype=choice.dtype).eval(),
        target_v2=target(TARGET_V2) if with_update else None,
        device=choice,
        manifest=json.loads(manifest_path.read_text()),
        profile=prof.name,
        target_version=prof.target_version(TARGET_V1),
        target_v2_version=prof.target_version(TARGET_V2),
    )
