"""Load the shipped checkpoints onto the best device: CUDA with bf16 when a GPU is present, else the CPU (fp32)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import Transformer
from engine.train import CHECKPOINT_DIR, MANIFEST, load_checkpoint

TARGET_V1, TARGET_V2, DRAFT_V1 = "target-v1", "target-v2", "draft-v1"


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
    """The shipped models on one device, with their version ids."""

    target: Transformer  # target-v1
    draft: Transformer  # draft-v1, distilled from target-v1
    target_v2: Transformer | None  # the "model update"; None when not loaded
    device: DeviceChoice
    manifest: dict

    target_version: str = TARGET_V1
    draft_version: str = DRAFT_V1
    target_v2_version: str = TARGET_V2


def load_models(
    checkpoint_dir: Path | str | None = None, device: str | None = None, with_update: bool = True
) -> Models:
    """Load target-v1, draft-v1 and (optionally) target-v2 from ``checkpoint_dir`` (default: shipped ones)."""
    d = Path(checkpoint_dir) if checkpoint_dir else CHECKPOINT_DIR
    choice = pick_device(device)
    manifest_path = d / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(
            f"no checkpoint manifest at {manifest_path}; the repository ships one under checkpoints/ — "
            "run `spectune train` to reproduce it"
        )

    def load(name: str) -> Transformer:
        return load_checkpoint(name, d).to(device=choice.device, dtype=choice.dtype).eval()

    return Models(
        target=load(TARGET_V1),
        draft=load(DRAFT_V1),
        target_v2=load(TARGET_V2) if with_update else None,
        device=choice,
        manifest=json.loads(manifest_path.read_text()),
    )
